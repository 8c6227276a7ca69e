//! Registering a tensor on the worker's device (placing the payload, replacing or refusing what
//! the name held) and taking one out.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn_backend::{Backend, DType};
use ferry_backend::Primitive;
use ferry_io::connection::{ChunkChecksums, SealedRegion};
use ferry_io::hash_plan::{AtRegister, at_register};
use ferry_proto::TensorMeta;

use super::Worker;
use super::entry::{AbandonOnDrop, Entry};
use crate::device::verify::VerifyJob;
use crate::device::{
    Arrived, HashState, IfExists, KnownHash, Payload, Reservation, TensorDesc, Version,
};
use crate::engine::TransferPath;
use crate::error::NodeError;

impl<B: Backend> Worker<B> {
    /// Takes a tensor out of the map and the hash index.
    pub(super) fn unregister(&mut self, name: &str) -> Option<Entry<B>> {
        let entry = self.tensors.remove(name)?;
        self.changes.fetch_add(1, Ordering::Release);
        if let Some(hash) = entry.desc.content_hash.indexed() {
            Self::unindex(&mut self.by_hash, hash, name);
        }
        self.held_bytes -= entry.desc.bytes;
        Some(entry)
    }

    /// Registers `payload` under `name`, replacing a tensor registered under it only where
    /// `existing` says so.
    pub(super) fn insert(
        &mut self,
        name: String,
        payload: Payload,
        path: TransferPath,
        existing: IfExists,
        reservation: Reservation,
    ) -> Result<TensorDesc, NodeError> {
        if existing == IfExists::Refuse && self.tensors.contains_key(&name) {
            return Err(NodeError::AlreadyExists(self.key(&name)));
        }
        // A new name takes a slot under the cap now, before anything can be replaced; a
        // replacement takes over the slot of the tensor it replaces.
        let new_slot = if self.tensors.contains_key(&name) {
            None
        } else {
            Some(self.budget.claim_slot()?)
        };
        let Placed {
            primitive,
            dtype,
            shape,
            bytes,
            mut content_hash,
            region,
            checksums,
        } = self.place(&name, payload)?;
        // What the verifier will read, prepared before anything is replaced: nothing after the
        // replacement can fail.
        let mut pending = None;
        if !content_hash.is_verified() {
            let meta = TensorMeta::new(shape.clone(), dtype)?;
            let shared = primitive.shared_host_bytes().filter(|shared| {
                shared.dtype == dtype && shared.shape == shape && shared.len() as u64 == bytes
            });
            match shared {
                Some(shared) => {
                    pending = Some((meta, Arc::downgrade(&shared.values), shared.tail));
                }
                // Not readable in place after all: checked here, from a copy, before anything
                // is replaced.
                None => {
                    let data = primitive.to_data()?;
                    let computed = ferry_proto::tensor::content_hash(&meta, data.as_bytes());
                    content_hash = HashState::Verified(match &content_hash {
                        HashState::Stated(stated) => self.settle(&name, *stated, computed),
                        HashState::Verified(_) | HashState::Computing => computed,
                    });
                }
            }
        }
        self.next_version += 1;
        let version = Version(self.next_version);
        let desc = TensorDesc {
            key: self.key(&name),
            dtype,
            shape,
            bytes,
            path,
            content_hash,
            version,
        };
        let abandoned = Arc::new(AtomicBool::new(false));
        // Replaced (with `IfExists::Replace`): the old tensor leaves the index with it, and
        // leaves its slot to the new one.
        let replaced = self.unregister(&name);
        let slot = match (new_slot, replaced) {
            (Some(slot), _) => slot,
            (None, Some(Entry { slot, .. })) => slot,
            (None, None) => self.budget.claim_slot()?,
        };
        if let Some(hash) = desc.content_hash.indexed() {
            self.by_hash.entry(hash).or_default().insert(name.clone());
        }
        self.held_bytes += desc.bytes;
        self.changes.fetch_add(1, Ordering::Release);
        self.tensors.insert(
            name.clone(),
            Entry {
                primitive,
                desc: desc.clone(),
                region,
                _abandoned: AbandonOnDrop(abandoned.clone()),
                waiting: Vec::new(),
                checksums,
                reservation: Arc::new(reservation),
                slot,
            },
        );
        if let Some((meta, values, tail)) = pending {
            let job = VerifyJob {
                name: name.clone(),
                version,
                meta,
                values,
                tail,
                abandoned,
            };
            self.verify_later(job);
        }
        Ok(desc)
    }

