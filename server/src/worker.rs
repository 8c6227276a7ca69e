//! The device worker: the single owner of one hosted device and its tensors, on its own thread.
//!
//! Everything that touches a device's tensors is a [`Command`] sent to its worker; nothing else
//! holds them. Registration is one map insert on this thread, so a tensor is either wholly
//! registered or not at all.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn_backend::{Backend, DType, TensorData};
use ferry_proto::{TensorInfo, TensorKey, WireDType, dtype_name};
use tokio::sync::{mpsc, oneshot};

use crate::backend::{BackendKind, DeviceSpec, Primitive, SharedPayload};
use crate::engine::TransferPath;
use crate::error::NodeError;

/// How many commands may wait for one worker before senders wait too.
const QUEUE_DEPTH: usize = 256;

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
    /// BLAKE3 of its bytes (hex), computed once when it arrived.
    pub content_hash: String,
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

/// A device's memory budget: bytes registered plus bytes reserved for transfers in flight.
#[derive(Debug)]
pub struct Budget {
    device: u32,
    limit: Option<u64>,
    used: AtomicU64,
}

impl Budget {
    fn new(device: u32, limit: Option<u64>) -> Self {
        Self {
            device,
            limit,
            used: AtomicU64::new(0),
        }
    }

    /// Claims `bytes`, or says how much is free. Claimed before a single byte is received, so
    /// many clients together cannot push a device past its budget.
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Result<Reservation, NodeError> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let next = used.checked_add(bytes);
            if let (Some(limit), Some(next)) = (self.limit, next)
                && next > limit
            {
                return Err(NodeError::OverBudget {
                    device: self.device,
                    bytes,
                    available: limit.saturating_sub(used),
                    limit,
                });
            }
            let next = next.ok_or(NodeError::TensorTooLarge {
                bytes,
                limit: u64::MAX,
            })?;
            match self
                .used
                .compare_exchange_weak(used, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    return Ok(Reservation {
                        budget: self.clone(),
                        bytes,
                    });
                }
                Err(now) => used = now,
            }
        }
    }

    /// Bytes registered or reserved now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// The budget, if any.
    pub fn limit(&self) -> Option<u64> {
        self.limit
    }
}

/// Bytes claimed from a [`Budget`]; given back when dropped (a failed transfer, a removed tensor).
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

/// A backend primitive handed between two workers of the same backend (the native path).
pub struct NativeTensor {
    primitive: Box<dyn Any + Send>,
    dtype: DType,
    shape: Vec<usize>,
    bytes: u64,
    content_hash: String,
}

impl std::fmt::Debug for NativeTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeTensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish()
    }
}

/// What a worker registers.
#[derive(Debug)]
pub enum Payload {
    /// Host bytes, validated against the byte-length rule: `from_data` on the target. The
    /// content hash comes along when the receiver already computed it.
    Data(TensorData, Option<String>),
    /// A primitive from a worker of the same backend: `*_to_device` on the target.
    Native(NativeTensor),
}

/// A tensor's bytes on the host, for sending.
pub enum HostBytes {
    /// Shared with the registered tensor (no copy); the `Arc` keeps them alive even if the
    /// tensor is removed meanwhile, and nothing writes to a buffer that is shared.
    Shared(SharedPayload),
    /// Read out with `into_data`.
    Owned(TensorData),
}

impl HostBytes {
    /// The payload, as the slices it lies in (to be sent end to end).
    pub fn parts(&self) -> Vec<&[u8]> {
        match self {
            HostBytes::Shared(shared) => [&shared.values[..], &shared.tail[..]]
                .into_iter()
                .filter(|p| !p.is_empty())
                .collect(),
            HostBytes::Owned(data) => vec![data.as_bytes()],
        }
    }

