//! The node's typed errors, each mapped to the wire's error code.

use crate::node::models::ModelError;
use ferry_proto::message::NameError;
use ferry_proto::{ErrorCode, ErrorReply, MetaError, ProtoError, TensorKey};
use thiserror::Error;

/// Why a node operation failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum NodeError {
    /// No device at that index.
    #[error("no device {index}: this node hosts {count} device(s)")]
    NoSuchDevice {
        /// The index asked for.
        index: u32,
        /// How many the node hosts.
        count: usize,
    },
    /// No tensor under that key.
    #[error("no tensor {0}")]
    NotFound(TensorKey),
    /// A backend primitive handed in or asked for on a device of another backend.
    #[error("device {device} is a {backend} device, not one of the backend asked for")]
    OtherBackend {
        /// The device's index.
        device: u32,
        /// Its backend.
        backend: &'static str,
    },
    /// A tensor already exists under that key.
    #[error("tensor {0} already exists (pass overwrite to replace it)")]
    AlreadyExists(TensorKey),
    /// The target device's backend cannot hold the dtype.
    #[error("device {device} cannot hold {dtype}: {reason}")]
    UnsupportedDType {
        /// The device, readable.
        device: String,
        /// The dtype, readable.
        dtype: String,
        /// Why.
        reason: String,
    },
    /// A tensor over the node's per-tensor limit.
    #[error("tensor of {bytes} bytes exceeds this node's limit of {limit} bytes per tensor")]
    TensorTooLarge {
        /// Its size.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
    /// Larger than one buffer of the device (a GPU adapter's limit, `max_buffer_size` and the
    /// storage binding size): the device could never hold it.
    #[error(
        "device {device} takes at most {limit} bytes in one buffer (its adapter's limit); the \
         tensor needs {bytes}"
    )]
    TooLargeForDevice {
        /// The device, readable.
        device: String,
        /// The tensor's bytes, values and scales together.
        bytes: u64,
        /// The device's largest buffer.
        limit: u64,
    },
    /// The device's memory budget would be exceeded.
    #[error(
        "device {device} has {available} of its {limit} byte budget free; the tensor needs {bytes}"
    )]
    OverBudget {
        /// The device index.
        device: u32,
        /// Bytes needed.
        bytes: u64,
        /// Bytes free.
        available: u64,
        /// The budget.
        limit: u64,
    },
    /// Host copies being sent from the device hold their whole share of its budget: a reader
    /// may try again once some are sent.
    #[error(
        "copies being sent from device {device} hold {sending} bytes of the {limit} they may \
         hold; a copy of {bytes} more must wait: try again"
    )]
    SendingShareFull {
        /// The device index.
        device: u32,
        /// Bytes of the copy asked for.
        bytes: u64,
        /// Bytes of copies being sent now.
        sending: u64,
        /// The share copies being sent may hold.
        limit: u64,
    },
    /// The device holds as many tensors as it may.
    #[error("device {device} holds {limit} tensors, the most it may (--max-tensors)")]
    TooManyTensors {
        /// The device index.
        device: u32,
        /// The cap.
        limit: u64,
    },
    /// A client holds as many outstanding capabilities as one may.
    #[error(
        "this client holds {limit} outstanding capabilities, the most one may (--max-grants); \
         use or release some first"
    )]
    TooManyGrants {
        /// The cap.
        limit: usize,
    },
    /// A listing asked for whole that would not fit one answer.
    #[error(
        "{tensors} tensors are too many for one listing (at most {limit}); list them a page at \
         a time (ListPage, protocol minor 3)"
    )]
    ListingTooLarge {
        /// The tensors there are.
        tensors: u64,
        /// The most one listing holds.
        limit: usize,
    },
    /// The node's capability table is full.
    #[error("{limit} capabilities are outstanding on this node; try again once some are used")]
    CapabilitiesFull {
        /// The table's size.
        limit: usize,
    },
    /// The tensor's content hash is still being verified: it cannot be granted or deduped on
    /// yet. Passes on its own.
    #[error("the content hash of {0} is still being verified; try again")]
    StillVerifying(TensorKey),
    /// Bytes that arrived do not hash to the content hash they were granted under: altered on
    /// the way, or a false statement. Nothing was registered.
    #[error(
        "the bytes pulled from {source_addr} do not have the granted content hash {expected} \
         (they hash to {computed}); nothing was registered"
    )]
    Integrity {
        /// The source node.
        source_addr: String,
        /// The hash granted.
        expected: ferry_proto::ContentHash,
        /// The hash of what arrived.
        computed: ferry_proto::ContentHash,
    },
    /// A node configured without devices.
    #[error("a node needs at least one device")]
    NoDevices,
    /// More devices configured than a device index can name.
    #[error("{count} devices are more than a node can index")]
    TooManyDevices {
        /// How many were configured.
        count: usize,
    },
    /// A node id outside its allowed length.
    #[error("a node id is 1 to {max} bytes; this one is {len}")]
    InvalidNodeId {
        /// Its length in bytes.
        len: usize,
        /// The longest allowed.
        max: usize,
    },
    /// A node id configured that is not the identity of the node's TLS certificate.
    #[error(
        "the node id {given:?} is not the identity of this node's certificate ({certified:?}); \
         under TLS a node is who its certificate says"
    )]
    NodeIdNotCertified {
        /// The id configured.
        given: String,
        /// The certificate's identity.
        certified: String,
    },
    /// A peer listed with an identity that no certificate will show: the node has no TLS, or
    /// the peer is a Unix socket.
    #[error(
        "the peer {0} is listed with a name, which only a TLS certificate can show: give the node \
         --tls-cert/--tls-key/--tls-ca and the peer a TCP address, or list it without a name"
    )]
    UncheckablePeerName(String),
    /// The receive pool the configuration asks for cannot be planned.
    #[error("receive buffers: {0}")]
    ReceivePlan(#[from] crate::node::ReceivePlanError),
    /// The receive pool could not be reserved (address space, or memory to touch).
    #[error("reserving the receive pool: {0}")]
    ReceivePool(std::io::Error),
    /// A transfer whose source and target are one key.
    #[error("source and target are the same tensor {0}")]
    SameTensor(TensorKey),
    /// A pull whose source address is empty, too long or holds control characters (shown
    /// escaped).
    #[error("not a source address: \"{0}\" (empty, over 1024 bytes, or with control characters)")]
    InvalidSource(String),
    /// A pull from a source outside the node's configured peers (or its cluster's members), or
    /// one whose certificate names another node than the one listed or registered there.
    #[error(
        "{0} is not an allowed peer of this node (its --peer list, or a member of its cluster \
         showing the identity it registered); nothing was sent there"
    )]
    NotAllowedPeer(String),
    /// A pull that does not name the content hash its capability was granted under.
    #[error(
        "a pull names the content hash its capability was granted under (Pull.content_hash): \
         the bytes are checked against it end to end"
    )]
    PullWithoutHash,
    /// A model operation refused (its message says what the model holds).
    #[error(transparent)]
    Model(#[from] crate::node::models::ModelError),
    /// A model version whose tensors are not those its collect sent.
    #[error(
        "version {version} of model {model} was not committed: it holds {held} tensors, and {sent} were sent{}; nothing of it was kept",
        if held == sent { " under other paths" } else { "" }
    )]
    ModelIncomplete {
        /// The model.
        model: crate::node::models::ModelId,
        /// The version.
        version: u64,
        /// How many tensors it held.
        held: u64,
        /// How many the collect sent.
        sent: u64,
    },
    /// A connection at its bound of model versions it writes or holds.
    #[error("this connection has {max} {what}: commit, abort or close one first")]
    TooManyOpen {
        /// What.
        what: &'static str,
        /// The bound.
        max: usize,
    },
    /// A close of a version this connection does not hold.
    #[error("this connection holds no version {version} of model {model}")]
    NotOpen {
        /// The model.
        model: crate::node::models::ModelId,
        /// The version.
        version: u64,
    },
    /// A wait longer than one request may ask for.
    #[error(
        "a wait of {asked_ms} ms is longer than one request may ask ({max_ms} ms): ask again after it"
    )]
    WaitTooLong {
        /// The wait asked for.
        asked_ms: u32,
        /// The longest.
        max_ms: u32,
    },
    /// A fetch resumed from beyond the end of the tensor.
    #[error("offset {offset} is beyond the tensor's {bytes} bytes")]
    OffsetOutOfRange {
        /// The offset asked for.
        offset: u64,
        /// The tensor's size.
        bytes: u64,
    },
    /// Bytes that arrived do not form the tensor they were described as.
    #[error("the received bytes do not form the tensor described: {0}")]
    Received(#[source] ProtoError),
    /// A bad tensor name.
    #[error(transparent)]
    Name(#[from] NameError),
    /// A bad tensor description.
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// The backend failed or panicked.
    #[error("{0}")]
    Backend(String),
    /// The device worker is gone (the node is shutting down).
    #[error("device {0} is shut down")]
    DeviceGone(u32),
    /// The node is shutting down.
    #[error("the node is shutting down")]
    ShuttingDown,
    /// The tensor under the key is not the version the operation was for: it was replaced or
    /// deleted meanwhile.
    #[error(
        "tensor {0} changed meanwhile (another version is registered now); nothing was changed"
    )]
    Changed(TensorKey),
    /// A move registered its copy, but the version it copied was replaced or removed meanwhile
    /// by another operation, so the move removed nothing: it did what a copy does.
    #[error(
        "{copy} holds a copy of {moved}, but {moved} was replaced or removed meanwhile by \
         another operation, so this move removed nothing"
    )]
    SourceKept {
        /// The key moved from.
        moved: TensorKey,
        /// Where the copy is registered.
        copy: TensorKey,
    },
    /// A capability that is unknown, used, expired or bound to another node.
    #[error("capability refused: {0}")]
    CapabilityRefused(Refusal),
    /// A node-to-node transfer failed on the way; nothing was registered.
    #[error("pull from {source_addr} failed: {message}")]
    Peer {
        /// The source node.
        source_addr: String,
        /// What went wrong.
        message: String,
    },
}

