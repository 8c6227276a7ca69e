//! [`ServerBuilder`]: everything a server is told, each setting a method, the defaults those of
//! `ferry-server` with no flag. Nothing is checked or opened here: [`ServerBuilder::start`]
//! does both.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use ferry_backend::DeviceSpec;
use ferry_io::{ConnectionLimits, NodeTls, SharedMemory, TlsFiles};
use ferry_proto::NodeId;

use super::{ClusterJoin, PeerToken};
use crate::engine::TransferPolicy;
use crate::node::{NodeConfig, NodeLimits, Peer, ReceiveBuffers, Striping};
use crate::service::door::certificate_grant::CertificateGrant;
use crate::service::door::credential::Credential;
use crate::service::{Exposure, ServiceConfig};

/// The recycled receive buffers a server keeps by default.
pub const DEFAULT_RECYCLE: usize = 512 << 20;

/// Whether a server sets process-wide policy (the allocator's, the open-file limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProcessTuning {
    /// As `ferry-server`: freed tensor memory goes back to the system (one allocator arena, a
    /// fixed mmap threshold, periodic trims), the soft open-file limit raised to the hard one.
    #[default]
    Tuned,
    /// Left as the program set them.
    Untouched,
}

/// The node's TLS: loaded already, or files to load at start.
#[derive(Debug, Clone)]
pub(crate) enum TlsSource {
    /// Loaded.
    Loaded(NodeTls),
    /// To load.
    Files(TlsFiles),
}

/// A server to start: a node, its service on TCP (and a Unix socket), its metrics, its cluster.
/// Made by [`Server::builder`](super::Server::builder); the defaults are `ferry-server`'s with
/// no flag: two Flex devices, an elastic receive pool with memory kept ready, loopback only
/// (`127.0.0.1:7070`), no credential (so only this host's own user and root connect), the
/// limits and timeouts of [`NodeConfig`] and [`ServiceConfig`].
#[derive(Debug, Clone)]
#[must_use = "a ServerBuilder does nothing until it is started"]
pub struct ServerBuilder {
    pub(crate) listen: SocketAddr,
    pub(crate) unix: Option<PathBuf>,
    pub(crate) node: NodeConfig,
    pub(crate) service: ServiceConfig,
    pub(crate) tokens: Vec<String>,
    pub(crate) token_files: Vec<PathBuf>,
    pub(crate) tls: Option<TlsSource>,
    pub(crate) peers: Vec<Peer>,
    pub(crate) peer_token: PeerToken,
    pub(crate) cluster: Option<ClusterJoin>,
    pub(crate) metrics: Option<SocketAddr>,
    pub(crate) recycle: usize,
    pub(crate) process: ProcessTuning,
}

impl Default for ServerBuilder {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            unix: None,
            node: NodeConfig::default(),
            service: ServiceConfig::default(),
            tokens: Vec::new(),
            token_files: Vec::new(),
            tls: None,
            peers: Vec::new(),
            peer_token: PeerToken::default(),
            cluster: None,
            metrics: None,
            recycle: DEFAULT_RECYCLE,
            process: ProcessTuning::default(),
        }
    }
}

