//! How a pull's attempts fail: which failures are worth a reconnection (`classify`), what a
//! client learns of a source that could not be reached (`opening_failed`, [`UNREACHABLE`]), and
//! the rate-limited log of a source's trouble ([`SOURCE_TROUBLE`]).

use ferry_io::{ConnectionError, ExchangeError};
use ferry_proto::{ErrorCode, Untrusted};

use super::plan::Failure;
use super::receive::Receiving;
use crate::error::{NodeError, Refusal};
use crate::service::door::refusal_log::RefusalLog;

/// How one attempt failed: [`Transient`](Failure::Transient) (the connection dropped or went
/// silent: worth reconnecting and resuming, the `String` saying why) or
/// [`Fatal`](Failure::Fatal) (anything else: the pull fails with the error).
pub(super) type AttemptError = Failure<String, NodeError>;

/// How one attempt failed, and what it had received (to resume from).
pub(super) struct Failed {
    pub(super) error: AttemptError,
    pub(super) resume: Option<Receiving>,
}

impl Failed {
    /// A failure no retry mends: nothing to resume.
    pub(super) fn fatal(error: NodeError) -> Failed {
        Failed {
            error: AttemptError::Fatal(error),
            resume: None,
        }
    }
}

/// What a client hears of a source it named that could not be reached or did not answer hello
/// as a ferry node: one message for both, so that a node does not tell a closed port from an open
/// one, nor what answered there.
pub(super) const UNREACHABLE: &str = "peer unreachable or not a ferry node";

/// What went wrong with a pull's source (a drop, a retry, a source that is no ferry node, a
/// failed release): a client with the write scope can point pull after pull at a source that
/// fails, so one line a second at most, each naming the source and carrying how many went
/// unlogged.
pub(super) static SOURCE_TROUBLE: RefusalLog =
    RefusalLog::new("pull", "trouble with a pull's source");

/// How opening a link failed, as the client that named the source may learn it: a ferry node's
/// own refusal as it said it, anything else (which could be the banner of whatever service
/// listens there, or its certificate) only as "not a ferry node", the details in this node's
/// log.
pub(super) fn opening_failed(source: &str, error: ExchangeError) -> AttemptError {
    match error {
        ExchangeError::Connection(ConnectionError::Proto(_)) | ExchangeError::Unexpected(_) => {
            let detail = format!("the source did not answer hello as a ferry node: {error}");
            SOURCE_TROUBLE.note(&Untrusted(source).to_string(), &detail);
            AttemptError::Fatal(NodeError::Peer {
                source_addr: source.to_string(),
                message: UNREACHABLE.into(),
            })
        }
        // A source whose certificate names another node than the one listed there.
        ExchangeError::NotTheNode { .. } => {
            let detail =
                format!("refused: the source is not the peer listed at its address: {error}");
            SOURCE_TROUBLE.note(&Untrusted(source).to_string(), &detail);
            AttemptError::Fatal(NodeError::NotAllowedPeer(source.to_string()))
        }
        // The peer token may not go there (beyond loopback in clear, or to a loopback port
        // another local user holds): nothing was sent, and no retry changes that. The client
        // that named the source hears why; the address is one this node was told to pull from.
        ExchangeError::TokenWithheld(withheld) => {
            let detail = format!("the peer token was withheld: {withheld}");
            SOURCE_TROUBLE.note(&Untrusted(source).to_string(), &detail);
            AttemptError::Fatal(NodeError::Peer {
                source_addr: source.to_string(),
                message: withheld.to_string(),
            })
        }
        // A certificate that fails (the source's, or ours as it judged it) or a Unix socket
        // served by another user: no retry changes that, so none is made.
        ExchangeError::Connection(ConnectionError::Io(e))
            if e.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            let detail = format!("the source's identity did not check: {e}");
            SOURCE_TROUBLE.note(&Untrusted(source).to_string(), &detail);
            AttemptError::Fatal(NodeError::Peer {
                source_addr: source.to_string(),
                message: UNREACHABLE.into(),
            })
        }
        other => classify(source, other),
    }
}

/// Which failures are worth a reconnection: a connection that dropped, closed, failed or went
/// silent. A refused capability, a corrupt chunk or a bad description are not.
pub(super) fn classify(source: &str, error: ExchangeError) -> AttemptError {
    match error {
        ExchangeError::Connection(
            ConnectionError::Io(_)
            | ConnectionError::Closed
            | ConnectionError::IdleTimeout(_)
            | ConnectionError::PayloadDeadline { .. },
        )
        | ExchangeError::OutOfStep => AttemptError::Transient(error.to_string()),
        ExchangeError::Refused(ferry_proto::ErrorReply {
            code: ErrorCode::CapabilityRefused,
            message,
        }) => AttemptError::Fatal(NodeError::CapabilityRefused(Refusal::BySource {
            source_addr: source.to_string(),
            message,
        })),
        // A source that sends from host copies answers `Busy` while its share of them is taken
        // (other fetches in flight): asked again after the backoff, as a dropped link is.
        ExchangeError::Refused(ferry_proto::ErrorReply {
            code: ErrorCode::ShuttingDown | ErrorCode::Busy,
            message,
        }) => AttemptError::Transient(message),
        other => AttemptError::Fatal(NodeError::Peer {
            source_addr: source.to_string(),
            message: other.to_string(),
        }),
    }
}
