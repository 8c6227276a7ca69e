//! Payloads: a tensor's bytes after its control message, written and read as chunk frames (each
//! with its offset and checksum), or handed to the shared-memory route where that was agreed;
//! each whole payload within its deadline.

use bytes::Buf;
use ferry_proto::frame::{self, CHUNK_PREFIX_LEN, FrameHeader, FrameKind, HEADER_LEN};
use ferry_proto::{FrameError, StreamError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{Connection, ConnectionError, Known, RegionUse, SealedRegion};
use crate::assembler::TensorAssembler;
use crate::transport::Transport;

/// Bytes of a payload read and checksummed at a time (fits in L2 alongside everything else).
pub(super) const CHECKSUM_PIECE: usize = 256 * 1024;

/// How a payload travelled.
// Exhaustive on purpose: a receiver decides how far to trust the bytes by their route (a
// route added later must be handled, not fall into a wildcard).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadRoute {
    /// As chunk frames through the socket.
    Chunks,
    /// As one shared-memory region.
    Region,
}

/// Where a payload's chunk frames are written as they arrive: a whole tensor's receiver
/// ([`TensorAssembler`]) or one stripe's ([`StripeReceiver`](crate::striped::StripeReceiver)).
pub trait ChunkSink {
    /// Whether a chunk of `len` bytes at payload offset `offset` is the next expected, within
    /// what is expected, and not empty: checked before any of its bytes is read.
    fn check_chunk(&self, offset: u64, len: usize) -> Result<(), StreamError>;
    /// The place for `len` bytes at payload offset `offset`: the start of the next chunk
    /// expected, or the next piece of the chunk arriving (right after the last place given);
    /// within what is expected, and not empty.
    fn slot(&mut self, offset: u64, len: usize) -> Result<&mut [u8], StreamError>;
    /// Counts the `len` bytes written at `offset` through [`slot`](Self::slot) as received,
    /// with their chunk's checksum where it was checked (`checked`).
    fn commit(&mut self, offset: u64, len: usize, checked: Option<u32>) -> Result<(), StreamError>;
    /// Whether each chunk's checksum must be checked (see [`TensorAssembler::checks_chunks`]).
    fn checks_chunks(&self) -> bool;
    /// Whether every byte expected has arrived.
    fn is_complete(&self) -> bool;
    /// Bytes still expected, for the payload's deadline.
    fn remaining(&self) -> u64;
}

impl ChunkSink for TensorAssembler {
    fn check_chunk(&self, offset: u64, len: usize) -> Result<(), StreamError> {
        TensorAssembler::check_chunk(self, offset, len)
    }

    fn slot(&mut self, offset: u64, len: usize) -> Result<&mut [u8], StreamError> {
        TensorAssembler::slot(self, offset, len)
    }

    fn commit(&mut self, offset: u64, len: usize, checked: Option<u32>) -> Result<(), StreamError> {
        TensorAssembler::commit(self, offset, len)?;
        self.record_checksum(offset, len, checked);
        Ok(())
    }

    fn checks_chunks(&self) -> bool {
        TensorAssembler::checks_chunks(self)
    }

    fn is_complete(&self) -> bool {
        TensorAssembler::is_complete(self)
    }

    fn remaining(&self) -> u64 {
        (self.meta().byte_len() - self.received()) as u64
    }
}

/// Runs `io`, the move of a payload of `bytes`, within its `deadline` (none: unbounded).
async fn within<T>(
    deadline: Option<std::time::Duration>,
    bytes: u64,
    io: impl std::future::Future<Output = Result<T, ConnectionError>>,
) -> Result<T, ConnectionError> {
    match deadline {
        None => io.await,
        Some(deadline) => tokio::time::timeout(deadline, io)
            .await
            .map_err(|_| ConnectionError::PayloadDeadline { bytes, deadline })?,
    }
}

/// Whether a payload written whole may travel as one shared-memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Whole {
    /// Where shared memory was agreed and the payload is large enough to gain from it.
    MayGoAsRegion,
    /// Never: the receiver reads chunk frames (a part of a payload).
    AsChunks,
}

