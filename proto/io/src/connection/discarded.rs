//! A payload read only to be dropped: what follows an eager put the node refused, read frame by
//! frame to find the next request, and kept nowhere.

use ferry_proto::StreamError;
use ferry_proto::frame::next_chunk_end;

use super::{Connection, ConnectionError, payload::CHECKSUM_PIECE};
use crate::connection::ChunkSink;
use crate::transport::Transport;

/// A [`ChunkSink`] that checks the chunks' order and lengths as a tensor's receiver does and
/// keeps no byte: each piece lands in one scratch buffer of at most one piece, reused.
#[derive(Debug)]
pub(super) struct DiscardedPayload {
    /// The payload's announced length.
    total: u64,
    /// Bytes read so far (committed).
    received: u64,
    /// Bytes handed out through `slot` so far (a chunk is handed out piece by piece).
    handed: u64,
    /// Where every piece lands, overwritten by the next.
    scratch: Vec<u8>,
}

impl DiscardedPayload {
    /// A sink for a payload of `total` bytes.
    pub(super) fn new(total: u64) -> Self {
        Self {
            total,
            received: 0,
            handed: 0,
            scratch: Vec::new(),
        }
    }

    /// `len` bytes at `offset`, where `expected` is where they must start: within the payload
    /// and not empty.
    fn check(&self, offset: u64, len: usize, expected: u64) -> Result<(), StreamError> {
        next_chunk_end(offset, len, expected, self.total).map(|_| ())
    }
}

impl ChunkSink for DiscardedPayload {
    fn check_chunk(&self, offset: u64, len: usize) -> Result<(), StreamError> {
        self.check(offset, len, self.received)
    }

    fn slot(&mut self, offset: u64, len: usize) -> Result<&mut [u8], StreamError> {
        self.check(offset, len, self.handed)?;
        if len > CHECKSUM_PIECE {
            // The connection asks for one piece at a time; anything larger is a caller's bug,
            // refused rather than allocated.
            return Err(StreamError::PastEnd {
                offset,
                len: len as u64,
                total: self.total,
            });
        }
        self.handed += len as u64;
        if self.scratch.len() < len {
            self.scratch.resize(len, 0);
        }
        Ok(&mut self.scratch[..len])
    }

    fn commit(
        &mut self,
        offset: u64,
        len: usize,
        _checked: Option<u32>,
    ) -> Result<(), StreamError> {
        self.check(offset, len, self.received)?;
        self.received += len as u64;
        Ok(())
    }

    fn checks_chunks(&self) -> bool {
        // Bytes dropped unread need no checksum: a chunk's order and length are still checked,
        // so the next request is found where it lies or the connection is closed.
        false
    }

    fn is_complete(&self) -> bool {
        self.received == self.total
    }

    fn remaining(&self) -> u64 {
        self.total - self.received
    }
}

impl<S: Transport> Connection<S> {
    /// Reads a payload of `len` bytes that followed its request unasked (an eager put that was
    /// refused) and drops it: chunk frames only, in order, within the payload's deadline.
    pub async fn discard_payload(&mut self, len: u64) -> Result<(), ConnectionError> {
        self.read_chunks(&mut DiscardedPayload::new(len)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks in order fill it; one out of order, empty or past the end is refused.
    #[test]
    fn checks_chunks_as_a_receiver_does() {
        let mut sink = DiscardedPayload::new(10);
        assert!(!sink.is_complete());
        sink.check_chunk(0, 4).unwrap();
        assert_eq!(sink.slot(0, 4).unwrap().len(), 4);
        sink.commit(0, 4, None).unwrap();
        assert_eq!(sink.remaining(), 6);
        assert_eq!(
            sink.check_chunk(5, 1),
            Err(StreamError::OutOfOrder {
                offset: 5,
                expected: 4
            })
        );
        assert_eq!(
            sink.check_chunk(4, 0),
            Err(StreamError::EmptyChunk { offset: 4 })
        );
        assert!(matches!(
            sink.check_chunk(4, 7),
            Err(StreamError::PastEnd { .. })
        ));
        sink.slot(4, 3).unwrap();
        sink.slot(7, 3).unwrap();
        sink.commit(4, 6, None).unwrap();
        assert!(sink.is_complete());
        assert!(sink.scratch.len() <= 4, "one piece of scratch, reused");
    }
}
