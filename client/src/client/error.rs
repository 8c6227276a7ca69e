//! `ClientError`: why a client call failed, and how the failures of the layers below become one.

use ferry_io::connection::ConnectionError;
use ferry_io::{ExchangeError, TokenWithheld};
use ferry_proto::{
    ContentHash, ErrorCode, ErrorReply, MetaError, NodeId, ProtoError, TensorInfo, TensorKey,
};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The connection failed or the node broke the protocol.
    #[error(transparent)]
    Connection(#[from] ConnectionError),
    /// The node could not be reached (refused, unreachable, timed out, or the connection lost
    /// before its hello was answered).
    #[error("cannot reach {node}: {source}")]
    Unreachable {
        /// The address, as it was asked for.
        node: String,
        /// Why.
        source: ConnectionError,
    },
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
    /// The node at the address is not the one expected there: its certificate names another
    /// identity, or (TCP in clear) none at all. Nothing was sent to it.
    #[error(
        "the node is not {expected}: its certificate {}; nothing was sent",
        match certified {
            Some(other) => format!("names {other:?}"),
            None => "is missing (TCP in clear shows no identity: use TLS)".to_string(),
        }
    )]
    NotTheNode {
        /// The identity expected.
        expected: NodeId,
        /// The identity the certificate showed, if any.
        certified: Option<String>,
    },
    /// The source holds another version of the tensor than the one a directory listed.
    #[error(
        "{key}: the source now holds another version (content hash {granted}) than the one \
         listed ({listed}); nothing was copied"
    )]
    NotTheListedVersion {
        /// The source key.
        key: TensorKey,
        /// The hash listed.
        listed: ContentHash,
        /// The hash the source granted.
        granted: ContentHash,
    },
    /// A token would go in clear to a TCP address that only the cluster's directory vouches for.
    #[error(
        "refusing to send the token to @{member} at {addr} in clear: the address came from the \
         cluster's directory, and nothing there proves the node is @{member}; use TLS (its \
         certificate is checked against the node id @{member} registered), or name the node by \
         its address"
    )]
    UncheckedMember {
        /// The member's name.
        member: String,
        /// The address the directory gave.
        addr: String,
    },
    /// The node at a member's address answers as another node than the member registered.
    #[error(
        "the node at @{member}'s address answers as node {answered:?}, not {registered:?} as \
         @{member} registered: the directory is stale or wrong"
    )]
    NotTheMember {
        /// The member's name.
        member: String,
        /// The node id it registered.
        registered: NodeId,
        /// The node id the node gave.
        answered: NodeId,
    },
    /// Under TLS a member's name is its certificate's name (its node id); a record that names
    /// another node id under it is not the member's own, whoever wrote it.
    #[error(
        "@{member}'s record names node {registered:?}: under TLS a member's name is its \
         certificate's, so the record is not @{member}'s own (written by someone else?)"
    )]
    NameIsNotIdentity {
        /// The member's name.
        member: String,
        /// The node id its record names.
        registered: NodeId,
    },
    /// A node-to-node copy ([`NodeCopy::run`](crate::NodeCopy::run)) whose connection failed
    /// part way: what it had answered is in [`InterruptedCopy::answered`], final.
    #[error(
        "the copy stopped after {} of its {} tensors: {}",
        .0.answered.len(),
        .0.answered.len() + .0.unanswered.len(),
        .0.cause
    )]
    CopyInterrupted(Box<InterruptedCopy>),
    /// A tensor of a copy or a put over several lanes
    /// ([`NodeCopy::run_in_lanes`](crate::NodeCopy::run_in_lanes),
    /// [`PutBatch::lanes`](crate::PutBatch::lanes)) that got no answer of
    /// its own: its lane's connection failed during the transfer (a copy's tensor may have been
    /// copied, or moved: its source deleted once the target held it; of a put's, only those
    /// whose payloads were sent, or being sent, and not yet answered, at most two per
    /// connection, may have been stored, the others were not), or
    /// before anything was asked (it was not). `reason` says which; sending it again with
    /// [`IfExists::Replace`](ferry_proto::IfExists::Replace) is safe.
    #[error("{reason}")]
    NoAnswer {
        /// The tensor's key: a copy's source key, a put's key.
        key: TensorKey,
        /// What became of its lane.
        reason: String,
    },
    /// The token may not go where the connection leads: beyond loopback in clear (without
    /// [`ClearTokens::Anywhere`](ferry_io::ClearTokens::Anywhere)), or to a loopback port a
    /// user other than this one or root holds. Nothing was sent, not even the hello.
    #[error(transparent)]
    TokenWithheld(#[from] TokenWithheld),
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
    /// A model copy between nodes in which a tensor was refused: the target's version was given
    /// up, and its model is as it was.
    #[error("the model was not copied: {path} was refused: {cause}")]
    ModelNotCopied {
        /// The tensor's path in the model.
        path: String,
        /// Why.
        cause: Box<ClientError>,
    },
    /// A move of a model onto its own place (the same node, device and prefix): there is
    /// nothing to move, so it is refused before anything is held or written (it would otherwise
    /// copy the model onto itself as a new version and then fail to delete the one it copied).
    /// Two nodes are one when they answer with the same id.
    #[error(
        "model {prefix} on device {device} is already where the move would put it (the same node, \
         device and prefix): nothing was done"
    )]
    ModelMoveOntoItself {
        /// The model's device.
        device: u32,
        /// The model's prefix.
        prefix: String,
    },
    /// A move of a model between nodes committed it on the target, but the source's model
    /// changed meanwhile (a newer version was committed there), so it was not deleted: both
    /// remain.
    #[error(
        "model {prefix} version {version} was copied to the target as version {}, but the \
         source's model changed meanwhile, so it was kept: both remain",
        stored.version
    )]
    ModelSourceChanged {
        /// The model's prefix on the source.
        prefix: String,
        /// The source's version that was copied.
        version: u64,
        /// The target's new version.
        stored: Box<ferry_proto::message::ModelManifest>,
    },
    /// A blocking call ([`.wait()`](crate::Wait::wait), or opening a
    /// [`BlockingClient`](crate::BlockingClient)) on a thread that drives an async runtime,
    /// where waiting for the node would stall it. `.await` the call there, or call from
    /// `tokio::task::spawn_blocking` or a thread of its own.
    #[error(
        "a BlockingClient blocks until the node answers: call it from spawn_blocking or a thread \
         of its own, or use the async Client inside a runtime"
    )]
    InsideRuntime,
}

