//! What a sender already knows of a payload that never changes: the sealed region it lies in
//! ([`Known`]) and its chunk checksums, computed once and reused ([`ChunkChecksums`]), or kept
//! from the receive that checked them ([`ReceivedChecksums`]).

use super::SealedRegion;

/// What a sender already knows of a payload that never changes (a registered tensor's).
#[derive(Debug, Clone, Copy, Default)]
pub struct Known<'a> {
    /// The sealed region the payload lies in, kept from when it arrived. The caller vouches
    /// that its bytes are exactly the payload's (a node keeps a region only while it is the
    /// registered tensor's own memory); only its length is checked here, and the receiver
    /// checks its crc32c.
    pub region: Option<&'a SealedRegion>,
    /// The payload's chunk checksums, once a send computed them.
    pub checksums: Option<&'a ChunkChecksums>,
}

/// The chunk checksums of a payload that never changes, computed by its first whole send and
/// reused by later sends with the same chunk size (a model served to many workers is
/// checksummed once). A stale entry could only make a receiver refuse a chunk, never accept a
/// wrong one; and a checksum taken once also lets a receiver that checks chunks (a put's, a
/// get's) catch a later change of the bytes in memory (a pull's catches it by the hash).
#[derive(Debug, Default)]
pub struct ChunkChecksums {
    known: std::sync::Mutex<Option<(usize, std::sync::Arc<Vec<u32>>)>>,
}

impl ChunkChecksums {
    pub(super) fn for_chunk_size(&self, chunk: usize) -> Option<std::sync::Arc<Vec<u32>>> {
        let known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        known
            .as_ref()
            .filter(|(size, _)| *size == chunk)
            .map(|(_, crcs)| crcs.clone())
    }

    pub(super) fn remember(&self, chunk: usize, crcs: Vec<u32>) {
        *self.known.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((chunk, std::sync::Arc::new(crcs)));
    }

    /// Checksums known from the start: `crcs[i]` is chunk `i`'s of `chunk` bytes (the last may
    /// be shorter), as a receive checked them ([`ReceivedChecksums::into_known`]).
    pub fn known(chunk: usize, crcs: Vec<u32>) -> Self {
        Self {
            known: std::sync::Mutex::new(Some((chunk, std::sync::Arc::new(crcs)))),
        }
    }

    /// How many chunk checksums are known (for tests).
    pub fn len(&self) -> usize {
        let known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        known.as_ref().map_or(0, |(_, crcs)| crcs.len())
    }

    /// Whether none are known yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The checksums a receive checked, chunk by chunk, kept so that the node need not compute them
/// again when it sends the same bytes on (a model put to one node and copied to the next reads
/// its bytes once there, for the send, instead of twice). Kept only for a payload that came as
/// one run of equal chunks from offset 0, the layout a sender with that chunk size writes; any
/// other (a resume, a chunk not checked, a stripe) keeps none, and the next send computes them.
#[derive(Debug, Default)]
pub struct ReceivedChecksums {
    state: Recording,
}

#[derive(Debug, Default)]
enum Recording {
    /// No chunk yet.
    #[default]
    Empty,
    /// Chunks of `chunk` bytes from offset 0, `covered` bytes in all, each checked; once one
    /// shorter came (`covered` no longer a multiple of `chunk`), it was the last.
    Run {
        chunk: usize,
        crcs: Vec<u32>,
        covered: u64,
    },
    /// A chunk out of that layout, or not checked: none kept.
    Broken,
}

impl ReceivedChecksums {
    /// Notes the chunk of `len` bytes at `offset`, with its checksum where it was checked.
    pub fn record(&mut self, offset: u64, len: usize, checked: Option<u32>) {
        self.state = match (std::mem::take(&mut self.state), checked) {
            (Recording::Empty, Some(crc)) if offset == 0 && len > 0 => Recording::Run {
                chunk: len,
                crcs: vec![crc],
                covered: len as u64,
            },
            (
                Recording::Run {
                    chunk,
                    mut crcs,
                    covered,
                },
                Some(crc),
            ) if offset == covered
                && covered.is_multiple_of(chunk as u64)
                && len > 0
                && len <= chunk =>
            {
                crcs.push(crc);
                Recording::Run {
                    chunk,
                    crcs,
                    covered: covered.saturating_add(len as u64),
                }
            }
            _ => Recording::Broken,
        };
    }

