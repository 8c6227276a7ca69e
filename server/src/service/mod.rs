//! The service: accepts connections (TCP, and a Unix socket where asked), runs one session per
//! connection, shuts down gracefully.
//!
//! Bounded everywhere: a semaphore on connections (at the limit the oldest connection still
//! waiting for its hello makes room, else the newcomer is told so and closed), a maximum frame body, an idle timeout in the middle of a frame, a per-tensor
//! limit and a per-device memory budget checked before a payload's buffer is allocated.

use std::future::Future;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ferry_io::transport::UnixTransport;
use ferry_io::{Connection, ConnectionLimits, NodeTls, Stream};
use ferry_proto::{ErrorCode, ErrorReply, Response};
use tokio::net::{TcpListener, UnixListener, UnixStream};
use tokio::sync::{Semaphore, broadcast, mpsc};

use crate::node::{Node, Refused};
use crate::peer::PeerLink;
use awaiting_hello::{AwaitingHello, Place};
use door::certificate_grant::CertificateGrant;
use door::credential::{Credential, Scopes};
use door::handshake;
use door::refusal_log::RefusalLog;
use local_users::{OTHER_LOCAL_USER, TcpDoor, refuse_stranger, unix_stranger};
use per_address::{PerAddress, counted_as};
use per_identity::{PerIdentity, default_share};
use session::Session;

pub use bind_error::BindError;
pub use exposure::{Exposure, ExposureError, Missing};
pub(crate) use exposure::{Protections, metrics_door, service_door};

mod awaiting_hello;
mod bind_error;
pub(crate) mod door;
mod exposure;
mod local_users;
mod per_address;
mod per_identity;
mod session;

/// How long a connection has waited for its hello at least before it is closed to make room: a
/// client whose hello is on its way (a few milliseconds, more on a loaded machine) is not
/// closed for a newcomer. Shorter than [`MAKING_ROOM`], which a newcomer waits.
const SILENT_BEFORE_EVICTION: Duration = Duration::from_millis(250);

/// How long a newcomer waits for the slot an evicted silent connection gives back.
const MAKING_ROOM: Duration = Duration::from_secs(1);

/// The largest control frame body (a request) a node takes once a connection is welcomed: the
/// largest request (a put's key and description, a pull's addresses and capability) is a few KiB.
const MAX_REQUEST_BODY: usize = 64 * 1024;

/// The largest frame body accepted before a connection's `Hello` is answered.
const HANDSHAKE_MAX_BODY: usize = 64 * 1024;

/// How the service listens and what it allows.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// The tokens a client must present one of over TCP in clear, each with what it allows;
    /// none for no authentication (every client may do everything). A node with TLS takes none
    /// (`Service::bind` refuses them): a token would travel to whatever node a client reaches.
    pub credentials: Vec<Credential>,
    /// Under TLS, the scopes granted to certificate identities (and `peer` to every node
    /// certificate); with none, every certificate of the CA may do everything. Without TLS
    /// there is no identity to grant to (`Service::bind` refuses them).
    pub grants: Vec<CertificateGrant>,
    /// Connections served at once.
    pub max_connections: usize,
    /// Frame, chunk and idle limits.
    pub limits: ConnectionLimits,
    /// How long in-flight requests may take to finish at shutdown.
    pub shutdown_grace: Duration,
    /// How long a connection may sit between requests before the node closes it, so that idle
    /// connections cannot hold every connection slot; zero for never.
    pub keepalive: Duration,
    /// How long a new connection may take to say `Hello` before it is closed: a socket that
    /// never speaks holds a connection slot for this long at most.
    pub hello_timeout: Duration,
    /// Connections served at once from one IP address (an IPv6 host by its /64; Unix sockets
    /// apart), counted from accept: one host cannot take every slot. Clients behind one NAT, and
    /// a node's pulls from this one, share their address's.
    pub max_connections_per_address: NonZeroUsize,
    /// Connections served at once of one identity (a token credential, a certificate's
    /// identity, the node's own user on its Unix socket), counted from its hello: one
    /// credential's holder cannot take every slot, from however many addresses. `None` for
    /// three quarters of `max_connections` (a quarter kept for the others). A node that asks no
    /// credential has one kind of client only, and no such limit.
    pub max_connections_per_identity: Option<NonZeroUsize>,
    /// Whether it may listen beyond loopback without TLS, a credential or a peer list
    /// ([`Exposure::Guarded`], the default, refuses; `ferry-server --insecure` is
    /// [`Exposure::Insecure`]).
    pub exposure: Exposure,
}

