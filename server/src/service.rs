//! The service: accepts connections (TCP, and a Unix socket where asked), runs one session per
//! connection, shuts down gracefully.
//!
//! Bounded everywhere: a semaphore on connections (one over the limit is told so and closed,
//! never queued), a maximum frame body, an idle timeout in the middle of a frame, a per-tensor
//! limit and a per-device memory budget checked before a payload's buffer is allocated.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ferry_io::handshake::{self, protocol_error, refuse as fail};
use ferry_io::transport::UnixTransport;
use ferry_io::{
    Connection, ConnectionError, ConnectionLimits, PayloadRoute, RegionUse, Stream, Transport,
};
use ferry_proto::{ErrorCode, ErrorReply, Request, Response, TensorKey, TensorMeta};
use tokio::net::{TcpListener, UnixListener, UnixStream};
use tokio::sync::{Semaphore, broadcast, mpsc};
use tracing::Instrument;

use crate::device::{Arrived, Existing, KnownHash};
use crate::error::{NodeError, Refusal};
use crate::node::{AGENT, ClientId, Direction, MAX_PAGE, Node, TransferMode};
use crate::peer::{PeerLink, PullRequest};

/// The largest frame body accepted before a connection's `Hello` is answered.
const HANDSHAKE_MAX_BODY: usize = 64 * 1024;

/// How the service listens and what it allows.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// The shared token a client must present, if any.
    pub token: Option<String>,
    /// Connections served at once.
    pub max_connections: usize,
    /// Frame, chunk and idle limits.
    pub limits: ConnectionLimits,
    /// How long in-flight requests may take to finish at shutdown.
    pub shutdown_grace: Duration,
    /// How long a connection may sit between requests before the node closes it, so that idle
    /// connections cannot hold every connection slot; zero for never.
    pub keepalive: Duration,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            token: None,
            max_connections: 1024,
            limits: ConnectionLimits::default(),
            shutdown_grace: Duration::from_secs(30),
            keepalive: Duration::from_secs(300),
        }
    }
}

/// A bound, not yet running, service over a node.
#[derive(Debug)]
pub struct Service {
    node: Node,
    listener: TcpListener,
    unix: Option<UnixSocket>,
    config: Arc<ServiceConfig>,
}

/// The Unix socket a service listens on; its file is removed when the listener goes.
#[derive(Debug)]
struct UnixSocket {
    listener: UnixListener,
    path: PathBuf,
}

