//! The device worker: the single owner of one hosted device and its tensors, on its own thread.
//!
//! Everything that touches a device's tensors is a [`Command`] sent to its worker; nothing else
//! holds them. Registration is one map insert on this thread, so a tensor is either wholly
//! registered or not at all.
//!
//! A tensor pulled from another node is registered under the content hash that node stated in its
//! grant (relayed by the client), and the worker's verifier thread recomputes it from the
//! registered bytes afterwards: hashing is off the transfer's critical path, and a stated hash is
//! used for nothing that trusts it (dedup) until it is verified.
//!
//! Registered tensors are never written to (the node moves tensors; it computes nothing), so a
//! tensor that arrived as a sealed shared-memory region keeps that region, and is passed on
//! through it without a copy.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use burn_backend::{Backend, DType, TensorData};
use ferry_io::connection::{ChunkChecksums, Known, SealedRegion};
use ferry_proto::{TensorInfo, TensorKey, TensorMeta, WireDType, dtype_name};
use tokio::sync::{mpsc, oneshot};

use crate::backend::{BackendKind, DeviceSpec, Primitive, SharedPayload};
use crate::engine::TransferPath;
use crate::error::NodeError;

/// How many commands may wait for one worker before senders wait too.
const QUEUE_DEPTH: usize = 256;

/// What a registered tensor costs beyond its payload, charged to its device's budget: the
/// description, the map entries, the backend's tensor and allocator rounding (about 4 KiB each
/// was measured resident for small tensors), so that a budget bounds many tiny tensors as well
/// as a few large ones.
pub const TENSOR_OVERHEAD: u64 = 4096;

/// Which registration under a key a tensor is: every insert takes a new one, never reused while
/// the node runs. Operations that read a tensor and then act on it (a copy, a move, a dedup, a
/// fetch under a capability, a conditional delete) pin the version they read, so that a tensor
/// replaced meanwhile is never mistaken for the one they were about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Version(u64);

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// A registered tensor, as the node describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDesc {
    /// Where it is.
    pub key: TensorKey,
    /// Its dtype, quantization scheme included.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its payload length in bytes.
    pub bytes: u64,
    /// How it arrived.
    pub path: TransferPath,
    /// BLAKE3 of its bytes (hex), computed once when it arrived (or stated by the node it came
    /// from, until [`hash_verified`](Self::hash_verified)).
    pub content_hash: String,
    /// Whether this node computed `content_hash` from the bytes it holds. Only verified hashes
    /// answer dedup, and are granted or matched by a conditional delete.
    pub hash_verified: bool,
    /// Which registration under the key this is.
    pub version: Version,
}

impl TensorDesc {
    /// The wire form.
    pub fn to_wire(&self) -> TensorInfo {
        TensorInfo {
            key: self.key.clone(),
            dtype: WireDType::from(self.dtype),
            shape: self.shape.iter().map(|&d| d as u64).collect(),
            bytes: self.bytes,
            path: self.path.name().to_string(),
        }
    }
}

/// A device's memory budget: bytes registered (each tensor with its [`TENSOR_OVERHEAD`]), bytes
/// reserved for transfers in flight, and host copies read out of it for sending; and the number
/// of tensors it may hold.
///
/// Invariant: `used <= limit` and `tensors <= max_tensors` at every instant, whatever the
/// interleaving: both are claimed by compare-and-swap before the memory they stand for exists,
/// and given back only when it is gone (a [`Reservation`] dropped).
#[derive(Debug)]
pub struct Budget {
    device: u32,
    limit: Option<u64>,
    max_tensors: Option<u64>,
    used: AtomicU64,
    tensors: AtomicU64,
}

impl Budget {
    fn new(device: u32, limit: Option<u64>, max_tensors: Option<u64>) -> Self {
        Self {
            device,
            limit,
            max_tensors,
            used: AtomicU64::new(0),
            tensors: AtomicU64::new(0),
        }
    }

