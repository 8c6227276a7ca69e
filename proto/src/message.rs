//! The control messages: one enum of requests, one of responses, with their meaning.
//!
//! These are what a body of a control frame holds; `control` turns them into bytes. A request
//! that carries a tensor (`Put`) and a response that does (`Tensor`) are followed on the same
//! connection by chunk frames covering exactly `meta.byte_len` bytes, in order.

use serde::{Deserialize, Serialize};

use crate::content_hash::ContentHash;
use crate::dtype::WireDType;
use crate::growable::growable;
use crate::meta::WireMeta;
use crate::secret::{CapabilityToken, NodeId, Token};
use crate::transfer_path::TransferPath;

/// The minor that added [`Request::DeleteIf`], which a move between nodes ends with.
pub const DELETE_IF_MINOR: u16 = 3;

/// The minor that added [`Request::FetchRange`] and [`Response::TensorPart`], which a pull
/// spread over several connections asks and is answered with.
pub const FETCH_RANGE_MINOR: u16 = 8;

/// The longest tensor name accepted, in bytes.
pub const MAX_NAME_LEN: usize = 1024;

/// Where a tensor lives on a node: a device index and a name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorKey {
    /// Index of the device on its node.
    pub device: u32,
    /// The tensor's name, e.g. `encoder.layer1.weight`.
    pub name: String,
}

impl TensorKey {
    /// A key for `name` on `device`.
    pub fn new(device: u32, name: impl Into<String>) -> Self {
        Self {
            device,
            name: name.into(),
        }
    }

    /// The same name on `device`.
    pub fn on(&self, device: u32) -> Self {
        Self::new(device, self.name.clone())
    }
}

impl std::fmt::Display for TensorKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.device, self.name)
    }
}

/// Why a name is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// Empty.
    #[error("a tensor name cannot be empty")]
    Empty,
    /// Too long.
    #[error("tensor name of {len} bytes exceeds the maximum of {MAX_NAME_LEN}")]
    TooLong {
        /// Its length.
        len: usize,
    },
    /// Holds a control character.
    #[error("tensor name {name:?} holds a control character")]
    ControlCharacter {
        /// The name.
        name: String,
    },
}

/// Checks a tensor name from outside: 1 to [`MAX_NAME_LEN`] bytes, no control characters.
pub fn validate_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > MAX_NAME_LEN {
        return Err(NameError::TooLong { len: name.len() });
    }
    if name.chars().any(char::is_control) {
        return Err(NameError::ControlCharacter {
            name: name.to_string(),
        });
    }
    Ok(())
}

/// The first message on every connection, from the side that opened it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The protocol major version the peer speaks.
    pub major: u8,
    /// The protocol minor version the peer speaks.
    pub minor: u16,
    /// Optional features the peer speaks (see `PROTOCOL.md`).
    pub features: Vec<String>,
    /// The shared token, where the node requires one.
    pub token: Option<Token>,
    /// Free text naming the peer's software, for logs.
    pub agent: String,
}

/// The node's answer to a [`Hello`] it accepts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// The protocol major version the node speaks.
    pub major: u8,
    /// The protocol minor version the node speaks.
    pub minor: u16,
    /// The features both sides speak.
    pub features: Vec<String>,
    /// Free text naming the node's software, for logs.
    pub agent: String,
    /// The largest frame body the node accepts.
    pub max_body: u64,
    /// The payload bytes per chunk the node sends and prefers to receive.
    pub chunk_size: u64,
}

