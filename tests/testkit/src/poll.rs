//! Polling helpers: wait until a condition holds, or fail the test.

use std::time::{Duration, Instant};

/// How often the polling helpers look again.
const POLL: Duration = Duration::from_millis(5);

/// Polls `check` until it holds; fails the test, naming `what`, if it does not within `within`.
/// For what becomes true when a node gets round to it (a dropped connection giving its
/// reservation back, a region arriving), so that no test sleeps a fixed time and hopes.
pub async fn eventually(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] for a check that must ask a node (an async call).
pub async fn eventually_async<F: Future<Output = bool>>(
    what: &str,
    within: Duration,
    mut check: impl FnMut() -> F,
) {
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] outside a runtime (a child process's exit, a file appearing).
pub fn eventually_blocking(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        std::thread::sleep(POLL);
    }
}