    /// The payload's length.
    pub fn len(&self) -> usize {
        match self {
            HostBytes::Shared(shared) => shared.len(),
            HostBytes::Owned(data) => data.as_bytes().len(),
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
            HostBytes::Shared(b) => write!(f, "HostBytes::Shared({} bytes)", b.len()),
            HostBytes::Owned(d) => write!(f, "HostBytes::Owned({} bytes)", d.as_bytes().len()),
        }
    }
}

/// What a worker hands out for a copy or a move.
#[derive(Debug)]
pub enum Exported {
    /// Host bytes (`into_data`).
    Data(TensorData),
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
        /// Refuse the tensor unless its content hash is this (a pull checks end to end that it
        /// assembled the tensor it was granted).
        expect_hash: Option<String>,
        /// Answered once registered.
        reply: Reply<TensorDesc>,
    },
    /// A tensor's bytes; it stays registered. With `share`, the bytes are shared with the
    /// registered tensor where the backend allows it (for sending); otherwise, and always
    /// without `share`, they are read out with `into_data` (a copy the caller owns).
    Read {
        /// The name.
        name: String,
        /// Share rather than copy where the backend allows it.
        share: bool,
        /// The description and bytes.
        reply: Reply<(TensorDesc, HostBytes)>,
    },
    /// Hand out a tensor for a copy or move.
    Export {
        /// The name.
        name: String,
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
        /// Remove it only if its content hash is still this (a move removes the version it
        /// copied, never a newer one registered meanwhile).
        expect_hash: Option<String>,
        /// What was removed.
        reply: Reply<TensorDesc>,
    },
    /// Describe every tensor.
    List {
        /// The descriptions, sorted by name.
        reply: Reply<Vec<TensorDesc>>,
    },
}

/// The handle through which everything else reaches a device worker.
#[derive(Debug, Clone)]
pub struct DeviceHandle {
    index: u32,
    kind: BackendKind,
    label: String,
    tx: mpsc::Sender<Command>,
    budget: Arc<Budget>,
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
pub fn spawn(
    index: u32,
    spec: DeviceSpec,
    memory_limit: Option<u64>,
) -> std::io::Result<(DeviceHandle, std::thread::JoinHandle<()>)> {
    match spec.kind {
        BackendKind::Flex => {
            spawn_on::<burn_flex::Flex>(index, spec.kind, Default::default(), memory_limit)
        }
        // Deprecated upstream in favour of Flex, but still what many deployments run, and the
        // second CPU backend that keeps the cross-backend paths honest.
        #[allow(deprecated)]
        BackendKind::NdArray => {
            spawn_on::<burn_ndarray::NdArray>(index, spec.kind, Default::default(), memory_limit)
        }
    }
}

fn spawn_on<B: Backend>(
    index: u32,
    kind: BackendKind,
    device: B::Device,
    memory_limit: Option<u64>,
) -> std::io::Result<(DeviceHandle, std::thread::JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
    let label = format!("{kind}:{device:?}");
    let worker = Worker::<B> {
        index,
        kind,
        device,
        tensors: HashMap::new(),
    };
    let thread = std::thread::Builder::new()
        .name(format!("ferry-device-{index}"))
        .spawn(move || worker.run(rx))?;
    let handle = DeviceHandle {
        index,
        kind,
        label,
        tx,
        budget: Arc::new(Budget::new(index, memory_limit)),
    };
    Ok((handle, thread))
}

struct Entry<B: Backend> {
    primitive: Primitive<B>,
    desc: TensorDesc,
    _reservation: Reservation,
}

struct Worker<B: Backend> {
    index: u32,
    kind: BackendKind,
    device: B::Device,
    tensors: HashMap<String, Entry<B>>,
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
        let bytes = self.tensors.values().map(|e| e.desc.bytes).sum();
        crate::metrics::device_held(self.index, self.tensors.len(), bytes);
    }

    fn key(&self, name: &str) -> TensorKey {
        TensorKey::new(self.index, name)
    }