/// What a client asks of a node.
// Exhaustive on purpose: a node must answer every request it can decode (PROTOCOL.md §4.1 says
// how a request a peer's minor lacks is kept from it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Opens a connection; answered by [`Response::Welcome`] or an error, then a close.
    Hello(Hello),
    /// Uploads a tensor to `device` under `name` (one is chosen when absent). Answered by
    /// [`Response::Ready`], after which the payload follows as chunk frames, and then by
    /// [`Response::Stored`] once registered; or by an error, and then no chunks follow.
    Put {
        /// Target device index.
        device: u32,
        /// The name, or `None` for a node-chosen one.
        name: Option<String>,
        /// What follows.
        meta: WireMeta,
        /// Replace a tensor already registered under the key instead of refusing.
        overwrite: bool,
    },
    /// Downloads a tensor: answered by [`Response::Tensor`] and its chunk frames.
    Get {
        /// Which tensor.
        key: TensorKey,
    },
    /// Copies (or moves) a tensor between two devices of this node. Answered by
    /// [`Response::Stored`] only after the target registered it; a move deletes the source
    /// only then.
    Copy {
        /// The source.
        src: TensorKey,
        /// The target device.
        dst_device: u32,
        /// The target name; the source's name when absent.
        dst_name: Option<String>,
        /// Delete the source once the target holds the tensor.
        remove_source: bool,
        /// Replace a tensor already registered under the target key instead of refusing.
        overwrite: bool,
    },
    /// Deletes a tensor: answered by [`Response::Deleted`].
    Delete {
        /// Which tensor.
        key: TensorKey,
    },
    /// Lists tensors, on one device or all: answered by [`Response::Listing`].
    List {
        /// One device, or every device when absent.
        device: Option<u32>,
    },
    /// Node statistics: answered by [`Response::Stats`].
    Stat,
    /// The node's identity: answered by [`Response::Identity`].
    Identify,
    /// Asks a source node for a capability that lets the node `audience` pull the tensor under
    /// `key` once: answered by [`Response::Capability`].
    Grant {
        /// The tensor.
        key: TensorKey,
        /// The node id of the only node that may use it.
        audience: NodeId,
    },
    /// Asks a target node to pull a tensor from `source` with a capability the source issued,
    /// and register it on `dst_device`. The bytes go from node to node; answered by
    /// [`Response::Stored`] once the target registered the tensor.
    Pull {
        /// The source node's address, as the target can reach it.
        source: String,
        /// The capability from the source's [`Response::Capability`].
        capability: CapabilityToken,
        /// The tensor on the source.
        src: TensorKey,
        /// The target device.
        dst_device: u32,
        /// The target name; the source's name when absent.
        dst_name: Option<String>,
        /// Replace a tensor already registered under the target key instead of refusing.
        overwrite: bool,
        /// The source's content hash, so a target that already holds the same bytes skips the
        /// transfer.
        content_hash: Option<ContentHash>,
    },
    /// From one node to another: send the tensor a capability names, from `offset` on (a
    /// resumed transfer starts where the verified bytes end). Answered by [`Response::Tensor`]
    /// and chunk frames from `offset`.
    Fetch {
        /// The capability.
        capability: CapabilityToken,
        /// The node id of the node fetching.
        node_id: NodeId,
        /// The first payload byte wanted.
        offset: u64,
    },
    /// From one node to another, after a fetch's last byte arrived and verified: the capability
    /// is used up. Answered by [`Response::Released`]. Until then the source keeps it, so that a
    /// transfer cut after the source sent its last byte can still resume.
    Release {
        /// The capability.
        capability: CapabilityToken,
        /// The node id of the node that fetched.
        node_id: NodeId,
    },
    /// Lists tensors a page at a time, sorted by device and name: at most `limit` of them (the
    /// node may answer fewer), starting after the key `after`. Answered by [`Response::Page`].
    /// Added in minor 3: a listing of any size, where [`Request::List`] is bounded by a frame.
    ListPage {
        /// One device, or every device when absent.
        device: Option<u32>,
        /// The last key of the previous page; the first page when absent.
        after: Option<TensorKey>,
        /// The most tensors wanted in this page.
        limit: u32,
    },
    /// Deletes the tensor under `key` only if it is still the version whose content hash is
    /// `content_hash` (a move between nodes deletes the version it copied, never a newer one
    /// written meanwhile). Answered by [`Response::Deleted`], or an error with code
    /// [`ErrorCode::Changed`] (nothing deleted). Added in minor 3.
    DeleteIf {
        /// Which tensor.
        key: TensorKey,
        /// The content hash of the version to delete (see `PROTOCOL.md` §7.2).
        content_hash: ContentHash,
    },
    /// What a device measured at start that it stores bit-exact: answered by
    /// [`Response::Holds`]. Added in minor 5.
    Holds {
        /// Which device.
        device: u32,
    },
    /// From one node to another: send the part of the tensor a capability names that lies at
    /// `from..to` of its content hash's input (PROTOCOL.md §7.2: the meta's bytes, then the
    /// payload), so that a node asks for a stripe before it knows the meta. Answered by
    /// [`Response::TensorPart`] and chunk frames covering the payload range it names. Added in
    /// minor 8.
    FetchRange {
        /// The capability.
        capability: CapabilityToken,
        /// The node id of the node fetching.
        node_id: NodeId,
        /// The first byte of the hash input wanted.
        from: u64,
        /// One past the last byte of the hash input wanted.
        to: u64,
    },
}

