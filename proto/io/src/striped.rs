//! Receiving one tensor over several connections at once: the receiver's buffer cut into the
//! stripes of a [`StripePlan`], each stripe written and hashed by its own [`StripeReceiver`] (on
//! whichever connection fetches it, on whichever thread runs that), and the receiver rebuilt once
//! every stripe arrived, its content hash merged from the stripes' without reading a byte again.

use std::ops::Range;

use ferry_proto::StreamError;
use ferry_proto::frame::next_chunk_end;
use ferry_proto::stripes::{StripeDigest, StripeHasher, StripeLen, StripePlan};

use crate::assembler::{HashUse, Shell, TensorAssembler};
use crate::connection::ChunkSink;
use ferry_memory::split_buffer::{BufferPiece, SplitBuffer};

/// A receive cut into stripes: what is left of the receiver while its stripes are out.
#[derive(Debug)]
pub struct StripedReceive {
    shell: Shell,
    split: SplitBuffer,
    plan: StripePlan,
}

impl std::fmt::Debug for Shell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shell").field("meta", self.meta()).finish()
    }
}

/// One stripe's receiver: its piece of the buffer, filled in order and hashed as each chunk is
/// committed, while it is still in cache.
#[derive(Debug)]
pub struct StripeReceiver {
    index: usize,
    piece: BufferPiece,
    /// Bytes of the piece received and hashed.
    received: usize,
    /// The end (in the piece) of the last place handed out: past `received` while a chunk
    /// arrives piece by piece.
    slot_end: usize,
    hasher: StripeHasher,
}

impl StripedReceive {
    /// Cuts `assembler` into stripes of `stripe_len`: `Err` gives it back where one stripe would
    /// hold the whole hash input, where a byte already arrived, or where it does not hash what
    /// it receives to check it ([`HashUse::Check`]: stripes check no chunk checksum, and only the
    /// merged hash, compared with one the caller trusts, vouches for their bytes).
    pub fn new(
        assembler: TensorAssembler,
        stripe_len: StripeLen,
    ) -> Result<(StripedReceive, Vec<StripeReceiver>), Box<TensorAssembler>> {
        if assembler.hash_use() != HashUse::Check {
            return Err(Box::new(assembler));
        }
        let Some(plan) = StripePlan::new(assembler.meta(), stripe_len) else {
            return Err(Box::new(assembler));
        };
        let (shell, buf) = assembler.take_apart()?;
        let cuts: Vec<Range<usize>> = (0..plan.count())
            .map(|i| {
                let part = plan.payload_range(i);
                part.start as usize..part.end as usize
            })
            .collect();
        let (split, pieces) = match SplitBuffer::split(buf, &cuts) {
            Ok(done) => done,
            // Not reached: a plan's stripes tile the payload, each part non-empty.
            Err(buf) => {
                debug_assert!(false, "the stripes of a plan did not tile its payload");
                let assembler = TensorAssembler::from_shell(shell, buf);
                return Err(Box::new(assembler));
            }
        };
        let receivers = pieces
            .into_iter()
            .enumerate()
            .map(|(index, piece)| StripeReceiver {
                index,
                piece,
                received: 0,
                slot_end: 0,
                hasher: plan.hasher(index),
            })
            .collect();
        Ok((StripedReceive { shell, split, plan }, receivers))
    }

    /// How the payload is cut.
    pub fn plan(&self) -> &StripePlan {
        &self.plan
    }

    /// The receiver whole again, given every stripe, each complete: every byte arrived, the
    /// content hash (merged from the stripes') settled for [`finish`](TensorAssembler::finish).
    pub fn join(self, mut stripes: Vec<StripeReceiver>) -> Result<TensorAssembler, StreamError> {
        let total = self.shell.meta().byte_len() as u64;
        let received: u64 = stripes.iter().map(|s| s.received as u64).sum();
        stripes.sort_by_key(|s| s.index);
        let whole = stripes.len() == self.plan.count()
            && stripes
                .iter()
                .enumerate()
                .all(|(i, s)| s.index == i && s.is_complete());
        if !whole {
            return Err(StreamError::Incomplete { received, total });
        }
        let digests: Vec<StripeDigest> = stripes.iter().map(|s| s.hasher.finish()).collect();
        let hash = self.plan.merge(&digests);
        let pieces = stripes.into_iter().map(|s| s.piece).collect();
        match (self.split.join(pieces), hash) {
            (Some(buf), Some(hash)) => Ok(TensorAssembler::from_striped(self.shell, buf, hash)),
            // Not reached: every stripe of this plan is here.
            _ => Err(StreamError::Incomplete { received, total }),
        }
    }
}

impl StripeReceiver {
    /// Which stripe.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The payload bytes it receives.
    pub fn payload_range(&self) -> Range<u64> {
        let range = self.piece.range();
        range.start as u64..range.end as u64
    }

    /// The payload offset of the next byte it expects (where a resumed fetch of it starts).
    pub fn next_offset(&self) -> u64 {
        (self.piece.range().start + self.received) as u64
    }

    fn check(&self, offset: u64, len: usize) -> Result<Range<usize>, StreamError> {
        let stripe = self.payload_range();
        let end = next_chunk_end(offset, len, self.next_offset(), stripe.end)?;
        // Within the stripe, so its place in the piece is a usize.
        Ok(self.received..(end - stripe.start) as usize)
    }
}

impl ChunkSink for StripeReceiver {
    fn check_chunk(&self, offset: u64, len: usize) -> Result<(), StreamError> {
        self.check(offset, len).map(|_| ())
    }