    fn entry(&self, name: &str) -> Result<&Entry<B>, NodeError> {
        self.tensors
            .get(name)
            .ok_or_else(|| NodeError::NotFound(self.key(name)))
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
                expect_hash,
                reply,
            } => {
                let result = self.insert(name, payload, path, overwrite, reservation, expect_hash);
                self.publish_held();
                let _ = reply.send(result);
            }
            Command::Read { name, share, reply } => {
                let result = self.entry(&name).and_then(|e| {
                    let shared = share
                        .then(|| e.primitive.shared_host_bytes())
                        .flatten()
                        .filter(|shared| {
                            shared.dtype == e.desc.dtype
                                && shared.shape == e.desc.shape
                                && shared.len() as u64 == e.desc.bytes
                        });
                    let bytes = match shared {
                        Some(shared) => HostBytes::Shared(shared),
                        None => HostBytes::Owned(e.primitive.to_data()?),
                    };
                    Ok((e.desc.clone(), bytes))
                });
                let _ = reply.send(result);
            }
            Command::Export {
                name,
                native,
                reply,
            } => {
                let result = self.entry(&name).and_then(|e| {
                    if native {
                        Ok(Exported::Native(NativeTensor {
                            primitive: Box::new(e.primitive.clone()),
                            dtype: e.desc.dtype,
                            shape: e.desc.shape.clone(),
                            bytes: e.desc.bytes,
                            content_hash: e.desc.content_hash.clone(),
                        }))
                    } else {
                        e.primitive.to_data().map(Exported::Data)
                    }
                });
                let _ = reply.send(result);
            }
            Command::Describe { name, reply } => {
                let _ = reply.send(self.entry(&name).map(|e| e.desc.clone()));
            }
            Command::Remove {
                name,
                expect_hash,
                reply,
            } => {
                let result = match (self.tensors.get(&name), expect_hash) {
                    (None, _) => Err(NodeError::NotFound(self.key(&name))),
                    (Some(e), Some(hash)) if e.desc.content_hash != hash => {
                        Err(NodeError::Changed(self.key(&name)))
                    }
                    _ => self
                        .tensors
                        .remove(&name)
                        .map(|e| e.desc)
                        .ok_or_else(|| NodeError::NotFound(self.key(&name))),
                };
                self.publish_held();
                let _ = reply.send(result);
            }
            Command::List { reply } => {
                let mut all: Vec<TensorDesc> =
                    self.tensors.values().map(|e| e.desc.clone()).collect();
                all.sort_by(|a, b| a.key.name.cmp(&b.key.name));
                let _ = reply.send(Ok(all));
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
        expect_hash: Option<String>,
    ) -> Result<TensorDesc, NodeError> {
        if !overwrite && self.tensors.contains_key(&name) {
            return Err(NodeError::AlreadyExists(self.key(&name)));
        }
        let (primitive, dtype, shape, bytes, content_hash) = match payload {
            Payload::Data(data, hashed) => {
                let dtype = data.dtype();
                let shape = data.shape().as_slice().to_vec();
                let bytes = data.bytes().len() as u64;
                let meta = ferry_proto::tensor::meta_of(&data)?;
                let content_hash = hashed
                    .unwrap_or_else(|| ferry_proto::tensor::content_hash(&meta, data.as_bytes()));
                if let Some(expected) = &expect_hash
                    && *expected != content_hash
                {
                    return Err(NodeError::Changed(self.key(&name)));
                }
                let primitive = Primitive::<B>::from_data(data, &self.device)?;
                (primitive, dtype, shape, bytes, content_hash)
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
                )
            }
        };
        let desc = TensorDesc {
            key: self.key(&name),
            dtype,
            shape,
            bytes,
            path,
            content_hash,
        };
        self.tensors.insert(
            name,
            Entry {
                primitive,
                desc: desc.clone(),
                _reservation: reservation,
            },
        );
        Ok(desc)
    }
}
