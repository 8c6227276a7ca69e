//! Where a node listens (`HOST:PORT` or `unix:PATH`) and the byte streams that reach it: TCP
//! (plain, or under mutual TLS), or a Unix socket that can also carry file descriptors
//! (shared-memory regions) with its bytes.

use std::collections::VecDeque;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

use crate::tls::{ClientTls, Identity};

/// The prefix that marks a Unix socket address.
pub const UNIX_PREFIX: &str = "unix:";

/// Descriptors received and not yet claimed by a region frame, at most. A peer that sends more
/// is breaking the protocol; the connection fails rather than holding them.
const MAX_QUEUED_FDS: usize = 4;

/// The most bytes one `recvmsg` reads.
const RECV_PIECE: usize = 256 * 1024;

/// A node's address: `HOST:PORT` (TCP) or `unix:PATH` (a Unix domain socket).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `HOST:PORT`, resolved when connecting.
    Tcp(String),
    /// The path of a Unix domain socket.
    Unix(PathBuf),
}

impl Endpoint {
    /// Reads `unix:PATH` as a Unix socket and anything else as `HOST:PORT`.
    pub fn parse(address: &str) -> Self {
        match address.strip_prefix(UNIX_PREFIX) {
            Some(path) => Endpoint::Unix(PathBuf::from(path)),
            None => Endpoint::Tcp(address.to_string()),
        }
    }

    /// Opens a stream to it: over TCP under `tls` where given (the node's certificate verified
    /// against its CA and address before anything is sent), in clear otherwise. A Unix socket
    /// never takes TLS: its peer is checked by the kernel instead.
    pub async fn connect(&self, tls: Option<&ClientTls>) -> io::Result<Stream> {
        match self {
            Endpoint::Tcp(addr) => {
                let socket = TcpStream::connect(addr.as_str()).await?;
                // Frames are written whole; waiting to coalesce them only adds latency.
                let _ = socket.set_nodelay(true);
                match tls {
                    Some(tls) => Ok(Stream::Tls(Box::new(tls.connect(socket, addr).await?))),
                    None => Ok(Stream::Tcp(socket)),
                }
            }
            Endpoint::Unix(path) => {
                let socket = UnixStream::connect(path).await?;
                check_unix_peer(&socket, path)?;
                Ok(Stream::Unix(UnixTransport::new(socket)))
            }
        }
    }
}

/// Whether the process on the other end of a Unix socket may be sent tokens and tensors: one of
/// this user's, or root's, as the kernel reports it (`SO_PEERCRED`). A socket path in a shared
/// directory could have been bound by anyone; nothing is sent before this holds.
fn check_unix_peer(socket: &UnixStream, path: &std::path::Path) -> io::Result<()> {
    let peer = socket.peer_cred()?.uid();
    let own = rustix::process::geteuid().as_raw();
    if peer == own || peer == 0 {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "{} is served by user {peer}, neither this user ({own}) nor root: nothing sent",
            path.display()
        ),
    ))
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Tcp(addr) => f.write_str(addr),
            Endpoint::Unix(path) => write!(f, "{UNIX_PREFIX}{}", path.display()),
        }
    }
}

impl From<&str> for Endpoint {
    fn from(address: &str) -> Self {
        Endpoint::parse(address)
    }
}

impl From<String> for Endpoint {
    fn from(address: String) -> Self {
        Endpoint::parse(&address)
    }
}

impl From<&String> for Endpoint {
    fn from(address: &String) -> Self {
        Endpoint::parse(address)
    }
}

impl From<&Endpoint> for Endpoint {
    fn from(endpoint: &Endpoint) -> Self {
        endpoint.clone()
    }
}

impl From<std::net::SocketAddr> for Endpoint {
    fn from(addr: std::net::SocketAddr) -> Self {
        Endpoint::Tcp(addr.to_string())
    }
}

impl From<&Path> for Endpoint {
    fn from(path: &Path) -> Self {
        Endpoint::Unix(path.to_path_buf())
    }
}

impl From<PathBuf> for Endpoint {
    fn from(path: PathBuf) -> Self {
        Endpoint::Unix(path)
    }
}