    /// Claims room for a tensor of `bytes` (with its overhead), or says what is short. Claimed
    /// before a single byte is received, so many clients together cannot push a device past
    /// its budget. Without `overwrite`, a device already at its tensor cap refuses at once
    /// (the slot itself is claimed when the tensor is registered under a new name).
    pub fn reserve_tensor(
        self: &Arc<Self>,
        bytes: u64,
        overwrite: bool,
    ) -> Result<Reservation, NodeError> {
        let charged = bytes
            .checked_add(TENSOR_OVERHEAD)
            .ok_or(NodeError::TensorTooLarge {
                bytes,
                limit: u64::MAX - TENSOR_OVERHEAD,
            })?;
        if !overwrite
            && let Some(limit) = self.max_tensors
            && self.tensors.load(Ordering::Acquire) >= limit
        {
            return Err(self.too_many_tensors());
        }
        self.reserve_copy(charged)
    }

    /// One of the device's tensor slots, for a tensor registered under a new name; held by the
    /// registered tensor.
    fn claim_slot(self: &Arc<Self>) -> Result<TensorSlot, NodeError> {
        claim(&self.tensors, 1, self.max_tensors).map_err(|_| self.too_many_tensors())?;
        Ok(TensorSlot {
            budget: self.clone(),
        })
    }

    fn too_many_tensors(&self) -> NodeError {
        NodeError::TooManyTensors {
            device: self.device,
            limit: self.max_tensors.unwrap_or(u64::MAX),
        }
    }

    /// Claims room for a host copy of `bytes` read out of the device (to send, or to hand to
    /// another device), held for as long as the copy lives.
    pub fn reserve_copy(self: &Arc<Self>, bytes: u64) -> Result<Reservation, NodeError> {
        self.claim_bytes(bytes)?;
        Ok(Reservation {
            budget: self.clone(),
            bytes,
        })
    }

    fn claim_bytes(&self, bytes: u64) -> Result<(), NodeError> {
        claim(&self.used, bytes, self.limit).map_err(|used| NodeError::OverBudget {
            device: self.device,
            bytes,
            available: self.limit.map_or(u64::MAX, |l| l.saturating_sub(used)),
            limit: self.limit.unwrap_or(u64::MAX),
        })
    }

    /// The budget, if any.
    pub fn limit(&self) -> Option<u64> {
        self.limit
    }

    /// Bytes claimed now: registered tensors with their overhead, transfers in flight and host
    /// copies being sent.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

/// Adds `amount` to `counter` unless that would pass `limit` (or overflow); on refusal, the
/// counter's value seen.
fn claim(counter: &AtomicU64, amount: u64, limit: Option<u64>) -> Result<(), u64> {
    let mut now = counter.load(Ordering::Relaxed);
    loop {
        let next = now
            .checked_add(amount)
            .filter(|&next| limit.is_none_or(|limit| next <= limit))
            .ok_or(now)?;
        match counter.compare_exchange_weak(now, next, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return Ok(()),
            Err(seen) => now = seen,
        }
    }
}

/// Room claimed from a [`Budget`]; given back when dropped (a failed transfer, a removed tensor,
/// a send finished).
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Budget>,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// One of a device's tensor slots ([`DeviceLimits::tensors`]), held by a registered tensor: a
/// tensor that replaces another under its name takes the other's slot over, so a device at its
/// cap still accepts overwrites.
#[derive(Debug)]
struct TensorSlot {
    budget: Arc<Budget>,
}

impl Drop for TensorSlot {
    fn drop(&mut self) {
        self.budget.tensors.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A backend primitive handed between two workers of the same backend (the native path).
pub struct NativeTensor {
    primitive: Box<dyn Any + Send>,
    dtype: DType,
    shape: Vec<usize>,
    bytes: u64,
    content_hash: String,
    hash_verified: bool,
}

impl std::fmt::Debug for NativeTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeTensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish()
    }
}

/// What a receiver knows of a tensor's content hash when it hands the tensor over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KnownHash {
    /// Nothing: the worker computes it before registering.
    Unknown,
    /// Computed by this node over the bytes it hands over.
    Computed(String),
    /// Stated by the node the bytes came from: registered as is where the worker can verify it
    /// afterwards from the registered tensor, else checked before registering.
    Stated(String),
}

/// Host bytes that arrived, to register.
#[derive(Debug)]
pub struct Arrived {
    /// The tensor, validated against the byte-length rule.
    pub data: TensorData,
    /// What is known of its content hash.
    pub hash: KnownHash,
    /// The sealed shared-memory region the bytes lie in, where it was kept.
    pub region: Option<SealedRegion>,
}