/// A backend call that failed or panicked (ferry-backend's `Primitive` calls) is the node's
/// [`NodeError::Backend`], with the same message.
impl From<ferry_backend::BackendError> for NodeError {
    fn from(e: ferry_backend::BackendError) -> Self {
        NodeError::Backend(e.0)
    }
}

impl NodeError {
    /// The wire code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            NodeError::NoSuchDevice { .. }
            | NodeError::NoDevices
            | NodeError::TooManyDevices { .. }
            | NodeError::InvalidNodeId { .. }
            | NodeError::NodeIdNotCertified { .. }
            | NodeError::UncheckablePeerName(_)
            | NodeError::ReceivePlan(_)
            | NodeError::ReceivePool(_)
            | NodeError::SameTensor(_)
            | NodeError::PullWithoutHash
            | NodeError::InvalidSource(_)
            | NodeError::NotAllowedPeer(_)
            | NodeError::OffsetOutOfRange { .. }
            | NodeError::WaitTooLong { .. }
            | NodeError::ModelIncomplete { .. }
            | NodeError::NotOpen { .. }
            | NodeError::Model(
                ModelError::Sealed { .. }
                | ModelError::NotWriting { .. }
                | ModelError::BadPrefix { .. },
            )
            | NodeError::Name(_) => ErrorCode::BadRequest,
            NodeError::Model(ModelError::NoModel { .. }) => ErrorCode::NotFound,
            NodeError::Model(ModelError::Exists { .. }) => ErrorCode::AlreadyExists,
            NodeError::Model(ModelError::Superseded { .. } | ModelError::NotCurrent { .. }) => {
                ErrorCode::Changed
            }
            NodeError::Meta(MetaError::TooLarge { .. } | MetaError::AllocationFailed { .. })
            | NodeError::Received(ProtoError::Meta(
                MetaError::TooLarge { .. } | MetaError::AllocationFailed { .. },
            )) => ErrorCode::LimitExceeded,
            NodeError::Meta(_) | NodeError::Received(_) => ErrorCode::BadRequest,
            NodeError::NotFound(_) => ErrorCode::NotFound,
            NodeError::OtherBackend { .. } => ErrorCode::BadRequest,
            NodeError::AlreadyExists(_) => ErrorCode::AlreadyExists,
            NodeError::UnsupportedDType { .. } => ErrorCode::UnsupportedDType,
            NodeError::TensorTooLarge { .. }
            | NodeError::TooLargeForDevice { .. }
            | NodeError::OverBudget { .. }
            | NodeError::TooManyTensors { .. }
            | NodeError::TooManyGrants { .. }
            | NodeError::CapabilitiesFull { .. }
            | NodeError::TooManyOpen { .. }
            | NodeError::ListingTooLarge { .. } => ErrorCode::LimitExceeded,
            NodeError::StillVerifying(_) | NodeError::SendingShareFull { .. } => ErrorCode::Busy,
            NodeError::Backend(_) => ErrorCode::Backend,
            NodeError::DeviceGone(_) | NodeError::ShuttingDown => ErrorCode::ShuttingDown,
            NodeError::CapabilityRefused(_) => ErrorCode::CapabilityRefused,
            NodeError::Peer { .. } => ErrorCode::PeerFailed,
            NodeError::Changed(_) | NodeError::SourceKept { .. } => ErrorCode::Changed,
            NodeError::Integrity { .. } => ErrorCode::Integrity,
        }
    }

    /// The reply a client gets.
    pub fn reply(&self) -> ErrorReply {
        ErrorReply {
            code: self.code(),
            message: self.to_string(),
        }
    }
}