    /// Makes `payload`, bound for `name`, a tensor of this device, with what describes it;
    /// nothing is registered or replaced yet.
    fn place(&self, name: &str, payload: Payload) -> Result<Placed<B>, NodeError> {
        Ok(match payload {
            Payload::Data(Arrived {
                data,
                hash,
                region,
                checksums,
            }) => {
                let dtype = data.dtype();
                let shape = data.shape().as_slice().to_vec();
                let bytes = data.bytes().len() as u64;
                let meta = ferry_proto::tensor::meta_of(&data)?;
                let compute = || ferry_proto::tensor::content_hash(&meta, data.as_bytes());
                // Checked or computed later only where the verifier can read the registered
                // bytes without a copy; elsewhere that would take a second host copy, so now
                // (`ferry_io::hash_plan::at_register`).
                let later = self.kind.shares_registered_bytes(&dtype);
                let content_hash = match (hash, at_register(hash.known(), later)) {
                    // Trusted as is: `KnownHash` is crate-private, and the places that make a
                    // `Computed` (a pull's receiver, `peer/`; a put's, `service/session/put.rs`)
                    // hashed these very bytes as they arrived. No embedder or peer can state a
                    // hash that lands here; a stated one is `Stated` below, and verified from
                    // the registered bytes.
                    (KnownHash::Computed(hash), _) => HashState::Verified(hash),
                    (KnownHash::Stated(hash), AtRegister::VerifyLater) => HashState::Stated(hash),
                    (KnownHash::Stated(stated), _) => {
                        HashState::Verified(self.settle(name, stated, compute()))
                    }
                    (KnownHash::Unknown, AtRegister::ComputeLater) => HashState::Computing,
                    (KnownHash::Unknown, _) => HashState::Verified(compute()),
                };
                let origin = data.as_bytes().as_ptr();
                let primitive = Primitive::<B>::from_data(data, &self.device)?;
                // A device may defer a failure to the first read of the buffer (a GPU that
                // could not allocate it): asked now, so that it is never registered.
                primitive.confirm_written()?;
                // Kept only while the region's mapping is the tensor's own storage: a backend that
                // copied the bytes out freed the mapping, and the region would double the memory.
                // The checksums likewise: a backend that repacked the bytes sends others.
                let in_place = primitive
                    .shared_host_bytes()
                    .is_some_and(|shared| std::ptr::eq(shared.values.as_ptr(), origin));
                let region = region.filter(|_| in_place);
                // Only where the whole payload is the bytes received: a quantized tensor's tail
                // (its scales) is rebuilt from the backend's own, and may differ in a bit.
                let sent_as_received = primitive
                    .shared_host_bytes()
                    .is_some_and(|shared| shared.tail.is_empty());
                let checksums = if in_place && sent_as_received {
                    checksums
                } else {
                    ChunkChecksums::default()
                };
                Placed {
                    primitive,
                    dtype,
                    shape,
                    bytes,
                    content_hash,
                    region: region.map(Arc::new),
                    checksums: Arc::new(checksums),
                }
            }
            Payload::Native(native) => {
                let primitive = native.primitive.downcast::<Primitive<B>>().map_err(|_| {
                    NodeError::Backend(format!(
                        "native transfer to device {} ({}) got a tensor of another backend",
                        self.index, self.kind
                    ))
                })?;
                let primitive = primitive.to_device(&self.device)?;
                primitive.confirm_written()?;
                Placed {
                    primitive,
                    dtype: native.dtype,
                    shape: native.shape,
                    bytes: native.bytes,
                    content_hash: native.content_hash,
                    region: None,
                    checksums: Arc::default(),
                }
            }
        })
    }
}

/// A payload made a tensor of its device, with what describes it, before it is registered.
struct Placed<B: Backend> {
    primitive: Primitive<B>,
    dtype: DType,
    shape: Vec<usize>,
    bytes: u64,
    /// As far as known when it arrived.
    content_hash: HashState,
    /// The sealed region its bytes lie in, where the region's mapping is the tensor's storage.
    region: Option<Arc<SealedRegion>>,
    /// Its chunk checksums, as received, where its storage is the very bytes received.
    checksums: Arc<ChunkChecksums>,
}
