//! `ClientError`: why a client call failed, and how the failures of the layers below become one.

use ferry_io::connection::ConnectionError;
use ferry_io::handshake::HelloError;
use ferry_proto::{ErrorCode, ErrorReply, MetaError, ProtoError, TensorInfo, TensorKey};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The connection failed or the node broke the protocol.
    #[error(transparent)]
    Connection(#[from] ConnectionError),
    /// The node refused or failed the request; `message` is the node's own.
    #[error("{code:?}: {message}")]
    Node {
        /// What kind of failure.
        code: ErrorCode,
        /// The node's message.
        message: String,
    },
    /// A tensor that cannot be sent as it is (its bytes disagree with its shape and dtype).
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// The node answered something that does not fit the request.
    #[error("unexpected answer from the node: {0}")]
    Unexpected(String),
    /// An earlier call on this connection ended in the middle of an exchange (a failure while
    /// reading an answer, or a cancelled future), so answers could be misattributed; connect
    /// again.
    #[error("the connection is out of step after an unfinished exchange; connect again")]
    OutOfStep,
    /// A Burn tensor could not be made from, or read into, the data (wrong rank or kind for the
    /// dtype, a device that cannot hold it).
    #[error("{0}")]
    Tensor(String),
    /// A move between nodes copied the tensor, but the source changed meanwhile (a newer
    /// version was written there), so the source was not deleted: both remain.
    #[error(
        "{key} was copied to the target as {}, but the source changed meanwhile, so it was \
         kept: both remain",
        stored.key
    )]
    SourceChanged {
        /// The source key.
        key: TensorKey,
        /// What the target registered.
        stored: Box<TensorInfo>,
    },
    /// The node's `stat` answer is of another protocol minor version, whose fields differ
    /// (PROTOCOL.md §8): the one answer that does not carry across minors.
    #[error(
        "the node speaks protocol minor {node}, this client minor {client}: its stat answer has \
         other fields ({cause}); use a client of the node's version"
    )]
    StatsOfAnotherMinor {
        /// The node's minor version.
        node: u16,
        /// This client's.
        client: u16,
        /// What failed to decode.
        cause: String,
    },
    /// The node speaks a protocol minor older than a request needs.
    #[error("the node speaks protocol minor {node}; {what} needs minor {needs} or later")]
    NodeTooOld {
        /// What was asked.
        what: &'static str,
        /// The node's minor version.
        node: u16,
        /// The minor the request needs.
        needs: u16,
    },
}

impl ClientError {
    /// The node's error code, when the node reported the failure.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Node { code, .. } => Some(*code),
            _ => None,
        }
    }
}

impl From<ErrorReply> for ClientError {
    fn from(reply: ErrorReply) -> Self {
        ClientError::Node {
            code: reply.code,
            message: reply.message,
        }
    }
}

impl From<HelloError> for ClientError {
    fn from(error: HelloError) -> Self {
        match error {
            HelloError::Connection(e) => ClientError::Connection(e),
            HelloError::Refused(reply) => reply.into(),
            HelloError::Unexpected(what) => ClientError::Unexpected(what),
        }
    }
}

impl From<ProtoError> for ClientError {
    fn from(e: ProtoError) -> Self {
        ClientError::Connection(ConnectionError::Proto(e))
    }
}

/// The error for an answer that does not fit the request: the node's own, where it sent one.
pub(super) fn unexpected(response: ferry_proto::Response) -> ClientError {
    match response {
        ferry_proto::Response::Error(reply) => reply.into(),
        other => ClientError::Unexpected(format!("{other:?}")),
    }
}