impl Request {
    /// The request's name, for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Hello(_) => "hello",
            Request::Put { .. } => "put",
            Request::Get { .. } => "get",
            Request::Copy {
                remove_source: true,
                ..
            } => "move",
            Request::Copy { .. } => "copy",
            Request::Delete { .. } => "delete",
            Request::List { .. } => "list",
            Request::Stat => "stat",
            Request::Identify => "identify",
            Request::Grant { .. } => "grant",
            Request::Pull { .. } => "pull",
            Request::Fetch { .. } => "fetch",
            Request::Release { .. } => "release",
            Request::ListPage { .. } => "list",
            Request::DeleteIf { .. } => "delete",
            Request::Holds { .. } => "holds",
            Request::FetchRange { .. } => "fetch-range",
        }
    }

    /// The protocol minor that added it. A peer of an older minor does not know it:
    /// `control::encode_request_for` refuses to encode it for one, and a client asks such a node
    /// something else or says the node is too old.
    pub fn since_minor(&self) -> u16 {
        // Every variant by name, so that a variant added later cannot default to minor 0.
        match self {
            Request::Hello(_)
            | Request::Put { .. }
            | Request::Get { .. }
            | Request::Copy { .. }
            | Request::Delete { .. }
            | Request::List { .. }
            | Request::Stat
            | Request::Identify
            | Request::Grant { .. }
            | Request::Pull { .. }
            | Request::Fetch { .. }
            | Request::Release { .. } => 0,
            Request::ListPage { .. } => 3,
            Request::DeleteIf { .. } => DELETE_IF_MINOR,
            Request::Holds { .. } => 5,
            Request::FetchRange { .. } => FETCH_RANGE_MINOR,
        }
    }

    /// Whether it moves a tensor's bytes (counted as a transfer in flight).
    pub fn moves_a_tensor(&self) -> bool {
        matches!(
            self,
            Request::Put { .. }
                | Request::Get { .. }
                | Request::Copy { .. }
                | Request::Pull { .. }
                | Request::Fetch { .. }
                | Request::FetchRange { .. }
        )
    }
}

