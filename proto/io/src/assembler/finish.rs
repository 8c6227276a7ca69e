//! Handing out the received tensor, once every byte arrived: with its content hash where
//! asked, and the region it was received into sealed, where it was.

use burn_std::{Bytes, TensorData};

use ferry_proto::tensor::from_parts;
use ferry_proto::{ContentHash, ProtoError, StreamError};

use super::{Backing, RunningHash, Sealed, TensorAssembler};

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

    /// The assembled tensor, once every declared byte has arrived (no content hash computed).
    pub fn finish(self) -> Result<TensorData, ProtoError> {
        self.finish_sealed().map(|(data, _)| data)
    }

    /// [`finish`](Self::finish), with the region the tensor was received into, sealed (see
    /// [`new_in_region`](Self::new_in_region)).
    pub fn finish_sealed(mut self) -> Result<(TensorData, Sealed), ProtoError> {
        self.check_complete()?;
        // Joined (and its thread done with the buffer) before the buffer is handed out.
        self.hash = RunningHash::None;
        let sealed = self.seal();
        Ok((from_parts(&self.meta, self.buf)?, sealed))
    }

    /// The assembled tensor and its content hash
    /// ([`content_hash`](ferry_proto::tensor::content_hash)), once every declared byte has
    /// arrived.
    pub fn finish_hashed(self) -> Result<(TensorData, ContentHash), ProtoError> {
        self.finish_hashed_sealed()
            .map(|(data, hash, _)| (data, hash))
    }

    /// [`finish_hashed`](Self::finish_hashed), with the region the tensor was received into,
    /// sealed.
    pub fn finish_hashed_sealed(mut self) -> Result<(TensorData, ContentHash, Sealed), ProtoError> {
        let hash = self.settle_hash()?;
        let sealed = self.seal();
        Ok((from_parts(&self.meta, self.buf)?, hash, sealed))
    }

    /// [`finish_sealed`](Self::finish_sealed), with the content hash where it was computed as
    /// the bytes arrived ([`hashing`](Self::hashing)); `None` where it was not (a receiver that
    /// does not hash, or a payload recorded that came whole: see
    /// [`HashUse::Record`](super::HashUse::Record)). The hashing thread is waited for: call it
    /// off an async runtime.
    pub fn finish_recorded(
        mut self,
    ) -> Result<(TensorData, Option<ContentHash>, Sealed), ProtoError> {
        self.check_complete()?;
        let hash = match self.hash {
            RunningHash::None => None,
            _ => Some(self.settle_hash()?),
        };
        self.hash = RunningHash::None;
        let sealed = self.seal();
        Ok((from_parts(&self.meta, self.buf)?, hash, sealed))
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
