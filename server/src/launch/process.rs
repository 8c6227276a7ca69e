//! What a server sets for its whole process: the allocator's policy (freed tensor memory goes
//! back to the system), the recycled receive buffers kept, and the open-file limit.
//!
//! These are process-wide: a program that embeds a node and wants its own allocator policy
//! says so ([`ProcessTuning::Untouched`](super::ProcessTuning::Untouched)).

use std::sync::Once;
use std::time::Duration;

/// How long a recycled receive buffer may wait unused before it is freed.
const RECYCLED_IDLE: Duration = Duration::from_secs(2);

/// Makes the allocator give freed tensor memory back ([`ferry_memory::allocator::tune`]), once per
/// process. Its one-arena setting holds only where no second thread allocated yet (first thing
/// in `main`, as `ferry-server` does); the thresholds and the trims hold whenever it is called.
pub fn tune_allocator() {
    static TUNED: Once = Once::new();
    TUNED.call_once(|| ferry_memory::allocator::tune(RECYCLED_IDLE));
}

/// Keeps up to `bytes` of freed receive buffers for reuse, and tunes the allocator.
pub(crate) fn tune(recycle: usize, max_connections: usize) {
    tune_allocator();
    ferry_memory::host::set_recycle_limit(recycle);
    raise_fd_limit(max_connections);
}

/// Raises the soft limit on open files to the hard one: every connection, peer link and region
/// in flight is a descriptor, and the default soft limit (often 1024) is below what
/// `max_connections` allows, which would make `accept` fail before the node can say why.
fn raise_fd_limit(max_connections: usize) {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if let Some(hard) = limit.maximum
        && limit.current.is_some_and(|soft| soft < hard)
    {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(hard),
                maximum: Some(hard),
            },
        );
    }
    let soft = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
    // Room for listeners, peer links, regions in flight and the process's own files.
    if (max_connections as u64).saturating_add(64) > soft {
        tracing::warn!(
            soft,
            max_connections,
            "the open-file limit is below the connection limit; connections past it fail in accept"
        );
    }
}
