//! Which of this host's Unix users may connect: on the Unix socket always the node's own user
//! and root, and over TCP the same where the node asks no credential (no token, no TLS), so
//! that a default node on loopback is not every local user's to read and delete from.
//!
//! Over TCP the kernel says who holds the peer's socket (`ferry_io::local_peer`, one exact
//! socket lookup); a peer that is not on this host is another host's, left to the listen
//! address (beyond loopback only with `--insecure` where no credential is asked).

use std::time::Duration;

use ferry_io::Connection;
use ferry_io::ConnectionLimits;
use ferry_io::Stream;
use ferry_io::local_peer::{TcpPeer, tcp_peer, tcp_peers_visible};
use ferry_proto::{ErrorCode, ErrorReply, Response};
use tokio::net::{TcpStream, UnixStream};

use super::door::refusal_log::RefusalLog;

/// Who may open a TCP connection, settled when the service binds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TcpDoor {
    /// Every client shows a token or a certificate, which decides what it may do: anyone may
    /// try, local or not.
    Credentialed,
    /// No credential is asked: of this host's users only the node's own and root connect.
    OwnUserOnHost {
        /// The node's effective user id.
        own: u32,
    },
}

impl TcpDoor {
    /// The door of a node with or without credentials (a token or TLS). An open node first makes
    /// sure the kernel lets it see who connects; where it cannot, it does not start.
    pub(super) fn of(credentialed: bool) -> std::io::Result<TcpDoor> {
        if credentialed {
            return Ok(TcpDoor::Credentialed);
        }
        tcp_peers_visible().map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!(
                    "a node that asks no credential serves its own Unix user only, and cannot \
                     tell who connects here ({e}): give it a --token (or TLS)"
                ),
            )
        })?;
        Ok(TcpDoor::OwnUserOnHost {
            own: rustix::process::geteuid().as_raw(),
        })
    }

    /// `None` if the TCP peer may go on to its hello; else who it is, for the refusal.
    pub(super) fn refuses(self, socket: &TcpStream) -> Option<Stranger> {
        let TcpDoor::OwnUserOnHost { own } = self else {
            return None;
        };
        let (local, peer) = match (socket.local_addr(), socket.peer_addr()) {
            (Ok(local), Ok(peer)) => (local, peer),
            // Gone already.
            _ => return Some(Stranger::Unknown),
        };
        match tcp_peer(local, peer) {
            Ok(TcpPeer::Local { uid }) if uid == own || uid == 0 => None,
            Ok(TcpPeer::Local { uid }) => Some(Stranger::User { uid, own }),
            // Another host's: the listen address settles it.
            Ok(TcpPeer::OtherHost) => None,
            // From this host, but not seen: closed already, or hiding (a socket bound to a
            // device). Refused: only a peer seen to be the node's user is served.
            Ok(TcpPeer::Unseen) => Some(Stranger::Unknown),
            Err(error) => {
                LOOKUP_FAILED.note(&peer.to_string(), &error.to_string());
                Some(Stranger::Unknown)
            }
        }
    }
}

/// A local peer the door refused.
#[derive(Debug, Clone, Copy)]
pub(super) enum Stranger {
    /// Another Unix user of this host.
    User {
        /// The peer's user id.
        uid: u32,
        /// The node's.
        own: u32,
    },
    /// Its user could not be told (its socket gone, the lookup failed): refused all the same.
    Unknown,
}

/// `None` if a Unix peer may connect (the node's own user, or root); else who it is. The socket
/// file is the owner's only (mode 0600), but between `bind` and `chmod` another user could have
/// queued a connection; the kernel's word on who is calling settles it.
pub(super) fn unix_stranger(socket: &UnixStream) -> Option<Stranger> {
    let own = rustix::process::geteuid().as_raw();
    match socket.peer_cred() {
        Ok(cred) if cred.uid() == own || cred.uid() == 0 => None,
        Ok(cred) => Some(Stranger::User {
            uid: cred.uid(),
            own,
        }),
        Err(_) => Some(Stranger::Unknown),
    }
}

impl std::fmt::Display for Stranger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stranger::User { uid, own } => write!(f, "user {uid}, the node's is {own}"),
            Stranger::Unknown => f.write_str("user unknown"),
        }
    }
}

/// Another user of this host, on the Unix socket or over TCP.
pub(super) static OTHER_LOCAL_USER: RefusalLog =
    RefusalLog::new("accept", "connection refused: another local user");
/// The kernel could not say who holds a TCP peer's socket.
static LOOKUP_FAILED: RefusalLog = RefusalLog::new(
    "accept",
    "connection refused: could not tell which local user it is",
);

/// Tells a refused local peer why, in one error frame, and closes: the node's user is named,
/// and what would let the peer in.
pub(super) async fn refuse_stranger(socket: Stream, stranger: Stranger) {
    let mut conn = Connection::new(socket, ConnectionLimits::default());
    let message = match stranger {
        Stranger::User { uid, own } => format!(
            "this node asks no credential, so it serves only its own Unix user ({own}) and root \
             on this host, and you are user {uid}: ask its operator for a token (--token-file)"
        ),
        Stranger::Unknown => "this node asks no credential, so it serves only its own Unix user \
                              on this host, and could not tell which user you are"
            .to_string(),
    };
    let reply = Response::Error(ErrorReply {
        code: ErrorCode::AuthRefused,
        message,
    });
    let _ = tokio::time::timeout(Duration::from_secs(1), conn.write_response(&reply)).await;
}
