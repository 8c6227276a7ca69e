//! The device worker: the single owner of one hosted device and its tensors, on its own thread.
//!
//! It answers [`Command`]s one at a time from its queue, over its table of registered tensors
//! (sorted by name, and indexed by content hash).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use burn_backend::{Backend, DType, TensorData};
use ferry_io::connection::{ChunkChecksums, SealedRegion};
use ferry_proto::{ContentHash, TensorKey, TensorMeta};
use tokio::sync::{mpsc, oneshot};

use crate::backend::{BackendKind, DeviceSpec, Primitive};
use crate::device::budget::TensorSlot;
use crate::device::payload::NativeTensor;
use crate::device::verify::{VerifierHandle, VerifyJob, note_mismatch, spawn_verifier};
use crate::device::{
    Arrived, Budget, Command, DeviceHandle, DeviceLimits, DeviceSummary, Exported, HashState,
    HostBytes, IfExists, KnownHash, Payload, Reservation, TensorDesc, Version,
};
use crate::engine::TransferPath;
use crate::error::NodeError;

/// How many commands may wait for one worker before senders wait too.
const QUEUE_DEPTH: usize = 256;

/// Starts the worker thread for one device.
pub(crate) fn spawn(
    index: u32,
    spec: DeviceSpec,
    limits: DeviceLimits,
) -> std::io::Result<(DeviceHandle, std::thread::JoinHandle<()>)> {
    let cpu = |kind: BackendKind| {
        let label = format!("{kind}:Cpu");
        let holds = kind
            .measured_holds()
            .ok_or_else(|| std::io::Error::other(format!("{kind} is not a CPU backend")))?;
        Ok::<_, std::io::Error>((label, holds))
    };
    match spec {
        DeviceSpec::Flex => {
            let (label, holds) = cpu(BackendKind::Flex)?;
            let at = Opened::new(index, spec, label, holds, None);
            spawn_on::<burn_flex::Flex>(at, Default::default(), limits)
        }
        // Deprecated upstream in favour of Flex, but still what many deployments run, and the
        // second CPU backend that keeps the cross-backend paths honest.
        #[allow(deprecated)]
        DeviceSpec::NdArray => {
            let (label, holds) = cpu(BackendKind::NdArray)?;
            let at = Opened::new(index, spec, label, holds, None);
            spawn_on::<burn_ndarray::NdArray>(at, Default::default(), limits)
        }
        DeviceSpec::Wgpu(gpu) => spawn_gpu(index, spec, gpu, limits),
    }
}

/// Opens a GPU device, measures what it holds (once per adapter in a process) and starts its
/// worker.
#[cfg(feature = "wgpu")]
fn spawn_gpu(
    index: u32,
    spec: DeviceSpec,
    gpu: crate::gpu::GpuSpec,
    limits: DeviceLimits,
) -> std::io::Result<(DeviceHandle, std::thread::JoinHandle<()>)> {
    let opened = crate::gpu::open(gpu).map_err(std::io::Error::other)?;
    let device = opened.device.clone();
    let holds = crate::holds::HoldsTable::cached(&format!("wgpu {}", opened.adapter), || {
        crate::holds::HoldsTable::measure::<crate::gpu::Backend>(&device)
    });
    let label = format!("{gpu} on {}", opened.adapter);
    let at = Opened::new(index, spec, label, holds, Some(opened.largest_buffer));
    spawn_on::<crate::gpu::Backend>(at, opened.device, limits)
}

#[cfg(not(feature = "wgpu"))]
fn spawn_gpu(
    _index: u32,
    _spec: DeviceSpec,
    gpu: crate::gpu::GpuSpec,
    _limits: DeviceLimits,
) -> std::io::Result<(DeviceHandle, std::thread::JoinHandle<()>)> {
    Err(std::io::Error::other(format!(
        "device {gpu}: this build of ferry-server has no GPU runtime: build it with its `wgpu` \
         feature (`cargo build --release --bin ferry-server --features ferry-server-cli/wgpu`)"
    )))
}

/// A device about to get its worker: where it sits, what it is, and what it measured.
struct Opened {
    index: u32,
    kind: BackendKind,
    label: String,
    holds: Arc<crate::holds::HoldsTable>,
    /// The most bytes one tensor may take on it (a GPU adapter's largest buffer); none for host
    /// memory, which the budget bounds.
    largest_tensor: Option<u64>,
}

impl Opened {
    fn new(
        index: u32,
        spec: DeviceSpec,
        label: String,
        holds: Arc<crate::holds::HoldsTable>,
        largest_tensor: Option<u64>,
    ) -> Opened {
        let (probed, exact) = holds.counts();
        tracing::info!(
            device = index,
            spec = %spec,
            label,
            probed,
            exact,
            probe_ms = holds.took().as_millis() as u64,
            largest_tensor,
            "device measured what it holds bit-exact"
        );
        Opened {
            index,
            kind: spec.kind(),
            label,
            holds,
            largest_tensor,
        }
    }
}