impl<S: Transport> Connection<S> {
    /// Reads chunk frames into `sink` until it is complete (one stripe of a tensor, say): chunk
    /// frames only, never a region, within the deadline of what it still expects.
    pub async fn read_chunks<K: ChunkSink>(&mut self, sink: &mut K) -> Result<(), ConnectionError> {
        let bytes = sink.remaining();
        let deadline = self.limits.payload_deadline(bytes);
        let read = async {
            while !sink.is_complete() {
                let header = self.next_chunk_header().await?;
                self.read_chunk(header, sink).await?;
            }
            Ok(())
        };
        within(deadline, bytes, read).await
    }

    /// The next frame's header (its body not read yet), checked against the body limit.
    async fn next_header(&mut self) -> Result<FrameHeader, ConnectionError> {
        self.fill_to(HEADER_LEN).await?;
        let head = self
            .buffer
            .first_chunk::<HEADER_LEN>()
            .ok_or(FrameError::TruncatedFrame)?;
        Ok(FrameHeader::decode(head, self.limits.max_body)?)
    }

    /// The next frame's header, which must be a chunk's.
    async fn next_chunk_header(&mut self) -> Result<FrameHeader, ConnectionError> {
        let header = self.next_header().await?;
        match header.kind {
            FrameKind::Chunk => Ok(header),
            got => Err(ConnectionError::UnexpectedFrame {
                expected: "chunk",
                got,
            }),
        }
    }

    /// Reads chunk frames into `assembler` until the whole payload has arrived. Each chunk's
    /// payload goes straight into its place in the preallocated buffer and counts only once its
    /// checksum matches (on a link that authenticates every byte itself, TLS, once it has
    /// arrived: the checksum is not computed there). Where shared memory was agreed, the whole payload may come instead as
    /// one region, which is checked and adopted.
    pub async fn read_payload(
        &mut self,
        assembler: &mut TensorAssembler,
    ) -> Result<PayloadRoute, ConnectionError> {
        self.read_payload_keeping(assembler, RegionUse::Map)
            .await
            .map(|(route, _)| route)
    }

    /// [`read_payload`](Self::read_payload), keeping (with `keep`) the region a payload of at
    /// least [`KEEP_REGION_MIN`](super::KEEP_REGION_MIN) bytes came in, so that whoever
    /// registers the tensor can pass it on through shared memory without copying it
    /// ([`write_payload_known`](Self::write_payload_known)).
    ///
    /// The whole payload must arrive within
    /// [`ConnectionLimits::payload_deadline`](super::ConnectionLimits::payload_deadline).
    pub async fn read_payload_keeping(
        &mut self,
        assembler: &mut TensorAssembler,
        regions: RegionUse,
    ) -> Result<(PayloadRoute, Option<SealedRegion>), ConnectionError> {
        let bytes = assembler.meta().byte_len() as u64;
        let deadline = self.limits.payload_deadline(bytes);
        within(
            deadline,
            bytes,
            self.read_payload_unbounded(assembler, regions),
        )
        .await
    }

    async fn read_payload_unbounded(
        &mut self,
        assembler: &mut TensorAssembler,
        regions: RegionUse,
    ) -> Result<(PayloadRoute, Option<SealedRegion>), ConnectionError> {
        while !assembler.is_complete() {
            let header = self.next_header().await?;
            match header.kind {
                FrameKind::Chunk => {}
                FrameKind::Region => {
                    let kept = self.read_region(header, assembler, regions).await?;
                    return Ok((PayloadRoute::Region, kept));
                }
                FrameKind::Control => {
                    return Err(ConnectionError::UnexpectedFrame {
                        expected: "chunk",
                        got: header.kind,
                    });
                }
            }
            self.read_chunk(header, assembler).await?;
        }
        Ok((PayloadRoute::Chunks, None))
    }