/// A byte stream ferry frames travel on, and whether file descriptors can travel with them.
pub trait Transport: AsyncRead + AsyncWrite + Unpin + Send {
    /// Whether this stream can carry file descriptors (a Unix socket).
    fn passes_fds(&self) -> bool {
        false
    }

    /// The oldest descriptor received with the bytes read so far and not yet claimed.
    fn take_fd(&mut self) -> Option<OwnedFd> {
        None
    }

    /// Sends `fd` with the next bytes written. Fails where descriptors cannot travel.
    fn attach_fd(&mut self, fd: OwnedFd) -> io::Result<()> {
        drop(fd);
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "file descriptors only travel on Unix sockets",
        ))
    }

    /// Bytes written that the peer has not read yet, where the stream can tell (a Unix socket).
    fn unread_by_peer(&self) -> Option<usize> {
        None
    }

    /// Whether the link itself authenticates every byte read (TLS's AEAD records, between two
    /// certified ends): a per-chunk checksum then adds nothing, and is not checked.
    fn authenticated(&self) -> bool {
        false
    }
}

impl Transport for TcpStream {}
impl Transport for tokio::io::DuplexStream {}
impl Transport for tokio_rustls::TlsStream<TcpStream> {
    fn authenticated(&self) -> bool {
        true
    }
}

/// A TCP stream under TLS and the identity its peer's certificate proved. Only a finished
/// handshake makes one (in `tls`), so its identity is always a verified one.
#[derive(Debug)]
pub struct TlsLink {
    stream: tokio_rustls::TlsStream<TcpStream>,
    peer: Identity,
}

impl TlsLink {
    pub(crate) fn new(stream: tokio_rustls::TlsStream<TcpStream>, peer: Identity) -> Self {
        Self { stream, peer }
    }

    /// Who the peer is, by its verified certificate.
    pub fn peer(&self) -> &Identity {
        &self.peer
    }
}

/// A Unix socket that reads with `recvmsg`, so descriptors sent with the bytes are kept (a plain
/// `read` would make the kernel close them), and writes an attached descriptor with `sendmsg`.
#[derive(Debug)]
pub struct UnixTransport {
    stream: UnixStream,
    received: VecDeque<OwnedFd>,
    outgoing: Option<OwnedFd>,
}

impl UnixTransport {
    /// Wraps a connected Unix stream.
    pub fn new(stream: UnixStream) -> Self {
        Self {
            stream,
            received: VecDeque::new(),
            outgoing: None,
        }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &UnixStream {
        &self.stream
    }
}

fn too_many_fds() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("peer sent more than {MAX_QUEUED_FDS} file descriptors not claimed by frames"),
    )
}

