//! The node's Prometheus metrics: their names (public, for dashboards and the exporter) and their
//! emitters, through the `metrics` facade (free when no recorder is installed;
//! `ferry-server --metrics ADDR` installs the Prometheus exporter). Events reach them through the
//! node's recorder (`node/recorder.rs`), which counts the same events for `stat`; only the
//! per-device gauges come straight from the device workers that own those numbers.

use std::time::Duration;

use metrics::{counter, gauge, histogram};

/// Transfers that ended, by operation, path and outcome.
pub const TRANSFERS: &str = "ferry_transfers_total";
/// Transfer latency in seconds, by operation and outcome.
pub const TRANSFER_SECONDS: &str = "ferry_transfer_seconds";
/// Payload bytes moved, by direction (`in`, `out`) and route (`chunks`, `shm`, `local`).
pub const BYTES: &str = "ferry_bytes_total";
/// Transfers under way now.
pub const IN_FLIGHT: &str = "ferry_transfers_in_flight";
/// Fetches this node serves now (other nodes pulling from it): its load as a source.
pub const FETCHES_IN_FLIGHT: &str = "ferry_fetches_in_flight";
/// The payload bytes those fetches were charged (a fetch's whole payload, a stripe's range).
pub const FETCH_BYTES_IN_FLIGHT: &str = "ferry_fetch_bytes_in_flight";
/// Tensors held, per device.
pub const DEVICE_TENSORS: &str = "ferry_device_tensors";
/// Bytes held, per device.
pub const DEVICE_BYTES: &str = "ferry_device_bytes";
/// Connections open now.
pub const CONNECTIONS: &str = "ferry_connections";
/// Connections refused before they were served, by `reason`: `node_limit` (every slot held by
/// a connection that said hello), `address_limit` (the peer's address holds its share),
/// `tls_handshake` (no valid certificate, or not TLS), `hello_deadline` (no hello, or no TLS
/// handshake, in time), `local_user` (a peer of another Unix user of this host),
/// `identity_share` (the identity its hello showed holds its share).
pub const CONNECTIONS_REFUSED: &str = "ferry_connections_refused_total";
/// Reconnections of node-to-node pulls after a transient drop.
pub const PULL_RETRIES: &str = "ferry_pull_retries_total";
/// Pulls answered from a tensor this node already held.
pub const DEDUP_HITS: &str = "ferry_dedup_hits_total";
/// Pulls refused because the bytes did not hash to the granted content hash.
pub const INTEGRITY_FAILURES: &str = "ferry_integrity_failures_total";
/// The node process's resident memory, in bytes.
pub const RESIDENT_BYTES: &str = "ferry_process_resident_bytes";
/// The receive pool's capacity, in bytes (a fixed pool's is resident from start; an elastic
/// pool's is address space, of which what is drawn or ready is resident).
pub const POOL_BYTES: &str = "ferry_pool_bytes";
/// Of the receive pool, bytes nothing holds now.
pub const POOL_FREE_BYTES: &str = "ferry_pool_free_bytes";
/// Of the receive pool, bytes nothing holds now that are ready (touched): what receives draw
/// with no page fault.
pub const POOL_READY_BYTES: &str = "ferry_pool_ready_bytes";
/// Receives the pool could not hold, which went to fresh memory.
pub const POOL_MISSES: &str = "ferry_pool_misses_total";