/// The default [`ServiceConfig::max_connections_per_address`]: a quarter of the default
/// connection limit, room for a client's pool of connections and a load test's.
pub const DEFAULT_MAX_CONNECTIONS_PER_ADDRESS: NonZeroUsize =
    NonZeroUsize::new(256).expect("256 is not zero");

/// The default [`ServiceConfig::hello_timeout`]: a client says hello within a round trip of
/// connecting; a few seconds leave room for a loaded machine.
pub const DEFAULT_HELLO_TIMEOUT: Duration = Duration::from_secs(5);

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            credentials: Vec::new(),
            grants: Vec::new(),
            max_connections: 1024,
            limits: ConnectionLimits::default(),
            shutdown_grace: Duration::from_secs(30),
            keepalive: Duration::from_secs(300),
            hello_timeout: DEFAULT_HELLO_TIMEOUT,
            max_connections_per_address: DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
            max_connections_per_identity: None,
            exposure: Exposure::Guarded,
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
    door: TcpDoor,
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
    /// Binds `addr` (`127.0.0.1:0` picks a free port). A node that asks no credential (no
    /// token, no TLS) serves only its own Unix user and root among this host's users, over TCP
    /// as on its Unix socket; it does not bind where the kernel cannot say who connects.
    ///
    /// Refused ([`BindError`]): tokens with TLS and grants without it; beyond loopback, under
    /// [`Exposure::Guarded`] (the default), a listener without TLS, without a credential, or
    /// over a node that pulls from any address a client names ([`PeerPolicy::Any`]).
    ///
    /// [`PeerPolicy::Any`]: crate::PeerPolicy::Any
    pub async fn bind(
        node: Node,
        addr: SocketAddr,
        config: ServiceConfig,
    ) -> Result<Self, BindError> {
        let tls = node.config().tls.is_some();
        if tls && !config.credentials.is_empty() {
            return Err(BindError::TokensUnderTls);
        }
        if !tls && !config.grants.is_empty() {
            return Err(BindError::GrantsWithoutTls);
        }
        let protections = Protections {
            tls,
            credential: !config.credentials.is_empty() || !config.grants.is_empty(),
            listed_peers: !matches!(node.config().pulls.peers, crate::PeerPolicy::Any),
        };
        if let Some(missing) = service_door(addr, protections, config.exposure)? {
            tracing::warn!(%addr, %missing, "Exposure::Insecure: serving beyond loopback with {missing}");
        }
        let credentialed = !config.credentials.is_empty() || tls;
        let door = TcpDoor::of(credentialed).map_err(BindError::Door)?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| BindError::Io { addr, source })?;
        Ok(Self {
            node,
            listener,
            unix: None,
            config: Arc::new(config),
            door,
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
    let awaiting = Arc::new(AwaitingHello::new(SILENT_BEFORE_EVICTION));
    let per_address = PerAddress::new(service.config.max_connections_per_address);
    let per_identity = PerIdentity::new(per_identity_share(&service.config));
    loop {
        let accepted = tokio::select! {
            tcp = service.listener.accept() => tcp.map(|(socket, peer)| {
                // Frames are written whole; waiting to coalesce them only adds latency.
                let _ = socket.set_nodelay(true);
                (Stream::Tcp(socket), peer.to_string(), Some(peer.ip()))
            }),
            unix = accept_unix(service.unix.as_ref()) => unix.map(|socket| {
                let peer = unix_peer(&socket);
                // The node's own user (checked below): no address to count it under.
                (Stream::Unix(UnixTransport::new(socket)), peer, None)
            }),
        };
        // Another user of this host, where only the node's own may connect: told, and closed
        // before it holds any slot.
        let stranger = match &accepted {
            Ok((Stream::Unix(unix), ..)) => unix_stranger(unix.get_ref()),
            Ok((Stream::Tcp(tcp), ..)) => service.door.refuses(tcp),
            _ => None,
        };
        let accepted = match (accepted, stranger) {
            (Ok((socket, peer, _)), Some(stranger)) => {
                OTHER_LOCAL_USER.note(&peer, &stranger.to_string());
                service
                    .node
                    .recorder()
                    .connection_refused(Refused::LocalUser);
                tokio::spawn(refuse_stranger(socket, stranger));
                continue;
            }
            (accepted, _) => accepted,
        };
        // One deadline from here for the TLS handshake and the hello together.
        let hello_by = tokio::time::Instant::now() + service.config.hello_timeout;
        let (socket, peer, ip) = match accepted {
            Ok(accepted) => accepted,
            // Out of file descriptors and the like: back off rather than spin or die.
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // One address holds so many slots at most, speaking or not (before the limit below, so
        // that its silent sockets cannot make another host's connections give way). At that
        // limit the address's own connection that has waited longest for its hello makes room:
        // one local user's silent sockets cannot keep out another on the same loopback address.
        let address = ip.map(counted_as);
        // In the address's line before anyone is told to close, so that the slot freed is
        // handed to this newcomer, not to whoever comes next.
        let address_slot = match address.map(|a| (a, per_address.queue_for(a))) {
            Some((address, Err(waiter))) if awaiting.evict_oldest_from(address) => {
                AddressSlotFor::MadeRoom(waiter)
            }
            Some((_, Err(_out_of_line))) => {
                AT_ADDRESS_LIMIT.note(&peer, "no silent connection of the address to close");
                service
                    .node
                    .recorder()
                    .connection_refused(Refused::AddressLimit);
                let why = Full::Address(per_address.limit());
                tokio::spawn(refuse(socket, service.node.clone(), why));
                continue;
            }
            Some((_, Ok(slot))) => AddressSlotFor::Held(Some(slot)),
            None => AddressSlotFor::Held(None),
        };
        // At the limit, the connection that has waited longest for its hello (and has been
        // silent a moment) makes room. A newcomer that made room in its address waits for the
        // node slot that connection gives back too, and closes nothing else.
        let made_room = matches!(address_slot, AddressSlotFor::MadeRoom(_));
        let permit = match permits.clone().try_acquire_owned() {
            Ok(permit) => Some(permit),
            Err(_) if made_room || awaiting.evict_oldest() => None,
            Err(_) => {
                AT_NODE_LIMIT.note(&peer, "no silent connection to close");
                service
                    .node
                    .recorder()
                    .connection_refused(Refused::NodeLimit);
                let why = Full::Node(service.config.max_connections);
                tokio::spawn(refuse(socket, service.node.clone(), why));
                continue;
            }
        };
        let node = service.node.clone();
        let config = service.config.clone();
        let shutdown = notify_shutdown.subscribe();
        let done = done_tx.clone();
        let permits = permits.clone();
        let awaiting = awaiting.clone();
        let per_address = per_address.clone();
        let per_identity = per_identity.clone();
        // Queued here, in accept order, if it holds its slots already; a newcomer waiting for a
        // slot it made room for queues once it holds that slot (only a connection that holds
        // its slots can be evicted to free one).
        let holds_slots = permit.is_some() && matches!(address_slot, AddressSlotFor::Held(_));
        let place = holds_slots.then(|| awaiting.enter(address));
        tokio::spawn(async move {
            let address_slot = match address_slot {
                AddressSlotFor::Held(slot) => slot,
                // The evicted connection gives its slot back as it closes; another newcomer from
                // the address may take it first.
                AddressSlotFor::MadeRoom(waiter) => match waiter.wait(MAKING_ROOM).await {
                    Some(slot) => Some(slot),
                    None => {
                        drop(permit);
                        AT_ADDRESS_LIMIT.note(&peer, "the slot made room for went to another");
                        node.recorder().connection_refused(Refused::AddressLimit);
                        let why = Full::Address(per_address.limit());
                        refuse(socket, node.clone(), why).await;
                        return;
                    }
                },
            };
            let permit = match permit {
                Some(permit) => permit,
                // The evicted connection gives its slot back as it closes; another newcomer may
                // take it first.
                None => match tokio::time::timeout(MAKING_ROOM, permits.acquire_owned()).await {
                    Ok(Ok(permit)) => permit,
                    _ => {
                        // Its address slot goes to whoever waits for it while this one is told.
                        drop(address_slot);
                        AT_NODE_LIMIT.note(&peer, "the slot made room for went to another");
                        node.recorder().connection_refused(Refused::NodeLimit);
                        refuse(socket, node.clone(), Full::Node(config.max_connections)).await;
                        return;
                    }
                },
            };
            let mut place = place.unwrap_or_else(|| awaiting.enter(address));
            let tls = node.config().tls.as_ref();
            let socket = match secure(socket, tls, &peer, &mut place, hello_by).await {
                Ok(socket) => socket,
                Err(Unsecured::Refused) => {
                    node.recorder().connection_refused(Refused::TlsHandshake);
                    return;
                }
                Err(Unsecured::TooSlow) => {
                    node.recorder().connection_refused(Refused::HelloDeadline);
                    return;
                }
                Err(Unsecured::Evicted) => return,
            };
            // The Unix socket's peers were checked to be the node's own user or root above; a
            // TLS peer's certificate, in the handshake.
            let door = match (&socket, socket.peer_identity()) {
                (Stream::Unix(_), _) => handshake::Door::OwnUserSocket,
                (_, Some(identity)) => handshake::Door::Certified(identity.clone()),
                (_, None) => handshake::Door::Clear,
            };
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
                scopes: Scopes::of(&[]),
                hello_by,
                door,
                per_identity: &per_identity,
                models: session::SessionModels::default(),
            }
            .serve(&mut conn, place)
            .await;
            if let Err(error) = result {
                CLOSED_ON_ERROR.note(&peer, &error.to_string());
            }
            node.client_gone(id);
            drop(open);
            drop(address_slot);
            drop(permit);
            drop(done);
        });
    }
}

// Every line a stranger can cause before its hello, each kind bounded in rate: one line a second
// at most, carrying how many went unlogged (a flood of sockets or garbage cannot fill the log).
/// Refused at the per-address limit.
static AT_ADDRESS_LIMIT: RefusalLog =
    RefusalLog::new("accept", "connection refused: at the per-address limit");
/// Refused at the node's connection limit.
static AT_NODE_LIMIT: RefusalLog =
    RefusalLog::new("accept", "connection refused: at the connection limit");
/// Closed before its hello: silent past the deadline, evicted, or not speaking the protocol.
pub(super) static CLOSED_BEFORE_HELLO: RefusalLog =
    RefusalLog::new("hello", "connection closed before its hello");
/// Closed on an error after its hello (a malformed request, a broken upload): a client that
/// connects again and again cannot fill the log either.
static CLOSED_ON_ERROR: RefusalLog = RefusalLog::new("session", "connection closed on error");
/// A failed TLS handshake: anyone can open a socket and fail one.
static TLS_REFUSALS: RefusalLog = RefusalLog::new("TLS handshake", "authentication refused");

/// A new connection's place in its address's count.
enum AddressSlotFor {
    /// Held (`None`: a connection of no address, a Unix socket).
    Held(Option<per_address::AddressSlot>),
    /// The address was full; its oldest silent connection was told to close, and the newcomer
    /// waits first in line for the slot it gives back.
    MadeRoom(per_address::SlotWaiter),
}

/// Why a connection was not put under TLS.
enum Unsecured {
    /// The handshake failed (logged at a bounded rate, by [`secure`]).
    Refused,
    /// No handshake by the hello deadline.
    TooSlow,
    /// Its slot went to a newer connection first.
    Evicted,
}

/// Puts a TCP connection under the node's TLS, by the hello deadline and unless its slot goes to
/// a newer connection first; a Unix socket, or any stream of a node without TLS, as it is. A
/// failed handshake is logged at a bounded rate.
async fn secure(
    socket: Stream,
    tls: Option<&NodeTls>,
    peer: &str,
    place: &mut Place,
    hello_by: tokio::time::Instant,
) -> Result<Stream, Unsecured> {
    let (tls, tcp) = match (tls, socket) {
        (Some(tls), Stream::Tcp(tcp)) => (tls, tcp),
        (_, other) => return Ok(other),
    };
    tokio::select! {
        accepted = tokio::time::timeout_at(hello_by, tls.accept(tcp)) => match accepted {
            Ok(Ok(link)) => Ok(Stream::Tls(Box::new(link))),
            Ok(Err(error)) => {
                TLS_REFUSALS.note(peer, &error.to_string());
                Err(Unsecured::Refused)
            }
            Err(_) => {
                CLOSED_BEFORE_HELLO.note(peer, "no TLS handshake by the hello deadline");
                Err(Unsecured::TooSlow)
            }
        },
        _ = &mut place.evicted => {
            CLOSED_BEFORE_HELLO.note(peer, "its slot went to a newer connection, mid TLS handshake");
            Err(Unsecured::Evicted)
        }
    }
}

/// The most connections one identity holds at once: as configured, or three quarters of the
/// node's.
fn per_identity_share(config: &ServiceConfig) -> usize {
    config
        .max_connections_per_identity
        .map_or_else(|| default_share(config.max_connections), NonZeroUsize::get)
}

/// Completes after `keepalive`; never, where it is zero.
pub(super) async fn idle_for(keepalive: Duration) {
    if keepalive.is_zero() {
        std::future::pending::<()>().await;
    }
    tokio::time::sleep(keepalive).await;
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

/// Which connection limit a newcomer met.
#[derive(Debug, Clone, Copy)]
enum Full {
    /// The node's: this many connections at once, every one of which said hello.
    Node(usize),
    /// Its address's: this many connections from one address at once.
    Address(NonZeroUsize),
}

/// Tells a connection over a limit why it is closed, without waiting on it for long. A TCP
/// connection to a TLS node is closed without a word: nothing goes to a peer before its
/// certificate is verified, and a handshake is what the limit is there to spare.
async fn refuse(socket: Stream, node: Node, full: Full) {
    if node.config().tls.is_some() && matches!(socket, Stream::Tcp(_)) {
        return;
    }
    // Only this one answer goes out, and the peer never said hello: the default limits serve.
    let mut conn = Connection::new(socket, ConnectionLimits::default());
    let message = match full {
        Full::Node(limit) => {
            format!("the node serves at most {limit} connections at once; try again later")
        }
        Full::Address(limit) => format!(
            "the node serves at most {limit} connections from one address at once; close some \
             or try again later"
        ),
    };
    let reply = Response::Error(ErrorReply {
        code: ErrorCode::LimitExceeded,
        message,
    });
    let _ = tokio::time::timeout(Duration::from_secs(1), conn.write_response(&reply)).await;
}
