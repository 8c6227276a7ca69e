//! `Node`: the embeddable library API over a node's device workers, and its transfer engine.
//!
//! An application (a GPU worker running its model) holds a `Node` and calls `insert`, `get`,
//! `take`, `remove` and `copy` in process; the TCP service calls exactly the same methods, so
//! both share one set of device workers and one set of rules.

mod admission;
mod capability;
mod peer_policy;
mod recorder;
mod stats;
mod tensors;
mod transfer;

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_io::{ConnectionLimits, NodeTls};
use ferry_proto::NodeId;

use crate::backend::DeviceSpec;
use crate::device::{self, DeviceHandle, DeviceLimits};
use crate::engine::TransferPolicy;
use crate::error::NodeError;

pub(crate) use admission::Admission;
use capability::Capability;
pub(crate) use capability::ClientId;
pub use capability::DEFAULT_MAX_GRANTS;
pub(crate) use peer_policy::PeerTerms;
pub use peer_policy::{ClusterMembers, Peer, PeerPolicy};
pub(crate) use recorder::{Direction, Recorder, Refused};
pub(crate) use stats::process_memory;
pub(crate) use tensors::MAX_PAGE;

/// The software name a node reports.
pub(crate) const AGENT: &str = concat!("ferry-server/", env!("CARGO_PKG_VERSION"));

/// What a node hosts and the limits it keeps. Its `Debug` never shows the peer token.
#[derive(Clone)]
pub struct NodeConfig {
    /// The devices, in index order.
    pub devices: Vec<DeviceSpec>,
    /// The largest tensor accepted, in bytes.
    pub max_tensor_bytes: u64,
    /// A memory budget per device, in bytes: tensors (each with
    /// [`TENSOR_OVERHEAD`](crate::device::TENSOR_OVERHEAD)), transfers in flight and host copies
    /// being sent.
    pub memory_limit: Option<u64>,
    /// The most tensors one device holds.
    pub max_tensors: Option<u64>,
    /// The most capabilities one client (one connection) may hold outstanding at once.
    pub max_grants_per_client: usize,
    /// Which transfer paths may be taken.
    pub policy: TransferPolicy,
    /// The node's id; a random one when absent. Under TLS the id is the certificate's identity,
    /// and an id given here must be the same.
    pub node_id: Option<NodeId>,
    /// Mutual TLS on every TCP link, served and opened (to peers): the node's certificate, key
    /// and CA. The node's identity is then its certificate's, and a peer that fetches under a
    /// capability is who its certificate says; `None` for TCP in clear.
    pub tls: Option<NodeTls>,
    /// How long a capability this node issues stays valid.
    pub capability_ttl: Duration,
    /// How often a pull reconnects after a transient drop before it gives up.
    pub pull_retries: u32,
    /// The wait before the first reconnection; it doubles with each further one.
    pub retry_backoff: Duration,
    /// The token this node presents to the nodes it pulls from.
    pub peer_token: Option<ferry_proto::Token>,
    /// Which nodes this node pulls from (and so sends its peer token to).
    pub peers: PeerPolicy,
    /// Frame, chunk and idle limits of the connections this node opens to peers; the idle
    /// timeout is how long a silent source may stall a pull.
    pub peer_limits: ConnectionLimits,
    /// Move payloads through shared memory on Unix-socket connections whose other side agrees
    /// (clients, and peers this node pulls from).
    pub shared_memory: bool,
    /// Where large receives on Flex devices land.
    pub receive_buffers: ReceiveBuffers,
}

/// Where a node's large receives on Flex devices (puts and pulls, by any link but a sealed
/// region, which is adopted as it is) land. One choice per node: a pool's memory is reused, so
/// it can never be sealed and shared; a shareable region is sealed for good, so it can never go
/// back to a pool.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum ReceiveBuffers {
    /// New memory, or a freed buffer the process recycles (`--recycle`).
    #[default]
    Fresh,
    /// The node's receive pool (`--pool`), reserved and touched by whoever starts the node:
    /// payloads it cannot hold go to fresh memory.
    Pool(ferry_io::Pool),
    /// A new shared-memory region each for payloads of `min_bytes` and more (the command line
    /// uses [`KEEP_REGION_MIN`](ferry_io::connection::KEEP_REGION_MIN), the size from which a
    /// region that arrived sealed is kept), sealed once complete (`--shareable-receives`): every
    /// such tensor the node holds can go on to a same-host peer without a copy, whichever link
    /// it arrived by.
    Shareable {
        /// The smallest payload received into a region.
        min_bytes: usize,
    },
}