/// A node's answer.
// Exhaustive on purpose, as `Request` is: a client must handle every answer it can decode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Response {
    /// The connection is open.
    Welcome(Welcome),
    /// The target registered the tensor.
    Stored(TensorInfo),
    /// A tensor follows as chunk frames.
    Tensor {
        /// Where it is and what it is.
        info: TensorInfo,
        /// What follows.
        meta: WireMeta,
    },
    /// The tensor was deleted.
    Deleted(TensorInfo),
    /// The tensors asked for, sorted by device and name.
    Listing(Vec<TensorInfo>),
    /// Node statistics.
    Stats(NodeStats),
    /// The request failed; the connection stays usable unless `code` is fatal.
    Error(ErrorReply),
    /// A `Put` was admitted (name, meta, limits, budget checked; the buffer is allocated): the
    /// client may send its chunk frames now. A refused `Put` gets an `Error` instead, and the
    /// client sends no chunks.
    Ready,
    /// The node's identity.
    Identity {
        /// The node's id, stable for its lifetime.
        node_id: NodeId,
    },
    /// A single-use capability to pull one tensor.
    Capability {
        /// The secret to hand to the target.
        token: CapabilityToken,
        /// Milliseconds until it expires.
        expires_in_ms: u64,
        /// What it grants.
        info: TensorInfo,
        /// The tensor's content hash (see `PROTOCOL.md`: BLAKE3 over its dtype, shape and
        /// bytes, hex).
        content_hash: ContentHash,
    },
    /// The capability is used up.
    Released,
    /// One page of a listing ([`Request::ListPage`]). Added in minor 3.
    Page {
        /// The tensors, sorted by device and name.
        tensors: Vec<TensorInfo>,
        /// Where the next page starts (pass it as `after`); `None` once this page is the last.
        next: Option<TensorKey>,
    },
    /// What a device stores bit-exact ([`Request::Holds`]), as its probe measured: every dtype it
    /// probed on each class of shape, in probe order. Added in minor 5.
    Holds {
        /// Which device.
        device: u32,
        /// Each probed dtype and what came of it.
        dtypes: Vec<HeldDtype>,
    },
    /// Part of a tensor follows as chunk frames, covering payload bytes `start..end` exactly
    /// (never a region): the answer to [`Request::FetchRange`]. `end` reaches past the part asked
    /// for, to the payload's end, where the source sends the rest on this connection instead (a
    /// tensor it would have to copy out of its device for every part). Added in minor 8.
    TensorPart {
        /// Where it is and what it is.
        info: TensorInfo,
        /// The whole tensor's meta.
        meta: WireMeta,
        /// The first payload byte that follows.
        start: u64,
        /// One past the last payload byte that follows.
        end: u64,
    },
}

impl Response {
    /// The answer's name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Response::Welcome(_) => "welcome",
            Response::Stored(_) => "stored",
            Response::Tensor { .. } => "tensor",
            Response::Deleted(_) => "deleted",
            Response::Listing(_) => "listing",
            Response::Stats(_) => "stats",
            Response::Error(_) => "error",
            Response::Ready => "ready",
            Response::Identity { .. } => "identity",
            Response::Capability { .. } => "capability",
            Response::Released => "released",
            Response::Page { .. } => "page",
            Response::Holds { .. } => "holds",
            Response::TensorPart { .. } => "tensor-part",
        }
    }
}

/// One probe a device ran at start ([`Response::Holds`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldDtype {
    /// The dtype probed (a quantized one stands for its scheme with any block size).
    pub dtype: WireDType,
    /// The shape probed, standing for its class (PROTOCOL.md §5.5): rank 0, an empty dimension,
    /// whole 32-bit words, or any other.
    pub shape: Vec<u64>,
    /// Why the device does not store it bit-exact; `None` where it does.
    pub refused: Option<String>,
}

/// A registered tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorInfo {
    /// Where it is.
    pub key: TensorKey,
    /// Its dtype.
    pub dtype: WireDType,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Its payload length in bytes.
    pub bytes: u64,
    /// How it got there.
    pub path: TransferPath,
}

/// An error, as a node reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// What kind of failure.
    pub code: ErrorCode,
    /// A message for a person.
    pub message: String,
}

/// What kind of failure a node reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ErrorCode {
    /// The bytes did not follow the protocol; the node closes the connection.
    Protocol,
    /// A request that cannot be carried out as asked (bad name, bad meta, unknown device).
    BadRequest,
    /// No tensor under that key.
    NotFound,
    /// A tensor already exists under that key.
    AlreadyExists,
    /// The target device's backend cannot hold that dtype.
    UnsupportedDType,
    /// A limit (tensor size, memory budget, connections) would be exceeded.
    LimitExceeded,
    /// Wrong or missing token; the node closes the connection.
    AuthRefused,
    /// The backend failed (or panicked) on this tensor; the node lives on.
    Backend,
    /// The node is shutting down.
    ShuttingDown,
    /// A protocol major version the node does not speak; the node closes the connection.
    VersionMismatch,
    /// A capability that is unknown, used, expired, or bound to another node.
    CapabilityRefused,
    /// A node-to-node transfer failed on the way (the peer vanished, went silent, or sent
    /// corrupt bytes); nothing was registered.
    PeerFailed,
    /// The tensor under the key is no longer the version the operation was for (it was
    /// replaced or deleted meanwhile); nothing was changed. Added in minor 3.
    Changed,
    /// The bytes that arrived do not have the content hash they were granted under (altered on
    /// the way, or a false statement); nothing was registered. Added in minor 3.
    Integrity,
    /// Not possible right now for a reason that passes (a content hash still being verified);
    /// the same request may succeed if tried again. Added in minor 3.
    Busy,
}