impl Arrived {
    /// Bytes with nothing known about them yet.
    pub fn new(data: TensorData) -> Self {
        Self {
            data,
            hash: KnownHash::Unknown,
            region: None,
        }
    }
}

/// What a worker registers.
#[derive(Debug)]
pub enum Payload {
    /// Host bytes: `from_data` on the target.
    Data(Arrived),
    /// A primitive from a worker of the same backend: `*_to_device` on the target.
    Native(NativeTensor),
}

/// A tensor's bytes on the host, for sending; counted in its device's budget for as long as
/// they live, even if the tensor is removed meanwhile.
pub enum HostBytes {
    /// Shared with the registered tensor (no copy); the `Arc` keeps them alive even if the
    /// tensor is removed meanwhile, and nothing writes to a buffer that is shared. The tensor's
    /// own reservation is held with them, so a removed tensor's memory stays counted until the
    /// last send of it ends.
    Shared(SharedPayload, Arc<Reservation>),
    /// Read out with `into_data`: a copy, with its own reservation.
    Owned(TensorData, Reservation),
}

impl HostBytes {
    /// The payload, as the slices it lies in (to be sent end to end).
    pub fn parts(&self) -> Vec<&[u8]> {
        match self {
            HostBytes::Shared(shared, _) => [&shared.values[..], &shared.tail[..]]
                .into_iter()
                .filter(|p| !p.is_empty())
                .collect(),
            HostBytes::Owned(data, _) => vec![data.as_bytes()],
        }
    }

    /// What is known of the payload already: the sealed region it lies in, if it was kept, and
    /// its chunk checksums, once a send computed them (the registered tensor never changes).
    pub fn known(&self) -> Known<'_> {
        match self {
            HostBytes::Shared(shared, _) => Known {
                region: shared.region.as_deref(),
                checksums: shared.checksums.as_deref(),
            },
            HostBytes::Owned(..) => Known::default(),
        }
    }

    /// The payload's length.
    pub fn len(&self) -> usize {
        match self {
            HostBytes::Shared(shared, _) => shared.len(),
            HostBytes::Owned(data, _) => data.as_bytes().len(),
        }
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostBytes::Shared(b, _) => write!(f, "HostBytes::Shared({} bytes)", b.len()),
            HostBytes::Owned(d, _) => write!(f, "HostBytes::Owned({} bytes)", d.as_bytes().len()),
        }
    }
}

/// What a worker hands out for a copy or a move.
#[derive(Debug)]
pub enum Exported {
    /// Host bytes (`into_data`), counted in the source device's budget while they live.
    Data(TensorData, Reservation),
    /// The primitive itself (a cheap clone of the handle).
    Native(NativeTensor),
}

type Reply<T> = oneshot::Sender<Result<T, NodeError>>;

