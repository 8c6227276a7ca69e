//! A node's configuration: what it hosts ([`NodeConfig`]), the limits it keeps
//! ([`NodeLimits`]), how it pulls from other nodes ([`PullConfig`]) and where its receives land
//! ([`ReceiveBuffers`]).

use std::time::Duration;

use ferry_backend::DeviceSpec;
use ferry_io::{ConnectionLimits, NodeTls, SharedMemory};
use ferry_proto::{NodeId, Token};

use crate::engine::TransferPolicy;
use crate::node::{DEFAULT_MAX_GRANTS, PeerPolicy};

/// The default [`NodeLimits::max_tensors`].
pub const DEFAULT_MAX_TENSORS: u64 = 1_000_000;

/// What a node hosts, who it is, and how it behaves. Its `Debug` never shows the peer token.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The devices, in index order.
    pub devices: Vec<DeviceSpec>,
    /// What the node holds at most.
    pub limits: NodeLimits,
    /// Which transfer paths may be taken.
    pub policy: TransferPolicy,
    /// The node's id; a random one when absent. Under TLS the id is the certificate's identity,
    /// and an id given here must be the same.
    pub node_id: Option<NodeId>,
    /// Mutual TLS on every TCP link, served and opened (to peers): the node's certificate, key
    /// and CA. The node's identity is then its certificate's, and a peer that fetches under a
    /// capability is who its certificate says; `None` for TCP in clear.
    pub tls: Option<NodeTls>,
    /// How it pulls from other nodes.
    pub pulls: PullConfig,
    /// Shared memory for payloads on Unix-socket connections whose other side agrees (clients,
    /// and peers this node pulls from): agreed to and offered, or declined.
    pub shared_memory: SharedMemory,
    /// Where large receives land: by default an elastic pool that keeps memory ready
    /// ([`ReceiveBuffers::Elastic`]), as `ferry-server` does.
    pub receive_buffers: ReceiveBuffers,
}

/// What a node holds at most, and for how long it lends a tensor out.
#[derive(Debug, Clone)]
pub struct NodeLimits {
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
    /// How long a capability this node issues stays valid.
    pub capability_ttl: Duration,
}

/// How a node pulls from other nodes: which it may reach, what it presents, how it retries.
#[derive(Debug, Clone)]
pub struct PullConfig {
    /// Which nodes this node pulls from (and so, in clear, sends its peer token to).
    pub peers: PeerPolicy,
    /// The token this node presents to the nodes it pulls from over TCP in clear (under TLS its
    /// certificate is its credential and no token is sent; its `Debug` never shows it).
    pub peer_token: Option<Token>,
    /// Where the peer token may go over TCP in clear: by default to loopback only, and there to
    /// a port this node's user or root holds (another local user who bound a source's port
    /// while it was down gets nothing). [`ClearTokens::Anywhere`](ferry_io::ClearTokens::Anywhere)
    /// is the opt-in for a network one trusts (`ferry-server --insecure`).
    pub clear_tokens: ferry_io::ClearTokens,
    /// Frame, chunk and idle limits of the connections this node opens to peers; the idle
    /// timeout is how long a silent source may stall a pull.
    pub peer_limits: ConnectionLimits,
    /// How often a pull reconnects after a transient drop before it gives up.
    pub retries: u32,
    /// The wait before the first reconnection; it doubles with each further one.
    pub retry_backoff: Duration,
    /// How a pull of a large tensor spreads over several connections to its source.
    pub striping: Striping,
}

/// How a pull of a tensor larger than one stripe spreads over several connections to its
/// source, each fetching whole stripes (aligned pieces of the content hash's input, hashed as
/// they arrive and merged: PROTOCOL.md §3, item 6.3) while there are any left.
///
/// It pays where one connection is the limit: a core each end copying and hashing while other
/// cores idle, on a link faster than that. On a machine with few cores the nodes' other work
/// already fills them, so [`for_this_machine`](Self::for_this_machine) keeps it off there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Striping {
    connections: std::num::NonZeroUsize,
    stripe_len: ferry_proto::stripes::StripeLen,
}

impl Striping {
    /// The most connections one pull spreads over.
    pub const MAX_CONNECTIONS: usize = 16;

    /// One connection per pull: no stripes.
    pub const OFF: Striping = Striping {
        connections: std::num::NonZeroUsize::MIN,
        stripe_len: ferry_proto::stripes::StripeLen::DEFAULT,
    };

    /// Up to `connections` per pull (1 turns striping off; at most
    /// [`MAX_CONNECTIONS`](Self::MAX_CONNECTIONS)), in stripes of `stripe_len`.
    pub fn new(connections: usize, stripe_len: ferry_proto::stripes::StripeLen) -> Striping {
        let connections = connections.clamp(1, Self::MAX_CONNECTIONS);
        Striping {
            connections: std::num::NonZeroUsize::new(connections)
                .unwrap_or(std::num::NonZeroUsize::MIN),
            stripe_len,
        }
    }

