//! ferry's integration tests, one binary: real nodes (in this process and as `ferry-server`
//! processes) driven through the client library and the `ferry` command line.
//!
//! One binary rather than one per file: each links Burn, and linking dominated a cold build.
//! Run one module with `cargo test -p ferry --test it MODULE::` (e.g. `hostile::`).

mod common;

mod binary;
mod cli;
mod concurrency;
mod hostile;
mod local;
mod netns;
mod node;
mod ops;
mod peers;
