//! What a node counts and reports: its counters, one log line and the metrics per transfer, and
//! `stat`'s answer ([`NodeStats`]), with the process's memory.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use ferry_proto::{DeviceStats, NodeStats, TensorKey, dtype_name};

use crate::device::{Command, TensorDesc};
use crate::error::NodeError;
use crate::node::{AGENT, Node};

/// What a node counts, for `stat`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) done: AtomicU64,
    failed: AtomicU64,
    pub(super) native: AtomicU64,
    pub(super) round_trip: AtomicU64,
    connections: AtomicU64,
    pub(crate) pulls: AtomicU64,
    pub(crate) pull_retries: AtomicU64,
    pub(crate) dedup_hits: AtomicU64,
    fetches_served: AtomicU64,
    shm_sent: AtomicU64,
    shm_received: AtomicU64,
    shm_bytes: AtomicU64,
}

/// Which way a payload went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Sent by this node.
    Sent,
    /// Received by this node.
    Received,
}

impl Node {
    /// One log line and the metrics per transfer: key, dtype, bytes, path, time.
    pub(super) fn record(
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

    /// Counts a connection opened, for `stat`.
    pub(crate) fn count_connection_opened(&self) {
        crate::metrics::connection(true);
        self.inner
            .counters
            .connections
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a connection closed, for `stat`.
    pub(crate) fn count_connection_closed(&self) {
        crate::metrics::connection(false);
        self.inner
            .counters
            .connections
            .fetch_sub(1, Ordering::Relaxed);
    }

    /// Counts a tensor sent whole to another node.
    pub(crate) fn count_fetch_served(&self) {
        self.inner
            .counters
            .fetches_served
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a payload that went through shared memory, sent by this node or received.
    pub(crate) fn count_shm_payload(&self, direction: Direction, bytes: u64) {
        let c = &self.inner.counters;
        let (count, metric, logged) = match direction {
            Direction::Sent => (&c.shm_sent, "out", "sent"),
            Direction::Received => (&c.shm_received, "in", "received"),
        };
        count.fetch_add(1, Ordering::Relaxed);
        c.shm_bytes.fetch_add(bytes, Ordering::Relaxed);
        crate::metrics::bytes(metric, "shm", bytes);
        tracing::info!(
            route = "shm",
            direction = logged,
            bytes,
            "payload moved through shared memory"
        );
    }

    /// Records the Unix socket the service listens on, for `stat`.
    pub(crate) fn set_unix_socket(&self, path: Option<String>) {
        *self
            .inner
            .unix_socket
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = path;
    }

    /// Counts a transfer that failed outside the node's own operations (a broken upload).
    pub(crate) fn count_failure(&self) {
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
pub(crate) struct ProcessMemory {
    /// Resident now (VmRSS), bytes.
    pub resident: u64,
    /// The highest resident so far (VmHWM), bytes.
    pub peak: u64,
}

/// This process's resident and peak memory, from `/proc/self/status`; `None` off Linux.
pub(crate) fn process_memory() -> Option<ProcessMemory> {
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