/// What a device worker is asked to do.
pub enum Command {
    /// Register a tensor under `name`.
    Insert {
        /// The name.
        name: String,
        /// The tensor.
        payload: Payload,
        /// How it travelled.
        path: TransferPath,
        /// Replace an existing tensor of that name.
        overwrite: bool,
        /// The budget claimed for it, held for as long as the tensor is registered.
        reservation: Reservation,
        /// Answered once registered.
        reply: Reply<TensorDesc>,
    },
    /// A tensor's bytes; it stays registered. With `share`, the bytes are shared with the
    /// registered tensor where the backend allows it (for sending); otherwise, and always
    /// without `share`, they are read out with `into_data` (a copy the caller owns).
    Read {
        /// The name.
        name: String,
        /// Only this version ([`NodeError::Changed`] if the name holds another).
        pin: Option<Version>,
        /// Share rather than copy where the backend allows it.
        share: bool,
        /// The description and bytes.
        reply: Reply<(TensorDesc, HostBytes)>,
    },
    /// Hand out a tensor for a copy or move.
    Export {
        /// The name.
        name: String,
        /// Only this version ([`NodeError::Changed`] if the name holds another).
        pin: Option<Version>,
        /// Hand out the primitive rather than its bytes.
        native: bool,
        /// The tensor.
        reply: Reply<Exported>,
    },
    /// Describe a tensor.
    Describe {
        /// The name.
        name: String,
        /// Its description.
        reply: Reply<TensorDesc>,
    },
    /// Unregister a tensor.
    Remove {
        /// The name.
        name: String,
        /// Remove it only if it is still this version (a move removes the version it copied,
        /// never a newer one registered meanwhile).
        pin: Option<Version>,
        /// What was removed.
        reply: Reply<TensorDesc>,
    },
    /// Describe the tensors whose names come after `after`, at most `limit` of them.
    List {
        /// The last name of the previous page; from the first name when absent.
        after: Option<String>,
        /// The most descriptions wanted.
        limit: usize,
        /// The descriptions, sorted by name.
        reply: Reply<Vec<TensorDesc>>,
    },
    /// Count the tensors and what they hold.
    Summary {
        /// The counts.
        reply: Reply<DeviceSummary>,
    },
    /// A tensor whose content hash is `hash`: one whose hash is verified if there is one, else
    /// one registered under that hash as its source stated it (to await with
    /// [`AwaitVerified`](Command::AwaitVerified)).
    FindByHash {
        /// The content hash.
        hash: String,
        /// Its description, if any tensor answers to that hash.
        reply: Reply<Option<TensorDesc>>,
    },
    /// Describe a tensor once its content hash is verified (at once if it is).
    AwaitVerified {
        /// The name.
        name: String,
        /// Its description then; dropped unanswered if the tensor goes first.
        reply: oneshot::Sender<TensorDesc>,
    },
    /// The verifier's answer for a stated hash (sent by the worker's own verifier thread).
    Verified {
        /// The tensor's name.
        name: String,
        /// Which registration under that name was checked.
        version: Version,
        /// The hash of the registered bytes.
        computed: String,
    },
}

/// What a device holds, in sum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceSummary {
    /// Registered tensors.
    pub tensors: u64,
    /// Their payload bytes.
    pub bytes: u64,
    /// Those whose stated content hash is not verified yet.
    pub hashes_pending: u64,
}

/// The handle through which everything else reaches a device worker.
#[derive(Debug, Clone)]
pub struct DeviceHandle {
    index: u32,
    kind: BackendKind,
    label: String,
    tx: mpsc::Sender<Command>,
    budget: Arc<Budget>,
    hash_mismatches: Arc<AtomicU64>,
}

impl DeviceHandle {
    /// Its index on the node.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Its backend.
    pub fn kind(&self) -> BackendKind {
        self.kind
    }

    /// Its Burn device, readable.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Its memory budget.
    pub fn budget(&self) -> &Arc<Budget> {
        &self.budget
    }

    /// Stated content hashes that the registered bytes did not match.
    pub fn hash_mismatches(&self) -> u64 {
        self.hash_mismatches.load(Ordering::Relaxed)
    }

    /// Checks that this device's backend stores `dtype` on `shape` exactly.
    pub fn check_holds(&self, dtype: &DType, shape: &[usize]) -> Result<(), NodeError> {
        self.kind
            .holds(dtype, shape)
            .map_err(|reason| NodeError::UnsupportedDType {
                device: format!("{} ({})", self.index, self.kind),
                dtype: dtype_name(dtype),
                reason,
            })
    }

    /// Queues a command whose answer comes some other way.
    pub async fn tell(&self, command: Command) -> Result<(), NodeError> {
        self.tx
            .send(command)
            .await
            .map_err(|_| NodeError::DeviceGone(self.index))
    }

    /// Sends a command and waits for its answer.
    pub async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, NodeError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| NodeError::DeviceGone(self.index))?;
        answer
            .await
            .map_err(|_| NodeError::DeviceGone(self.index))?
    }
}

/// Starts the worker thread for one device.
/// What bounds a device's memory: its budget in bytes and the most tensors it holds.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeviceLimits {
    /// Bytes of tensors (with their overhead), transfers in flight and copies being sent.
    pub memory: Option<u64>,
    /// Registered tensors.
    pub tensors: Option<u64>,
}

/// Starts the worker thread for one device.
pub fn spawn(
    index: u32,
    spec: DeviceSpec,
    limits: DeviceLimits,
) -> std::io::Result<(DeviceHandle, std::thread::JoinHandle<()>)> {
    match spec.kind {
        BackendKind::Flex => {
            spawn_on::<burn_flex::Flex>(index, spec.kind, Default::default(), limits)
        }
        // Deprecated upstream in favour of Flex, but still what many deployments run, and the
        // second CPU backend that keeps the cross-backend paths honest.
        #[allow(deprecated)]
        BackendKind::NdArray => {
            spawn_on::<burn_ndarray::NdArray>(index, spec.kind, Default::default(), limits)
        }
    }
}

