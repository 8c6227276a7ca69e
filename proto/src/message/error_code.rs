//! A request that failed: the [`ErrorReply`] a node sends, its [`ErrorCode`]s, the minor each
//! code arrived in, and the code an older peer gets instead.

use serde::{Deserialize, Serialize};

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
