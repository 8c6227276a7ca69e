//! ferry's wire: dtype codes, tensor metas and their byte-length rule, frames and control
//! messages. No sockets, no runtime, no threads and no `unsafe`: everything here works on bytes
//! in memory (the I/O that moves them is `ferry-io`).
//!
//! `PROTOCOL.md` at the repository root describes the same format for a peer in another
//! language; the golden vectors in `proto/tests/golden` pin it.

#![forbid(unsafe_code)]

pub mod choices;
pub mod cluster;
pub mod contain;
pub mod content_hash;
pub mod control;
pub mod dtype;
pub mod error;
pub mod frame;
mod growable;
pub mod message;
pub mod meta;
pub mod scales;
pub mod secret;
pub mod stripes;
pub mod tensor;
pub mod transfer_path;
pub mod untrusted;

pub use burn_std::{BoolStore, DType, TensorData};
pub use choices::{IfExists, Transfer};
pub use contain::{Panicked, contained};
pub use content_hash::{ContentHash, ContentHashError};
pub use dtype::{WireDType, WireQuantScheme, dtype_name};
pub use error::{DTypeError, FrameError, MetaError, ProtoError, StreamError};
pub use frame::{
    Chunk, Frame, FrameHeader, FrameKind, PROTOCOL_MINOR, PROTOCOL_VERSION, RegionDescriptor,
};
pub use message::{
    DeviceStats, ErrorCode, ErrorReply, HeldDtype, Hello, NodeStats, Request, Response, TensorInfo,
    TensorKey, WaitFor, Welcome,
};
pub use meta::{TensorMeta, WireMeta};
pub use secret::{CapabilityToken, NodeId, Token};
pub use transfer_path::{TransferPath, UnknownPath};
pub use untrusted::Untrusted;

/// Features this build speaks, announced in [`Hello`] and [`Welcome`].
pub const FEATURES: &[&str] = &["chunked-crc32c"];

/// The feature that lets payloads travel as shared-memory regions ([`FrameKind::Region`]); only
/// offered and accepted on a Unix socket, where file descriptors can be passed.
pub const FEATURE_SHM: &str = "shm-memfd";
