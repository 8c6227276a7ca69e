//! Which Unix user holds the other end of a TCP connection made from this very host, as the
//! kernel's socket diagnostics (`sock_diag`, what `ss` reads) tell it: what lets a node that
//! asks no credential serve its own user's loopback clients and refuse every other local user,
//! as the Unix socket's `SO_PEERCRED` check does.
//!
//! One exact lookup by the connection's two ends (no dump of every socket): a netlink request
//! and its single answer, a few microseconds, whatever the number of sockets on the host.
//! Linux only, as the rest of ferry.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use netlink_packet_core::{NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload};
use netlink_packet_sock_diag::SockDiagMessage;
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP};
use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketType, netlink};

/// Where the other end of a TCP connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpPeer {
    /// A socket on this host (in this network namespace), created by this Unix user.
    Local {
        /// The user id the kernel recorded for that socket.
        uid: u32,
    },
    /// Another host: the peer's address is none of this host's (a container in its own network
    /// namespace is another host as far as this goes).
    OtherHost,
    /// From one of this host's own addresses, but no open socket here was found with the
    /// connection's two ends: closed already, or bound to a device (`SO_BINDTODEVICE`), which an
    /// exact lookup does not see. Who it is cannot be told.
    Unseen,
}

/// `TCP_TIME_WAIT`: a closed socket's leftover, which the kernel reports as root's.
const TIME_WAIT: u8 = 6;
/// `TCP_LISTEN`: a listener, which the kernel answers with where no connection matched.
const LISTEN: u8 = 10;

/// The kernel's "no cookie": the socket is found by its two ends alone.
const NO_COOKIE: [u8; 8] = [0xff; 8];
/// The kernel answers within the request's own system call; this only bounds a broken one.
const ANSWER_WITHIN: Duration = Duration::from_secs(1);

/// Who holds the peer's end of the connection whose own end is `local` and whose peer is
/// `peer` (as `accept` reported them). An IPv4 connection seen through an IPv6 socket
/// (`::ffff:a.b.c.d`) is looked up as the IPv4 connection it is. Never blocks: the kernel has
/// answered by the time the request is sent.
pub fn tcp_peer(local: SocketAddr, peer: SocketAddr) -> io::Result<TcpPeer> {
    match lookup(local, peer)? {
        Some(uid) => Ok(TcpPeer::Local { uid }),
        None if is_own_address(peer) => Ok(TcpPeer::Unseen),
        None => Ok(TcpPeer::OtherHost),
    }
}

/// Whether `peer`'s address is one of this host's: a socket can be bound to it.
fn is_own_address(peer: SocketAddr) -> bool {
    let mut probe = match peer {
        SocketAddr::V6(v6) if v6.ip().to_ipv4_mapped().is_some() => {
            SocketAddr::new(peer.ip().to_canonical(), 0)
        }
        other => other,
    };
    probe.set_port(0);
    std::net::UdpSocket::bind(probe).is_ok()
}

/// The user id of the open socket with the connection's two ends, if the kernel has one.
fn lookup(local: SocketAddr, peer: SocketAddr) -> io::Result<Option<u32>> {
    let (source, destination) = (peer.ip().to_canonical(), local.ip().to_canonical());
    let family = match (source, destination) {
        (IpAddr::V4(_), IpAddr::V4(_)) => AF_INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => AF_INET6,
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{peer} and {local} are not of one address family"),
            ));
        }
    };
    let mut id = match family {
        AF_INET => SocketId::new_v4(),
        _ => SocketId::new_v6(),
    };
    // The peer's socket: its source is the peer, its destination this end.
    id.source_port = peer.port();
    id.destination_port = local.port();
    id.source_address = source;
    id.destination_address = destination;
    id.cookie = NO_COOKIE;
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST;
    let mut request = NetlinkMessage::new(
        header,
        SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::all(),
            socket_id: id.clone(),
        })
        .into(),
    );
    request.finalize();
    let mut bytes = vec![0; request.buffer_len()];
    request.serialize(&mut bytes);

    let diag = rustix::net::socket(
        AddressFamily::NETLINK,
        SocketType::RAW,
        Some(netlink::SOCK_DIAG),
    )?;
    rustix::net::sockopt::set_socket_timeout(
        &diag,
        rustix::net::sockopt::Timeout::Recv,
        Some(ANSWER_WITHIN),
    )?;
    rustix::net::sendto(
        &diag,
        &bytes,
        SendFlags::empty(),
        &netlink::SocketAddrNetlink::new(0, 0),
    )?;
    // One answer, queued before `sendto` returned: the socket's description (under a hundred
    // bytes with no extensions asked) or an error.
    let mut answer = [0u8; 4096];
    let (received, _) = rustix::net::recv(&diag, &mut answer[..], RecvFlags::DONTWAIT)?;
    let answer = answer.get(..received).unwrap_or_default();
    let message = NetlinkMessage::<SockDiagMessage>::deserialize(answer)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("sock_diag: {e}")))?;
    match message.payload {
        // The socket asked for, open. (Its addresses as the kernel keeps them: an IPv6 socket
        // talking IPv4 reports them mapped.)
        NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(found)) => {
            let found_id = &found.header.socket_id;
            let exact = found_id.source_port == id.source_port
                && found_id.destination_port == id.destination_port
                && found_id.source_address.to_canonical() == source
                && found_id.destination_address.to_canonical() == destination;
            // Anything else (a listener that happens to have the peer's port, a closed
            // socket's leftover, reported as root's) is not the peer's open socket.
            let open = !matches!(found.header.state, TIME_WAIT | LISTEN);
            Ok((exact && open).then_some(found.header.uid))
        }
        NetlinkPayload::Error(error) => match error.code.map(|code| code.get()) {
            Some(code) if code == -libc::ENOENT => Ok(None),
            Some(code) => Err(io::Error::from_raw_os_error(-code)),
            None => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "sock_diag acknowledged a lookup without answering it",
            )),
        },
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("sock_diag answered a lookup with {other:?}"),
        )),
    }
}

