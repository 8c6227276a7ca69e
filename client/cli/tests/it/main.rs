//! The `ferry` command line's integration tests, one binary: the commands against real nodes,
//! the README's quickstart, a loopback port another user holds (no token goes there), and
//! (ignored by default) a model pulled across network namespaces.
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

mod cli;
mod health;
mod local_users;
mod model_files;
mod netns;
mod quickstart;
mod squatter;

/// The binary under test, built by cargo for this package's tests.
fn ferry_cli() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_ferry"))
}