fn spawn_on<B: Backend>(
    at: Opened,
    device: B::Device,
    limits: DeviceLimits,
) -> std::io::Result<(DeviceHandle, std::thread::JoinHandle<()>)> {
    let Opened {
        index,
        kind,
        label,
        holds,
        largest_tensor,
    } = at;
    let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
    let hash_mismatches = Arc::new(AtomicU64::new(0));
    let changes = Arc::new(AtomicU64::new(0));
    let verifier = spawn_verifier(index, tx.downgrade())?;
    let budget = Arc::new(Budget::new(index, limits));
    let worker = Worker::<B> {
        index,
        kind,
        device,
        tensors: BTreeMap::new(),
        by_hash: HashMap::new(),
        verifier,
        next_version: 0,
        hash_mismatches: hash_mismatches.clone(),
        changes: changes.clone(),
        budget: budget.clone(),
        held_bytes: 0,
    };
    let thread = std::thread::Builder::new()
        .name(format!("ferry-device-{index}"))
        .spawn(move || worker.run(rx))?;
    let handle = DeviceHandle {
        index,
        kind,
        backend: std::any::TypeId::of::<B>(),
        label,
        tx,
        budget,
        hash_mismatches,
        changes,
        holds,
        largest_tensor,
    };
    Ok((handle, thread))
}

/// A registered tensor, as its worker holds it.
struct Entry<B: Backend> {
    primitive: Primitive<B>,
    /// Its description; `desc.version` is which registration under this name this is.
    desc: TensorDesc,
    /// The sealed region the tensor's bytes lie in, kept to pass them on without a copy.
    region: Option<Arc<SealedRegion>>,
    /// Raised when the entry goes, so that a pending verification of it stops.
    _abandoned: AbandonOnDrop,
    /// Who waits for the verification (dedup candidates).
    waiting: Vec<oneshot::Sender<TensorDesc>>,
    /// Its chunk checksums, filled by the first send that computes them.
    checksums: Arc<ChunkChecksums>,
    /// Its room in the budget, shared with sends of its bytes still under way.
    reservation: Arc<Reservation>,
    /// Its place under the device's tensor cap.
    slot: TensorSlot,
}

/// A flag raised when its holder is dropped.
struct AbandonOnDrop(Arc<AtomicBool>);

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A device's worker: its tensors, and what it needs to register and describe them.
struct Worker<B: Backend> {
    index: u32,
    kind: BackendKind,
    device: B::Device,
    /// Sorted by name, so that a listing is read a page at a time.
    tensors: BTreeMap<String, Entry<B>>,
    /// The names registered under each content hash, so that dedup never scans every tensor.
    by_hash: HashMap<ContentHash, std::collections::BTreeSet<String>>,
    verifier: VerifierHandle,
    next_version: u64,
    hash_mismatches: Arc<AtomicU64>,
    /// Raised on every registration, removal and verified hash (what a cluster's directory
    /// publishes), so that a watcher lists the tensors again only when something changed.
    changes: Arc<AtomicU64>,
    budget: Arc<Budget>,
    /// The payload bytes of every registered tensor, kept as they change (summing them per
    /// insert made a device of many tensors quadratic).
    held_bytes: u64,
}