fn spawn_on<B: Backend>(
    index: u32,
    kind: BackendKind,
    device: B::Device,
    limits: DeviceLimits,
) -> std::io::Result<(DeviceHandle, std::thread::JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
    let label = format!("{kind}:{device:?}");
    let hash_mismatches = Arc::new(AtomicU64::new(0));
    let verifier = spawn_verifier(index, tx.downgrade())?;
    let budget = Arc::new(Budget::new(index, limits.memory, limits.tensors));
    let worker = Worker::<B> {
        index,
        kind,
        device,
        tensors: BTreeMap::new(),
        by_hash: HashMap::new(),
        verifier,
        next_version: 0,
        hash_mismatches: hash_mismatches.clone(),
        budget: budget.clone(),
        held_bytes: 0,
    };
    let thread = std::thread::Builder::new()
        .name(format!("ferry-device-{index}"))
        .spawn(move || worker.run(rx))?;
    let handle = DeviceHandle {
        index,
        kind,
        label,
        tx,
        budget,
        hash_mismatches,
    };
    Ok((handle, thread))
}

/// A stated hash to check against a registered tensor's bytes.
struct VerifyJob {
    name: String,
    version: Version,
    meta: TensorMeta,
    /// The registered tensor's values, not kept alive by a queued job: a tensor removed before
    /// its turn is not hashed at all, and its memory is not held past its removal.
    values: std::sync::Weak<burn_backend::Bytes>,
    /// What follows the values in the payload (a quantized tensor's scales).
    tail: Vec<u8>,
    /// Set once the tensor is unregistered: the check is then abandoned.
    abandoned: Arc<AtomicBool>,
}

impl VerifyJob {
    /// The content hash of the job's bytes; `None` once the tensor is gone.
    fn hash(&self) -> Option<String> {
        let values = self.values.upgrade()?;
        let stop = || self.abandoned.load(Ordering::Relaxed);
        ferry_proto::tensor::content_hash_parts(&self.meta, &[&values[..], &self.tail], stop)
    }
}

/// Starts a device's verifier: one thread that hashes registered tensors whose hash was stated by
/// their source, and reports to the worker. It ends when the worker does (its queue closes).
fn spawn_verifier(
    index: u32,
    worker: mpsc::WeakSender<Command>,
) -> std::io::Result<std::sync::mpsc::Sender<VerifyJob>> {
    let (jobs, queue) = std::sync::mpsc::channel::<VerifyJob>();
    std::thread::Builder::new()
        .name(format!("ferry-verify-{index}"))
        .spawn(move || {
            while let Ok(job) = queue.recv() {
                let Some(computed) = job.hash() else {
                    continue;
                };
                let Some(worker) = worker.upgrade() else {
                    return;
                };
                let verified = Command::Verified {
                    name: job.name,
                    version: job.version,
                    computed,
                };
                if worker.blocking_send(verified).is_err() {
                    return;
                }
            }
        })?;
    Ok(jobs)
}

/// Counts and logs a stated content hash that the bytes do not have. The bytes are what the
/// source sent, each chunk checked (and the capability pinned them to what the source held):
/// only the statement about them was wrong, so the tensor answers to the computed hash.
fn note_mismatch(count: &AtomicU64, key: &TensorKey, stated: &str, computed: &str) {
    count.fetch_add(1, Ordering::Relaxed);
    tracing::error!(
        %key,
        %stated,
        %computed,
        "a stated content hash is not the bytes'; the tensor answers to the computed one"
    );
}

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