impl AsyncRead for UnixTransport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
        let this = self.get_mut();
        loop {
            ready!(this.stream.poll_read_ready(cx))?;
            // Zeroing is the price of handing recvmsg an initialised slice; bound it so a large
            // reservation is not cleared again on every read.
            let room = buf.remaining().min(RECV_PIECE);
            let dst = buf.initialize_unfilled_to(room);
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let result = this.stream.try_io(Interest::READABLE, || {
                let mut iov = [io::IoSliceMut::new(dst)];
                rustix::net::recvmsg(
                    &this.stream,
                    &mut iov,
                    &mut control,
                    RecvFlags::CMSG_CLOEXEC,
                )
                .map_err(io::Error::from)
            });
            match result {
                Ok(msg) => {
                    for message in control.drain() {
                        if let RecvAncillaryMessage::ScmRights(fds) = message {
                            this.received.extend(fds);
                        }
                    }
                    if msg.flags.contains(ReturnFlags::CTRUNC)
                        || this.received.len() > MAX_QUEUED_FDS
                    {
                        return Poll::Ready(Err(too_many_fds()));
                    }
                    buf.advance(msg.bytes);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for UnixTransport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        let this = self.get_mut();
        let Some(fd) = this.outgoing.as_ref() else {
            return Pin::new(&mut this.stream).poll_write(cx, data);
        };
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        loop {
            ready!(this.stream.poll_write_ready(cx))?;
            let fds = [std::os::fd::AsFd::as_fd(fd)];
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
                return Poll::Ready(Err(io::Error::other("no room for a descriptor")));
            }
            let result = this.stream.try_io(Interest::WRITABLE, || {
                rustix::net::sendmsg(
                    &this.stream,
                    &[io::IoSlice::new(data)],
                    &mut control,
                    SendFlags::NOSIGNAL,
                )
                .map_err(io::Error::from)
            });
            match result {
                Ok(n) => {
                    // The kernel holds its own reference now: ours can go.
                    this.outgoing = None;
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// `SIOCOUTQ`: on a Unix stream socket, the bytes sent and not yet consumed by the peer (they
/// stay charged to the sender until read). Linux defines it as `TIOCOUTQ` (`linux/sockios.h`),
/// whose number differs between architectures, so it is taken from `libc` rather than written
/// out. Other systems have no such request: there a socket cannot tell, and nothing asks, as
/// shared memory (the only user) is Linux's alone.
#[cfg(target_os = "linux")]
const SIOCOUTQ: rustix::ioctl::Opcode = libc::TIOCOUTQ as rustix::ioctl::Opcode;

impl Transport for UnixTransport {
    fn passes_fds(&self) -> bool {
        true
    }

    #[cfg(target_os = "linux")]
    fn unread_by_peer(&self) -> Option<usize> {
        // SAFETY: SIOCOUTQ writes one `int` on a socket, which is what the getter provides.
        let unread = unsafe {
            let getter = rustix::ioctl::Getter::<SIOCOUTQ, std::ffi::c_int>::new();
            rustix::ioctl::ioctl(&self.stream, getter)
        }
        .ok()?;
        usize::try_from(unread).ok()
    }

    fn take_fd(&mut self) -> Option<OwnedFd> {
        self.received.pop_front()
    }

    fn attach_fd(&mut self, fd: OwnedFd) -> io::Result<()> {
        if self.outgoing.is_some() {
            return Err(io::Error::other(
                "a descriptor is already waiting to be sent",
            ));
        }
        self.outgoing = Some(fd);
        Ok(())
    }
}

/// A connection's stream: TCP, TCP under TLS, or a Unix socket.
#[derive(Debug)]
pub enum Stream {
    /// TCP in clear.
    Tcp(TcpStream),
    /// TCP under mutual TLS.
    Tls(Box<TlsLink>),
    /// A Unix domain socket.
    Unix(UnixTransport),
}

impl Stream {
    /// On a Unix socket, that this very user serves it, root not counted: for a socket whose
    /// path came from someone else (a cluster's directory), where a root daemon that happens to
    /// listen there is not the node meant and must get no token. Other streams pass.
    pub fn require_own_user(&self) -> io::Result<()> {
        let Stream::Unix(unix) = self else {
            return Ok(());
        };
        let peer = unix.get_ref().peer_cred()?.uid();
        let own = rustix::process::geteuid().as_raw();
        if peer == own {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the Unix socket is served by user {peer}, not this user ({own}): nothing sent"
            ),
        ))
    }

    /// Who the peer is by its certificate, on a TLS link; `None` on any other.
    pub fn peer_identity(&self) -> Option<&Identity> {
        match self {
            Stream::Tls(link) => Some(&link.peer),
            Stream::Tcp(_) | Stream::Unix(_) => None,
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(&mut s.stream).poll_read(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, data),
            Stream::Tls(s) => Pin::new(&mut s.stream).poll_write(cx, data),
            Stream::Unix(s) => Pin::new(s).poll_write(cx, data),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(&mut s.stream).poll_flush(cx),
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(&mut s.stream).poll_shutdown(cx),
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

impl Transport for Stream {
    fn passes_fds(&self) -> bool {
        match self {
            Stream::Tcp(s) => s.passes_fds(),
            Stream::Tls(s) => s.stream.passes_fds(),
            Stream::Unix(s) => s.passes_fds(),
        }
    }

    fn take_fd(&mut self) -> Option<OwnedFd> {
        match self {
            Stream::Tcp(s) => s.take_fd(),
            Stream::Tls(s) => s.stream.take_fd(),
            Stream::Unix(s) => s.take_fd(),
        }
    }

    fn authenticated(&self) -> bool {
        match self {
            Stream::Tcp(s) => s.authenticated(),
            Stream::Tls(s) => s.stream.authenticated(),
            Stream::Unix(s) => s.authenticated(),
        }
    }

    fn unread_by_peer(&self) -> Option<usize> {
        match self {
            Stream::Tcp(s) => s.unread_by_peer(),
            Stream::Tls(s) => s.stream.unread_by_peer(),
            Stream::Unix(s) => s.unread_by_peer(),
        }
    }

    fn attach_fd(&mut self, fd: OwnedFd) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.attach_fd(fd),
            Stream::Tls(s) => s.stream.attach_fd(fd),
            Stream::Unix(s) => s.attach_fd(fd),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_by_prefix() {
        assert_eq!(
            Endpoint::parse("unix:/run/user/1000/ferry.sock"),
            Endpoint::Unix(PathBuf::from("/run/user/1000/ferry.sock"))
        );
        assert_eq!(
            Endpoint::parse("127.0.0.1:7070"),
            Endpoint::Tcp("127.0.0.1:7070".into())
        );
        assert_eq!(
            Endpoint::parse("unix:/tmp/a.sock").to_string(),
            "unix:/tmp/a.sock"
        );
    }

    /// Only a TLS stream vouches for its bytes (and so skips the chunks' checksum): TCP in clear,
    /// a Unix socket and an in-memory pipe never do.
    #[tokio::test]
    async fn only_tls_streams_are_authenticated() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let tcp = Endpoint::from(listener.local_addr().unwrap())
            .connect(None)
            .await
            .unwrap();
        assert!(!tcp.authenticated(), "TCP in clear");
        let (a, _b) = UnixStream::pair().unwrap();
        assert!(!Stream::Unix(UnixTransport::new(a)).authenticated(), "Unix");
        let (pipe, _other) = tokio::io::duplex(64);
        assert!(!pipe.authenticated(), "in-memory pipe");
    }

    /// A Unix socket another user serves (here bound by a thread that took another user's id,
    /// which needs root: as the tests run in CI) is refused before a byte is sent.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_unix_socket_served_by_another_user_is_refused_before_anything_is_sent() {
        use std::io::Read;
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let path = dir.path().join("other.sock");
        let bind_at = path.clone();
        let listener = std::thread::spawn(move || {
            // Linux keeps user ids per thread: only this thread becomes `nobody`.
            let nobody = rustix::process::Uid::from_raw(65534);
            rustix::thread::set_thread_res_uid(nobody, nobody, nobody)
                .expect("these tests run as root, which may take another user's id");
            std::os::unix::net::UnixListener::bind(&bind_at).unwrap()
        })
        .join()
        .unwrap();
        let refused = Endpoint::Unix(path).connect(None).await.err().unwrap();
        assert_eq!(refused.kind(), io::ErrorKind::PermissionDenied);
        assert!(refused.to_string().contains("user 65534"), "{refused}");
        let (mut accepted, _) = listener.accept().unwrap();
        let mut sent = Vec::new();
        accepted.read_to_end(&mut sent).unwrap();
        assert!(sent.is_empty(), "nothing reaches another user's socket");
    }

    /// A socket root serves passes the transport's own check but is not this user's own: for a
    /// path that came from someone else, `require_own_user` refuses it (here the connecting
    /// thread takes another user's id, which needs root: as the tests run in CI).
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_socket_root_serves_is_not_this_users_own() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let path = dir.path().join("root.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
        let runtime = tokio::runtime::Handle::current();
        let as_nobody = std::thread::spawn(move || {
            let _entered = runtime.enter();
            let nobody = rustix::process::Uid::from_raw(65534);
            rustix::thread::set_thread_res_uid(nobody, nobody, nobody)
                .expect("these tests run as root, which may take another user's id");
            let socket = std::os::unix::net::UnixStream::connect(&path).unwrap();
            socket.set_nonblocking(true).unwrap();
            let socket = UnixStream::from_std(socket).unwrap();
            check_unix_peer(&socket, &path).expect("root's socket passes the transport's check");
            Stream::Unix(UnixTransport::new(socket)).require_own_user()
        })
        .join()
        .unwrap();
        let refused = as_nobody.unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::PermissionDenied);
        assert!(refused.to_string().contains("user 0"), "{refused}");
        // A socket this user serves is its own.
        let (a, _b) = UnixStream::pair().unwrap();
        Stream::Unix(UnixTransport::new(a))
            .require_own_user()
            .unwrap();
    }
}