    /// The checksums of a payload of `total` bytes, where the recorded chunks covered exactly
    /// that; none otherwise.
    pub fn into_known(self, total: usize) -> ChunkChecksums {
        match self.state {
            Recording::Run {
                chunk,
                crcs,
                covered,
                ..
            } if covered == total as u64 => ChunkChecksums::known(chunk, crcs),
            _ => ChunkChecksums::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assembler::{BufferFrom, HashUse, TensorAssembler};
    use crate::connection::{Connection, ConnectionError, ConnectionLimits};
    use ferry_proto::{TensorData, tensor::into_parts};

    fn limits() -> ConnectionLimits {
        ConnectionLimits {
            chunk_size: 1000,
            ..ConnectionLimits::default()
        }
    }

    /// Sends `payload` with `known` through an in-memory pipe and reads it back.
    async fn send_and_receive(
        meta: &ferry_proto::TensorMeta,
        payload: &[u8],
        known: Known<'_>,
    ) -> Result<Vec<u8>, ConnectionError> {
        let assembler =
            TensorAssembler::new(meta.clone(), 1 << 30, BufferFrom::Fresh, HashUse::Skip).unwrap();
        let assembler = send_into(assembler, payload, known).await?;
        Ok(assembler.finish().unwrap().data.as_bytes().to_vec())
    }

    /// Sends `payload` with `known` through an in-memory pipe into `assembler`.
    async fn send_into(
        mut assembler: TensorAssembler,
        payload: &[u8],
        known: Known<'_>,
    ) -> Result<TensorAssembler, ConnectionError> {
        // Room for every frame: a reader that refuses a chunk does not leave the writer waiting.
        let (a, b) = tokio::io::duplex(2 * payload.len() + (1 << 16));
        let mut writer = Connection::new(a, limits());
        let mut reader = Connection::new(b, limits());
        let parts = [payload];
        let (sent, received) = tokio::join!(
            writer.write_payload_known(&parts, 0, known),
            reader.read_payload(&mut assembler),
        );
        received?;
        sent?;
        Ok(assembler)
    }

    /// A receiver that hashes the payload to check it (a pull, which compares the hash with its
    /// grant) reads each byte once, for the hash: chunk checksums are not checked. A receiver
    /// that does not hash checks each chunk, and so does one that only records the hash (a put),
    /// whose hash comes out of the same receive. Shown with checksums that do not match the
    /// bytes.
    #[tokio::test]
    async fn a_receiver_that_hashes_the_payload_whole_checks_the_hash_not_the_chunks() {
        // Hashed in line, and (over a megabyte) on a thread that trails the receiver.
        for n in [2500, crate::TRAILING_HASH_MIN / 4 + 250] {
            let data = TensorData::new((0..n).map(|i| i as f32).collect::<Vec<_>>(), [n]);
            let (meta, payload) = into_parts(data).unwrap();
            let checksums = ChunkChecksums::default();
            let known = Known {
                region: None,
                checksums: Some(&checksums),
            };
            send_and_receive(&meta, &payload, known).await.unwrap();
            let mut wrong = checksums.for_chunk_size(1000).unwrap().to_vec();
            wrong[7] ^= 1;
            checksums.remember(1000, wrong);

            let recording =
                TensorAssembler::new(meta.clone(), 1 << 30, BufferFrom::Fresh, HashUse::Record)
                    .unwrap();
            for (receiver, what) in [
                (
                    TensorAssembler::new(meta.clone(), 1 << 30, BufferFrom::Fresh, HashUse::Skip)
                        .unwrap(),
                    "does not hash",
                ),
                (recording, "records its hash"),
            ] {
                assert!(receiver.checks_chunks(), "{what}");
                let checked = send_into(receiver, &payload, known).await;
                assert!(
                    matches!(
                        checked,
                        Err(ConnectionError::Proto(ferry_proto::ProtoError::Frame(
                            ferry_proto::FrameError::ChecksumMismatch { .. }
                        )))
                    ),
                    "{n}: a receiver that {what} checks each chunk: {checked:?}"
                );
            }
            let hashing =
                TensorAssembler::new(meta.clone(), 1 << 30, BufferFrom::Fresh, HashUse::Check)
                    .unwrap();
            assert!(!hashing.checks_chunks());
            let back = send_into(hashing, &payload, known)
                .await
                .expect("a hashing receiver does not check chunk checksums")
                .finish()
                .unwrap();
            assert_eq!(back.data.as_bytes(), &payload[..], "{n}");
            assert_eq!(
                back.hash,
                Some(ferry_proto::tensor::content_hash(&meta, &payload)),
                "{n}"
            );
        }
    }

    #[tokio::test]
    async fn chunk_checksums_are_computed_once_and_reused() {
        let data = TensorData::new((0..2500).map(|i| i as f32).collect::<Vec<_>>(), [2500]);
        let (meta, payload) = into_parts(data).unwrap();
        let checksums = ChunkChecksums::default();
        let known = Known {
            region: None,
            checksums: Some(&checksums),
        };
        assert_eq!(
            send_and_receive(&meta, &payload, known).await.unwrap(),
            &payload[..]
        );
        assert_eq!(checksums.len(), 10, "one per 1000-byte chunk");
        let first = checksums.for_chunk_size(1000).unwrap();
        assert_eq!(
            send_and_receive(&meta, &payload, known).await.unwrap(),
            &payload[..]
        );
        assert!(std::sync::Arc::ptr_eq(
            &first,
            &checksums.for_chunk_size(1000).unwrap()
        ));
        // Checksums that do not match the bytes (the bytes changed in memory since): refused.
        let mut wrong = first.to_vec();
        wrong[3] ^= 1;
        checksums.remember(1000, wrong);
        let refused = send_and_receive(&meta, &payload, known).await;
        assert!(
            matches!(
                refused,
                Err(ConnectionError::Proto(ferry_proto::ProtoError::Frame(
                    ferry_proto::FrameError::ChecksumMismatch { .. }
                )))
            ),
            "{refused:?}"
        );
    }

    /// A receive that checks every chunk hands out their checksums, the very ones the sender
    /// computed; sent on with them, the bytes pass a checking receiver bit-exact. One that does
    /// not check chunks (a pull's, checked by its hash) keeps none.
    #[tokio::test]
    async fn a_checking_receive_keeps_the_checksums_a_send_on_reuses() {
        let data = TensorData::new((0..2500).map(|i| i as f32).collect::<Vec<_>>(), [2500]);
        let (meta, payload) = into_parts(data).unwrap();
        let at_sender = ChunkChecksums::default();
        let known = Known {
            region: None,
            checksums: Some(&at_sender),
        };
        let receiver =
            TensorAssembler::new(meta.clone(), 1 << 30, BufferFrom::Fresh, HashUse::Record)
                .unwrap();
        let received = send_into(receiver, &payload, known)
            .await
            .unwrap()
            .finish()
            .unwrap();
        let sent = at_sender.for_chunk_size(1000).unwrap();
        assert_eq!(
            received.checksums.for_chunk_size(1000).unwrap(),
            sent,
            "one per 1000-byte chunk, as the sender computed them"
        );

        let on = Known {
            region: None,
            checksums: Some(&received.checksums),
        };
        let next =
            TensorAssembler::new(meta.clone(), 1 << 30, BufferFrom::Fresh, HashUse::Skip).unwrap();
        let again = send_into(next, received.data.as_bytes(), on)
            .await
            .unwrap()
            .finish()
            .unwrap();
        assert_eq!(again.data.as_bytes(), &payload[..]);

        let hashing =
            TensorAssembler::new(meta.clone(), 1 << 30, BufferFrom::Fresh, HashUse::Check).unwrap();
        let pulled = send_into(hashing, &payload, known)
            .await
            .unwrap()
            .finish()
            .unwrap();
        assert!(pulled.checksums.is_empty(), "chunks not checked, none kept");
    }

    /// What a receive keeps of the checksums it checked: only a run of equal chunks from 0
    /// (the last maybe shorter) that covers the payload, every one checked.
    #[test]
    fn received_checksums_table() {
        type Chunk = (u64, usize, Option<u32>);
        /// What a case expects kept: the chunk size and the checksums.
        type Kept = Option<(usize, Vec<u32>)>;
        let c = |offset, len, crc| -> Chunk { (offset, len, Some(crc)) };
        let cases: [(&str, usize, Vec<Chunk>, Kept); 10] = [
            ("one chunk", 10, vec![c(0, 10, 1)], Some((10, vec![1]))),
            (
                "equal chunks",
                30,
                vec![c(0, 10, 1), c(10, 10, 2), c(20, 10, 3)],
                Some((10, vec![1, 2, 3])),
            ),
            (
                "a shorter last",
                25,
                vec![c(0, 10, 1), c(10, 10, 2), c(20, 5, 3)],
                Some((10, vec![1, 2, 3])),
            ),
            ("nothing", 0, vec![], None),
            (
                "short of the end",
                30,
                vec![c(0, 10, 1), c(10, 10, 2)],
                None,
            ),
            ("not from 0", 20, vec![c(10, 10, 2)], None),
            ("a gap", 30, vec![c(0, 10, 1), c(20, 10, 3)], None),
            (
                "a chunk after a shorter one",
                20,
                vec![c(0, 10, 1), c(10, 5, 2), c(15, 5, 3)],
                None,
            ),
            ("a longer chunk", 30, vec![c(0, 10, 1), c(10, 20, 2)], None),
            (
                "one not checked",
                20,
                vec![c(0, 10, 1), (10, 10, None)],
                None,
            ),
        ];
        for (what, total, chunks, expected) in cases {
            let mut received = ReceivedChecksums::default();
            for (offset, len, crc) in chunks {
                received.record(offset, len, crc);
            }
            let known = received.into_known(total);
            let got = expected
                .as_ref()
                .and_then(|(chunk, _)| known.for_chunk_size(*chunk))
                .map(|crcs| crcs.to_vec());
            assert_eq!(got, expected.map(|(_, crcs)| crcs), "{what}");
            assert_eq!(known.is_empty(), got.is_none(), "{what}");
        }
    }
}
