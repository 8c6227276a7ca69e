//! `Node`: the embeddable library API over a node's device workers, and its transfer engine.
//!
//! An application (a GPU worker running its model) holds a `Node` and calls `insert`, `get`,
//! `take`, `remove` and `copy` in process; the TCP service calls exactly the same methods, so
//! both share one set of device workers and one set of rules.

mod admission;
mod arrivals;
mod capability;
mod config;
pub(crate) mod models;
mod native;
mod peer_policy;
mod ready_bound;
mod receive_plan;
mod recorder;
mod stats;
mod tensors;
mod transfer;

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use ferry_proto::NodeId;

use crate::device::{self, DeviceHandle, DeviceLimits};
use crate::error::NodeError;

pub(crate) use admission::{Admission, Receive};
use capability::Capability;
pub use capability::DEFAULT_MAX_GRANTS;
pub(crate) use capability::{ClientId, FetchWants};
pub use config::{
    DEFAULT_MAX_TENSORS, NodeConfig, NodeLimits, PullConfig, ReadyMemory, ReceiveBuffers, Striping,
};
pub(crate) use peer_policy::PeerTerms;
pub use peer_policy::{ClusterMembers, Peer, PeerPolicy};
pub use receive_plan::ReceivePlanError;
pub(crate) use recorder::{Direction, FAILED_TRANSFERS, Recorder, Refused};
pub(crate) use stats::process_memory;
pub(crate) use tensors::MAX_PAGE;

/// The software name a node reports.
pub(crate) const AGENT: &str = concat!("ferry-server/", env!("CARGO_PKG_VERSION"));

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
    /// When the node started, for `stat`'s uptime.
    started: std::time::Instant,
    /// Registrations, for [`Node::wait_for`].
    arrivals: arrivals::Arrivals,
    /// The models: their versions, being written, current and held.
    models: models::Models,
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
    /// Starts one worker thread per configured device, and makes the receive pool
    /// [`NodeConfig::receive_buffers`] asks for (by default an elastic one, as `ferry-server`
    /// has: [`ReceiveBuffers::Elastic`]).
    pub fn start(mut config: NodeConfig) -> Result<Node, NodeError> {
        if config.devices.is_empty() {
            return Err(NodeError::NoDevices);
        }
        // Planned first (a pure decision), made before the devices start, and from then on the
        // node holds the pool itself: every receive and `stat` reads `ReceiveBuffers::Pool`.
        let planned = receive_plan::plan(
            &config.receive_buffers,
            &config.devices,
            config.limits.memory_limit,
            receive_plan::machine_bytes(),
        )?;
        match receive_plan::reserve(planned).map_err(NodeError::ReceivePool)? {
            Some(pool) => config.receive_buffers = ReceiveBuffers::Pool(pool),
            None if matches!(
                config.receive_buffers,
                ReceiveBuffers::Elastic(_) | ReceiveBuffers::Reserved(_)
            ) =>
            {
                config.receive_buffers = ReceiveBuffers::Fresh;
            }
            None => {}
        }
        // A peer's name can be checked only against a certificate: over TCP, under TLS.
        if let Some(peer) = config.pulls.peers.named().find(|p| {
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
                memory: config.limits.memory_limit,
                tensors: config.limits.max_tensors,
            };
            let (handle, thread) = device::spawn(index, *spec, limits)
                .map_err(|e| NodeError::Backend(format!("cannot start device {index}: {e}")))?;
            devices.push(handle);
            threads.push(thread);
        }
        // The pool keeps no more ready than the budgets of the devices it serves have room for
        // (not a fixed pool, all ready for good, nor one another node bounded first).
        if let (ReceiveBuffers::Pool(pool), Some(room)) = (
            &config.receive_buffers,
            ready_bound::BudgetRoom::of(&devices),
        ) && !pool.bound_ready_by(Arc::new(room))
        {
            tracing::info!("the receive pool is not bounded by this node's budgets");
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
                started: std::time::Instant::now(),
                arrivals: arrivals::Arrivals::new(),
                models: models::Models::default(),
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
