//! ferry: move any Burn tensor between devices, processes and machines, bit-exact.
//!
//! This root crate re-exports the libraries ([`proto`], [`io`], [`server`], [`client`]) and
//! holds what the integration tests and benchmarks of every package share: [`samples`], the
//! dtype and quantization matrix, and [`testing`], nodes and helpers to test against.

pub use ferry_certs as certs;
pub use ferry_client as client;
pub use ferry_io as io;
pub use ferry_proto as proto;
pub use ferry_server as server;

pub mod samples;
pub mod testing;