/// Why a capability was refused.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Refusal {
    /// Never issued here, already used up, or released.
    #[error("unknown or already used capability")]
    Unknown,
    /// Past its time to live.
    #[error("expired capability")]
    Expired,
    /// Bound to another node than the one presenting it.
    #[error("capability issued to another node")]
    OtherNode,
    /// Presented over TLS by a peer whose certificate names another node than it claims.
    #[error("the fetching node claims to be {claimed} but its certificate names {certified}")]
    NotCertified {
        /// What it claimed (escaped).
        claimed: String,
        /// Who its certificate says it is.
        certified: String,
    },
    /// Presented over TLS with a client's certificate (no server usage), which never speaks
    /// for a node.
    #[error("{certified}'s certificate is a client's, not a node's: it fetches for no node")]
    NotANode {
        /// Who its certificate says it is.
        certified: String,
    },
    /// Fetched as often as one capability may be.
    #[error("capability fetched too often; ask for a new one")]
    FetchedTooOften,
    /// A release by someone who may not release it.
    #[error(
        "unknown capability, or not this client's to release (only the node that fetched it, \
         or before any fetch the client it was granted to)"
    )]
    NotYours,
    /// The version it grants was replaced or deleted.
    #[error("{0} changed or went since the capability was granted")]
    VersionGone(TensorKey),
    /// The source node refused the capability this node presented.
    #[error("by {source_addr}: {message}")]
    BySource {
        /// The source node.
        source_addr: String,
        /// What it answered.
        message: String,
    },
}
