//! `Node`: the embeddable library API over a node's device workers, and its transfer engine.
//!
//! An application (a GPU worker running its model) holds a `Node` and calls `insert`, `get`,
//! `take`, `remove` and `copy` in process; the TCP service calls exactly the same methods, so
//! both share one set of device workers and one set of rules.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_io::ConnectionLimits;

use burn_backend::TensorData;
use ferry_io::TensorAssembler;
use ferry_proto::message::validate_name;
use ferry_proto::{DeviceStats, NodeStats, TensorKey, TensorMeta, dtype_name};

use crate::backend::{BackendKind, DeviceSpec};
use crate::engine::{TransferPath, TransferPolicy, choose_path};
use crate::error::NodeError;
use crate::worker::{
    self, Arrived, Command, DeviceHandle, DeviceLimits, DeviceSummary, Exported, HostBytes,
    Payload, Reservation, TensorDesc, Version,
};

/// How long a dedup check waits for a candidate's stated hash to be verified.
const VERIFY_WAIT: Duration = Duration::from_secs(10);

/// The software name a node reports.
pub const AGENT: &str = concat!("ferry-server/", env!("CARGO_PKG_VERSION"));

/// What a node hosts and the limits it keeps.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The devices, in index order.
    pub devices: Vec<DeviceSpec>,
    /// The largest tensor accepted, in bytes.
    pub max_tensor_bytes: u64,
    /// A memory budget per device, in bytes: tensors (each with
    /// [`TENSOR_OVERHEAD`](crate::worker::TENSOR_OVERHEAD)), transfers in flight and host copies
    /// being sent.
    pub memory_limit: Option<u64>,
    /// The most tensors one device holds.
    pub max_tensors: Option<u64>,
    /// The most capabilities one client (one connection) may hold outstanding at once.
    pub max_grants_per_client: usize,
    /// Which transfer paths may be taken.
    pub policy: TransferPolicy,
    /// The node's id; a random one when absent.
    pub node_id: Option<String>,
    /// How long a capability this node issues stays valid.
    pub capability_ttl: Duration,
    /// How often a pull reconnects after a transient drop before it gives up.
    pub pull_retries: u32,
    /// The wait before the first reconnection; it doubles with each further one.
    pub retry_backoff: Duration,
    /// The token this node presents to the nodes it pulls from.
    pub peer_token: Option<String>,
    /// Frame, chunk and idle limits of the connections this node opens to peers; the idle
    /// timeout is how long a silent source may stall a pull.
    pub peer_limits: ConnectionLimits,
    /// Move payloads through shared memory on Unix-socket connections whose other side agrees
    /// (clients, and peers this node pulls from).
    pub shared_memory: bool,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            devices: vec![
                DeviceSpec {
                    kind: crate::BackendKind::Flex,
                },
                DeviceSpec {
                    kind: crate::BackendKind::Flex,
                },
            ],
            max_tensor_bytes: 16 << 30,
            memory_limit: None,
            max_tensors: Some(DEFAULT_MAX_TENSORS),
            max_grants_per_client: DEFAULT_MAX_GRANTS,
            policy: TransferPolicy::Auto,
            node_id: None,
            capability_ttl: Duration::from_secs(300),
            pull_retries: 3,
            retry_backoff: Duration::from_millis(100),
            peer_token: None,
            peer_limits: ConnectionLimits::default(),
            shared_memory: true,
        }
    }
}

/// Copy or move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferMode {
    /// The source stays.
    Copy,
    /// The source is deleted once the target registered the tensor.
    Move,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) done: AtomicU64,
    failed: AtomicU64,
    native: AtomicU64,
    round_trip: AtomicU64,
    connections: AtomicU64,
    pub(crate) pulls: AtomicU64,
    pub(crate) pull_retries: AtomicU64,
    pub(crate) dedup_hits: AtomicU64,
    fetches_served: AtomicU64,
    shm_sent: AtomicU64,
    shm_received: AtomicU64,
    shm_bytes: AtomicU64,
}

/// The most capabilities a node keeps outstanding; past it, `Grant` is refused until some are
/// used or expire. With the per-client cap and capabilities revoked with the connection that
/// asked for them, only a node whose every connection asks for its cap reaches it.
const MAX_CAPABILITIES: usize = 65_536;

/// The default [`NodeConfig::max_grants_per_client`].
pub const DEFAULT_MAX_GRANTS: usize = 64;

/// The default [`NodeConfig::max_tensors`].
pub const DEFAULT_MAX_TENSORS: u64 = 1_000_000;

/// The most tensors one listing page holds: a page of the longest names stays far below the
/// control message limit.
pub const MAX_PAGE: usize = 4096;

