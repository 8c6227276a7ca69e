//! `stat`'s answer ([`NodeStats`]): the devices, the recorder's counters and the process's
//! memory.

use ferry_proto::{DeviceStats, NodeStats};

use crate::device::Command;
use crate::error::NodeError;
use crate::node::{AGENT, Node};

impl Node {
    /// Records the Unix socket the service listens on, for `stat`.
    pub(crate) fn set_unix_socket(&self, path: Option<String>) {
        *self
            .inner
            .unix_socket
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = path;
    }

    /// The sum of every device's change counter ([`crate::DeviceHandle::changes`]).
    pub fn changes(&self) -> u64 {
        self.inner
            .devices
            .iter()
            .fold(0u64, |sum, d| sum.wrapping_add(d.changes()))
    }

    /// What device `device` measured at start that it stores bit-exact.
    pub fn holds(&self, device: u32) -> Result<std::sync::Arc<crate::HoldsTable>, NodeError> {
        Ok(self.device(device)?.holds().clone())
    }

    /// Devices, tensors, bytes held, transfers done and failed, per-path counts.
    pub async fn stats(&self) -> Result<NodeStats, NodeError> {
        let mut devices = Vec::with_capacity(self.inner.devices.len());
        let (mut hashes_pending, mut hash_mismatches) = (0, 0);
        for handle in &self.inner.devices {
            let summary = handle.call(|reply| Command::Summary { reply }).await?;
            hashes_pending += summary.hashes_pending;
            hash_mismatches += handle.hash_mismatches();
            let (measured, exact) = handle.holds().counts();
            devices.push(DeviceStats {
                index: handle.index(),
                backend: handle.kind().name().to_string(),
                device: handle.label().to_string(),
                tensors: summary.tensors,
                bytes_held: summary.bytes,
                memory_limit: handle.budget().limit(),
                holds_measured: u32::try_from(measured).unwrap_or(u32::MAX),
                holds_exact: u32::try_from(exact).unwrap_or(u32::MAX),
                largest_tensor: handle.largest_tensor(),
            });
        }
        let c = self.recorder().counts();
        let memory = process_memory();
        let pool = self.inner.config.receive_buffers.pool();
        Ok(NodeStats {
            agent: AGENT.to_string(),
            devices,
            transfers_done: c.done,
            transfers_failed: c.failed,
            native_transfers: c.native,
            round_trip_transfers: c.round_trip,
            connections: c.connections,
            transfer_policy: self.inner.config.policy.name().to_string(),
            node_id: self.inner.node_id.to_string(),
            pulls: c.pulls,
            pull_retries: c.pull_retries,
            dedup_hits: c.dedup_hits,
            fetches_served: c.fetches_served,
            unix_socket: self
                .inner
                .unix_socket
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            shared_memory: self.inner.config.shared_memory == ferry_io::SharedMemory::Offer
                && ferry_io::connection::shared_memory_supported(),
            shm_payloads_sent: c.shm_sent,
            shm_payloads_received: c.shm_received,
            shm_bytes: c.shm_bytes,
            regions_in_flight: regions_in_flight(),
            resident_bytes: memory.map_or(0, |m| m.resident),
            peak_resident_bytes: memory.map_or(0, |m| m.peak),
            hashes_pending,
            hash_mismatches,
            recycled_bytes: ferry_memory::host::recycled_bytes() as u64,
            regions_kept: regions_kept(),
            pool_bytes: pool.as_ref().map_or(0, |p| p.capacity() as u64),
            pool_free_bytes: pool.as_ref().map_or(0, |p| p.free_bytes() as u64),
            pool_misses: pool.as_ref().map_or(0, |p| p.misses()),
            uptime_ms: u64::try_from(self.inner.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            fetches_in_flight: c.fetches_in_flight,
            fetch_bytes_in_flight: c.fetch_bytes_in_flight,
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
    ferry_memory::region::regions_in_flight()
}

#[cfg(not(target_os = "linux"))]
fn regions_in_flight() -> u64 {
    0
}

#[cfg(target_os = "linux")]
fn regions_kept() -> u64 {
    ferry_memory::region::regions_kept()
}

#[cfg(not(target_os = "linux"))]
fn regions_kept() -> u64 {
    0
}