    /// A connection per four cores, up to 8: off on fewer than 8 cores, where a pull's one
    /// connection and the hashing and registering around it already keep every core busy.
    pub fn for_this_machine() -> Striping {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        Striping::new((cores / 4).min(8), ferry_proto::stripes::StripeLen::DEFAULT)
    }

    /// The most connections one pull spreads over.
    pub fn connections(&self) -> usize {
        self.connections.get()
    }

    /// Whether a pull may spread over more than one connection.
    pub fn spreads(&self) -> bool {
        self.connections.get() > 1
    }

    /// The stripe length.
    pub fn stripe_len(&self) -> ferry_proto::stripes::StripeLen {
        self.stripe_len
    }
}

/// Where a node's large receives (puts and pulls, by any link but a sealed region, which is
/// adopted as it is) land: on Flex devices the tensor's memory, on GPU devices the host staging.
/// One choice per node: a pool's memory is reused, so it can never be sealed and shared; a
/// shareable region is sealed for good, so it can never go back to a pool.
///
/// The default is what `ferry-server` does: an elastic pool that keeps memory ready, since new
/// memory costs the kernel the zeroing of every page, more than the network copy into it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ReceiveBuffers {
    /// An elastic pool, made by [`Node::start`](crate::Node::start): address space up to the
    /// device's memory limit or half the machine's memory, `ReadyMemory` of it made ready in the
    /// background at the lowest CPU priority, more ahead of the receives while tensors arrive,
    /// freed buffers above the ready amount given back after 30 s without a receive. None for a
    /// node of NdArray devices only (they take no pooled memory over without a copy).
    Elastic(ReadyMemory),
    /// A pool of this many bytes, reserved and touched (huge pages advised) at start and kept.
    Reserved(u64),
    /// New memory, or a freed buffer the process recycles (`--recycle`): nothing kept ready.
    Fresh,
    /// A pool reserved by whoever starts the node: payloads it cannot hold go to fresh memory.
    Pool(ferry_memory::Pool),
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

impl Default for ReceiveBuffers {
    fn default() -> Self {
        ReceiveBuffers::Elastic(ReadyMemory::ForAModel)
    }
}

/// How much receive memory an elastic pool keeps ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadyMemory {
    /// 256 MiB; and on a node with a Flex device, a quarter of the pool made ready at start for
    /// the first tensors (a model), until the first tensor arrives or for 10 minutes, and only
    /// while half the machine's memory (and of its cgroup limits) is free.
    #[default]
    ForAModel,
    /// This many bytes, from the start (no start amount): a worker that waits for a model larger
    /// than the start amount makes it that size, and the whole model lands in ready memory; it
    /// is resident while the node is idle.
    Kept(u64),
}

impl ReceiveBuffers {
    /// The pool, where there is one.
    pub fn pool(&self) -> Option<&ferry_memory::Pool> {
        match self {
            ReceiveBuffers::Pool(pool) => Some(pool),
            ReceiveBuffers::Elastic(_)
            | ReceiveBuffers::Reserved(_)
            | ReceiveBuffers::Fresh
            | ReceiveBuffers::Shareable { .. } => None,
        }
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            devices: vec![DeviceSpec::Flex, DeviceSpec::Flex],
            limits: NodeLimits::default(),
            policy: TransferPolicy::Auto,
            node_id: None,
            tls: None,
            pulls: PullConfig::default(),
            shared_memory: SharedMemory::Offer,
            receive_buffers: ReceiveBuffers::default(),
        }
    }
}

impl NodeConfig {
    /// The defaults, less the memory kept ready for receives: every receive goes to new (or
    /// recycled) memory. For a process that hosts many small nodes (tests, examples), or where
    /// an idle node's resident memory matters more than how fast a first model lands.
    pub fn light() -> Self {
        Self {
            receive_buffers: ReceiveBuffers::Fresh,
            ..Self::default()
        }
    }
}

impl Default for NodeLimits {
    fn default() -> Self {
        Self {
            max_tensor_bytes: 16 << 30,
            memory_limit: None,
            max_tensors: Some(DEFAULT_MAX_TENSORS),
            max_grants_per_client: DEFAULT_MAX_GRANTS,
            capability_ttl: Duration::from_secs(300),
        }
    }
}

impl Default for PullConfig {
    fn default() -> Self {
        Self {
            peers: PeerPolicy::Any,
            peer_token: None,
            clear_tokens: ferry_io::ClearTokens::default(),
            peer_limits: ConnectionLimits::default(),
            retries: 3,
            retry_backoff: Duration::from_millis(100),
            striping: Striping::for_this_machine(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_printed_for_debugging_does_not_show_the_peer_token() {
        let config = NodeConfig {
            pulls: PullConfig {
                peer_token: Some("s3cret-peer-token".into()),
                ..PullConfig::default()
            },
            ..NodeConfig::default()
        };
        let printed = format!("{config:?}");
        assert!(!printed.contains("s3cret"), "{printed}");
        assert!(printed.contains("<redacted>"), "{printed}");
    }
}
