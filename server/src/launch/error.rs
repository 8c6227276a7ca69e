//! Why a [`Server`](crate::Server) would not start: every refusal of the builder's rules, typed,
//! each with the setting at fault and what would fix it.

use std::net::SocketAddr;
use std::path::PathBuf;

use ferry_io::credential::CredentialError;
use ferry_io::tls::TlsError;

use crate::error::NodeError;
use crate::service::{BindError, ExposureError};

/// Why a server would not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A token that is empty: it would silently turn authentication off (a variable that
    /// expanded to nothing).
    #[error("the {0} is empty: give a token, or leave it unset")]
    EmptyToken(&'static str),
    /// A hello timeout of zero.
    #[error("the hello timeout must be at least 1 second")]
    HelloTimeoutZero,
    /// A chunk size outside 1 byte to a frame's body less its header.
    #[error(
        "the chunk size (--chunk-size, ConnectionLimits::chunk_size) must be between 1 and \
         {largest} bytes, not {given}"
    )]
    ChunkSize {
        /// As given.
        given: usize,
        /// The largest a frame's body carries beside a chunk's header.
        largest: usize,
    },
    /// A file of secrets that could not be read.
    #[error("reading {path}: {source}")]
    Secret {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file of secrets whose contents are not what it should hold.
    #[error("{path}: {source}")]
    SecretFile {
        /// The file.
        path: PathBuf,
        /// What is wrong in it.
        source: CredentialError,
    },
    /// A token file with no credential in it.
    #[error("{0} holds no credential")]
    NoCredential(PathBuf),
    /// The node's TLS files.
    #[error("loading the node's TLS files: {0}")]
    Tls(#[from] TlsError),
    /// A token beside TLS.
    #[error(
        "tokens are not taken under TLS (a token sent to a node can be replayed by it anywhere; \
         a certificate cannot): grant certificate names their scopes with --grant NAME=SCOPES \
         (ServerBuilder::grant) instead of tokens (every node certificate of the CA may fetch)"
    )]
    TokensUnderTls,
    /// etcd over TLS without the node's certificate to reach it with.
    #[error("the cluster {0} is etcd over TLS: give the node its TLS files")]
    EtcdsWithoutTls(String),
    /// A cluster address that is not one.
    #[error("the cluster {cluster:?}: {reason}")]
    Cluster {
        /// As given.
        cluster: String,
        /// What is wrong.
        reason: String,
    },
    /// A member name that is not one.
    #[error(
        "the member name {0:?}: 1 to 63 letters, digits, '-', '_' or '.', not starting with '.'"
    )]
    MemberName(String),
    /// Under TLS, a member name other than the certificate's.
    #[error("under TLS a member's name is its certificate's name: {certified} (not {given})")]
    MemberNameNotCertified {
        /// The name given.
        given: String,
        /// The certificate's.
        certified: String,
    },
    /// A cluster member listening on a wildcard with no address to advertise.
    #[error("listening on {0}, a wildcard: say which address to advertise (--advertise HOST:PORT)")]
    AdvertiseNeeded(SocketAddr),
    /// An etcd user with an empty name or password.
    #[error("the etcd user or its password is empty")]
    EtcdUser,
    /// The metrics endpoint refused by the door.
    #[error(transparent)]
    MetricsExposed(ExposureError),
    /// The metrics endpoint could not be served.
    #[error("serving metrics on {addr}: {reason}")]
    Metrics {
        /// Where.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// The node would not start.
    #[error("starting the node: {0}")]
    Node(#[from] NodeError),
    /// The service would not bind.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The Unix socket would not bind.
    #[error("binding the Unix socket {path}: {source}")]
    Unix {
        /// Its path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}
