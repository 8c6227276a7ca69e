//! The node and client libraries' integration tests, one binary: real nodes in this process on
//! loopback, driven through the client library (every dtype, hostile input, node to node, and
//! randomized histories of racing clients).
//!
//! One binary rather than one per file: each links Burn, and linking dominated a cold build.
//! Run one module with `cargo test -p ferry-suite --test it MODULE::` (e.g. `hostile::`). Tests of
//! the `ferry-server` and `ferry` binaries live with the packages that own them (`server/cli`,
//! `client/cli`).
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

mod blocking;
mod cancel;
mod cluster;
mod concurrency;
mod eager_put;
mod etcd;
mod fair;
mod gpu;
mod holds;
mod hostile;
mod models;
mod node;
mod peers;
mod pool;
mod relay;
mod remote_host;
mod server;
mod shareable;
mod squatter;
mod stripes;
mod tls;
mod wait;