    /// Reads the body of the chunk frame whose header is `header` into `sink`, straight into its
    /// place there, and commits it once it arrived whole and (where checked) its checksum
    /// matched.
    async fn read_chunk<K: ChunkSink>(
        &mut self,
        header: FrameHeader,
        sink: &mut K,
    ) -> Result<(), ConnectionError> {
        let body_len = header.body_len as usize;
        let len = body_len
            .checked_sub(CHUNK_PREFIX_LEN)
            .ok_or(FrameError::ShortChunk { len: body_len })?;
        self.fill_to(HEADER_LEN + CHUNK_PREFIX_LEN).await?;
        self.buffer.advance(HEADER_LEN);
        let offset_bytes = self.buffer.get_u64_le().to_le_bytes();
        let offset = u64::from_le_bytes(offset_bytes);
        // A chunk's checksum catches noise on a link in clear. On a link that authenticates
        // every byte (TLS) neither noise nor a tampered chunk gets here, and a payload hashed
        // as it arrives to be checked (a pull, whose hash is compared with its grant before
        // it is answered) is checked by that hash, which catches whatever the checksum would:
        // in both the checksum is not computed, so each byte is read once after the kernel
        // wrote it (by the hash, where there is one). A hash only recorded (a put's) trails
        // the checksum by a piece, reading what the checksum left in cache.
        let check = !self.stream.get_ref().authenticated() && sink.checks_chunks();
        let mut crc = if check {
            crc32c::crc32c(&offset_bytes)
        } else {
            0
        };
        // Read in cache-sized pieces, each asked of the sink on its own (so that a hash
        // trailing the receive reads a piece while the next arrives) and checksummed while it
        // is still hot, so the payload costs one pass over memory rather than two. The first
        // comes from what the connection's buffer holds already, as far as it goes.
        sink.check_chunk(offset, len)?;
        let mut at = 0;
        while at < len {
            let piece_len = (len - at).min(CHECKSUM_PIECE);
            let piece = sink.slot(offset + at as u64, piece_len)?;
            let buffered = self.buffer.len().min(piece_len);
            piece[..buffered].copy_from_slice(&self.buffer[..buffered]);
            self.buffer.advance(buffered);
            if buffered < piece_len {
                let idle = self.limits.idle_timeout;
                let rest = &mut piece[buffered..];
                match tokio::time::timeout(idle, self.stream.read_exact(rest)).await {
                    Err(_) => return Err(ConnectionError::IdleTimeout(idle)),
                    Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        return Err(ConnectionError::Closed);
                    }
                    Ok(result) => {
                        result?;
                    }
                }
            }
            if check {
                crc = crc32c::crc32c_append(crc, piece);
            }
            at += piece_len;
        }
        if check {
            header.verify_crc(crc)?;
        }
        sink.commit(offset, len, check.then_some(crc))?;
        Ok(())
    }

    /// Writes `payload` and flushes: as one shared-memory region where that was agreed and the
    /// payload is large enough to gain from it, else as chunk frames written from where the
    /// payload lies (only the 24-byte prefix of each chunk is built).
    pub async fn write_payload(&mut self, payload: &[u8]) -> Result<PayloadRoute, ConnectionError> {
        self.write_payload_parts(&[payload], 0).await
    }

    /// [`write_payload`](Self::write_payload) for a payload that lies in several slices (a
    /// quantized tensor's values and its scales, kept apart by the backend), sent as if laid end
    /// to end, without joining them, from byte `start` on (a resumed transfer: chunk frames whose
    /// offsets count from the payload's start, or, from the start only, one region).
    pub async fn write_payload_parts(
        &mut self,
        parts: &[&[u8]],
        start: usize,
    ) -> Result<PayloadRoute, ConnectionError> {
        self.write_payload_known(parts, start, Known::default())
            .await
    }

    /// [`write_payload_parts`](Self::write_payload_parts) for a payload that never changes, with
    /// what is already known of it: where a region is due and the payload lies in a kept
    /// region, that one is passed on as it is, with no copy at all; chunk checksums computed by
    /// an earlier send with the same chunk size are reused rather than computed again.
    ///
    /// The whole payload must be written within
    /// [`ConnectionLimits::payload_deadline`](super::ConnectionLimits::payload_deadline): a peer
    /// that stops reading cannot pin the payload's memory for ever.
    pub async fn write_payload_known(
        &mut self,
        parts: &[&[u8]],
        start: usize,
        known: Known<'_>,
    ) -> Result<PayloadRoute, ConnectionError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let range = start.min(total)..total;
        self.write_payload_within(parts, range, known, Whole::MayGoAsRegion)
            .await
    }

    /// How a whole payload of `len` bytes written now travels: as one region where shared
    /// memory was agreed and the payload is large enough to gain from it, else as chunk frames.
    pub fn whole_payload_route(&self, len: usize) -> PayloadRoute {
        if self.shared_memory && len >= self.limits.region_min.max(1) {
            PayloadRoute::Region
        } else {
            PayloadRoute::Chunks
        }
    }

    /// [`write_payload_known`](Self::write_payload_known) for payload bytes `range` only (one
    /// stripe of a tensor), always as chunk frames. A `range` past the payload is cut to it.
    pub async fn write_payload_part(
        &mut self,
        parts: &[&[u8]],
        range: std::ops::Range<usize>,
        known: Known<'_>,
    ) -> Result<(), ConnectionError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let end = range.end.min(total);
        let range = range.start.min(end)..end;
        self.write_payload_within(parts, range, known, Whole::AsChunks)
            .await
            .map(|_| ())
    }

    async fn write_payload_within(
        &mut self,
        parts: &[&[u8]],
        range: std::ops::Range<usize>,
        known: Known<'_>,
        whole: Whole,
    ) -> Result<PayloadRoute, ConnectionError> {
        let bytes = range.len() as u64;
        let deadline = self.limits.payload_deadline(bytes);
        within(
            deadline,
            bytes,
            self.write_payload_unbounded(parts, range, known, whole),
        )
        .await
    }

    /// Writes payload bytes `range` (within the payload), then flushes.
    async fn write_payload_unbounded(
        &mut self,
        parts: &[&[u8]],
        range: std::ops::Range<usize>,
        known: Known<'_>,
        whole: Whole,
    ) -> Result<PayloadRoute, ConnectionError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let everything = range == (0..total);
        if whole == Whole::MayGoAsRegion
            && everything
            && self.whole_payload_route(total) == PayloadRoute::Region
            && self.write_region(parts, total, known.region).await?
        {
            return Ok(PayloadRoute::Region);
        }
        let idle = self.limits.idle_timeout;
        let chunk = self.limits.chunk_size.max(1);
        let mut offset = range.start;
        let cached = known.checksums.and_then(|c| c.for_chunk_size(chunk));
        // A whole send with nothing cached yet records what it computes, for the next one.
        let mut computed =
            (everything && cached.is_none() && known.checksums.is_some()).then(Vec::new);
        while offset < range.end {
            // Chunks end on multiples of the chunk size, so that a send from anywhere (a resume,
            // a stripe) reuses the checksums cached for those chunks after its first.
            let aligned_end = (offset / chunk).saturating_add(1).saturating_mul(chunk);
            let end = aligned_end.min(range.end);
            let pieces = frame::slices_in(parts, offset..end);
            let whole_chunk = offset.is_multiple_of(chunk) && end == aligned_end.min(total);
            let known_crc = cached
                .as_ref()
                .filter(|_| whole_chunk)
                .and_then(|crcs| crcs.get(offset / chunk));
            let prefix = match known_crc {
                Some(&crc) => frame::chunk_prefix_checked(offset as u64, end - offset, crc),
                None => frame::chunk_prefix_parts(offset as u64, &pieces),
            };
            if let Some(crcs) = &mut computed {
                crcs.push(frame::prefix_checksum(&prefix));
            }
            let write = async {
                self.stream.write_all(&prefix).await?;
                for piece in &pieces {
                    self.stream.write_all(piece).await?;
                }
                Ok::<(), std::io::Error>(())
            };
            // Each chunk must get out within the idle timeout: a reader that stalls is dropped.
            tokio::time::timeout(idle, write)
                .await
                .map_err(|_| ConnectionError::IdleTimeout(idle))??;
            offset = end;
        }
        tokio::time::timeout(idle, self.stream.flush())
            .await
            .map_err(|_| ConnectionError::IdleTimeout(idle))??;
        if let (Some(crcs), Some(cache)) = (computed, known.checksums) {
            cache.remember(chunk, crcs);
        }
        Ok(PayloadRoute::Chunks)
    }
}