    fn slot(&mut self, offset: u64, len: usize) -> Result<&mut [u8], StreamError> {
        let start = self.piece.range().start;
        let continues =
            self.slot_end > self.received && offset == (start + self.slot_end) as u64 && len != 0;
        let range = match continues {
            true => {
                let end = self
                    .slot_end
                    .checked_add(len)
                    .filter(|&end| end <= self.piece.len());
                match end {
                    Some(end) => self.slot_end..end,
                    None => {
                        return Err(StreamError::PastEnd {
                            offset,
                            len: len as u64,
                            total: self.payload_range().end,
                        });
                    }
                }
            }
            false => self.check(offset, len)?,
        };
        self.slot_end = range.end;
        Ok(&mut self.piece[range])
    }

    // A stripe's chunks are never checked one by one (the merged hash is): nothing to keep.
    fn commit(&mut self, offset: u64, len: usize, _: Option<u32>) -> Result<(), StreamError> {
        let range = self.check(offset, len)?;
        if range.end > self.slot_end {
            // Bytes never handed out: nothing was written there.
            return Err(StreamError::Incomplete {
                received: (self.piece.range().start + self.slot_end) as u64,
                total: (self.piece.range().start + range.end) as u64,
            });
        }
        self.hasher.update(&self.piece[range.clone()]);
        self.received = range.end;
        Ok(())
    }

    /// Never: the merged hash is checked against the grant's (see [`StripedReceive::new`]).
    fn checks_chunks(&self) -> bool {
        false
    }

    fn is_complete(&self) -> bool {
        self.received == self.piece.len()
    }

    fn remaining(&self) -> u64 {
        (self.piece.len() - self.received) as u64
    }
}

#[cfg(test)]
mod tests {
    use burn_std::TensorData;
    use ferry_proto::frame::chunks;
    use ferry_proto::tensor::{content_hash, into_parts};

    use super::*;
    use crate::assembler::BufferFrom;

    fn receiver(data: &TensorData) -> TensorAssembler {
        let (meta, _) = into_parts(data.clone()).unwrap();
        TensorAssembler::new(meta, u64::MAX, BufferFrom::Fresh, HashUse::Check).unwrap()
    }

    /// Stripes filled on their own threads, in chunks of any size, out of order with each
    /// other, join into the tensor with its content hash, bit for bit.
    #[test]
    fn stripes_filled_apart_give_the_tensor_and_its_hash() {
        let n = 300_000;
        let data = TensorData::new(
            (0..n).map(|i| (i as f32).sin()).collect::<Vec<_>>(),
            [3, n / 3],
        );
        let (meta, payload) = into_parts(data.clone()).unwrap();
        let len = StripeLen::new(64 << 10).unwrap();
        let (striped, receivers) = StripedReceive::new(receiver(&data), len).unwrap();
        assert_eq!(receivers.len(), striped.plan().count());
        assert!(receivers.len() > 10);
        let payload = std::sync::Arc::new(payload.to_vec());
        let filled: Vec<StripeReceiver> = receivers
            .into_iter()
            .rev()
            .map(|mut stripe| {
                let payload = payload.clone();
                std::thread::spawn(move || {
                    let part = stripe.payload_range();
                    let bytes = &payload[part.start as usize..part.end as usize];
                    for (offset, piece) in chunks(bytes, 10_007) {
                        let at = part.start + offset;
                        stripe.slot(at, piece.len()).unwrap().copy_from_slice(piece);
                        stripe.commit(at, piece.len(), None).unwrap();
                    }
                    stripe
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        let back = striped.join(filled).unwrap().finish().unwrap();
        assert_eq!(back.hash, Some(content_hash(&meta, &payload)));
        let back = back.data;
        assert_eq!(back.as_bytes(), data.as_bytes());
        assert_eq!(back.dtype(), data.dtype());
        assert_eq!(back.shape(), data.shape());
    }

    /// A stripe refuses what is not its next bytes, and the receive does not join with a stripe
    /// missing or short.
    #[test]
    fn a_stripe_takes_only_its_next_bytes_and_all_must_arrive() {
        let data = TensorData::new(vec![7u8; 10_000], [10_000]);
        let len = StripeLen::new(4096).unwrap();
        let (striped, mut receivers) = StripedReceive::new(receiver(&data), len).unwrap();
        let second = &mut receivers[1];
        let start = second.payload_range().start;
        assert!(matches!(
            second.slot(start + 1, 4),
            Err(StreamError::OutOfOrder { .. })
        ));
        assert!(matches!(
            second.slot(start, 0),
            Err(StreamError::EmptyChunk { .. })
        ));
        assert!(matches!(
            second.slot(start, 4097),
            Err(StreamError::PastEnd { .. })
        ));
        second.slot(start, 4).unwrap();
        second.commit(start, 4, None).unwrap();
        assert_eq!(second.next_offset(), start + 4);
        assert!(!second.is_complete());
        receivers.pop();
        assert!(matches!(
            striped.join(receivers),
            Err(StreamError::Incomplete {
                received: 4,
                total: 10_000
            })
        ));
    }

    /// A receiver that fits one stripe, that only records its hash, or that has bytes already,
    /// is not cut.
    #[test]
    fn only_a_fresh_checked_receive_of_several_stripes_is_cut() {
        let data = TensorData::new(vec![1u8; 10_000], [10_000]);
        let big = StripeLen::new(16 << 10).unwrap();
        assert!(StripedReceive::new(receiver(&data), big).is_err());
        let small = StripeLen::new(1024).unwrap();
        let (meta, payload) = into_parts(data.clone()).unwrap();
        let recording =
            TensorAssembler::new(meta.clone(), u64::MAX, BufferFrom::Fresh, HashUse::Record)
                .unwrap();
        assert!(StripedReceive::new(recording, small).is_err());
        let mut started = receiver(&data);
        started.accept(0, &payload[..10]).unwrap();
        assert!(StripedReceive::new(started, small).is_err());
    }
}
