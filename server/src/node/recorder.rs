//! What a node counts: each event recorded once, into `stat`'s counters and the Prometheus
//! metrics together, so that the two never tell different stories.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferry_io::PayloadRoute;
use ferry_proto::{TensorKey, Untrusted, dtype_name};

use crate::device::TensorDesc;
use crate::engine::TransferPath;
use crate::error::NodeError;
use crate::metrics;
use crate::node::Node;
use crate::service::door::refusal_log::RefusalLog;

/// Why a connection was refused before it was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Every slot of the node was held by a connection that said hello.
    NodeLimit,
    /// The peer's address held its share of the node's connections.
    AddressLimit,
    /// The TLS handshake failed: no valid certificate, or not TLS at all.
    TlsHandshake,
    /// No hello (or no TLS handshake) by the hello deadline.
    HelloDeadline,
    /// A peer of another Unix user of this host, on the Unix socket or, where the node asks no
    /// credential, over TCP.
    LocalUser,
    /// The identity its hello showed (a token credential, a certificate) held its share of the
    /// node's connections.
    IdentityShare,
}

impl Refused {
    fn label(self) -> &'static str {
        match self {
            Refused::NodeLimit => "node_limit",
            Refused::AddressLimit => "address_limit",
            Refused::TlsHandshake => "tls_handshake",
            Refused::HelloDeadline => "hello_deadline",
            Refused::LocalUser => "local_user",
            Refused::IdentityShare => "identity_share",
        }
    }
}

/// Which way a payload went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Sent by this node.
    Sent,
    /// Received by this node.
    Received,
}

/// The node's event counters: `stat` reads them ([`Recorder::counts`]), and every event that
/// moves one also moves its metric.
#[derive(Debug, Default)]
pub(crate) struct Recorder {
    done: AtomicU64,
    failed: AtomicU64,
    native: AtomicU64,
    round_trip: AtomicU64,
    connections: AtomicU64,
    pulls: AtomicU64,
    pull_retries: AtomicU64,
    dedup_hits: AtomicU64,
    fetches_served: AtomicU64,
    /// Fetches under way now and the bytes they were charged: gauges, each moved up by a
    /// [`FetchLease`](crate::node::capability::FetchLease)'s start and down by its drop.
    fetches_in_flight: AtomicU64,
    fetch_bytes_in_flight: AtomicU64,
    shm_sent: AtomicU64,
    shm_received: AtomicU64,
    shm_bytes: AtomicU64,
}

/// The counters at one moment, for `stat`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counts {
    pub(crate) done: u64,
    pub(crate) failed: u64,
    pub(crate) native: u64,
    pub(crate) round_trip: u64,
    pub(crate) connections: u64,
    pub(crate) pulls: u64,
    pub(crate) pull_retries: u64,
    pub(crate) dedup_hits: u64,
    pub(crate) fetches_served: u64,
    pub(crate) fetches_in_flight: u64,
    pub(crate) fetch_bytes_in_flight: u64,
    pub(crate) shm_sent: u64,
    pub(crate) shm_received: u64,
    pub(crate) shm_bytes: u64,
}

/// An open connection, counted until dropped.
#[derive(Debug)]
pub(crate) struct OpenConnection {
    node: Node,
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        metrics::connection(false);
        self.node
            .recorder()
            .connections
            .fetch_sub(1, Ordering::Relaxed);
    }
}

impl Recorder {
    /// A transfer ended, as `op` by `path`.
    pub(crate) fn transfer_ended(&self, op: &'static str, path: &str, ok: bool, elapsed: Duration) {
        let counter = if ok { &self.done } else { &self.failed };
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::transfer(op, path, ok, elapsed);
    }