/// One client of the node (a connection), as capabilities know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientId(u64);

/// A capability this node issued.
///
/// Its life: granted to a client (for one audience node) → fetched by that audience, perhaps
/// resumed → released by the connection that fetched it (every byte arrived and verified), or by
/// the client it was granted to before any fetch began (a dedup never fetched). It also ends
/// when it expires, when a fetch ended and no release or resume came within one idle timeout,
/// or, before any fetch, when the connection that asked for it closes.
#[derive(Debug)]
struct Capability {
    key: TensorKey,
    /// The version it grants: a fetch of anything else (the tensor was replaced) is refused, so
    /// a resumed transfer can never join two versions.
    version: Version,
    audience: String,
    expires: Instant,
    /// The connection that asked for it.
    granted_to: ClientId,
    /// The connection of the latest fetch, once one began.
    fetcher: Option<ClientId>,
    /// Counts fetches; only the latest may touch the capability when it ends, so a resume can
    /// take over from a fetch whose connection has not noticed it is dead.
    generation: u64,
    /// A fetch sent every byte once: from then on only a resume (from a later offset) is served.
    served: bool,
    /// A fetch is under way now (its lease is alive).
    in_flight: bool,
    /// The connection it was granted to closed while a fetch was under way: it ends with that
    /// fetch.
    orphaned: bool,
}

/// The most fetches one capability serves: the first and its resumes (a pull retries three
/// times by default), so that a capability cannot be fetched again and again until it expires.
const MAX_FETCHES: u64 = 16;

/// The longest node id or audience accepted.
const MAX_NODE_ID_LEN: usize = 256;

struct Inner {
    devices: Vec<DeviceHandle>,
    config: NodeConfig,
    node_id: String,
    capabilities: Mutex<HashMap<String, Capability>>,
    next_client: AtomicU64,
    counters: Counters,
    /// The Unix socket the service listens on, for `stat`.
    unix_socket: Mutex<Option<String>>,
    threads: std::sync::Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Dropping the handles closes the workers' queues; they finish what they hold and stop.
        self.devices.clear();
        let threads = match self.threads.get_mut() {
            Ok(threads) => std::mem::take(threads),
            Err(poisoned) => std::mem::take(poisoned.into_inner()),
        };
        for thread in threads {
            let _ = thread.join();
        }
    }
}

/// A running node: its device workers and the operations on them. Cheap to clone.
#[derive(Clone)]
pub struct Node {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("devices", &self.inner.devices)
            .finish()
    }
}