impl Drop for UnixSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Binds a Unix socket at `path`: a socket file left by a node that is gone is replaced, one a
/// live node answers on is not, nor is any other kind of file. Only the owner may connect (mode
/// 0600): a node's tensors are not for every local user.
fn bind_unix(path: &Path) -> std::io::Result<UnixSocket> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Ok(existing) = std::fs::symlink_metadata(path) {
        if !existing.file_type().is_socket() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("another node listens on {}", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    let socket = UnixSocket {
        listener,
        path: path.to_path_buf(),
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(socket)
}

impl Service {
    /// Binds `addr` (`127.0.0.1:0` picks a free port).
    pub async fn bind(
        node: Node,
        addr: SocketAddr,
        config: ServiceConfig,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        Ok(Self {
            node,
            listener,
            unix: None,
            config: Arc::new(config),
        })
    }

    /// Also listens on a Unix domain socket at `path` (clients and peers reach it as
    /// `unix:PATH`). Connections there may move payloads through shared memory.
    pub fn listen_unix(mut self, path: &Path) -> std::io::Result<Self> {
        let socket = bind_unix(path)?;
        self.node
            .set_unix_socket(Some(format!("unix:{}", path.display())));
        self.unix = Some(socket);
        Ok(self)
    }

    /// The Unix socket listened on, if any.
    pub fn unix_path(&self) -> Option<&Path> {
        self.unix.as_ref().map(|u| u.path.as_path())
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown` completes, then stops accepting, lets sessions finish the request
    /// in hand within the grace period, and returns.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> std::io::Result<()> {
        let (notify_shutdown, _) = broadcast::channel::<()>(1);
        let (done_tx, mut done_rx) = mpsc::channel::<()>(1);
        let permits = Arc::new(Semaphore::new(self.config.max_connections));
        let accept = accept_loop(&self, &permits, &notify_shutdown, &done_tx);
        tokio::select! {
            result = accept => result?,
            () = shutdown => tracing::info!("shutting down: no new connections"),
        }
        // Closed now, so that new clients are refused at once rather than left waiting.
        drop(self.listener);
        drop(self.unix);
        self.node.set_unix_socket(None);
        drop(notify_shutdown);
        drop(done_tx);
        let grace = self.config.shutdown_grace;
        if tokio::time::timeout(grace, done_rx.recv()).await.is_err() {
            tracing::warn!(
                ?grace,
                "sessions still busy after the grace period; leaving them"
            );
        }
        Ok(())
    }
}

async fn accept_loop(
    service: &Service,
    permits: &Arc<Semaphore>,
    notify_shutdown: &broadcast::Sender<()>,
    done_tx: &mpsc::Sender<()>,
) -> std::io::Result<()> {
    loop {
        let accepted = tokio::select! {
            tcp = service.listener.accept() => tcp.map(|(socket, peer)| {
                // Frames are written whole; waiting to coalesce them only adds latency.
                let _ = socket.set_nodelay(true);
                (Stream::Tcp(socket), peer.to_string())
            }),
            unix = accept_unix(service.unix.as_ref()) => unix.map(|socket| {
                let peer = unix_peer(&socket);
                (Stream::Unix(UnixTransport::new(socket)), peer)
            }),
        };
        if let Ok((Stream::Unix(unix), peer)) = &accepted
            && !unix_peer_allowed(unix.get_ref())
        {
            tracing::warn!(%peer, "Unix connection refused: another user");
            continue;
        }
        let (socket, peer) = match accepted {
            Ok(accepted) => accepted,
            // Out of file descriptors and the like: back off rather than spin or die.
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "connection refused: at the connection limit");
            service.node.recorder().connection_refused();
            tokio::spawn(refuse(socket, service.config.clone()));
            continue;
        };
        let node = service.node.clone();
        let config = service.config.clone();
        let shutdown = notify_shutdown.subscribe();
        let done = done_tx.clone();
        tokio::spawn(async move {
            let open = node.connection_opened();
            let mut conn = Connection::new(socket, config.limits);
            let id = node.new_client();
            let result = Session {
                node: &node,
                config: &config,
                shutdown,
                peer: PeerLink::default(),
                client: &peer,
                id,
            }
            .serve(&mut conn)
            .await;
            if let Err(error) = result {
                tracing::info!(%peer, %error, "connection closed on error");
            }
            node.client_gone(id);
            drop(open);
            drop(permit);
            drop(done);
        });
    }
}

/// Completes after `keepalive`; never, where it is zero.
async fn idle_for(keepalive: Duration) {
    if keepalive.is_zero() {
        std::future::pending::<()>().await;
    }
    tokio::time::sleep(keepalive).await;
}

/// Whether a Unix peer may connect: the node's own user, or root. The socket file is the
/// owner's only (mode 0600), but between `bind` and `chmod` another user could have queued a
/// connection; the kernel's word on who is calling settles it.
fn unix_peer_allowed(socket: &UnixStream) -> bool {
    match socket.peer_cred() {
        Ok(cred) => {
            let uid = cred.uid();
            uid == 0 || uid == rustix::process::geteuid().as_raw()
        }
        Err(_) => false,
    }
}

/// The next connection on the Unix socket; never, where there is none.
async fn accept_unix(unix: Option<&UnixSocket>) -> std::io::Result<UnixStream> {
    match unix {
        Some(unix) => unix.listener.accept().await.map(|(socket, _)| socket),
        None => std::future::pending().await,
    }
}

/// A Unix peer as logs name it: its process and user, as the kernel reports them.
fn unix_peer(socket: &UnixStream) -> String {
    match socket.peer_cred() {
        Ok(cred) => match cred.pid() {
            Some(pid) => format!("unix:pid={pid},uid={}", cred.uid()),
            None => format!("unix:uid={}", cred.uid()),
        },
        Err(_) => "unix".to_string(),
    }
}

/// Tells a connection over the limit why it is closed, without waiting on it for long.
async fn refuse(socket: Stream, config: Arc<ServiceConfig>) {
    let mut conn = Connection::new(socket, config.limits);
    let reply = Response::Error(ErrorReply {
        code: ErrorCode::LimitExceeded,
        message: format!(
            "the node serves at most {} connections at once; try again later",
            config.max_connections
        ),
    });
    let _ = tokio::time::timeout(Duration::from_secs(1), conn.write_response(&reply)).await;
}

struct Session<'a> {
    node: &'a Node,
    config: &'a ServiceConfig,
    shutdown: broadcast::Receiver<()>,
    peer: PeerLink,
    /// Who is on the other end, for logs.
    client: &'a str,
    /// Who is on the other end, for the capabilities it asks for, fetches and releases.
    id: ClientId,
}

impl Session<'_> {
    async fn serve<S: Transport>(
        mut self,
        conn: &mut Connection<S>,
    ) -> Result<(), ConnectionError> {
        // Until the peer has said hello (and shown its token), it gets small frames only: an
        // unauthenticated connection cannot make the node buffer a 16 MiB body.
        let limits = conn.limits();
        conn.set_limits(ConnectionLimits {
            max_body: limits.max_body.min(HANDSHAKE_MAX_BODY),
            ..limits
        });
        if !self.handshake(conn).await? {
            return Ok(());
        }
        conn.set_limits(limits);
        let keepalive = self.config.keepalive;
        loop {
            let request = tokio::select! {
                request = conn.read_request() => request,
                () = idle_for(keepalive) => {
                    // Only between requests: a request in progress is bounded by the idle
                    // timeout instead.
                    tracing::info!(client = self.client, ?keepalive, "closing an idle connection");
                    return Ok(());
                }
                _ = self.shutdown.recv() => {
                    let _ = conn.write_response(&Response::Error(NodeError::ShuttingDown.reply())).await;
                    return Ok(());
                }
            };
            let request = match request {
                Ok(Some(request)) => request,
                Ok(None) => return Ok(()),
                Err(error) => return Err(fail(conn, error).await),
            };
            // One span per request: every line a transfer logs carries what and for whom.
            let span = tracing::info_span!("request", op = request.name(), client = self.client);
            let _in_flight = request
                .moves_a_tensor()
                .then(|| self.node.recorder().in_flight());
            self.handle(conn, request).instrument(span).await?;
        }
    }

    /// The first frame must be a `Hello` with the right major version and token; `false` where
    /// the peer was refused or left.
    async fn handshake<S: Transport>(
        &self,
        conn: &mut Connection<S>,
    ) -> Result<bool, ConnectionError> {
        let policy = handshake::Policy {
            token: self.config.token.as_deref(),
            agent: AGENT,
            shared_memory: self.node.config().shared_memory,
            deadline: self.config.limits.idle_timeout,
        };
        Ok(matches!(
            handshake::accept(conn, policy).await?,
            handshake::Greeting::Welcomed(_)
        ))
    }

    async fn handle<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        request: Request,
    ) -> Result<(), ConnectionError> {
        let node = self.node;
        let reply = match request {
            Request::Hello(_) => {
                let error = protocol_error("Hello may only open a connection");
                return Err(fail(conn, error).await);
            }
            Request::Put {
                device,
                name,
                meta,
                overwrite,
            } => {
                let existing = Existing::from_overwrite(overwrite);
                return self.put(conn, device, name, &meta, existing).await;
            }
            Request::Get { key } => return self.get(conn, &key).await,
            Request::Copy {
                src,
                dst_device,
                dst_name,
                remove_source,
                overwrite,
            } => {
                let mode = if remove_source {
                    TransferMode::Move
                } else {
                    TransferMode::Copy
                };
                let existing = Existing::from_overwrite(overwrite);
                node.copy(&src, dst_device, dst_name.as_deref(), mode, existing)
                    .await
                    .map(|desc| Response::Stored(desc.to_wire()))
            }
            Request::Delete { key } => node
                .remove(&key)
                .await
                .map(|desc| Response::Deleted(desc.to_wire())),
            Request::List { device } => self.list_whole(device).await,
            Request::ListPage {
                device,
                after,
                limit,
            } => node
                .list_page(device, after.as_ref(), limit as usize)
                .await
                .map(|(page, next)| Response::Page {
                    tensors: page.iter().map(|d| d.to_wire()).collect(),
                    next,
                }),
            Request::DeleteIf { key, content_hash } => node
                .remove_if_content(&key, &content_hash)
                .await
                .map(|desc| Response::Deleted(desc.to_wire())),
            Request::Stat => node.stats().await.map(Response::Stats),
            Request::Identify => Ok(Response::Identity {
                node_id: node.node_id().to_string(),
            }),
            Request::Grant { key, audience } => {
                node.grant(&key, &audience, self.id)
                    .await
                    .map(|(token, ttl, desc)| Response::Capability {
                        token,
                        expires_in_ms: ttl.as_millis() as u64,
                        info: desc.to_wire(),
                        content_hash: desc.content_hash,
                    })
            }
            Request::Pull {
                source,
                capability,
                src,
                dst_device,
                dst_name,
                overwrite,
                content_hash,
            } => {
                let request = PullRequest {
                    source,
                    capability,
                    src,
                    dst_device,
                    dst_name,
                    existing: Existing::from_overwrite(overwrite),
                    content_hash,
                };
                node.pull(&mut self.peer, &request)
                    .await
                    .map(|desc| Response::Stored(desc.to_wire()))
            }
            Request::Fetch {
                capability,
                node_id,
                offset,
            } => return self.fetch(conn, &capability, &node_id, offset).await,
            Request::Release {
                capability,
                node_id,
            } => node
                .release(&capability, &node_id, self.id)
                .map(|()| Response::Released),
        };
        conn.write_response(&reply.unwrap_or_else(|e| Response::Error(e.reply())))
            .await?;
        Ok(())
    }

    async fn put<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        device: u32,
        name: Option<String>,
        wire: &ferry_proto::WireMeta,
        existing: Existing,
    ) -> Result<(), ConnectionError> {
        let node = self.node;
        let started = std::time::Instant::now();
        let name = name.unwrap_or_else(|| node.fresh_name());
        // Everything about the tensor is checked, and its budget claimed, before one byte of it
        // is read or its buffer allocated.
        let admitted = TensorMeta::try_from(wire)
            .map_err(NodeError::from)
            .and_then(|meta| {
                let bytes = meta.byte_len() as u64;
                let admission =
                    node.admit(device, &name, &meta.dtype(), meta.shape(), bytes, existing)?;
                let assembler = node.receiver(device, meta)?.hashing();
                Ok((assembler, admission))
            });
        let (mut assembler, admission) = match admitted {
            Ok(admitted) => admitted,
            Err(error) => {
                node.recorder()
                    .transfer_ended("put", "-", false, started.elapsed());
                tracing::warn!(device, %name, %error, "put refused");
                conn.write_response(&Response::Error(error.reply())).await?;
                return Ok(());
            }
        };
        conn.write_response(&Response::Ready).await?;
        let region = match conn
            .read_payload_keeping(&mut assembler, RegionUse::Keep)
            .await
        {
            Ok((route, region)) => {
                let bytes = assembler.meta().byte_len() as u64;
                node.recorder().payload(Direction::Received, route, bytes);
                region
            }
            Err(error) => {
                // The rest of the stream cannot be trusted to line up with frames: report and
                // close. Nothing was registered; the buffer and the reservation go first, not
                // after the report (which may wait on the peer).
                drop(assembler);
                drop(admission);
                node.recorder()
                    .transfer_ended("put", "-", false, started.elapsed());
                tracing::warn!(device, %name, %error, "upload failed");
                return Err(fail(conn, error).await);
            }
        };
        let reply = match finish_hashed(assembler).await {
            Ok((data, hash)) => {
                let arrived = Arrived {
                    data,
                    hash: KnownHash::Computed(hash),
                    region,
                };
                node.register(admission, arrived)
                    .await
                    .map(|desc| Response::Stored(desc.to_wire()))
            }
            Err(error) => Err(error),
        };
        conn.write_response(&reply.unwrap_or_else(|e| Response::Error(e.reply())))
            .await?;
        Ok(())
    }

    /// Serves a node-to-node fetch under a capability, from `offset` on.
    async fn fetch<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        capability: &str,
        node_id: &str,
        offset: u64,
    ) -> Result<(), ConnectionError> {
        let lease = match self.node.begin_fetch(capability, node_id, self.id, offset) {
            Ok(lease) => lease,
            Err(error) => {
                tracing::warn!(%node_id, %error, "fetch refused");
                return conn.write_response(&Response::Error(error.reply())).await;
            }
        };
        let read = self
            .node
            .read_host_pinned(lease.key(), Some(lease.version()))
            .await;
        let (desc, meta, bytes) = match read {
            Ok(read) => read,
            // The version granted is gone for good: so is the capability.
            Err(NodeError::Changed(key) | NodeError::NotFound(key)) => {
                self.node.revoke(capability);
                let error = NodeError::CapabilityRefused(Refusal::VersionGone(key));
                return conn.write_response(&Response::Error(error.reply())).await;
            }
            Err(error) => return conn.write_response(&Response::Error(error.reply())).await,
        };
        let Ok(start) = usize::try_from(offset).map(|o| o.min(bytes.len())) else {
            let error = NodeError::OffsetOutOfRange {
                offset,
                bytes: bytes.len() as u64,
            };
            return conn.write_response(&Response::Error(error.reply())).await;
        };
        conn.write_response(&Response::Tensor {
            info: desc.to_wire(),
            meta: meta.to_wire(),
        })
        .await?;
        // A failed write drops the lease (the capability waits briefly for a resume) and the
        // host copy read for it.
        let route = conn
            .write_payload_known(&bytes.parts(), start, bytes.known())
            .await?;
        self.count_sent(route, bytes.len());
        self.node.recorder().fetch_served();
        lease.served();
        drop(lease);
        Ok(())
    }

    /// The old, unpaged listing: bounded to what one answer holds.
    async fn list_whole(&self, device: Option<u32>) -> Result<Response, NodeError> {
        let (page, next) = self.node.list_page(device, None, MAX_PAGE).await?;
        if let Some(next) = next
            && !self
                .node
                .list_page(device, Some(&next), 1)
                .await?
                .0
                .is_empty()
        {
            let indexes: Vec<u32> = match device {
                Some(index) => vec![index],
                None => self.node.devices().iter().map(|d| d.index()).collect(),
            };
            let mut tensors = 0u64;
            for index in indexes {
                tensors += self.node.summary(index).await?.tensors;
            }
            return Err(NodeError::ListingTooLarge {
                tensors,
                limit: MAX_PAGE,
            });
        }
        Ok(Response::Listing(
            page.iter().map(|d| d.to_wire()).collect(),
        ))
    }

    fn count_sent(&self, route: PayloadRoute, bytes: usize) {
        self.node
            .recorder()
            .payload(Direction::Sent, route, bytes as u64);
    }

    async fn get<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        key: &TensorKey,
    ) -> Result<(), ConnectionError> {
        match self.node.read_host(key).await {
            Ok((desc, meta, bytes)) => {
                conn.write_response(&Response::Tensor {
                    info: desc.to_wire(),
                    meta: meta.to_wire(),
                })
                .await?;
                let route = conn
                    .write_payload_known(&bytes.parts(), 0, bytes.known())
                    .await?;
                self.count_sent(route, bytes.len());
            }
            Err(error) => conn.write_response(&Response::Error(error.reply())).await?,
        }
        Ok(())
    }
}

/// The assembled tensor and its content hash, off the runtime: the hashing thread may still
/// be a chunk or two behind the receiver.
pub(crate) async fn finish_hashed(
    assembler: ferry_io::TensorAssembler,
) -> Result<(burn_backend::TensorData, String), NodeError> {
    tokio::task::spawn_blocking(move || assembler.finish_hashed())
        .await
        .map_err(|e| NodeError::Backend(format!("hashing task: {e}")))?
        .map_err(NodeError::Received)
}
