//! ferry: move any Burn tensor between devices, processes and machines, bit-exact.
//!
//! This root crate re-exports the libraries ([`proto`], [`io`], [`memory`], [`server`],
//! [`client`], [`files`], [`certs`], [`etcd`]) and
//! holds what the integration tests and benchmarks of every package share: [`samples`], the
//! dtype and quantization matrix, [`testing`], nodes and helpers to test against, and
//! [`squatter`], a loopback port another local user holds.

pub use ferry_certs as certs;
pub use ferry_client as client;
pub use ferry_etcd as etcd;
pub use ferry_files as files;
pub use ferry_io as io;
pub use ferry_memory as memory;
pub use ferry_proto as proto;
pub use ferry_server as server;

pub mod samples;
pub mod squatter;
pub mod testing;

/// The README's and the docs' Rust examples, compiled and run as doc tests
/// (`cargo test -p ferry --doc`), so that they cannot rot.
#[cfg(doctest)]
mod docs_examples {
    #[doc = include_str!("../README.md")]
    mod readme {}
    #[doc = include_str!("../docs/library.md")]
    mod library {}
    #[doc = include_str!("../docs/deployment.md")]
    mod deployment {}
    #[doc = include_str!("../docs/node.md")]
    mod node {}
    #[doc = include_str!("../docs/cli.md")]
    mod cli {}
    #[doc = include_str!("../docs/security.md")]
    mod security {}
    #[doc = include_str!("../docs/same-host.md")]
    mod same_host {}
    #[doc = include_str!("../docs/gpu.md")]
    mod gpu {}
    #[doc = include_str!("../docs/cluster.md")]
    mod cluster {}
    #[doc = include_str!("../docs/benchmarks.md")]
    mod benchmarks {}
}
