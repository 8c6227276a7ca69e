//! ferry: move any Burn tensor between devices, processes and machines, bit-exact.
//!
//! This root crate re-exports the parts ([`proto`], [`server`], [`client`]) and holds
//! [`samples`], the dtype and quantization matrix the integration tests and benchmarks share.

pub use ferry_client as client;
pub use ferry_io as io;
pub use ferry_proto as proto;
pub use ferry_server as server;

pub mod samples;
