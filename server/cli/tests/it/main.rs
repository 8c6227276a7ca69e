//! The `ferry-server` binary's integration tests, one binary: its command line, and what only a
//! real node process shows (signals, logs, the metrics endpoint, the load generator against it,
//! shared memory between processes, the process-wide buffer pool).
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

mod cluster;
mod help;
mod local;
mod metrics;
mod ops;
mod recycling;
mod signals;
mod trust;

/// The binary under test, built by cargo for this package's tests.
fn ferry_server() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_ferry-server"))
}
