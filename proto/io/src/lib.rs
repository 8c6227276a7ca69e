//! ferry's I/O, shared by the node and the client: transports (TCP, Unix sockets with descriptor
//! passing), the [`Connection`] that moves frames and payloads over them, shared-memory regions,
//! host memory for received tensors, and the handshake both sides run.
//!
//! Every `unsafe` block of ferry lives in this crate (`allocator`, `assembler`, `host`, `pool`,
//! `region`, `split_buffer`, `trailing`, `transport`), each minimal and with its SAFETY reason;
//! `ferry-proto` is the sans-IO wire underneath and forbids `unsafe`.
// The one crate allowed `unsafe` (the workspace denies it); every block says why it is sound.
#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod allocator;
pub mod assembler;
pub mod connection;
pub mod credential;
pub mod exchange;
pub mod grant;
pub mod handshake;
pub mod host;
pub mod local_peer;
pub mod machine;
pub mod pool;
pub mod refusal_log;
#[cfg(target_os = "linux")]
pub mod region;
pub mod signed_record;
pub mod spare_memory;
pub mod split_buffer;
pub mod striped;
pub mod tls;
mod trailing;
pub mod transport;

pub use assembler::{HashUse, TRAILING_HASH_MIN, TensorAssembler};
pub use connection::{
    ChunkSink, Connection, ConnectionError, ConnectionLimits, PayloadRoute, RegionUse,
};
pub use exchange::{
    ClearTokens, Dial, Exchange, ExchangeError, LocalServer, PeerCheck, SharedMemory, Step,
    TokenWithheld,
};
pub use pool::{Pool, PoolError, ReadyBound};
pub use signed_record::{RecordCheck, RecordError, RecordSigner};
pub use tls::{ClientTls, Identity, NodeTls, TlsError, TlsFiles};
pub use transport::{Endpoint, Stream, Transport};