impl ErrorCode {
    /// Whether the node closes the connection after reporting it.
    pub fn is_fatal(self) -> bool {
        matches!(
            self,
            ErrorCode::Protocol | ErrorCode::AuthRefused | ErrorCode::VersionMismatch
        )
    }

    /// Every code, in wire order: its index here is its index on the wire (a test decodes one
    /// past the last, which must fail, so that a code added later is added here too).
    pub const ALL: [ErrorCode; 15] = [
        ErrorCode::Protocol,
        ErrorCode::BadRequest,
        ErrorCode::NotFound,
        ErrorCode::AlreadyExists,
        ErrorCode::UnsupportedDType,
        ErrorCode::LimitExceeded,
        ErrorCode::AuthRefused,
        ErrorCode::Backend,
        ErrorCode::ShuttingDown,
        ErrorCode::VersionMismatch,
        ErrorCode::CapabilityRefused,
        ErrorCode::PeerFailed,
        ErrorCode::Changed,
        ErrorCode::Integrity,
        ErrorCode::Busy,
    ];

    /// The protocol minor that added it.
    pub fn since_minor(self) -> u16 {
        // Every code by name, so that a code added later cannot default to minor 0.
        match self {
            ErrorCode::Protocol
            | ErrorCode::BadRequest
            | ErrorCode::NotFound
            | ErrorCode::AlreadyExists
            | ErrorCode::UnsupportedDType
            | ErrorCode::LimitExceeded
            | ErrorCode::AuthRefused
            | ErrorCode::Backend
            | ErrorCode::ShuttingDown
            | ErrorCode::VersionMismatch
            | ErrorCode::CapabilityRefused
            | ErrorCode::PeerFailed => 0,
            ErrorCode::Changed | ErrorCode::Integrity | ErrorCode::Busy => 3,
        }
    }

    /// The code to send a peer of protocol minor `minor`: this one if the peer knows it, else
    /// the closest code it does know (the message still says what happened). Whether the
    /// connection closes never changes with the mapping.
    pub fn as_of(self, minor: u16) -> ErrorCode {
        if self.since_minor() <= minor {
            return self;
        }
        match self {
            // The version the operation was for is gone; nothing was changed.
            ErrorCode::Changed => ErrorCode::NotFound,
            // What older nodes answered for bytes corrupted on the way: the pull failed and
            // nothing was registered.
            ErrorCode::Integrity => ErrorCode::PeerFailed,
            // Not possible now for a reason that passes, as a full budget is: try again later.
            ErrorCode::Busy => ErrorCode::LimitExceeded,
            // Known to every minor (not reached): listed so that a code added later needs a
            // mapping here.
            ErrorCode::Protocol
            | ErrorCode::BadRequest
            | ErrorCode::NotFound
            | ErrorCode::AlreadyExists
            | ErrorCode::UnsupportedDType
            | ErrorCode::LimitExceeded
            | ErrorCode::AuthRefused
            | ErrorCode::Backend
            | ErrorCode::ShuttingDown
            | ErrorCode::VersionMismatch
            | ErrorCode::CapabilityRefused
            | ErrorCode::PeerFailed => self,
        }
    }
}