/// Whether [`tcp_peer`] sees this host's TCP sockets at all: a loopback connection made here
/// must be found, this process's own. Where the kernel lacks its TCP diagnostics (a container
/// whose host never loaded them) every peer would look like another host's, so a node that
/// needs to tell local users apart asks this first.
pub fn tcp_peers_visible() -> io::Result<()> {
    let listener = std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))?;
    let _client = std::net::TcpStream::connect(listener.local_addr()?)?;
    let (accepted, peer) = listener.accept()?;
    let own = rustix::process::geteuid().as_raw();
    match tcp_peer(accepted.local_addr()?, peer)? {
        TcpPeer::Local { uid } if uid == own => Ok(()),
        found => Err(io::Error::other(format!(
            "the kernel's socket diagnostics do not see this host's TCP sockets (a loopback \
             connection of user {own} came back as {found:?}; is the tcp_diag module loaded?)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_connection_is_this_users_and_unknown_ends_are_unseen_or_another_host() {
        tcp_peers_visible().unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, peer) = listener.accept().unwrap();
        let local = accepted.local_addr().unwrap();
        let own = rustix::process::geteuid().as_raw();
        assert_eq!(tcp_peer(local, peer).unwrap(), TcpPeer::Local { uid: own });
        // The same ends seen through an IPv6 socket.
        let mapped = |a: SocketAddr| match a.ip() {
            IpAddr::V4(v4) => SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), a.port()),
            IpAddr::V6(_) => a,
        };
        assert_eq!(
            tcp_peer(mapped(local), mapped(peer)).unwrap(),
            TcpPeer::Local { uid: own }
        );
        // No socket has these ends, from one of this host's addresses.
        let nobody_there = SocketAddr::new(peer.ip(), 1);
        assert_eq!(tcp_peer(local, nobody_there).unwrap(), TcpPeer::Unseen);
        // An address of no host here (TEST-NET-1, RFC 5737).
        let far = SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 1)), 40000);
        assert_eq!(tcp_peer(local, far).unwrap(), TcpPeer::OtherHost);
    }

    /// A client whose own socket is IPv6, talking IPv4 (`::ffff:127.0.0.1`): the kernel
    /// reports its ends mapped, and it is still found.
    #[test]
    fn an_ipv6_socket_talking_ipv4_is_found() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let _client = std::net::TcpStream::connect(("::ffff:127.0.0.1", port)).unwrap();
        let (accepted, peer) = listener.accept().unwrap();
        let own = rustix::process::geteuid().as_raw();
        assert_eq!(
            tcp_peer(accepted.local_addr().unwrap(), peer).unwrap(),
            TcpPeer::Local { uid: own }
        );
    }

    /// A socket bound to a device (`SO_BINDTODEVICE`, which needs root here, as the tests run
    /// in CI; any user may bind to `lo` on recent kernels) escapes the exact lookup: from one of
    /// this host's addresses, it is `Unseen`, never another host.
    #[test]
    fn a_socket_bound_to_a_device_is_unseen_not_another_host() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let to = listener.local_addr().unwrap();
        let socket =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket.bind_device(Some(b"lo")).unwrap();
        socket.connect(&to.into()).unwrap();
        let (accepted, peer) = listener.accept().unwrap();
        assert_eq!(
            tcp_peer(accepted.local_addr().unwrap(), peer).unwrap(),
            TcpPeer::Unseen
        );
    }

    /// A socket a thread made as another user (which needs root: as the tests run in CI) is
    /// that user's.
    #[test]
    fn a_connection_made_as_another_user_is_that_users() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let to = listener.local_addr().unwrap();
        let client = std::thread::spawn(move || {
            // Linux keeps user ids per thread: only this thread becomes `nobody`.
            let nobody = rustix::process::Uid::from_raw(65534);
            rustix::thread::set_thread_res_uid(nobody, nobody, nobody)
                .expect("these tests run as root, which may take another user's id");
            std::net::TcpStream::connect(to).unwrap()
        })
        .join()
        .unwrap();
        let (accepted, peer) = listener.accept().unwrap();
        assert_eq!(
            tcp_peer(accepted.local_addr().unwrap(), peer).unwrap(),
            TcpPeer::Local { uid: 65534 }
        );
        drop(client);
    }
}
