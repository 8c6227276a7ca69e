//! The node's typed errors, each mapped to the wire's error code.

use ferry_proto::message::NameError;
use ferry_proto::{ErrorCode, ErrorReply, MetaError, TensorKey};
use thiserror::Error;

/// Why a node operation failed.
#[derive(Debug, Error)]
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
    /// Not possible right now, for a reason that passes (a hash still being verified).
    #[error("{0}")]
    Busy(String),
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
        expected: String,
        /// The hash of what arrived.
        computed: String,
    },
    /// A request that makes no sense as asked.
    #[error("{0}")]
    BadRequest(String),
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
    /// A capability that is unknown, used, expired or bound to another node.
    #[error("capability refused: {0}")]
    CapabilityRefused(String),
    /// A node-to-node transfer failed on the way; nothing was registered.
    #[error("pull from {source_addr} failed: {message}")]
    Peer {
        /// The source node.
        source_addr: String,
        /// What went wrong.
        message: String,
    },
}

impl NodeError {
    /// The wire code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            NodeError::NoSuchDevice { .. } | NodeError::BadRequest(_) | NodeError::Name(_) => {
                ErrorCode::BadRequest
            }
            NodeError::Meta(MetaError::TooLarge { .. } | MetaError::AllocationFailed { .. }) => {
                ErrorCode::LimitExceeded
            }
            NodeError::Meta(_) => ErrorCode::BadRequest,
            NodeError::NotFound(_) => ErrorCode::NotFound,
            NodeError::AlreadyExists(_) => ErrorCode::AlreadyExists,
            NodeError::UnsupportedDType { .. } => ErrorCode::UnsupportedDType,
            NodeError::TensorTooLarge { .. }
            | NodeError::OverBudget { .. }
            | NodeError::TooManyTensors { .. }
            | NodeError::TooManyGrants { .. }
            | NodeError::CapabilitiesFull { .. }
            | NodeError::ListingTooLarge { .. } => ErrorCode::LimitExceeded,
            NodeError::Busy(_) => ErrorCode::Busy,
            NodeError::Backend(_) => ErrorCode::Backend,
            NodeError::DeviceGone(_) | NodeError::ShuttingDown => ErrorCode::ShuttingDown,
            NodeError::CapabilityRefused(_) => ErrorCode::CapabilityRefused,
            NodeError::Peer { .. } => ErrorCode::PeerFailed,
            NodeError::Changed(_) => ErrorCode::Changed,
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
