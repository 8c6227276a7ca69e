//! A registered tensor as its worker holds it ([`Entry`]), and reading it out: its bytes on the
//! host for sending, a copy, or an export for a copy or move.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn_backend::{Backend, TensorData};
use ferry_backend::Primitive;
use ferry_io::connection::{ChunkChecksums, SealedRegion};
use tokio::sync::oneshot;

use crate::device::budget::TensorSlot;
use crate::device::payload::NativeTensor;
use crate::device::{Budget, Exported, HostBytes, Reservation, TensorDesc};
use crate::error::NodeError;

/// A registered tensor, as its worker holds it.
pub(super) struct Entry<B: Backend> {
    pub(super) primitive: Primitive<B>,
    /// Its description; `desc.version` is which registration under this name this is.
    pub(super) desc: TensorDesc,
    /// The sealed region the tensor's bytes lie in, kept to pass them on without a copy.
    pub(super) region: Option<Arc<SealedRegion>>,
    /// Raised when the entry goes, so that a pending verification of it stops.
    pub(super) _abandoned: AbandonOnDrop,
    /// Who waits for the verification (dedup candidates).
    pub(super) waiting: Vec<oneshot::Sender<TensorDesc>>,
    /// Its chunk checksums, filled by the first send that computes them.
    pub(super) checksums: Arc<ChunkChecksums>,
    /// Its room in the budget, shared with sends of its bytes still under way.
    pub(super) reservation: Arc<Reservation>,
    /// Its place under the device's tensor cap.
    pub(super) slot: TensorSlot,
}

/// A flag raised when its holder is dropped.
pub(super) struct AbandonOnDrop(pub(super) Arc<AtomicBool>);

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

impl<B: Backend> Entry<B> {
    /// The tensor's payload on the host, for sending: the registered bytes themselves where the
    /// backend allows it (with the region they lie in, if kept); otherwise a [`copy`](Self::copy).
    pub(super) fn host_bytes(&self, budget: &Arc<Budget>) -> Result<HostBytes, NodeError> {
        let shared = self.primitive.shared_host_bytes().filter(|shared| {
            shared.dtype == self.desc.dtype
                && shared.shape == self.desc.shape
                && shared.len() as u64 == self.desc.bytes
        });
        Ok(match shared {
            Some(shared) => HostBytes::Shared {
                payload: shared,
                region: self.region.clone(),
                checksums: self.checksums.clone(),
                _held: self.reservation.clone(),
            },
            None => {
                // Sent to a peer, who decides how long the copy lives: counted in the share
                // such copies may hold, so that stalled readers cannot starve writers.
                let held = budget.reserve_sending(self.desc.bytes)?;
                HostBytes::Owned {
                    data: self.primitive.to_data()?,
                    _held: held,
                }
            }
        })
    }

    /// The tensor's payload read out with `into_data`, with its room in `budget`.
    pub(super) fn copy(
        &self,
        budget: &Arc<Budget>,
    ) -> Result<(TensorData, Reservation), NodeError> {
        // The copy is memory too: counted before it is made, refused where it would not fit.
        let held = budget.reserve_copy(self.desc.bytes)?;
        Ok((self.primitive.to_data()?, held))
    }

    /// The tensor handed out for a copy or move: the primitive itself where `native`, otherwise
    /// a [`copy`](Self::copy) of its payload.
    pub(super) fn export(&self, native: bool, budget: &Arc<Budget>) -> Result<Exported, NodeError> {
        if native {
            Ok(Exported::Native(NativeTensor {
                primitive: Box::new(self.primitive.clone()),
                dtype: self.desc.dtype,
                shape: self.desc.shape.clone(),
                bytes: self.desc.bytes,
                content_hash: self.desc.content_hash,
            }))
        } else {
            let (data, held) = self.copy(budget)?;
            Ok(Exported::Data(data, held))
        }
    }
}
