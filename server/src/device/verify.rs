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

use ferry_proto::{ContentHash, TensorKey, TensorMeta};
use tokio::sync::mpsc;

use crate::device::{Command, Version};

/// What a receiver knows of a tensor's content hash when it hands the tensor over.
///
/// Crate-private, as is [`Arrived`](crate::device::Arrived) that carries it: the worker registers
/// a [`Computed`](KnownHash::Computed) hash as verified without looking at the bytes again, so
/// only code of this node that hashed the very bytes it hands over may make one (a pull's
/// receiver, `peer/`, after comparing its hash with the grant; a put's to a device that cannot
/// lend its registered bytes, `service/session.rs`, whose chunks came through their checksums or
/// TLS). Nothing outside the crate can hand the
/// node a hash it is to trust.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KnownHash {
    /// Nothing, and nothing waits for it (a put, whose answer needs no hash; a tensor an
    /// embedding program inserted; a host round trip between two devices of the node): computed
    /// after registering where the worker can read the registered tensor in place, else before.
    Unknown,
    /// Computed by this node over the bytes it hands over, as they arrived.
    Computed(ContentHash),
    /// Stated by the node the bytes came from: registered as is where the worker can verify it
    /// afterwards from the registered tensor, else checked before registering.
    Stated(ContentHash),
}

impl KnownHash {
    /// What is known, without the hash (what `ferry_io::hash_plan::at_register` decides on).
    pub(crate) fn known(self) -> ferry_io::hash_plan::HashKnown {
        use ferry_io::hash_plan::HashKnown;
        match self {
            Self::Unknown => HashKnown::Unknown,
            Self::Computed(_) => HashKnown::Computed,
            Self::Stated(_) => HashKnown::Stated,
        }
    }
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
    pub(super) fn hash(&self) -> Option<ContentHash> {
        let values = self.values.upgrade()?;
        let stop = || self.abandoned.load(Ordering::Relaxed);
        ferry_proto::tensor::content_hash_parts(&self.meta, &[&values[..], &self.tail], stop)
    }
}

/// The verifier's queue of jobs, oldest first, except that a job somebody waits for (a grant, a
/// conditional delete, a dedup check) is moved to the front: a grant right after a put of many
/// tensors waits for its own tensor's hash, not for every hash queued before it.
pub(super) struct VerifyQueue<T> {
    shared: Arc<(std::sync::Mutex<Queued<T>>, std::sync::Condvar)>,
}

struct Queued<T> {
    jobs: std::collections::VecDeque<T>,
    /// Set when the worker (the one pusher) is gone, or the verifier itself (then nothing
    /// more is taken): the verifier finishes what is queued and stops.
    closed: bool,
}