    /// An in-node copy or move went by `path` (native, or a host round trip).
    pub(crate) fn path_taken(&self, path: TransferPath) {
        let counter = match path {
            TransferPath::Native => &self.native,
            _ => &self.round_trip,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// A payload went `direction` by `route`.
    pub(crate) fn payload(&self, direction: Direction, route: PayloadRoute, bytes: u64) {
        let label = match direction {
            Direction::Sent => "out",
            Direction::Received => "in",
        };
        match route {
            PayloadRoute::Chunks => metrics::bytes(label, "chunks", bytes),
            PayloadRoute::Region => {
                let count = match direction {
                    Direction::Sent => &self.shm_sent,
                    Direction::Received => &self.shm_received,
                };
                count.fetch_add(1, Ordering::Relaxed);
                self.shm_bytes.fetch_add(bytes, Ordering::Relaxed);
                metrics::bytes(label, "shm", bytes);
                tracing::info!(
                    route = "shm",
                    direction = label,
                    bytes,
                    "payload moved through shared memory"
                );
            }
        }
    }

    /// A connection was refused before it was served, for `why`.
    pub(crate) fn connection_refused(&self, why: Refused) {
        metrics::connection_refused(why.label());
    }

    /// A pull registered bytes it received.
    pub(crate) fn pulled(&self) {
        self.pulls.fetch_add(1, Ordering::Relaxed);
    }

    /// A pull reconnected after a transient drop.
    pub(crate) fn pull_retry(&self) {
        self.pull_retries.fetch_add(1, Ordering::Relaxed);
        metrics::pull_retry();
    }

    /// A pull was answered from bytes the node already held.
    pub(crate) fn dedup_hit(&self) {
        self.dedup_hits.fetch_add(1, Ordering::Relaxed);
        metrics::dedup_hit();
    }

    /// A pull's bytes did not hash to the content hash they were granted under.
    pub(crate) fn integrity_failure(&self) {
        metrics::integrity_failure();
    }

    /// A tensor was sent whole to another node.
    pub(crate) fn fetch_served(&self) {
        self.fetches_served.fetch_add(1, Ordering::Relaxed);
    }

    /// A fetch of `bytes` began serving (it ends with [`fetch_ended`](Self::fetch_ended)).
    pub(crate) fn fetch_started(&self, bytes: u64) {
        self.fetches_in_flight.fetch_add(1, Ordering::Relaxed);
        self.fetch_bytes_in_flight
            .fetch_add(bytes, Ordering::Relaxed);
        metrics::fetch(true, bytes);
    }

    /// A fetch that [`fetch_started`](Self::fetch_started) with `bytes` ended, served or not.
    pub(crate) fn fetch_ended(&self, bytes: u64) {
        self.fetches_in_flight.fetch_sub(1, Ordering::Relaxed);
        self.fetch_bytes_in_flight
            .fetch_sub(bytes, Ordering::Relaxed);
        metrics::fetch(false, bytes);
    }

    /// A request that moves a tensor is under way until the guard drops.
    pub(crate) fn in_flight(&self) -> metrics::InFlight {
        metrics::InFlight::start()
    }

    /// The counters now.
    pub(crate) fn counts(&self) -> Counts {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Counts {
            done: load(&self.done),
            failed: load(&self.failed),
            native: load(&self.native),
            round_trip: load(&self.round_trip),
            connections: load(&self.connections),
            pulls: load(&self.pulls),
            pull_retries: load(&self.pull_retries),
            dedup_hits: load(&self.dedup_hits),
            fetches_served: load(&self.fetches_served),
            fetches_in_flight: load(&self.fetches_in_flight),
            fetch_bytes_in_flight: load(&self.fetch_bytes_in_flight),
            shm_sent: load(&self.shm_sent),
            shm_received: load(&self.shm_received),
            shm_bytes: load(&self.shm_bytes),
        }
    }
}

/// Failed transfers (a get, put, copy, move or pull): logged at most once a second, with how many
/// went unlogged, as every line a client can cause by failing requests.
pub(crate) static FAILED_TRANSFERS: RefusalLog = RefusalLog::new("request", "transfer failed");

impl Node {
    /// The node's counters.
    pub(crate) fn recorder(&self) -> &Recorder {
        &self.inner.recorder
    }

    /// Counts a connection open until the guard drops.
    pub(crate) fn connection_opened(&self) -> OpenConnection {
        metrics::connection(true);
        self.recorder().connections.fetch_add(1, Ordering::Relaxed);
        OpenConnection { node: self.clone() }
    }

    /// One log line, the counters and the metrics per transfer: key, dtype, bytes, path, time.
    pub(crate) fn record(
        &self,
        op: &'static str,
        key: &TensorKey,
        to: Option<&TensorKey>,
        path: &str,
        result: Result<&TensorDesc, &NodeError>,
        started: Instant,
    ) {
        let elapsed = started.elapsed();
        self.recorder()
            .transfer_ended(op, path, result.is_ok(), elapsed);
        let elapsed_ms = elapsed.as_secs_f64() * 1e3;
        match result {
            Ok(desc) => {
                // Keys are as a client named them (a failed one may not be a valid name).
                let dst = to
                    .map(|k| Untrusted(&k.to_string()).to_string())
                    .unwrap_or_default();
                tracing::info!(
                    op,
                    key = %Untrusted(&key.to_string()),
                    dst,
                    dtype = %dtype_name(&desc.dtype),
                    bytes = desc.bytes,
                    path,
                    elapsed_ms,
                    "transfer done"
                );
            }
            // A client can fail request after request (a missing name, a refused copy): at a
            // bounded rate, the key and error escaped and cut short.
            Err(error) => FAILED_TRANSFERS.note_in_request(&format!("{op} {key}: {error}")),
        }
    }
}
