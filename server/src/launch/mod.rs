//! One way to build a node with its door, for `ferry-server` and for every program that embeds
//! one: [`Server::builder`] takes what the command line's flags say, [`ServerBuilder::start`]
//! checks it by the same rules, makes the node, its receive pool, its service, its metrics and
//! its cluster membership, and [`Server::run`] serves until told to stop.
//!
//! The rules live here and in the layers below, never in a binary: an embedded node is refused
//! what `ferry-server` is refused (beyond loopback without TLS and a credential, a token beside
//! TLS, an empty token, ...) unless the program says otherwise in code
//! ([`ServerBuilder::insecure`]), and it is as fast by default (the elastic receive pool with
//! memory kept ready for a first model).

mod builder;
mod cluster_join;
mod error;
mod metrics_endpoint;
mod process;
mod pulls;
mod secrets;

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;

use ferry_io::NodeTls;
use ferry_proto::Token;

pub use builder::{DEFAULT_RECYCLE, ProcessTuning, ServerBuilder};
pub use cluster_join::ClusterJoin;
pub use error::StartError;
pub use process::tune_allocator;
pub use pulls::PeerToken;

use builder::TlsSource;
use pulls::{PullInputs, pull_policy};

use crate::cluster::Membership;
use crate::node::Node;
use crate::service::door::credential::{Credential, parse_token_file};
use crate::service::{Exposure, Service};

/// A started node with its door: bound, its receive pool made, its metrics served; serving once
/// [`run`](Self::run).
#[derive(Debug)]
pub struct Server {
    node: Node,
    service: Service,
    cluster: Option<crate::cluster::ClusterConfig>,
}

impl Server {
    /// A server with `ferry-server`'s defaults, to adjust and [`start`](ServerBuilder::start).
    pub fn builder() -> ServerBuilder {
        ServerBuilder::default()
    }

    /// The node, to use in process (cheap to clone).
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// The TCP address bound.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.service.local_addr()
    }

    /// The Unix socket listened on, if any.
    pub fn unix_path(&self) -> Option<&Path> {
        self.service.unix_path()
    }

    /// Joins the cluster (if one was given), serves until `shutdown` completes, lets sessions
    /// finish within the grace period, and leaves the cluster.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> std::io::Result<()> {
        let membership = self
            .cluster
            .map(|config| Membership::join(self.node.clone(), config));
        let served = self.service.run(shutdown).await;
        if let Some(membership) = membership {
            membership.leave().await;
        }
        served
    }
}

impl ServerBuilder {
    /// Checks the settings, then makes the node (and its receive pool), binds its service (and
    /// Unix socket), and serves its metrics. Must run inside a tokio runtime.
    pub async fn start(mut self) -> Result<Server, StartError> {
        let exposure = self.service.exposure;
        if self.service.hello_timeout.is_zero() {
            return Err(StartError::HelloTimeoutZero);
        }
        // A chunk travels in one frame beside its header (at most 64 bytes).
        let chunk = self.service.limits.chunk_size;
        let largest = ferry_proto::frame::DEFAULT_MAX_BODY - 64;
        if chunk == 0 || chunk > largest {
            return Err(StartError::ChunkSize {
                given: chunk,
                largest,
            });
        }
        // An empty token would silently turn authentication off: refused, so that a variable
        // that expanded to nothing cannot open the node.
        if self.tokens.iter().any(String::is_empty) {
            return Err(StartError::EmptyToken("token"));
        }
        if matches!(&self.peer_token, PeerToken::Given(t) if t.as_str().is_empty()) {
            return Err(StartError::EmptyToken("peer token"));
        }
        let mut credentials: Vec<Credential> = Vec::new();
        for token in &self.tokens {
            credentials.push(Credential::full(token).map_err(|_| StartError::EmptyToken("token"))?);
        }
        for path in &self.token_files {
            let listed = parse_token_file(&secrets::read_secret(path)?).map_err(|source| {
                StartError::SecretFile {
                    path: path.clone(),
                    source,
                }
            })?;
            if listed.is_empty() {
                return Err(StartError::NoCredential(path.clone()));
            }
            credentials.extend(listed);
        }
        self.service.credentials.extend(credentials);
        let tls = match self.tls.take() {
            Some(TlsSource::Loaded(tls)) => Some(tls),
            Some(TlsSource::Files(files)) => Some(NodeTls::load(&files)?),
            None => None,
        };
        // Under TLS a token would travel to whatever node a client reaches, which could replay
        // it; the certificate is the credential there.
        let peer_token_given =
            !matches!(self.peer_token, PeerToken::ClientToken | PeerToken::Nothing);
        if tls.is_some() && (!self.service.credentials.is_empty() || peer_token_given) {
            return Err(StartError::TokensUnderTls);
        }
        let etcd_user = match &self.cluster {
            Some(join) => join.check(tls.as_ref().map(|t| t.identity().as_str()))?,
            None => None,
        };
        let peer_token = match &self.peer_token {
            PeerToken::ClientToken => self.tokens.first().map(|t| Token::from(t.as_str())),
            PeerToken::Given(token) => Some(token.clone()),
            PeerToken::File(path) => Some(Token::from(secrets::token_in(path)?)),
            PeerToken::Nothing => None,
        };
        // Under TLS the certificate is the credential: no peer token is sent.
        let peer_token = peer_token.filter(|_| tls.is_none());
        self.node.pulls.peers = pull_policy(&PullInputs {
            listed: std::mem::take(&mut self.peers),
            peer_token: peer_token.clone(),
            tls: tls.is_some(),
            cluster: self.cluster.as_ref().map(|c| c.member_ids.clone()),
        });
        self.node.pulls.peer_token = peer_token;
        self.node.pulls.peer_limits = self.service.limits;
        if exposure == Exposure::Insecure {
            // A trusted network: the peer token may go in clear beyond loopback too (a loopback
            // port must still be held by this user or root).
            self.node.pulls.clear_tokens = ferry_io::ClearTokens::Anywhere {
                server: self.node.pulls.clear_tokens.server(),
            };
        }
        self.node.tls = tls;
        if self.process == ProcessTuning::Tuned {
            process::tune(self.recycle, self.service.max_connections);
        }
        let node = Node::start(self.node)?;
        let mut service = Service::bind(node.clone(), self.listen, self.service).await?;
        if let Some(path) = &self.unix {
            service = service
                .listen_unix(path)
                .map_err(|source| StartError::Unix {
                    path: path.clone(),
                    source,
                })?;
        }
        let cluster = match &self.cluster {
            Some(join) => {
                let addr = service.local_addr().map_err(|source| {
                    StartError::Bind(crate::service::BindError::Io {
                        addr: self.listen,
                        source,
                    })
                })?;
                Some(join.config(addr, service.unix_path(), etcd_user)?)
            }
            None => None,
        };
        // Last: the exporter becomes the process's recorder for good, so a node
        // that fails to start must not have installed it.
        if let Some(addr) = self.metrics {
            metrics_endpoint::serve(
                addr,
                exposure,
                node.config().receive_buffers.pool().cloned(),
            )?;
        }
        Ok(Server {
            node,
            service,
            cluster,
        })
    }
}