impl ReceiveBuffers {
    /// The pool, where there is one.
    pub fn pool(&self) -> Option<&ferry_io::Pool> {
        match self {
            ReceiveBuffers::Pool(pool) => Some(pool),
            ReceiveBuffers::Fresh | ReceiveBuffers::Shareable { .. } => None,
        }
    }
}

impl std::fmt::Debug for NodeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeConfig")
            .field("devices", &self.devices)
            .field("max_tensor_bytes", &self.max_tensor_bytes)
            .field("memory_limit", &self.memory_limit)
            .field("max_tensors", &self.max_tensors)
            .field("max_grants_per_client", &self.max_grants_per_client)
            .field("policy", &self.policy)
            .field("node_id", &self.node_id)
            .field("tls", &self.tls)
            .field("capability_ttl", &self.capability_ttl)
            .field("pull_retries", &self.pull_retries)
            .field("retry_backoff", &self.retry_backoff)
            .field(
                "peer_token",
                &self.peer_token.as_ref().map(|_| "<redacted>"),
            )
            .field("peers", &self.peers)
            .field("peer_limits", &self.peer_limits)
            .field("shared_memory", &self.shared_memory)
            .field("receive_buffers", &self.receive_buffers)
            .finish()
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            devices: vec![DeviceSpec::Flex, DeviceSpec::Flex],
            max_tensor_bytes: 16 << 30,
            memory_limit: None,
            max_tensors: Some(DEFAULT_MAX_TENSORS),
            max_grants_per_client: DEFAULT_MAX_GRANTS,
            policy: TransferPolicy::Auto,
            node_id: None,
            tls: None,
            capability_ttl: Duration::from_secs(300),
            pull_retries: 3,
            retry_backoff: Duration::from_millis(100),
            peer_token: None,
            peers: PeerPolicy::Any,
            peer_limits: ConnectionLimits::default(),
            shared_memory: true,
            receive_buffers: ReceiveBuffers::Fresh,
        }
    }
}

/// The default [`NodeConfig::max_tensors`].
pub const DEFAULT_MAX_TENSORS: u64 = 1_000_000;

struct Inner {
    devices: Vec<DeviceHandle>,
    config: NodeConfig,
    node_id: NodeId,
    capabilities: Mutex<HashMap<ferry_proto::CapabilityToken, Capability>>,
    next_client: AtomicU64,
    recorder: Recorder,
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
            return Err(NodeError::NoDevices);
        }
        // A peer's name can be checked only against a certificate: over TCP, under TLS.
        if let Some(peer) = config.peers.named().find(|p| {
            config.tls.is_none()
                || !matches!(
                    ferry_io::Endpoint::parse(&p.addr),
                    ferry_io::Endpoint::Tcp(_)
                )
        }) {
            return Err(NodeError::UncheckablePeerName(peer.addr.clone()));
        }
        let mut devices = Vec::with_capacity(config.devices.len());
        let mut threads = Vec::with_capacity(config.devices.len());
        for (index, spec) in config.devices.iter().enumerate() {
            let index = u32::try_from(index).map_err(|_| NodeError::TooManyDevices {
                count: config.devices.len(),
            })?;
            let limits = DeviceLimits {
                memory: config.memory_limit,
                tensors: config.max_tensors,
            };
            let (handle, thread) = device::spawn(index, *spec, limits)
                .map_err(|e| NodeError::Backend(format!("cannot start device {index}: {e}")))?;
            devices.push(handle);
            threads.push(thread);
        }
        let node_id = match (&config.tls, &config.node_id) {
            (Some(tls), Some(given)) if given.as_str() != tls.identity().as_str() => {
                return Err(NodeError::NodeIdNotCertified {
                    given: given.to_string(),
                    certified: tls.identity().to_string(),
                });
            }
            (Some(tls), _) => NodeId::new(tls.identity().as_str()),
            (None, Some(given)) => given.clone(),
            (None, None) => NodeId::new(format!("node-{:016x}", rand::random::<u64>())),
        };
        Ok(Node {
            inner: Arc::new(Inner {
                devices,
                config,
                node_id,
                capabilities: Mutex::new(HashMap::new()),
                next_client: AtomicU64::new(0),
                recorder: Recorder::default(),
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
    pub fn node_id(&self) -> &NodeId {
        &self.inner.node_id
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
}

#[cfg(test)]
mod registered_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_printed_for_debugging_does_not_show_the_peer_token() {
        let config = NodeConfig {
            peer_token: Some("s3cret-peer-token".into()),
            ..NodeConfig::default()
        };
        let printed = format!("{config:?}");
        assert!(!printed.contains("s3cret"), "{printed}");
        assert!(printed.contains("<redacted>"), "{printed}");
    }
}