impl<T> VerifyQueue<T> {
    fn new() -> (VerifyQueue<T>, VerifyQueue<T>) {
        let shared = Arc::new((
            std::sync::Mutex::new(Queued {
                jobs: std::collections::VecDeque::new(),
                closed: false,
            }),
            std::sync::Condvar::new(),
        ));
        (
            VerifyQueue {
                shared: shared.clone(),
            },
            VerifyQueue { shared },
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queued<T>> {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `job` last; gives it back where the verifier is gone.
    pub(super) fn push(&self, job: T) -> Result<(), T> {
        let mut queued = self.lock();
        if queued.closed {
            return Err(job);
        }
        queued.jobs.push_back(job);
        drop(queued);
        self.shared.1.notify_one();
        Ok(())
    }

    /// Moves the first queued job that `wanted` picks to the front; none queued (done, or
    /// being hashed now) leaves the queue as it is.
    pub(super) fn prioritize(&self, wanted: impl Fn(&T) -> bool) {
        let mut queued = self.lock();
        if let Some(at) = queued.jobs.iter().position(wanted)
            && let Some(job) = queued.jobs.remove(at)
        {
            queued.jobs.push_front(job);
        }
    }

    /// The next job, waiting for one; `None` once the queue is closed and empty.
    fn pop(&self) -> Option<T> {
        let mut queued = self.lock();
        loop {
            if let Some(job) = queued.jobs.pop_front() {
                return Some(job);
            }
            if queued.closed {
                return None;
            }
            queued = self
                .shared
                .1
                .wait(queued)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    fn close(&self) {
        self.lock().closed = true;
        self.shared.1.notify_all();
    }
}

/// The worker's end of the queue: closes it when dropped, so that the verifier stops.
pub(super) struct VerifierHandle(VerifyQueue<VerifyJob>);

impl std::ops::Deref for VerifierHandle {
    type Target = VerifyQueue<VerifyJob>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Drop for VerifierHandle {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// Starts a device's verifier: one thread that hashes registered tensors whose hash is not yet
/// verified (stated by their source, or still to compute), and reports to the worker. It ends
/// when the worker does (its handle closes the queue).
pub(super) fn spawn_verifier(
    index: u32,
    worker: mpsc::WeakSender<Command>,
) -> std::io::Result<VerifierHandle> {
    let (jobs, queue) = VerifyQueue::<VerifyJob>::new();
    std::thread::Builder::new()
        .name(format!("ferry-verify-{index}"))
        .spawn(move || {
            // However the thread ends (a panic included), nothing more is queued for it: the
            // worker then verifies in line.
            struct Closes(VerifyQueue<VerifyJob>);
            impl Drop for Closes {
                fn drop(&mut self) {
                    self.0.close();
                }
            }
            let queue = Closes(queue);
            run_in_background();
            while let Some(job) = queue.0.pop() {
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
    Ok(VerifierHandle(jobs))
}

/// How much less CPU the verifier gets than the threads that answer, when they contend (a nice
/// value this much above the node's). Its hashing is off the critical path, and a hash that
/// starts as a transfer registers must not delay that transfer's answer: in `same_host` on two
/// cores, 60 kept-region handoffs of 256 MiB each, 17 took over 2 ms (up to 11.6 ms) with the
/// verifier at the node's priority, 7 (up to 5.3 ms) at +10, 4 at +19. (A thread cannot take
/// back a priority it gave up without privilege, so a hash somebody waits for runs at this
/// priority too: it goes first, and is slower only while the CPUs are saturated.)
const VERIFIER_NICENESS: i32 = 10;

/// Lowers the calling thread's scheduling priority by [`VERIFIER_NICENESS`] (on Linux a thread
/// has its own nice value). Where it cannot, the verifier runs at the node's priority.
fn run_in_background() {
    #[cfg(target_os = "linux")]
    {
        let tid = rustix::thread::gettid();
        let lowered = rustix::process::getpriority_process(Some(tid)).and_then(|nice| {
            rustix::process::setpriority_process(Some(tid), (nice + VERIFIER_NICENESS).min(19))
        });
        if let Err(error) = lowered {
            tracing::debug!(%error, "the verifier runs at the node's priority");
        }
    }
}

/// Counts and logs a stated content hash that the bytes do not have. The bytes are what the
/// source sent, each chunk checked (and the capability pinned them to what the source held):
/// only the statement about them was wrong, so the tensor answers to the computed hash.
pub(super) fn note_mismatch(
    count: &AtomicU64,
    key: &TensorKey,
    stated: ContentHash,
    computed: ContentHash,
) {
    count.fetch_add(1, Ordering::Relaxed);
    // A client can state a wrong hash with every put: one line a second at most (the count
    // above has them all).
    STATED_HASH_WRONG.note_in_request(&format!("{key}: stated {stated}, computed {computed}"));
}

/// Stated content hashes that were not the bytes'.
static STATED_HASH_WRONG: crate::service::door::refusal_log::RefusalLog =
    crate::service::door::refusal_log::RefusalLog::new(
        "verify",
        "a stated content hash is not the bytes'; the tensor answers to the computed one",
    );

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_waited_for_goes_first_and_a_closed_queue_drains_then_ends() {
        let (pusher, popper) = VerifyQueue::<u32>::new();
        for job in 1..=4 {
            pusher.push(job).unwrap();
        }
        pusher.prioritize(|&j| j == 3);
        // One not queued (done, or being hashed) changes nothing.
        pusher.prioritize(|&j| j == 9);
        assert_eq!(popper.pop(), Some(3));
        pusher.close();
        assert_eq!(pusher.push(7), Err(7), "nothing is taken once closed");
        assert_eq!(
            std::iter::from_fn(|| popper.pop()).collect::<Vec<_>>(),
            vec![1, 2, 4]
        );
    }

    #[test]
    fn a_waiting_verifier_wakes_for_a_job_and_for_the_close() {
        let (pusher, popper) = VerifyQueue::<u32>::new();
        let verifier = std::thread::spawn(move || std::iter::from_fn(|| popper.pop()).sum::<u32>());
        std::thread::sleep(std::time::Duration::from_millis(20));
        pusher.push(5).unwrap();
        pusher.push(6).unwrap();
        pusher.close();
        assert_eq!(verifier.join().unwrap(), 11);
    }
}