impl<B: Backend> Worker<B> {
    fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        tracing::debug!(device = self.index, backend = %self.kind, "device worker started");
        while let Some(command) = rx.blocking_recv() {
            self.handle(command);
        }
        tracing::debug!(
            device = self.index,
            tensors = self.tensors.len(),
            "device worker stopped"
        );
    }

    /// Sets the held-tensors gauges after the set changed.
    fn publish_held(&self) {
        crate::metrics::device_held(self.index, self.tensors.len(), self.held_bytes);
    }

    fn key(&self, name: &str) -> TensorKey {
        TensorKey::new(self.index, name)
    }

    fn entry(&self, name: &str) -> Result<&Entry<B>, NodeError> {
        self.tensors
            .get(name)
            .ok_or_else(|| NodeError::NotFound(self.key(name)))
    }

    /// The entry under `name`, if it is the version `pin` asks for (any, without one).
    fn pinned(&self, name: &str, pin: Option<Version>) -> Result<&Entry<B>, NodeError> {
        let entry = self.entry(name)?;
        match pin {
            Some(version) if entry.desc.version != version => {
                Err(NodeError::Changed(self.key(name)))
            }
            _ => Ok(entry),
        }
    }

    // A dropped reply means the asker gave up (its connection closed); nothing to do about it.
    fn handle(&mut self, command: Command) {
        match command {
            Command::Insert {
                name,
                payload,
                path,
                existing,
                reservation,
                reply,
            } => {
                let result = self.insert(name, payload, path, existing, reservation);
                self.publish_held();
                let _ = reply.send(result);
            }
            Command::ReadHost { name, pin, reply } => {
                let result = self
                    .pinned(&name, pin)
                    .and_then(|e| Ok((e.desc.clone(), e.host_bytes(&self.budget)?)));
                let _ = reply.send(result);
            }
            Command::Read { name, reply } => {
                let result = self.entry(&name).and_then(|e| {
                    let (data, held) = e.copy(&self.budget)?;
                    Ok((e.desc.clone(), data, held))
                });
                let _ = reply.send(result);
            }
            Command::Export {
                name,
                pin,
                native,
                reply,
            } => {
                let result = self.pinned(&name, pin).and_then(|e| {
                    if native {
                        Ok(Exported::Native(NativeTensor {
                            primitive: Box::new(e.primitive.clone()),
                            dtype: e.desc.dtype,
                            shape: e.desc.shape.clone(),
                            bytes: e.desc.bytes,
                            content_hash: e.desc.content_hash,
                        }))
                    } else {
                        let (data, held) = e.copy(&self.budget)?;
                        Ok(Exported::Data(data, held))
                    }
                });
                let _ = reply.send(result);
            }
            Command::Describe { name, reply } => {
                let _ = reply.send(self.entry(&name).map(|e| e.desc.clone()));
            }
            Command::Remove { name, pin, reply } => {
                let result = self.pinned(&name, pin).map(|_| ()).and_then(|()| {
                    self.unregister(&name)
                        .map(|e| e.desc.clone())
                        .ok_or_else(|| NodeError::NotFound(self.key(&name)))
                });
                self.publish_held();
                let _ = reply.send(result);
            }
            Command::List {
                after,
                limit,
                reply,
            } => {
                use std::ops::Bound;
                let from = match &after {
                    Some(name) => Bound::Excluded(name.as_str()),
                    None => Bound::Unbounded,
                };
                let page = self
                    .tensors
                    .range::<str, _>((from, Bound::Unbounded))
                    .take(limit)
                    .map(|(_, e)| e.desc.clone())
                    .collect();
                let _ = reply.send(Ok(page));
            }
            Command::Summary { reply } => {
                let summary = DeviceSummary {
                    tensors: self.tensors.len() as u64,
                    bytes: self.held_bytes,
                    hashes_pending: self.tensors.values().fold(0, |pending, e| {
                        pending + u64::from(!e.desc.content_hash.is_verified())
                    }),
                };
                let _ = reply.send(Ok(summary));
            }
            Command::FindByHash { hash, reply } => {
                let named = self.by_hash.get(&hash).into_iter().flatten();
                let descs = named.filter_map(|name| self.tensors.get(name).map(|e| &e.desc));
                let found = descs
                    .clone()
                    .find(|d| d.content_hash.is_verified())
                    .or_else(|| descs.clone().next())
                    .cloned();
                let _ = reply.send(Ok(found));
            }
            Command::AwaitVerified { name, reply } => {
                if let Some(entry) = self.tensors.get_mut(&name) {
                    if entry.desc.content_hash.is_verified() {
                        let _ = reply.send(entry.desc.clone());
                    } else {
                        entry.waiting.push(reply);
                        // Somebody waits for this hash: it goes before those nobody waits for.
                        let version = entry.desc.version;
                        self.verifier
                            .prioritize(|job| job.name == name && job.version == version);
                    }
                }
            }
            Command::Verified {
                name,
                version,
                computed,
            } => self.verified(&name, version, computed),
        }
    }

    /// The hash a tensor answers to once `computed` from its bytes: a `stated` one it is not is
    /// counted and logged ([`note_mismatch`]).
    fn settle(&self, name: &str, stated: ContentHash, computed: ContentHash) -> ContentHash {
        if computed != stated {
            note_mismatch(&self.hash_mismatches, &self.key(name), stated, computed);
        }
        computed
    }

    /// Records a verifier's answer, if the registration it checked is still there.
    fn verified(&mut self, name: &str, version: Version, computed: ContentHash) {
        let key = self.key(name);
        let Some(entry) = self
            .tensors
            .get_mut(name)
            .filter(|e| e.desc.version == version)
        else {
            return;
        };
        let known = std::mem::replace(&mut entry.desc.content_hash, HashState::Verified(computed));
        self.changes.fetch_add(1, Ordering::Release);
        let indexed = match known {
            HashState::Verified(_) => true,
            HashState::Stated(stated) if stated == computed => true,
            HashState::Stated(stated) => {
                note_mismatch(&self.hash_mismatches, &key, stated, computed);
                Self::unindex(&mut self.by_hash, stated, name);
                false
            }
            HashState::Computing => false,
        };
        if !indexed {
            self.by_hash
                .entry(computed)
                .or_default()
                .insert(name.to_string());
        }
        for waiter in entry.waiting.drain(..) {
            let _ = waiter.send(entry.desc.clone());
        }
    }

    fn unindex(
        by_hash: &mut HashMap<ContentHash, std::collections::BTreeSet<String>>,
        hash: ContentHash,
        name: &str,
    ) {
        if let Some(names) = by_hash.get_mut(&hash) {
            names.remove(name);
            if names.is_empty() {
                by_hash.remove(&hash);
            }
        }
    }

    /// Takes a tensor out of the map and the hash index.
    fn unregister(&mut self, name: &str) -> Option<Entry<B>> {
        let entry = self.tensors.remove(name)?;
        self.changes.fetch_add(1, Ordering::Release);
        if let Some(hash) = entry.desc.content_hash.indexed() {
            Self::unindex(&mut self.by_hash, hash, name);
        }
        self.held_bytes -= entry.desc.bytes;
        Some(entry)
    }

    /// Hands a just registered tensor whose hash is not verified to the verifier, or, where there is
    /// no verifier to take it, verifies it here and now (so that nobody waiting for the
    /// verification waits forever).
    fn verify_later(&mut self, job: VerifyJob) {
        if let Err(job) = self.verifier.push(job) {
            tracing::warn!(key = %self.key(&job.name), "no hash verifier; verifying in line");
            if let Some(computed) = job.hash() {
                self.verified(&job.name, job.version, computed);
            }
        }
    }

    /// Registers `payload` under `name`, replacing a tensor registered under it only where
    /// `existing` says so.
    fn insert(
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
                checksums: Arc::default(),
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
            Payload::Data(Arrived { data, hash, region }) => {
                let dtype = data.dtype();
                let shape = data.shape().as_slice().to_vec();
                let bytes = data.bytes().len() as u64;
                let meta = ferry_proto::tensor::meta_of(&data)?;
                let compute = || ferry_proto::tensor::content_hash(&meta, data.as_bytes());
                // Checked or computed later only where the verifier can read the registered
                // bytes without a copy; elsewhere that would take a second host copy, so now.
                let later = self.kind.shares_registered_bytes(&dtype);
                let content_hash = match hash {
                    // Trusted as is: `KnownHash` is crate-private, and the places that make a
                    // `Computed` (a pull's receiver, `peer/`; a put's, `service/session.rs`)
                    // hashed these very bytes as they arrived. No embedder or peer can state a
                    // hash that lands here; a stated one is `Stated` below, and verified from
                    // the registered bytes.
                    KnownHash::Computed(hash) => HashState::Verified(hash),
                    KnownHash::Stated(hash) if later => HashState::Stated(hash),
                    KnownHash::Stated(stated) => {
                        HashState::Verified(self.settle(name, stated, compute()))
                    }
                    KnownHash::Unknown if later => HashState::Computing,
                    KnownHash::Unknown => HashState::Verified(compute()),
                };
                let origin = data.as_bytes().as_ptr();
                let primitive = Primitive::<B>::from_data(data, &self.device)?;
                // A device may defer a failure to the first read of the buffer (a GPU that
                // could not allocate it): asked now, so that it is never registered.
                primitive.confirm_written()?;
                // Kept only while the region's mapping is the tensor's own storage: a backend that
                // copied the bytes out freed the mapping, and the region would double the memory.
                let region = region.filter(|_| {
                    primitive
                        .shared_host_bytes()
                        .is_some_and(|shared| std::ptr::eq(shared.values.as_ptr(), origin))
                });
                Placed {
                    primitive,
                    dtype,
                    shape,
                    bytes,
                    content_hash,
                    region: region.map(Arc::new),
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
}

impl<B: Backend> Entry<B> {
    /// The tensor's payload on the host, for sending: the registered bytes themselves where the
    /// backend allows it (with the region they lie in, if kept); otherwise a [`copy`](Self::copy).
    fn host_bytes(&self, budget: &Arc<Budget>) -> Result<HostBytes, NodeError> {
        let shared = self.primitive.shared_host_bytes().filter(|shared| {
            shared.dtype == self.desc.dtype
                && shared.shape == self.desc.shape
                && shared.len() as u64 == self.desc.bytes
        });
        Ok(match shared {
            Some(mut shared) => {
                shared.region = self.region.clone();
                shared.checksums = Some(self.checksums.clone());
                HostBytes::Shared {
                    payload: shared,
                    _held: self.reservation.clone(),
                }
            }
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
    fn copy(&self, budget: &Arc<Budget>) -> Result<(TensorData, Reservation), NodeError> {
        // The copy is memory too: counted before it is made, refused where it would not fit.
        let held = budget.reserve_copy(self.desc.bytes)?;
        Ok((self.primitive.to_data()?, held))
    }
}
