//! ferry's memory: host memory for received tensors, files mapped whole, the receive pool,
//! shared-memory regions, split buffers, the allocator's policy and the machine's spare memory.
//!
//! Every `unsafe` block of ferry about memory lives in this crate (`allocator`, `host`,
//! `mapped_file`, `pool`, `region`, `split_buffer`), each minimal and with its SAFETY reason;
//! `ferry-io` builds its transports and connection on it.
// Allowed `unsafe` (the workspace denies it); every block says why it is sound.
#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod allocator;
pub mod host;
pub mod mapped_file;
pub mod pool;
#[cfg(target_os = "linux")]
pub mod region;
pub mod spare_memory;
pub mod split_buffer;

pub use pool::{Pool, PoolError, ReadyBound};
