//! ferry's I/O, shared by the node and the client: transports (TCP, Unix sockets with descriptor
//! passing), the [`Connection`] that moves frames and payloads over them (into shared-memory
//! regions and host memory from `ferry-memory`), and the connecting side's half of the handshake
//! (a client and a node pulling from a peer both run it; the accepting side's half, with the
//! credentials a node accepts, is the node's own, in `ferry-server`).
//!
//! The `unsafe` blocks of ferry's I/O live in this crate (`assembler`, `trailing`, `transport`),
//! each minimal and with its SAFETY reason; those about memory (host memory, the receive pool,
//! shared-memory regions, split buffers, the allocator) live in `ferry-memory`. `ferry-proto` is
//! the sans-IO wire underneath and forbids `unsafe`.
// Allowed `unsafe` (the workspace denies it); every block says why it is sound.
#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod assembler;
pub mod connection;
pub mod credential;
pub mod exchange;
pub mod handshake;
pub mod hash_plan;
pub mod local_peer;
pub mod machine;
pub mod signed_record;
pub mod striped;
pub mod tls;
mod trailing;
pub mod transport;

pub use assembler::{Assembled, BufferFrom, TRAILING_HASH_MIN, TensorAssembler};
pub use connection::{
    ChunkSink, Connection, ConnectionError, ConnectionLimits, PayloadRoute, RegionUse,
};
pub use exchange::{
    ClearTokens, Dial, Exchange, ExchangeError, LocalServer, PeerCheck, SharedMemory, Step,
    TokenWithheld,
};
pub use hash_plan::{HashUse, Purpose};
pub use signed_record::{RecordCheck, RecordError, RecordSigner};
pub use tls::{ClientTls, Identity, NodeTls, TlsError, TlsFiles};
pub use transport::{Endpoint, Stream, Transport};