/// Describes every metric to the installed recorder (units and help text on the scrape page).
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        TRANSFERS,
        "Transfers that ended, by operation (put, get, copy, move, pull, fetch), path and outcome"
    );
    describe_histogram!(
        TRANSFER_SECONDS,
        Unit::Seconds,
        "Transfer latency, from request to the target registering the tensor"
    );
    describe_counter!(
        BYTES,
        Unit::Bytes,
        "Payload bytes moved, by direction and route"
    );
    describe_gauge!(IN_FLIGHT, "Transfers under way");
    describe_gauge!(
        FETCHES_IN_FLIGHT,
        "Fetches served now (other nodes pulling from this one)"
    );
    describe_gauge!(
        FETCH_BYTES_IN_FLIGHT,
        Unit::Bytes,
        "Payload bytes of the fetches served now"
    );
    describe_gauge!(DEVICE_TENSORS, "Tensors held per device");
    describe_gauge!(DEVICE_BYTES, Unit::Bytes, "Bytes held per device");
    describe_gauge!(CONNECTIONS, "Client and peer connections open");
    describe_counter!(
        CONNECTIONS_REFUSED,
        "Connections refused before they were served, by reason"
    );
    describe_counter!(PULL_RETRIES, "Pull reconnections after a transient drop");
    describe_counter!(
        INTEGRITY_FAILURES,
        "Pulls refused: the bytes did not hash to the granted content hash"
    );
    describe_counter!(
        DEDUP_HITS,
        "Pulls skipped because the node held the same bytes"
    );
    describe_gauge!(
        RESIDENT_BYTES,
        Unit::Bytes,
        "Resident memory of the node process"
    );
    describe_gauge!(
        POOL_BYTES,
        Unit::Bytes,
        "Capacity of the receive pool (an elastic pool's is address space)"
    );
    describe_gauge!(
        POOL_READY_BYTES,
        Unit::Bytes,
        "Receive pool bytes free and ready (touched): drawn with no page fault"
    );
    describe_gauge!(
        POOL_FREE_BYTES,
        Unit::Bytes,
        "Receive pool bytes no tensor or receive holds"
    );
    describe_counter!(
        POOL_MISSES,
        "Receives the pool could not hold, which went to fresh memory"
    );
}

/// A transfer that ended.
pub(crate) fn transfer(op: &'static str, path: &str, ok: bool, elapsed: Duration) {
    let outcome = if ok { "ok" } else { "error" };
    counter!(TRANSFERS, "op" => op, "path" => path.to_string(), "outcome" => outcome).increment(1);
    histogram!(TRANSFER_SECONDS, "op" => op, "outcome" => outcome).record(elapsed.as_secs_f64());
}

/// Payload bytes that went `direction` (`in` or `out`) by `route`.
pub(crate) fn bytes(direction: &'static str, route: &'static str, bytes: u64) {
    counter!(BYTES, "direction" => direction, "route" => route).increment(bytes);
}

/// What a device holds now.
pub(crate) fn device_held(device: u32, tensors: usize, bytes: u64) {
    let device = device.to_string();
    gauge!(DEVICE_TENSORS, "device" => device.clone()).set(tensors as f64);
    gauge!(DEVICE_BYTES, "device" => device).set(bytes as f64);
}

/// A fetch of `bytes` began serving (`true`) or ended.
pub(crate) fn fetch(started: bool, bytes: u64) {
    let sign = if started { 1.0 } else { -1.0 };
    gauge!(FETCHES_IN_FLIGHT).increment(sign);
    gauge!(FETCH_BYTES_IN_FLIGHT).increment(sign * bytes as f64);
}

/// A connection opened (`true`) or closed.
pub(crate) fn connection(opened: bool) {
    let delta = if opened { 1.0 } else { -1.0 };
    gauge!(CONNECTIONS).increment(delta);
}

/// A connection refused before it was served, for `reason`.
pub(crate) fn connection_refused(reason: &'static str) {
    counter!(CONNECTIONS_REFUSED, "reason" => reason).increment(1);
}

/// A pull reconnected.
pub(crate) fn pull_retry() {
    counter!(PULL_RETRIES).increment(1);
}

/// A pull refused because the bytes that arrived did not hash to the granted content hash.
pub(crate) fn integrity_failure() {
    counter!(INTEGRITY_FAILURES).increment(1);
}

/// A pull answered by dedup.
pub(crate) fn dedup_hit() {
    counter!(DEDUP_HITS).increment(1);
}

/// The process's resident memory now, for the gauge; `None` where `/proc` does not say.
pub fn sample_resident_memory() -> Option<u64> {
    let resident = crate::node::process_memory().map(|m| m.resident)?;
    gauge!(RESIDENT_BYTES).set(resident as f64);
    Some(resident)
}

/// The receive pool's size, free and ready bytes and misses now, for the gauges.
pub fn sample_pool(pool: &ferry_memory::Pool) {
    gauge!(POOL_BYTES).set(pool.capacity() as f64);
    gauge!(POOL_FREE_BYTES).set(pool.free_bytes() as f64);
    gauge!(POOL_READY_BYTES).set(pool.ready_bytes() as f64);
    counter!(POOL_MISSES).absolute(pool.misses());
}

/// Counts a transfer as under way until dropped.
#[derive(Debug)]
pub(crate) struct InFlight(());

impl InFlight {
    /// Starts counting.
    pub(crate) fn start() -> Self {
        gauge!(IN_FLIGHT).increment(1.0);
        InFlight(())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        gauge!(IN_FLIGHT).decrement(1.0);
    }
}