growable! {
    /// Node statistics. Its fields are grouped by the protocol minor they arrived in: a peer of
    /// an older minor sends and receives only the fields it knows (PROTOCOL.md §4).
    #[derive(Debug, Clone, PartialEq, Default)]
    pub struct NodeStats {
        since 0 {
            /// The node's software, for people.
            pub agent: String,
            /// Each hosted device.
            pub devices: Vec<DeviceStats>,
            /// Transfers (put, get, copy, move) that completed.
            pub transfers_done: u64,
            /// Transfers that failed.
            pub transfers_failed: u64,
            /// In-node copies and moves that took the native path.
            pub native_transfers: u64,
            /// In-node copies and moves that took the host round trip.
            pub round_trip_transfers: u64,
            /// Connections open now.
            pub connections: u64,
            /// The path policy: `auto` or `round-trip`.
            pub transfer_policy: String,
            /// The node's id (what a capability is bound to).
            pub node_id: String,
            /// Tensors pulled from other nodes.
            pub pulls: u64,
            /// Reconnections of pulls after a transient drop.
            pub pull_retries: u64,
            /// Pulls skipped because this node already held the same bytes.
            pub dedup_hits: u64,
            /// Tensors sent to other nodes.
            pub fetches_served: u64,
        }
        since 1 {
            /// The Unix socket the node also listens on, if any.
            pub unix_socket: Option<String>,
            /// Whether payloads go through shared memory on Unix-socket connections that agree
            /// to it.
            pub shared_memory: bool,
            /// Payloads sent as a shared-memory region (gets and fetches).
            pub shm_payloads_sent: u64,
            /// Payloads received as a shared-memory region (puts and pulls).
            pub shm_payloads_received: u64,
            /// Payload bytes moved through shared memory, both ways.
            pub shm_bytes: u64,
            /// Shared-memory regions this node created that are not yet handed over or dropped.
            pub regions_in_flight: u64,
            /// The node process's resident memory now, in bytes (0 where the platform does not
            /// say).
            pub resident_bytes: u64,
            /// The node process's highest resident memory so far, in bytes (0 where unknown).
            pub peak_resident_bytes: u64,
        }
        since 2 {
            /// Registered tensors whose content hash, stated by the node they came from, this
            /// node has not yet recomputed (they answer no dedup until it has).
            pub hashes_pending: u64,
            /// Stated content hashes that the bytes turned out not to have (the tensor then
            /// answers to the computed one).
            pub hash_mismatches: u64,
            /// Freed receive buffers the node keeps for reuse, in bytes (resident, held by no
            /// tensor).
            pub recycled_bytes: u64,
            /// Shared-memory regions the node keeps (a descriptor each) to pass tensors on
            /// without a copy.
            pub regions_kept: u64,
        }
        since 4 {
            /// The node's receive pool (`--pool`), in bytes: reserved and resident from start; 0
            /// without one.
            pub pool_bytes: u64,
            /// Of the pool, bytes no tensor or receive holds now.
            pub pool_free_bytes: u64,
            /// Receives the pool could not hold (too large, or too full), which went to fresh
            /// memory.
            pub pool_misses: u64,
        }
        since 7 {
            /// Milliseconds since the node started (0 from a node older than minor 7).
            pub uptime_ms: u64,
        }
    }
}

growable! {
    /// One hosted device, in a [`NodeStats`]; its fields grow as that struct's do.
    #[derive(Debug, Clone, PartialEq, Eq, Default)]
    pub struct DeviceStats {
        since 0 {
            /// Its index on the node.
            pub index: u32,
            /// Its backend, e.g. `flex`.
            pub backend: String,
            /// Its Burn device, readable.
            pub device: String,
            /// Tensors registered.
            pub tensors: u64,
            /// Bytes registered.
            pub bytes_held: u64,
            /// The memory budget, if any.
            pub memory_limit: Option<u64>,
        }
        since 5 {
            /// How many probes it ran at start (a plain dtype or quantization scheme family on
            /// one class of shape each).
            pub holds_measured: u32,
            /// How many of them it gave back bit-exact (see [`Request::Holds`]).
            pub holds_exact: u32,
        }
        since 6 {
            /// The most bytes one tensor may take on it (values and scales together): a GPU
            /// adapter's largest buffer. `None` where only the node's per-tensor limit and the
            /// budget bound a tensor (host memory).
            pub largest_tensor: Option<u64>,
        }
    }
}
