//! Content hashes a device checks: what is known of a tensor's hash when it arrives
//! ([`KnownHash`]), and the device's verifier thread, which recomputes stated hashes from the
//! registered bytes.
//!
//! A tensor pulled from another node is registered under the content hash that node stated in its
//! grant (relayed by the client), and the worker's verifier thread recomputes it from the
//! registered bytes afterwards: hashing is off the transfer's critical path, and a stated hash is
//! used for nothing that trusts it (dedup) until it is verified.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use ferry_proto::{TensorKey, TensorMeta};
use tokio::sync::mpsc;

use crate::device::{Command, Version};

/// What a receiver knows of a tensor's content hash when it hands the tensor over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KnownHash {
    /// Nothing, and nothing waits for it (a put, whose answer needs no hash): computed after
    /// registering where the worker can read the registered tensor in place, else before.
    Unknown,
    /// Computed by this node over the bytes it hands over.
    Computed(String),
    /// Stated by the node the bytes came from: registered as is where the worker can verify it
    /// afterwards from the registered tensor, else checked before registering.
    Stated(String),
}

/// A stated hash to check against a registered tensor's bytes.
pub(super) struct VerifyJob {
    pub(super) name: String,
    pub(super) version: Version,
    pub(super) meta: TensorMeta,
    /// The registered tensor's values, not kept alive by a queued job: a tensor removed before
    /// its turn is not hashed at all, and its memory is not held past its removal.
    pub(super) values: std::sync::Weak<burn_backend::Bytes>,
    /// What follows the values in the payload (a quantized tensor's scales).
    pub(super) tail: Vec<u8>,
    /// Set once the tensor is unregistered: the check is then abandoned.
    pub(super) abandoned: Arc<AtomicBool>,
}

impl VerifyJob {
    /// The content hash of the job's bytes; `None` once the tensor is gone.
    pub(super) fn hash(&self) -> Option<String> {
        let values = self.values.upgrade()?;
        let stop = || self.abandoned.load(Ordering::Relaxed);
        ferry_proto::tensor::content_hash_parts(&self.meta, &[&values[..], &self.tail], stop)
    }
}

/// Starts a device's verifier: one thread that hashes registered tensors whose hash was stated by
/// their source, and reports to the worker. It ends when the worker does (its queue closes).
pub(super) fn spawn_verifier(
    index: u32,
    worker: mpsc::WeakSender<Command>,
) -> std::io::Result<std::sync::mpsc::Sender<VerifyJob>> {
    let (jobs, queue) = std::sync::mpsc::channel::<VerifyJob>();
    std::thread::Builder::new()
        .name(format!("ferry-verify-{index}"))
        .spawn(move || {
            while let Ok(job) = queue.recv() {
                let Some(computed) = job.hash() else {
                    continue;
                };
                let Some(worker) = worker.upgrade() else {
                    return;
                };
                let verified = Command::Verified {
                    name: job.name,
                    version: job.version,
                    computed,
                };
                if worker.blocking_send(verified).is_err() {
                    return;
                }
            }
        })?;
    Ok(jobs)
}

/// Counts and logs a stated content hash that the bytes do not have. The bytes are what the
/// source sent, each chunk checked (and the capability pinned them to what the source held):
/// only the statement about them was wrong, so the tensor answers to the computed hash.
pub(super) fn note_mismatch(count: &AtomicU64, key: &TensorKey, stated: &str, computed: &str) {
    count.fetch_add(1, Ordering::Relaxed);
    tracing::error!(
        %key,
        %stated,
        %computed,
        "a stated content hash is not the bytes'; the tensor answers to the computed one"
    );
}
