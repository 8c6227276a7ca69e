//! Handing out the received tensor, once every byte arrived: with its content hash where
//! asked, and the region it was received into sealed, where it was.

use burn_std::{Bytes, TensorData};

use ferry_proto::tensor::from_parts;
use ferry_proto::{ContentHash, ProtoError, StreamError};

use super::{Backing, RunningHash, Sealed, TensorAssembler};
use crate::connection::ChunkChecksums;

/// A received tensor, handed out by [`TensorAssembler::finish`].
#[derive(Debug)]
pub struct Assembled {
    /// The tensor, bit-exact as it arrived.
    pub data: TensorData,
    /// Its content hash, where the receiver computed it: never for a receiver that does not
    /// hash ([`HashUse::Skip`](super::HashUse::Skip)), nor for a payload that came whole and was
    /// not settled since.
    pub hash: Option<ContentHash>,
    /// The region it was received into, sealed, to pass on to a same-host peer without a copy.
    pub sealed: Sealed,
    /// Its chunk checksums, where every chunk's was checked as it arrived in a sender's usual
    /// layout: a node that sends these bytes on, unchanged, need not compute them again.
    pub checksums: ChunkChecksums,
}

impl TensorAssembler {
    pub(super) fn check_complete(&self) -> Result<(), ProtoError> {
        if !self.is_complete() {
            return Err(StreamError::Incomplete {
                received: self.received as u64,
                total: self.meta.byte_len() as u64,
            }
            .into());
        }
        Ok(())
    }

    /// Whether [`finish`](Self::finish) returns at once, doing little: a plain tensor under
    /// [`TRAILING_HASH_MIN`](super::TRAILING_HASH_MIN) whose hash, if any, was taken in line,
    /// and no region to seal. Such a receiver may be finished on an async runtime's thread,
    /// without a hand-off to a blocking one and back, which costs more. Not a quantized one:
    /// handing it out checks every scale (and the first check of a scale type builds a table).
    pub fn finishes_at_once(&self) -> bool {
        let small = self.meta.byte_len() < super::TRAILING_HASH_MIN;
        let plain = !matches!(self.meta.dtype(), burn_std::DType::QFloat(_));
        let hash_ready = matches!(
            self.hash,
            RunningHash::None | RunningHash::Inline(_) | RunningHash::Done(_)
        );
        #[cfg(target_os = "linux")]
        let nothing_to_seal = !matches!(self.backing, Backing::Region(_));
        #[cfg(not(target_os = "linux"))]
        let nothing_to_seal = true;
        small && plain && hash_ready && nothing_to_seal
    }

    /// The assembled tensor, once every declared byte has arrived, with its content hash where
    /// it was computed as the bytes arrived or settled ([`settle_hash`](Self::settle_hash)), and
    /// the region it was received into, sealed ([`BufferFrom::Region`](super::BufferFrom)). A
    /// hashing thread is waited for: call it off an async runtime where the receiver hashes.
    pub fn finish(mut self) -> Result<Assembled, ProtoError> {
        self.check_complete()?;
        let hash = match self.hash {
            RunningHash::None => None,
            _ => Some(self.settle_hash()?),
        };
        // Joined (and its thread done with the buffer) before the buffer is handed out.
        self.hash = RunningHash::None;
        let sealed = self.seal();
        let checksums = std::mem::take(&mut self.checksums).into_known(self.meta.byte_len());
        Ok(Assembled {
            data: from_parts(&self.meta, self.buf)?,
            hash,
            sealed,
            checksums,
        })
    }

    /// Seals the region the bytes were received into, if any, and makes its sealed mapping the
    /// buffer. A region that cannot be sealed leaves the bytes as they are (not shareable).
    fn seal(&mut self) -> Sealed {
        // The hashing thread, if any, is done with the buffer (both finishes end it first).
        debug_assert!(!matches!(self.hash, RunningHash::Trailing(_)));
        #[cfg(target_os = "linux")]
        if let Backing::Region(region) = std::mem::replace(&mut self.backing, Backing::Own) {
            let written = std::mem::replace(&mut self.buf, Bytes::from_bytes_vec(Vec::new()));
            let (bytes, kept) = region.seal(written).unwrap_or_else(|(error, written)| {
                tracing::info!(%error, "a received region could not be sealed; kept unshared");
                (written, None)
            });
            self.buf = bytes;
            return kept;
        }
        None
    }
}