/// What a node-to-node copy had done when its connection failed.
#[derive(Debug)]
#[non_exhaustive]
pub struct InterruptedCopy {
    /// One answer for each of the copy's first tensors, in order, as a whole run gives them:
    /// these are final.
    pub answered: Vec<Result<TensorInfo, ClientError>>,
    /// The source keys of the tensors after them, in order, whose outcome the copy could not
    /// report (a refused grant among them included: answers are given in order). Some may have
    /// been registered by the target all the same (a few pulls are asked ahead of their
    /// answers); on a move, the first one's source may have been deleted too, but only once the
    /// target had registered it, and no other's was. Copying them again (with
    /// [`IfExists::Replace`](ferry_proto::IfExists::Replace), or after a listing) is safe.
    pub unanswered: Vec<TensorKey>,
    /// Why the connection failed.
    pub cause: ClientError,
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

impl From<ExchangeError> for ClientError {
    fn from(error: ExchangeError) -> Self {
        match error {
            ExchangeError::Connection(e) => ClientError::Connection(e),
            ExchangeError::Refused(reply) => reply.into(),
            ExchangeError::Unexpected(what) => ClientError::Unexpected(what),
            ExchangeError::OutOfStep => ClientError::OutOfStep,
            ExchangeError::NotTheNode {
                expected,
                certified,
            } => ClientError::NotTheNode {
                expected,
                certified,
            },
            ExchangeError::TokenWithheld(withheld) => ClientError::TokenWithheld(withheld),
            ExchangeError::NodeTooOld { what, node, needs } => {
                ClientError::NodeTooOld { what, node, needs }
            }
            // A variant a later ferry-io adds: its message says what it is.
            other => ClientError::Unexpected(other.to_string()),
        }
    }
}

impl From<ProtoError> for ClientError {
    fn from(e: ProtoError) -> Self {
        ClientError::Connection(ConnectionError::Proto(e))
    }
}
