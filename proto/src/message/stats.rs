//! Node and device statistics: messages that grow by protocol minor (see `growable`).

#[cfg(doc)]
use super::Request;
use crate::growable::growable;

/// The minor that added [`NodeStats::fetches_in_flight`] and
/// [`NodeStats::fetch_bytes_in_flight`]: a node older than it answers 0 for both, which says
/// nothing of its load.
pub const LOAD_MINOR: u16 = 10;

growable! {
    /// Node statistics. Its fields are grouped by the protocol minor they arrived in: a peer of
    /// an older minor sends and receives only the fields it knows (PROTOCOL.md §4).
    #[derive(Debug, Clone, PartialEq, Default)]
    pub struct NodeStats {
        since 0 {
            /// The node's software, for people.
            pub agent: String,
            /// Each hosted device.
            pub devices: Vec<DeviceStats>,
            /// Transfers (put, get, copy, move) that completed.
            pub transfers_done: u64,
            /// Transfers that failed.
            pub transfers_failed: u64,
            /// In-node copies and moves that took the native path.
            pub native_transfers: u64,
            /// In-node copies and moves that took the host round trip.
            pub round_trip_transfers: u64,
            /// Connections open now.
            pub connections: u64,
            /// The path policy: `auto` or `round-trip`.
            pub transfer_policy: String,
            /// The node's id (what a capability is bound to).
            pub node_id: String,
            /// Tensors pulled from other nodes.
            pub pulls: u64,
            /// Reconnections of pulls after a transient drop.
            pub pull_retries: u64,
            /// Pulls skipped because this node already held the same bytes.
            pub dedup_hits: u64,
            /// Tensors sent to other nodes.
            pub fetches_served: u64,
        }
        since 1 {
            /// The Unix socket the node also listens on, if any.
            pub unix_socket: Option<String>,
            /// Whether payloads go through shared memory on Unix-socket connections that agree
            /// to it.
            pub shared_memory: bool,
            /// Payloads sent as a shared-memory region (gets and fetches).
            pub shm_payloads_sent: u64,
            /// Payloads received as a shared-memory region (puts and pulls).
            pub shm_payloads_received: u64,
            /// Payload bytes moved through shared memory, both ways.
            pub shm_bytes: u64,
            /// Shared-memory regions this node created that are not yet handed over or dropped.
            pub regions_in_flight: u64,
            /// The node process's resident memory now, in bytes (0 where the platform does not
            /// say).
            pub resident_bytes: u64,
            /// The node process's highest resident memory so far, in bytes (0 where unknown).
            pub peak_resident_bytes: u64,
        }
        since 2 {
            /// Registered tensors whose content hash, stated by the node they came from, this
            /// node has not yet recomputed (they answer no dedup until it has).
            pub hashes_pending: u64,
            /// Stated content hashes that the bytes turned out not to have (the tensor then
            /// answers to the computed one).
            pub hash_mismatches: u64,
            /// Freed receive buffers the node keeps for reuse, in bytes (resident, held by no
            /// tensor).
            pub recycled_bytes: u64,
            /// Shared-memory regions the node keeps (a descriptor each) to pass tensors on
            /// without a copy.
            pub regions_kept: u64,
        }
        since 4 {
            /// The node's receive pool (`--pool`), in bytes: reserved and resident from start; 0
            /// without one.
            pub pool_bytes: u64,
            /// Of the pool, bytes no tensor or receive holds now.
            pub pool_free_bytes: u64,
            /// Receives the pool could not hold (too large, or too full), which went to fresh
            /// memory.
            pub pool_misses: u64,
        }
        since 7 {
            /// Milliseconds since the node started (0 from a node older than minor 7).
            pub uptime_ms: u64,
        }
        since 10 {
            /// Fetches this node is serving now (other nodes pulling from it, a stripe each):
            /// its load as a source, which a copy by name weighs when it chooses among holders
            /// (0 from a node older than minor 10).
            pub fetches_in_flight: u64,
            /// The payload bytes those fetches were charged: a fetch's whole payload, a stripe's
            /// range (0 from a node older than minor 10).
            pub fetch_bytes_in_flight: u64,
        }
    }
}

growable! {
    /// One hosted device, in a [`NodeStats`]; its fields grow as that struct's do.
    #[derive(Debug, Clone, PartialEq, Eq, Default)]
    pub struct DeviceStats {
        since 0 {
            /// Its index on the node.
            pub index: u32,
            /// Its backend, e.g. `flex`.
            pub backend: String,
            /// Its Burn device, readable.
            pub device: String,
            /// Tensors registered.
            pub tensors: u64,
            /// Bytes registered.
            pub bytes_held: u64,
            /// The memory budget, if any.
            pub memory_limit: Option<u64>,
        }
        since 5 {
            /// How many probes it ran at start (a plain dtype or quantization scheme family on
            /// one class of shape each).
            pub holds_measured: u32,
            /// How many of them it gave back bit-exact (see [`Request::Holds`]).
            pub holds_exact: u32,
        }
        since 6 {
            /// The most bytes one tensor may take on it (values and scales together): a GPU
            /// adapter's largest buffer. `None` where only the node's per-tensor limit and the
            /// budget bound a tensor (host memory).
            pub largest_tensor: Option<u64>,
        }
    }
}