impl ServerBuilder {
    /// The TCP address to listen on (port 0 picks a free one). Beyond loopback the node needs
    /// TLS with grants, or a token, unless [`insecure`](Self::insecure).
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = addr;
        self
    }

    /// Also listens on a Unix socket at `path` (mode 0600; reached as `unix:PATH`), where
    /// payloads go through shared memory unless declined.
    pub fn unix_socket(mut self, path: impl Into<PathBuf>) -> Self {
        self.unix = Some(path.into());
        self
    }

    /// The devices to host, in index order (default: two Flex devices; an empty list keeps the
    /// default).
    pub fn devices(mut self, devices: Vec<DeviceSpec>) -> Self {
        if !devices.is_empty() {
            self.node.devices = devices;
        }
        self
    }

    /// A token clients present over TCP in clear, allowing everything (refused beside TLS,
    /// where grants say who may do what). Also the peer token, unless one is given.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.tokens.push(token.into());
        self
    }

    /// A file of credentials clients may present, one per line: `SCOPES TOKEN` or a bare
    /// `TOKEN` (everything); read at start, with a warning where others may read it.
    pub fn token_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.token_files.push(path.into());
        self
    }

    /// Credentials clients may present, with their scopes.
    pub fn credentials(mut self, credentials: impl IntoIterator<Item = Credential>) -> Self {
        self.service.credentials.extend(credentials);
        self
    }

    /// Mutual TLS on every TCP link, served and opened (to peers); the node's id is then its
    /// certificate's name.
    pub fn tls(mut self, tls: NodeTls) -> Self {
        self.tls = Some(TlsSource::Loaded(tls));
        self
    }

    /// Mutual TLS from these files (`ferry certs` makes them), loaded at start.
    pub fn tls_files(mut self, files: TlsFiles) -> Self {
        self.tls = Some(TlsSource::Files(files));
        self
    }

    /// Under TLS, what the certificates of a name may do (every node certificate of the CA may
    /// fetch). With none, every certificate of the CA may do everything (so beyond loopback
    /// the node needs one, unless [`insecure`](Self::insecure)).
    pub fn grants(mut self, grants: impl IntoIterator<Item = CertificateGrant>) -> Self {
        self.service.grants.extend(grants);
        self
    }

    /// Nodes this node may pull from; a pull from any other is refused without connecting.
    pub fn peers(mut self, peers: impl IntoIterator<Item = Peer>) -> Self {
        self.peers.extend(peers);
        self
    }

    /// The token presented to the nodes this node pulls from (default: the clients' token).
    pub fn peer_token(mut self, token: PeerToken) -> Self {
        self.peer_token = token;
        self
    }

    /// Joins a cluster kept in etcd.
    pub fn cluster(mut self, join: ClusterJoin) -> Self {
        self.cluster = Some(join);
        self
    }

    /// Serves Prometheus metrics on `addr` (clear HTTP: beyond loopback only where
    /// [`insecure`](Self::insecure)). One per process.
    pub fn metrics(mut self, addr: SocketAddr) -> Self {
        self.metrics = Some(addr);
        self
    }

    /// Declares the network trusted: the node may listen, and serve metrics, beyond loopback
    /// without TLS or a credential, and send its peer token in clear beyond loopback
    /// (`ferry-server --insecure`). Every such use is logged as a warning.
    pub fn insecure(mut self) -> Self {
        self.service.exposure = Exposure::Insecure;
        self
    }

    /// Where large receives land (default: an elastic pool with memory kept ready).
    pub fn receive_buffers(mut self, buffers: ReceiveBuffers) -> Self {
        self.node.receive_buffers = buffers;
        self
    }

    /// Freed receive buffers (16 MiB and up, of tensors on Flex devices) kept for reuse, at most
    /// (default 512 MiB; process-wide).
    pub fn recycle(mut self, bytes: usize) -> Self {
        self.recycle = bytes;
        self
    }

    /// What the node holds at most.
    pub fn limits(mut self, limits: NodeLimits) -> Self {
        self.node.limits = limits;
        self
    }

    /// Frame, chunk and idle limits of its connections, served and opened to peers.
    pub fn connection_limits(mut self, limits: ConnectionLimits) -> Self {
        self.service.limits = limits;
        self
    }

    /// Connections served at once, and at once from one address.
    pub fn max_connections(mut self, total: usize, per_address: NonZeroUsize) -> Self {
        self.service.max_connections = total;
        self.service.max_connections_per_address = per_address;
        self
    }

    /// Connections served at once per identity (a token, a certificate's name), so that one
    /// credential holder cannot take every slot from the others (default: three quarters of
    /// the connection limit).
    pub fn max_connections_per_identity(mut self, share: NonZeroUsize) -> Self {
        self.service.max_connections_per_identity = Some(share);
        self
    }

    /// How long a new connection may take to say hello, may sit idle between requests (zero:
    /// for ever), and in-flight requests get at shutdown.
    pub fn timeouts(mut self, hello: Duration, keepalive: Duration, grace: Duration) -> Self {
        self.service.hello_timeout = hello;
        self.service.keepalive = keepalive;
        self.service.shutdown_grace = grace;
        self
    }

    /// The node's id (random by default; under TLS the certificate's name).
    pub fn node_id(mut self, id: impl Into<NodeId>) -> Self {
        self.node.node_id = Some(id.into());
        self
    }

    /// Whether payloads may go through shared memory on Unix sockets.
    pub fn shared_memory(mut self, shared_memory: SharedMemory) -> Self {
        self.node.shared_memory = shared_memory;
        self
    }

    /// Which transfer paths between this node's devices may be taken.
    pub fn transfer_policy(mut self, policy: TransferPolicy) -> Self {
        self.node.policy = policy;
        self
    }

    /// Reconnections of a pull after a transient drop.
    pub fn pull_retries(mut self, retries: u32) -> Self {
        self.node.pulls.retries = retries;
        self
    }

    /// How a pull of a large tensor spreads over connections (default: by this machine's
    /// cores).
    pub fn striping(mut self, striping: Striping) -> Self {
        self.node.pulls.striping = striping;
        self
    }

    /// Sets process-wide policy or not (default: tuned, as `ferry-server`).
    pub fn process_tuning(mut self, tuning: ProcessTuning) -> Self {
        self.process = tuning;
        self
    }
}