struct Worker<B: Backend> {
    index: u32,
    kind: BackendKind,
    device: B::Device,
    /// Sorted by name, so that a listing is read a page at a time.
    tensors: BTreeMap<String, Entry<B>>,
    /// The names registered under each content hash, so that dedup never scans every tensor.
    by_hash: HashMap<String, std::collections::BTreeSet<String>>,
    verifier: std::sync::mpsc::Sender<VerifyJob>,
    next_version: u64,
    hash_mismatches: Arc<AtomicU64>,
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
                overwrite,
                reservation,
                reply,
            } => {
                let result = self.insert(name, payload, path, overwrite, reservation);
                self.publish_held();
                let _ = reply.send(result);
            }
            Command::Read {
                name,
                pin,
                share,
                reply,
            } => {
                let result = self
                    .pinned(&name, pin)
                    .and_then(|e| Ok((e.desc.clone(), e.host_bytes(share, &self.budget)?)));
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
                            content_hash: e.desc.content_hash.clone(),
                            hash_verified: e.desc.hash_verified,
                        }))
                    } else {
                        let held = self.budget.reserve_copy(e.desc.bytes)?;
                        Ok(Exported::Data(e.primitive.to_data()?, held))
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
                    hashes_pending: self
                        .tensors
                        .values()
                        .fold(0, |pending, e| pending + u64::from(!e.desc.hash_verified)),
                };
                let _ = reply.send(Ok(summary));
            }
            Command::FindByHash { hash, reply } => {
                let named = self.by_hash.get(&hash).into_iter().flatten();
                let descs = named.filter_map(|name| self.tensors.get(name).map(|e| &e.desc));
                let found = descs
                    .clone()
                    .find(|d| d.hash_verified)
                    .or_else(|| descs.clone().next())
                    .cloned();
                let _ = reply.send(Ok(found));
            }
            Command::AwaitVerified { name, reply } => {
                if let Some(entry) = self.tensors.get_mut(&name) {
                    if entry.desc.hash_verified {
                        let _ = reply.send(entry.desc.clone());
                    } else {
                        entry.waiting.push(reply);
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
    fn settle(&self, name: &str, stated: &str, computed: String) -> String {
        if computed != stated {
            note_mismatch(&self.hash_mismatches, &self.key(name), stated, &computed);
        }
        computed
    }

    /// Records a verifier's answer, if the registration it checked is still there.
    fn verified(&mut self, name: &str, version: Version, computed: String) {
        let key = self.key(name);
        let Some(entry) = self
            .tensors
            .get_mut(name)
            .filter(|e| e.desc.version == version)
        else {
            return;
        };
        if entry.desc.content_hash != computed {
            note_mismatch(
                &self.hash_mismatches,
                &key,
                &entry.desc.content_hash,
                &computed,
            );
            let stated = std::mem::replace(&mut entry.desc.content_hash, computed.clone());
            Self::unindex(&mut self.by_hash, &stated, name);
            self.by_hash
                .entry(computed)
                .or_default()
                .insert(name.to_string());
        }
        entry.desc.hash_verified = true;
        for waiter in entry.waiting.drain(..) {
            let _ = waiter.send(entry.desc.clone());
        }
    }

    fn unindex(
        by_hash: &mut HashMap<String, std::collections::BTreeSet<String>>,
        hash: &str,
        name: &str,
    ) {
        if let Some(names) = by_hash.get_mut(hash) {
            names.remove(name);
            if names.is_empty() {
                by_hash.remove(hash);
            }
        }
    }

    /// Takes a tensor out of the map and the hash index.
    fn unregister(&mut self, name: &str) -> Option<Entry<B>> {
        let entry = self.tensors.remove(name)?;
        Self::unindex(&mut self.by_hash, &entry.desc.content_hash, name);
        self.held_bytes -= entry.desc.bytes;
        Some(entry)
    }

    /// Hands a just registered tensor with a stated hash to the verifier, or, where there is
    /// no verifier to take it, verifies it here and now (so that nobody waiting for the
    /// verification waits forever).
    fn verify_later(&mut self, name: &str, job: VerifyJob) {
        if let Err(std::sync::mpsc::SendError(job)) = self.verifier.send(job) {
            tracing::warn!(key = %self.key(name), "no hash verifier; verifying in line");
            if let Some(computed) = job.hash() {
                self.verified(name, job.version, computed);
            }
        }
    }

    fn insert(
        &mut self,
        name: String,
        payload: Payload,
        path: TransferPath,
        overwrite: bool,
        reservation: Reservation,
    ) -> Result<TensorDesc, NodeError> {
        if !overwrite && self.tensors.contains_key(&name) {
            return Err(NodeError::AlreadyExists(self.key(&name)));
        }
        // A new name takes a slot under the cap now, before anything can be replaced; a
        // replacement takes over the slot of the tensor it replaces.
        let new_slot = if self.tensors.contains_key(&name) {
            None
        } else {
            Some(self.budget.claim_slot()?)
        };
        let (primitive, dtype, shape, bytes, mut content_hash, mut hash_verified, region) =
            match payload {
                Payload::Data(Arrived { data, hash, region }) => {
                    let dtype = data.dtype();
                    let shape = data.shape().as_slice().to_vec();
                    let bytes = data.bytes().len() as u64;
                    let meta = ferry_proto::tensor::meta_of(&data)?;
                    let compute = || ferry_proto::tensor::content_hash(&meta, data.as_bytes());
                    let (content_hash, hash_verified) = match hash {
                        KnownHash::Computed(hash) => (hash, true),
                        // Checked later only where the verifier can read the registered bytes
                        // without a copy; elsewhere that would take a second host copy, so now.
                        KnownHash::Stated(hash) if self.kind.shares_registered_bytes(&dtype) => {
                            (hash, false)
                        }
                        KnownHash::Stated(stated) => (self.settle(&name, &stated, compute()), true),
                        KnownHash::Unknown => (compute(), true),
                    };
                    let origin = data.as_bytes().as_ptr();
                    let primitive = Primitive::<B>::from_data(data, &self.device)?;
                    // Kept only while the region's mapping is the tensor's own storage: a backend that
                    // copied the bytes out freed the mapping, and the region would double the memory.
                    let region = region.filter(|_| {
                        primitive
                            .shared_host_bytes()
                            .is_some_and(|shared| std::ptr::eq(shared.values.as_ptr(), origin))
                    });
                    (
                        primitive,
                        dtype,
                        shape,
                        bytes,
                        content_hash,
                        hash_verified,
                        region.map(Arc::new),
                    )
                }
                Payload::Native(native) => {
                    let primitive = native.primitive.downcast::<Primitive<B>>().map_err(|_| {
                        NodeError::Backend(format!(
                            "native transfer to device {} ({}) got a tensor of another backend",
                            self.index, self.kind
                        ))
                    })?;
                    (
                        primitive.to_device(&self.device)?,
                        native.dtype,
                        native.shape,
                        native.bytes,
                        native.content_hash,
                        native.hash_verified,
                        None,
                    )
                }
            };
        // What the verifier will read, prepared before anything is replaced: nothing after the
        // replacement can fail.
        let mut pending = None;
        if !hash_verified {
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
                    content_hash = self.settle(&name, &content_hash, computed);
                    hash_verified = true;
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
            hash_verified,
            version,
        };
        let abandoned = Arc::new(AtomicBool::new(false));
        // Replaced (with `overwrite`): the old tensor leaves the index with it, and leaves its
        // slot to the new one.
        let replaced = self.unregister(&name);
        let slot = match (new_slot, replaced) {
            (Some(slot), _) => slot,
            (None, Some(Entry { slot, .. })) => slot,
            (None, None) => self.budget.claim_slot()?,
        };
        self.by_hash
            .entry(desc.content_hash.clone())
            .or_default()
            .insert(name.clone());
        self.held_bytes += desc.bytes;
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
            self.verify_later(&name, job);
        }
        Ok(desc)
    }
}

impl<B: Backend> Entry<B> {
    /// The tensor's payload on the host: with `share`, the registered bytes themselves where the
    /// backend allows it (with the region they lie in, if kept); otherwise a copy (`into_data`).
    fn host_bytes(&self, share: bool, budget: &Arc<Budget>) -> Result<HostBytes, NodeError> {
        let shared = share
            .then(|| self.primitive.shared_host_bytes())
            .flatten()
            .filter(|shared| {
                shared.dtype == self.desc.dtype
                    && shared.shape == self.desc.shape
                    && shared.len() as u64 == self.desc.bytes
            });
        Ok(match shared {
            Some(mut shared) => {
                shared.region = self.region.clone();
                shared.checksums = Some(self.checksums.clone());
                HostBytes::Shared(shared, self.reservation.clone())
            }
            // The copy is memory too: counted before it is made, refused where it would not fit.
            None => {
                let held = budget.reserve_copy(self.desc.bytes)?;
                HostBytes::Owned(self.primitive.to_data()?, held)
            }
        })
    }
}
