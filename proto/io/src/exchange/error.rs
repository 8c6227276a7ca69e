//! `ExchangeError`: why a request/answer exchange with a node failed, whichever client ran it.

use ferry_proto::{ErrorCode, ErrorReply, NodeId, ProtoError};

use super::TokenWithheld;
use crate::connection::ConnectionError;
use crate::handshake::HelloError;

/// Why an exchange with a node failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExchangeError {
    /// The connection failed or the node broke the protocol.
    #[error(transparent)]
    Connection(#[from] ConnectionError),
    /// The node refused or failed the request; the message is its own. The exchange finished:
    /// the connection takes the next request.
    #[error("{:?}: {}", .0.code, .0.message)]
    Refused(ErrorReply),
    /// The node answered something that does not fit the request.
    #[error("unexpected answer from the node: {0}")]
    Unexpected(String),
    /// An earlier exchange on this connection did not finish (an error mid-answer, a cancelled
    /// call), so the next answer on the wire could belong to it: connect again.
    #[error("the connection is out of step after an unfinished exchange; connect again")]
    OutOfStep,
    /// The node at the address is not the one expected there: its certificate names another
    /// identity, or the link shows none. Nothing was sent to it.
    #[error(
        "the node is not {expected}: its certificate {}; nothing was sent",
        match certified {
            Some(other) => format!("names {other:?}"),
            None => "is missing (only a TLS link shows an identity)".to_string(),
        }
    )]
    NotTheNode {
        /// The identity expected.
        expected: NodeId,
        /// The identity the certificate showed, if any.
        certified: Option<String>,
    },
    /// The token may not go where the link leads (beyond loopback in clear, or to a loopback
    /// port another local user holds); nothing was sent, not even the hello.
    #[error(transparent)]
    TokenWithheld(#[from] TokenWithheld),
    /// The node speaks a protocol minor older than a request needs; nothing was sent.
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

impl ExchangeError {
    /// The node's error code, where the node refused.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ExchangeError::Refused(reply) => Some(reply.code),
            _ => None,
        }
    }
}

impl From<HelloError> for ExchangeError {
    fn from(error: HelloError) -> Self {
        match error {
            HelloError::Connection(e) => ExchangeError::Connection(e),
            HelloError::Refused(reply) => ExchangeError::Refused(reply),
            HelloError::Unexpected(what) => ExchangeError::Unexpected(what),
        }
    }
}

impl From<ProtoError> for ExchangeError {
    fn from(e: ProtoError) -> Self {
        ExchangeError::Connection(ConnectionError::Proto(e))
    }
}

impl From<std::io::Error> for ExchangeError {
    fn from(e: std::io::Error) -> Self {
        ExchangeError::Connection(ConnectionError::Io(e))
    }
}
