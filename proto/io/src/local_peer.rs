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
    /// No socket on this host has the connection's two ends: the peer is another host (a
    /// container in its own network namespace is another host as far as this goes), or it has
    /// closed its end already.
    Elsewhere,
}

/// The kernel's "no cookie": the socket is found by its two ends alone.
const NO_COOKIE: [u8; 8] = [0xff; 8];
/// The kernel answers within the request's own system call; this only bounds a broken one.
const ANSWER_WITHIN: Duration = Duration::from_secs(1);

/// Who holds the peer's end of the connection whose own end is `local` and whose peer is
/// `peer` (as `accept` reported them). An IPv4 connection seen through an IPv6 socket
/// (`::ffff:a.b.c.d`) is looked up as the IPv4 connection it is.
pub fn tcp_peer(local: SocketAddr, peer: SocketAddr) -> io::Result<TcpPeer> {
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
    // One answer: the socket's description (under a hundred bytes with no extensions asked)
    // or an error.
    let mut answer = [0u8; 4096];
    let (received, _) = rustix::net::recv(&diag, &mut answer[..], RecvFlags::empty())?;
    let answer = answer.get(..received).unwrap_or_default();
    let message = NetlinkMessage::<SockDiagMessage>::deserialize(answer)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("sock_diag: {e}")))?;
    match message.payload {
        NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(found))
            if found.header.socket_id.source_port == id.source_port
                && found.header.socket_id.destination_port == id.destination_port
                && found.header.socket_id.source_address == source
                && found.header.socket_id.destination_address == destination =>
        {
            Ok(TcpPeer::Local {
                uid: found.header.uid,
            })
        }
        NetlinkPayload::Error(error) => match error.code.map(|code| code.get()) {
            Some(code) if code == -libc::ENOENT => Ok(TcpPeer::Elsewhere),
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
    fn a_loopback_connection_is_this_users_and_an_unknown_one_is_elsewhere() {
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
        // No socket has these ends.
        let nobody_there = SocketAddr::new(peer.ip(), 1);
        assert_eq!(tcp_peer(local, nobody_there).unwrap(), TcpPeer::Elsewhere);
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
