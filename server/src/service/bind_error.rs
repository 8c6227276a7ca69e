//! Why a service would not bind ([`BindError`]): a token beside TLS or a grant without it, an
//! exposure refused, a door that cannot tell who connects, an address that would not bind.

use std::net::SocketAddr;

use super::ExposureError;

/// Why a service would not bind.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BindError {
    /// Tokens beside TLS.
    #[error(
        "tokens are not taken under TLS (a token sent to a node can be replayed by it anywhere; a \
         certificate cannot): grant certificate names their scopes (--grant NAME=SCOPES, \
         ServiceConfig::grants) instead"
    )]
    TokensUnderTls,
    /// Grants without TLS.
    #[error(
        "grants name certificate identities, which only TLS proves (NodeConfig::tls); without it \
         they would leave the node open to everyone"
    )]
    GrantsWithoutTls,
    /// Beyond loopback without what keeps strangers out.
    #[error(transparent)]
    Exposed(#[from] ExposureError),
    /// A node that asks no credential cannot tell who connects.
    #[error("{0}")]
    Door(std::io::Error),
    /// The address could not be bound.
    #[error("binding {addr}: {source}")]
    Io {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

impl From<BindError> for std::io::Error {
    fn from(error: BindError) -> Self {
        let kind = match &error {
            BindError::Io { source, .. } | BindError::Door(source) => source.kind(),
            BindError::Exposed(_) => std::io::ErrorKind::PermissionDenied,
            BindError::TokensUnderTls | BindError::GrantsWithoutTls => {
                std::io::ErrorKind::InvalidInput
            }
        };
        std::io::Error::new(kind, error.to_string())
    }
}