impl Node {
    /// Starts one worker thread per configured device.
    pub fn start(config: NodeConfig) -> Result<Node, NodeError> {
        if config.devices.is_empty() {
            return Err(NodeError::BadRequest(
                "a node needs at least one device".into(),
            ));
        }
        let mut devices = Vec::with_capacity(config.devices.len());
        let mut threads = Vec::with_capacity(config.devices.len());
        for (index, spec) in config.devices.iter().enumerate() {
            let index = u32::try_from(index)
                .map_err(|_| NodeError::BadRequest("too many devices".into()))?;
            let limits = DeviceLimits {
                memory: config.memory_limit,
                tensors: config.max_tensors,
            };
            let (handle, thread) = worker::spawn(index, *spec, limits)
                .map_err(|e| NodeError::Backend(format!("cannot start device {index}: {e}")))?;
            devices.push(handle);
            threads.push(thread);
        }
        let node_id = config
            .node_id
            .clone()
            .unwrap_or_else(|| format!("node-{:016x}", rand::random::<u64>()));
        Ok(Node {
            inner: Arc::new(Inner {
                devices,
                config,
                node_id,
                capabilities: Mutex::new(HashMap::new()),
                next_client: AtomicU64::new(0),
                counters: Counters::default(),
                unix_socket: Mutex::new(None),
                threads: std::sync::Mutex::new(threads),
            }),
        })
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &NodeConfig {
        &self.inner.config
    }

    /// The node's id, which the capabilities it is granted are bound to.
    pub fn node_id(&self) -> &str {
        &self.inner.node_id
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.inner.counters
    }

    /// A new client's id, for the capabilities it asks for.
    pub fn new_client(&self) -> ClientId {
        ClientId(self.inner.next_client.fetch_add(1, Ordering::Relaxed))
    }

    /// A client's connection closed: the capabilities it asked for are revoked (nobody is left
    /// to wait for the copy they were for), those with a fetch under way once it ends; so a
    /// client that reconnects cannot pile up capabilities past its cap.
    pub fn client_gone(&self, client: ClientId) {
        self.capabilities().retain(|_, c| {
            if c.granted_to != client {
                return true;
            }
            c.orphaned = true;
            c.in_flight
        });
    }

    /// Issues a single-use capability for `audience` (a node id) to pull the version of the
    /// tensor under `key` registered now, with its content hash, which this node has verified
    /// (a tensor whose hash is still being verified is waited for).
    pub async fn grant(
        &self,
        key: &TensorKey,
        audience: &str,
        client: ClientId,
    ) -> Result<(String, Duration, TensorDesc), NodeError> {
        if audience.is_empty() || audience.len() > MAX_NODE_ID_LEN {
            return Err(NodeError::BadRequest(format!(
                "a node id is 1 to {MAX_NODE_ID_LEN} bytes"
            )));
        }
        let desc = self.describe_verified(key).await?;
        let ttl = self.inner.config.capability_ttl;
        let token = format!("{:032x}", rand::random::<u128>());
        let now = Instant::now();
        let mut capabilities = self.capabilities();
        capabilities.retain(|_, c| c.expires > now);
        let cap = self.inner.config.max_grants_per_client;
        let held = capabilities
            .values()
            .filter(|c| c.granted_to == client)
            .count();
        if held >= cap {
            return Err(NodeError::TooManyGrants { limit: cap });
        }
        if capabilities.len() >= MAX_CAPABILITIES {
            return Err(NodeError::CapabilitiesFull {
                limit: MAX_CAPABILITIES,
            });
        }
        capabilities.insert(
            token.clone(),
            Capability {
                key: key.clone(),
                version: desc.version,
                audience: audience.to_string(),
                expires: now + ttl,
                granted_to: client,
                fetcher: None,
                generation: 0,
                served: false,
                in_flight: false,
                orphaned: false,
            },
        );
        Ok((token, ttl, desc))
    }

    /// Describes the tensor under `key` once its content hash is verified: at once where it
    /// is, else after the verifier's answer (bounded by [`VERIFY_WAIT`]).
    async fn describe_verified(&self, key: &TensorKey) -> Result<TensorDesc, NodeError> {
        let desc = self.describe(key).await?;
        if desc.hash_verified {
            return Ok(desc);
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.device(key.device)?
            .tell(Command::AwaitVerified {
                name: key.name.clone(),
                reply,
            })
            .await?;
        match tokio::time::timeout(VERIFY_WAIT, answer).await {
            Ok(Ok(verified)) if verified.version == desc.version => Ok(verified),
            // Replaced or removed meanwhile.
            Ok(_) => Err(NodeError::Changed(key.clone())),
            Err(_) => Err(NodeError::Busy(format!(
                "the content hash of {key} is still being verified; try again"
            ))),
        }
    }

    fn capabilities(&self) -> std::sync::MutexGuard<'_, HashMap<String, Capability>> {
        // The map stays consistent under a panic (every update is one statement).
        self.inner
            .capabilities
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Starts serving a fetch from `offset` on: the capability must exist, be unexpired and be
    /// bound to `node_id`; a capability already served to the end once serves only a resume
    /// (a later offset). A new fetch takes over from an earlier one still under way.
    pub fn begin_fetch(
        &self,
        token: &str,
        node_id: &str,
        client: ClientId,
        offset: u64,
    ) -> Result<FetchLease, NodeError> {
        let now = Instant::now();
        let mut capabilities = self.capabilities();
        let refused = |why: &str| NodeError::CapabilityRefused(why.to_string());
        let capability = capabilities
            .get_mut(token)
            .ok_or_else(|| refused("unknown or already used capability"))?;
        if capability.expires <= now {
            capabilities.remove(token);
            return Err(refused("expired capability"));
        }
        if capability.audience != node_id {
            return Err(refused("capability issued to another node"));
        }
        if capability.served && offset == 0 {
            return Err(refused(
                "capability already served in full; only a resume from a later offset is served",
            ));
        }
        if capability.generation >= MAX_FETCHES {
            return Err(refused("capability fetched too often; ask for a new one"));
        }
        capability.generation += 1;
        capability.fetcher = Some(client);
        capability.in_flight = true;
        Ok(FetchLease {
            node: self.clone(),
            token: token.to_string(),
            key: capability.key.clone(),
            version: capability.version,
            generation: capability.generation,
        })
    }

    /// Ends a capability that can never be served again (the version it grants is gone), so
    /// that it stops counting against its client's cap at once.
    pub fn revoke(&self, token: &str) {
        self.capabilities().remove(token);
    }

    /// Uses a capability up: by the connection of its latest fetch once every byte arrived, or
    /// by the client it was granted to before any fetch began (handing back one it did not
    /// need). Nobody else may release it.
    pub fn release(&self, token: &str, node_id: &str, client: ClientId) -> Result<(), NodeError> {
        let mut capabilities = self.capabilities();
        let allowed = capabilities.get(token).is_some_and(|c| {
            c.audience == node_id
                && match c.fetcher {
                    Some(fetcher) => fetcher == client,
                    None => c.granted_to == client,
                }
        });
        if !allowed {
            return Err(NodeError::CapabilityRefused(
                "unknown capability, or not this client's to release (only the node that \
                 fetched it, or before any fetch the client it was granted to)"
                    .into(),
            ));
        }
        capabilities.remove(token);
        Ok(())
    }

    /// Finds a registered tensor with these bytes (BLAKE3, hex).
    /// Only hashes this node computed itself count: a tensor registered under a hash its source
    /// stated is waited for until the node has recomputed it (a model pushed twice in a row
    /// still costs one transfer), and answers only if the hash held.
    pub async fn find_by_hash(&self, content_hash: &str) -> Result<Option<TensorDesc>, NodeError> {
        let mut pending = Vec::new();
        for device in &self.inner.devices {
            let hash = content_hash.to_string();
            let found = device
                .call(|reply| Command::FindByHash { hash, reply })
                .await?;
            match found {
                Some(desc) if desc.hash_verified => return Ok(Some(desc)),
                Some(desc) => pending.push(desc),
                None => {}
            }
        }
        for candidate in pending {
            let (reply, answer) = tokio::sync::oneshot::channel();
            let name = candidate.key.name.clone();
            self.device(candidate.key.device)?
                .tell(Command::AwaitVerified { name, reply })
                .await?;
            // A tensor removed meanwhile drops the question unanswered: no candidate. A long
            // queue of verifications is not waited out: pulling the bytes is then cheaper.
            match tokio::time::timeout(VERIFY_WAIT, answer).await {
                Ok(Ok(desc)) if desc.content_hash == content_hash => return Ok(Some(desc)),
                Ok(_) => {}
                Err(_) => {
                    tracing::info!(key = %candidate.key, "dedup candidate still unverified; pulling");
                }
            }
        }
        Ok(None)
    }

    /// The device at `index`.
    pub fn device(&self, index: u32) -> Result<&DeviceHandle, NodeError> {
        self.inner
            .devices
            .get(index as usize)
            .ok_or(NodeError::NoSuchDevice {
                index,
                count: self.inner.devices.len(),
            })
    }

    /// Every hosted device.
    pub fn devices(&self) -> &[DeviceHandle] {
        &self.inner.devices
    }

    /// A fresh name for a tensor put without one.
    pub fn fresh_name(&self) -> String {
        // Random, not a counter: a counter restarting with the node would hand out names that
        // earlier uploads (or users) already hold.
        format!("tensor-{:032x}", rand::random::<u128>())
    }

    /// Everything checked before a tensor of `dtype`, `shape` and `bytes` may go to `device`:
    /// the name, the per-tensor limit, what the backend holds, the device's budget, and (for a
    /// tensor that may not replace another) its tensor cap. The returned reservation is held
    /// while the bytes arrive and then by the registered tensor.
    pub fn admit(
        &self,
        device: u32,
        name: &str,
        dtype: &burn_backend::DType,
        shape: &[usize],
        bytes: u64,
        overwrite: bool,
    ) -> Result<Reservation, NodeError> {
        validate_name(name)?;
        let limit = self.inner.config.max_tensor_bytes;
        if bytes > limit {
            return Err(NodeError::TensorTooLarge { bytes, limit });
        }
        let handle = self.device(device)?;
        handle.check_holds(dtype, shape)?;
        handle.budget().reserve_tensor(bytes, overwrite)
    }

    /// Registers `data` under `name` on `device`, after checking it against the byte-length rule
    /// and the device. Answered once registered.
    pub async fn insert(
        &self,
        device: u32,
        name: &str,
        data: TensorData,
        overwrite: bool,
    ) -> Result<TensorDesc, NodeError> {
        let meta = ferry_proto::tensor::meta_of(&data)?;
        let reservation = self.admit(
            device,
            name,
            &meta.dtype(),
            meta.shape(),
            meta.byte_len() as u64,
            overwrite,
        )?;
        self.register(device, name, Arrived::new(data), overwrite, reservation)
            .await
    }

    /// A receiver for a payload of `meta` bound for `device`, its buffer preallocated (refused
    /// over the node's largest tensor): a recycled buffer where the device's backend keeps the
    /// buffer as the tensor's memory as it is (Flex), so that it comes back for reuse when the
    /// tensor goes.
    pub fn receiver(&self, device: u32, meta: TensorMeta) -> Result<TensorAssembler, NodeError> {
        let max = self.config().max_tensor_bytes;
        let receiver = if self.device(device)?.kind() == BackendKind::Flex {
            TensorAssembler::new_recycled(meta, max)
        } else {
            TensorAssembler::new(meta, max)
        };
        Ok(receiver?)
    }

    /// Registers validated bytes for which [`admit`](Self::admit) gave `reservation`.
    pub async fn register(
        &self,
        device: u32,
        name: &str,
        arrived: Arrived,
        overwrite: bool,
        reservation: Reservation,
    ) -> Result<TensorDesc, NodeError> {
        let started = Instant::now();
        let result = self
            .device(device)?
            .call(|reply| Command::Insert {
                name: name.to_string(),
                payload: Payload::Data(arrived),
                path: TransferPath::Put,
                overwrite,
                reservation,
                reply,
            })
            .await;
        self.record(
            "put",
            &TensorKey::new(device, name),
            None,
            "put",
            result.as_ref(),
            started,
        );
        result
    }

    /// The bytes of the tensor under `key`, which stays registered.
    pub async fn get(&self, key: &TensorKey) -> Result<TensorData, NodeError> {
        self.read(key).await.map(|(_, data)| data)
    }

    /// The description and bytes of the tensor under `key`, which stays registered.
    pub async fn read(&self, key: &TensorKey) -> Result<(TensorDesc, TensorData), NodeError> {
        match self.read_bytes(key, None, false).await? {
            (desc, HostBytes::Owned(data, _)) => Ok((desc, data)),
            (_, HostBytes::Shared(..)) => Err(NodeError::Backend(
                "a worker shared bytes it was asked to copy".into(),
            )),
        }
    }

    /// A tensor's description and bytes, shared or copied (see [`Command::Read`]), logged as
    /// one transfer.
    async fn read_bytes(
        &self,
        key: &TensorKey,
        pin: Option<Version>,
        share: bool,
    ) -> Result<(TensorDesc, HostBytes), NodeError> {
        let started = Instant::now();
        let result = self
            .device(key.device)?
            .call(|reply| Command::Read {
                name: key.name.clone(),
                pin,
                share,
                reply,
            })
            .await;
        self.record(
            "get",
            key,
            None,
            "get",
            result.as_ref().map(|(desc, _)| desc),
            started,
        );
        result
    }

    /// The tensor under `key` as a description, a checked meta and its bytes for sending: shared
    /// with the registered tensor where the backend allows it (no host copy), read out
    /// otherwise. The tensor stays registered.
    pub async fn read_host(
        &self,
        key: &TensorKey,
    ) -> Result<(TensorDesc, ferry_proto::TensorMeta, HostBytes), NodeError> {
        self.read_host_pinned(key, None).await
    }

    /// [`read_host`](Self::read_host) of one version only ([`NodeError::Changed`] if the key
    /// holds another now).
    pub async fn read_host_pinned(
        &self,
        key: &TensorKey,
        pin: Option<Version>,
    ) -> Result<(TensorDesc, ferry_proto::TensorMeta, HostBytes), NodeError> {
        let (desc, bytes) = self.read_bytes(key, pin, true).await?;
        let meta = ferry_proto::TensorMeta::with_byte_len(
            desc.shape.clone(),
            desc.dtype,
            bytes.len() as u64,
        )?;
        Ok((desc, meta, bytes))
    }

    /// The bytes of the tensor under `key`, which is unregistered once they are read.
    pub async fn take(&self, key: &TensorKey) -> Result<TensorData, NodeError> {
        let (desc, data) = self.read(key).await?;
        // Only the version read goes; one registered meanwhile stays.
        self.remove_pinned(key, Some(desc.version)).await?;
        Ok(data)
    }

    /// Unregisters the tensor under `key`.
    pub async fn remove(&self, key: &TensorKey) -> Result<TensorDesc, NodeError> {
        self.remove_pinned(key, None).await
    }

    /// Unregisters the tensor under `key` only if it is still the version whose content hash,
    /// verified by this node, is `content_hash` ([`NodeError::Changed`] otherwise): the source
    /// side of a move between nodes deletes what it copied, never a newer version.
    pub async fn remove_if_content(
        &self,
        key: &TensorKey,
        content_hash: &str,
    ) -> Result<TensorDesc, NodeError> {
        let desc = self.describe_verified(key).await?;
        if desc.content_hash != content_hash {
            return Err(NodeError::Changed(key.clone()));
        }
        self.remove_pinned(key, Some(desc.version)).await
    }

    /// Unregisters the tensor under `key`, if it is still the version `pin` names.
    async fn remove_pinned(
        &self,
        key: &TensorKey,
        pin: Option<Version>,
    ) -> Result<TensorDesc, NodeError> {
        self.device(key.device)?
            .call(|reply| Command::Remove {
                name: key.name.clone(),
                pin,
                reply,
            })
            .await
    }

    /// Describes the tensor under `key`.
    pub async fn describe(&self, key: &TensorKey) -> Result<TensorDesc, NodeError> {
        self.device(key.device)?
            .call(|reply| Command::Describe {
                name: key.name.clone(),
                reply,
            })
            .await
    }

    /// Describes the tensors on one device, or on all, sorted by device and name.
    pub async fn list(&self, device: Option<u32>) -> Result<Vec<TensorDesc>, NodeError> {
        let mut all = Vec::new();
        let mut after = None;
        loop {
            let (page, next) = self.list_page(device, after.as_ref(), MAX_PAGE).await?;
            all.extend(page);
            match next {
                Some(next) => after = Some(next),
                None => return Ok(all),
            }
        }
    }

    /// One page of [`list`](Self::list): at most `limit` (and at most [`MAX_PAGE`]) tensors
    /// after the key `after`, and where the next page starts (`None` when this is the last).
    pub async fn list_page(
        &self,
        device: Option<u32>,
        after: Option<&TensorKey>,
        limit: usize,
    ) -> Result<(Vec<TensorDesc>, Option<TensorKey>), NodeError> {
        let limit = limit.clamp(1, MAX_PAGE);
        let devices: Vec<&DeviceHandle> = match device {
            Some(index) => vec![self.device(index)?],
            None => self.inner.devices.iter().collect(),
        };
        let mut page = Vec::new();
        for handle in devices {
            let from = match after {
                Some(after) if after.device > handle.index() => continue,
                Some(after) if after.device == handle.index() => Some(after.name.clone()),
                _ => None,
            };
            let want = limit - page.len();
            page.extend(
                handle
                    .call(|reply| Command::List {
                        after: from,
                        limit: want,
                        reply,
                    })
                    .await?,
            );
            if page.len() == limit {
                break;
            }
        }
        let next = (page.len() == limit)
            .then(|| page.last().map(|d: &TensorDesc| d.key.clone()))
            .flatten();
        Ok((page, next))
    }

    /// How many tensors, and bytes, a device holds.
    pub async fn summary(&self, device: u32) -> Result<DeviceSummary, NodeError> {
        self.device(device)?
            .call(|reply| Command::Summary { reply })
            .await
    }

    /// Copies or moves the tensor under `src` to `dst_device` (under `dst_name`, or its own
    /// name). Answered only after the target registered it; a move deletes the source only then,
    /// and a failed transfer leaves the source as it was.
    pub async fn copy(
        &self,
        src: &TensorKey,
        dst_device: u32,
        dst_name: Option<&str>,
        mode: TransferMode,
        overwrite: bool,
    ) -> Result<TensorDesc, NodeError> {
        let started = Instant::now();
        let dst = TensorKey::new(dst_device, dst_name.unwrap_or(&src.name));
        let mut path = None;
        // The version described here is the one copied (and, for a move, removed): one
        // replaced meanwhile is `Changed`, and nothing is copied or removed.
        let result = match self.describe(src).await {
            Ok(desc) => {
                self.transfer(&desc, &dst, mode, overwrite, None, &mut path)
                    .await
            }
            Err(error) => Err(error),
        };
        let op = match mode {
            TransferMode::Copy => "copy",
            TransferMode::Move => "move",
        };
        let path = path.map_or("-", TransferPath::name);
        self.record(op, src, Some(&dst), path, result.as_ref(), started);
        result
    }

    /// Copies (or moves) exactly the version `source` describes to `dst`: its bytes are
    /// reserved on the target before anything is read, the export is pinned to that version
    /// (so what was reserved is what arrives), and a move removes that version only.
    async fn transfer(
        &self,
        source: &TensorDesc,
        dst: &TensorKey,
        mode: TransferMode,
        overwrite: bool,
        label: Option<TransferPath>,
        path_taken: &mut Option<TransferPath>,
    ) -> Result<TensorDesc, NodeError> {
        let src = &source.key;
        if src == dst {
            return Err(NodeError::BadRequest(format!(
                "source and target are the same tensor {src}"
            )));
        }
        let from = self.device(src.device)?;
        let target = self.device(dst.device)?;
        let reservation = self.admit(
            dst.device,
            &dst.name,
            &source.dtype,
            &source.shape,
            source.bytes,
            overwrite,
        )?;
        let path = choose_path(
            self.inner.config.policy,
            from.kind(),
            target.kind(),
            &source.dtype,
        );
        *path_taken = Some(path);
        let exported = from
            .call(|reply| Command::Export {
                name: src.name.clone(),
                pin: Some(source.version),
                native: path == TransferPath::Native,
                reply,
            })
            .await?;
        // A host copy stays counted on the source device until the target holds the bytes
        // (under its own reservation).
        let mut copy_held = None;
        let payload = match exported {
            Exported::Native(native) => Payload::Native(native),
            Exported::Data(data, held) => {
                copy_held = Some(held);
                // The bytes crossed a channel between workers: held to the same rule as bytes
                // from a socket before the target's backend sees them.
                let meta = ferry_proto::tensor::meta_of(&data)?;
                if meta.byte_len() as u64 != source.bytes {
                    return Err(NodeError::Changed(src.clone()));
                }
                Payload::Data(Arrived::new(data))
            }
        };
        let registered = target
            .call(|reply| Command::Insert {
                name: dst.name.clone(),
                payload,
                path: label.unwrap_or(path),
                overwrite,
                reservation,
                reply,
            })
            .await?;
        drop(copy_held);
        match path {
            TransferPath::Native => &self.inner.counters.native,
            _ => &self.inner.counters.round_trip,
        }
        .fetch_add(1, Ordering::Relaxed);
        if mode == TransferMode::Move {
            self.remove_pinned(src, Some(source.version)).await?;
        }
        Ok(registered)
    }

    /// Registers a copy of the version `source` describes as a dedup'd pull, logged as one
    /// transfer.
    pub(crate) async fn copy_version(
        &self,
        source: &TensorDesc,
        dst: &TensorKey,
        overwrite: bool,
    ) -> Result<TensorDesc, NodeError> {
        let started = Instant::now();
        let mut path = None;
        let result = self
            .transfer(
                source,
                dst,
                TransferMode::Copy,
                overwrite,
                Some(TransferPath::Dedup),
                &mut path,
            )
            .await;
        let path = path.map_or("-", TransferPath::name);
        self.record(
            "copy",
            &source.key,
            Some(dst),
            path,
            result.as_ref(),
            started,
        );
        result
    }

    /// One log line and the metrics per transfer: key, dtype, bytes, path, time.
    fn record(
        &self,
        op: &'static str,
        key: &TensorKey,
        to: Option<&TensorKey>,
        path: &str,
        result: Result<&TensorDesc, &NodeError>,
        started: Instant,
    ) {
        let elapsed = started.elapsed();
        crate::metrics::transfer(op, path, result.is_ok(), elapsed);
        let elapsed_ms = elapsed.as_secs_f64() * 1e3;
        match result {
            Ok(desc) => {
                self.inner.counters.done.fetch_add(1, Ordering::Relaxed);
                let dst = to.map(|k| k.to_string()).unwrap_or_default();
                tracing::info!(
                    op,
                    key = %key,
                    dst,
                    dtype = %dtype_name(&desc.dtype),
                    bytes = desc.bytes,
                    path,
                    elapsed_ms,
                    "transfer done"
                );
            }
            Err(error) => {
                self.inner.counters.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(op, key = %key, %error, elapsed_ms, "transfer failed");
            }
        }
    }

    /// Counts a connection opened (`+1`) or closed (`-1`), for `stat`.
    pub fn count_connection(&self, opened: bool) {
        crate::metrics::connection(opened);
        if opened {
            self.inner
                .counters
                .connections
                .fetch_add(1, Ordering::Relaxed);
        } else {
            self.inner
                .counters
                .connections
                .fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Counts a tensor sent whole to another node.
    pub fn count_fetch_served(&self) {
        self.inner
            .counters
            .fetches_served
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a payload that went through shared memory (`sent` by this node, or received).
    pub fn count_shm_payload(&self, sent: bool, bytes: u64) {
        let c = &self.inner.counters;
        if sent {
            c.shm_sent.fetch_add(1, Ordering::Relaxed);
        } else {
            c.shm_received.fetch_add(1, Ordering::Relaxed);
        }
        c.shm_bytes.fetch_add(bytes, Ordering::Relaxed);
        crate::metrics::bytes(if sent { "out" } else { "in" }, "shm", bytes);
        tracing::info!(
            route = "shm",
            direction = if sent { "sent" } else { "received" },
            bytes,
            "payload moved through shared memory"
        );
    }

    /// Records the Unix socket the service listens on, for `stat`.
    pub fn set_unix_socket(&self, path: Option<String>) {
        *self
            .inner
            .unix_socket
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = path;
    }

    /// Counts a transfer that failed outside the node's own operations (a broken upload).
    pub fn count_failure(&self) {
        self.inner.counters.failed.fetch_add(1, Ordering::Relaxed);
    }

    /// Devices, tensors, bytes held, transfers done and failed, per-path counts.
    pub async fn stats(&self) -> Result<NodeStats, NodeError> {
        let mut devices = Vec::with_capacity(self.inner.devices.len());
        let (mut hashes_pending, mut hash_mismatches) = (0, 0);
        for handle in &self.inner.devices {
            let summary = handle.call(|reply| Command::Summary { reply }).await?;
            hashes_pending += summary.hashes_pending;
            hash_mismatches += handle.hash_mismatches();
            devices.push(DeviceStats {
                index: handle.index(),
                backend: handle.kind().name().to_string(),
                device: handle.label().to_string(),
                tensors: summary.tensors,
                bytes_held: summary.bytes,
                memory_limit: handle.budget().limit(),
            });
        }
        let c = &self.inner.counters;
        let memory = process_memory();
        Ok(NodeStats {
            agent: AGENT.to_string(),
            devices,
            transfers_done: c.done.load(Ordering::Relaxed),
            transfers_failed: c.failed.load(Ordering::Relaxed),
            native_transfers: c.native.load(Ordering::Relaxed),
            round_trip_transfers: c.round_trip.load(Ordering::Relaxed),
            connections: c.connections.load(Ordering::Relaxed),
            transfer_policy: self.inner.config.policy.name().to_string(),
            node_id: self.inner.node_id.clone(),
            pulls: c.pulls.load(Ordering::Relaxed),
            pull_retries: c.pull_retries.load(Ordering::Relaxed),
            dedup_hits: c.dedup_hits.load(Ordering::Relaxed),
            fetches_served: c.fetches_served.load(Ordering::Relaxed),
            unix_socket: self
                .inner
                .unix_socket
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            shared_memory: self.inner.config.shared_memory
                && ferry_io::connection::shared_memory_supported(),
            shm_payloads_sent: c.shm_sent.load(Ordering::Relaxed),
            shm_payloads_received: c.shm_received.load(Ordering::Relaxed),
            shm_bytes: c.shm_bytes.load(Ordering::Relaxed),
            regions_in_flight: regions_in_flight(),
            resident_bytes: memory.map_or(0, |m| m.resident),
            peak_resident_bytes: memory.map_or(0, |m| m.peak),
            hashes_pending,
            hash_mismatches,
            recycled_bytes: ferry_io::host::recycled_bytes() as u64,
            regions_kept: regions_kept(),
        })
    }
}

/// The process's memory as the kernel reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessMemory {
    /// Resident now (VmRSS), bytes.
    pub resident: u64,
    /// The highest resident so far (VmHWM), bytes.
    pub peak: u64,
}

/// This process's resident and peak memory, from `/proc/self/status`; `None` off Linux.
pub fn process_memory() -> Option<ProcessMemory> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    Some(ProcessMemory {
        resident: field("VmRSS")?,
        peak: field("VmHWM")?,
    })
}

#[cfg(target_os = "linux")]
fn regions_in_flight() -> u64 {
    ferry_io::region::regions_in_flight()
}

#[cfg(not(target_os = "linux"))]
fn regions_in_flight() -> u64 {
    0
}

#[cfg(target_os = "linux")]
fn regions_kept() -> u64 {
    ferry_io::region::regions_kept()
}

#[cfg(not(target_os = "linux"))]
fn regions_kept() -> u64 {
    0
}

/// A fetch in progress under a capability; when it ends, the capability waits one idle timeout
/// for the fetching node's release or a resume, and then lapses.
#[derive(Debug)]
pub struct FetchLease {
    node: Node,
    token: String,
    key: TensorKey,
    version: Version,
    generation: u64,
}

impl FetchLease {
    /// The tensor it grants.
    pub fn key(&self) -> &TensorKey {
        &self.key
    }

    /// The version it grants.
    pub fn version(&self) -> Version {
        self.version
    }

    /// Every byte was sent: from now on the capability serves only a resume.
    pub fn served(&self) {
        if let Some(capability) = self.node.capabilities().get_mut(&self.token)
            && capability.generation == self.generation
        {
            capability.served = true;
        }
    }
}

impl Drop for FetchLease {
    fn drop(&mut self) {
        // Whatever was read for this fetch is freed with it; the capability stays only long
        // enough for the same node to release it or resume.
        let window = self.node.inner.config.peer_limits.idle_timeout;
        let mut capabilities = self.node.capabilities();
        if let Some(capability) = capabilities.get_mut(&self.token)
            && capability.generation == self.generation
        {
            if capability.orphaned {
                capabilities.remove(&self.token);
                return;
            }
            capability.in_flight = false;
            capability.expires = capability.expires.min(Instant::now() + window);
        }
    }
}
