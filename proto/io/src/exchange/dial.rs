//! `Dial`: how a client reaches a node and what it checks before it sends anything (the token
//! included): the transport, the peer's identity, where a token may go in clear and who holds a
//! loopback port it goes to, then the handshake.

use std::io;
use std::net::SocketAddr;

use ferry_proto::{NodeId, Token};

use super::{Exchange, ExchangeError};
use crate::connection::{Connection, ConnectionLimits};
use crate::handshake;
use crate::local_peer::{self, TcpPeer};
use crate::tls::ClientTls;
use crate::transport::{Endpoint, Stream};

/// Who must answer at the address, checked on the open link before the first byte is sent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerCheck {
    /// Whoever the transport accepts: over TLS, any certificate the CA signed for the address.
    #[default]
    Any,
    /// The node with this id: over TCP its certificate must name it (TCP in clear shows none,
    /// and is refused); over a Unix socket this very user must serve it (root not counted).
    Node(NodeId),
    /// A certificate that names this node id, on any transport (a Unix socket shows none, and is
    /// refused).
    Certificate(NodeId),
    /// A certificate that names one of these node ids (an address several cluster members
    /// claim: whichever is there shows its certificate), on any transport.
    CertificateAmong(Vec<NodeId>),
    /// Over a Unix socket, this very user must serve it (root not counted); nothing more over
    /// TCP. For a socket whose path came from a cluster's directory.
    OwnUserSocket,
}

/// Whether to offer shared memory for payloads (taken up only on a Unix socket, where the node
/// agrees).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum SharedMemory {
    /// Offer it.
    #[default]
    Offer,
    /// Never: payloads go through the socket.
    Decline,
}

/// Where a token may travel over TCP in clear. It never travels under TLS (the certificate is
/// the credential there) nor over a Unix socket (the kernel's word on the user is), so this
/// rules TCP in clear alone, and only where there is a token: nothing secret leaves otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClearTokens {
    /// Only to a loopback address, whose port `server` must hold: beyond loopback anyone on the
    /// path could read the token. The default.
    LoopbackOnly {
        /// Who may hold the loopback port.
        server: LocalServer,
    },
    /// To any address: the explicit opt-in for a network one trusts (the command lines'
    /// `--insecure`). A loopback port must still be held by `server`.
    Anywhere {
        /// Who may hold a loopback port.
        server: LocalServer,
    },
}

impl Default for ClearTokens {
    fn default() -> Self {
        ClearTokens::LoopbackOnly {
            server: LocalServer::ThisUserOrRoot,
        }
    }
}

impl ClearTokens {
    /// Who may hold a loopback port a token goes to.
    pub fn server(self) -> LocalServer {
        match self {
            ClearTokens::LoopbackOnly { server } | ClearTokens::Anywhere { server } => server,
        }
    }
}

/// Who may hold a loopback port that a token goes to in clear, by the user the kernel recorded
/// for the node's socket (whoever created the listening socket). Any local user may bind a free
/// loopback port, while the node is down say, and would otherwise receive the token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum LocalServer {
    /// This process's effective user, or root.
    #[default]
    ThisUserOrRoot,
    /// This process's effective user, root, or the user with this id (a node that runs as a
    /// service account of its own).
    AlsoUser(u32),
}

impl LocalServer {
    /// Whether the user `uid` may hold the port, for a process whose effective user is `own`.
    fn admits(self, uid: u32, own: u32) -> bool {
        uid == own
            || uid == 0
            || match self {
                LocalServer::ThisUserOrRoot => false,
                LocalServer::AlsoUser(also) => uid == also,
            }
    }
}

/// Why a dial kept its token back. Nothing was sent, not even the hello.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenWithheld {
    /// The address is beyond loopback and tokens go in clear to loopback only.
    #[error(
        "refusing to send a token to {addr} in clear: it is beyond loopback, where anyone on the \
         path can read it; use TLS, or allow tokens in clear beyond loopback (--insecure) on a \
         network you trust; nothing was sent"
    )]
    BeyondLoopback {
        /// The address connected to.
        addr: SocketAddr,
    },
    /// The loopback port is held by a user that may not receive the token.
    #[error(
        "refusing to send a token to {addr}: that loopback port is held by user {uid}, not this \
         user ({own}){} nor root (another local user may have bound it while the node was \
         down); nothing was sent",
        match allowed {
            Some(also) => format!(", user {also}"),
            None => String::new(),
        }
    )]
    OtherLocalUser {
        /// The address connected to.
        addr: SocketAddr,
        /// The user holding the port.
        uid: u32,
        /// This process's effective user.
        own: u32,
        /// The other user allowed ([`LocalServer::AlsoUser`]), if any.
        allowed: Option<u32>,
    },
    /// Who holds the loopback port could not be told, so it cannot be trusted with the token.
    #[error(
        "refusing to send a token to {addr}: who holds that loopback port cannot be told \
         ({why}); nothing was sent"
    )]
    HolderUnknown {
        /// The address connected to.
        addr: SocketAddr,
        /// Why not.
        why: String,
    },
}

/// What carries a dial's bytes, as far as a token cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    /// TCP in clear, to `peer` (as the socket reports it, names resolved).
    ClearTcp {
        /// The peer's address.
        peer: SocketAddr,
    },
    /// TCP under TLS: no token is sent.
    Tls,
    /// A Unix socket: no token is sent.
    Unix,
}

/// Whether a dial may write its token: the rule alone, given whether there is a token, what
/// carries it, the rule, this process's effective user, and who holds a loopback port as the
/// kernel tells it (`holder`, asked only for a token going in clear to loopback).
fn token_may_go(
    token: bool,
    link: Link,
    rule: ClearTokens,
    own: u32,
    holder: impl FnOnce() -> io::Result<TcpPeer>,
) -> Result<(), TokenWithheld> {
    let Link::ClearTcp { peer } = link else {
        return Ok(());
    };
    if !token {
        return Ok(());
    }
    if !peer.ip().to_canonical().is_loopback() {
        return match rule {
            ClearTokens::Anywhere { .. } => Ok(()),
            ClearTokens::LoopbackOnly { .. } => Err(TokenWithheld::BeyondLoopback { addr: peer }),
        };
    }
    let server = rule.server();
    match holder() {
        Ok(TcpPeer::Local { uid }) if server.admits(uid, own) => Ok(()),
        Ok(TcpPeer::Local { uid }) => Err(TokenWithheld::OtherLocalUser {
            addr: peer,
            uid,
            own,
            allowed: match server {
                LocalServer::ThisUserOrRoot => None,
                LocalServer::AlsoUser(also) => Some(also),
            },
        }),
        Ok(TcpPeer::Unseen) => Err(TokenWithheld::HolderUnknown {
            addr: peer,
            why: "no socket found with the connection's ends (bound to a device?)".to_string(),
        }),
        Ok(TcpPeer::OtherHost) => Err(TokenWithheld::HolderUnknown {
            addr: peer,
            why: "the kernel places it on another host".to_string(),
        }),
        Err(e) => Err(TokenWithheld::HolderUnknown {
            addr: peer,
            why: format!("the kernel's socket diagnostics: {e}"),
        }),
    }
}

/// Everything a client says and checks when it opens a connection.
#[derive(Debug, Clone)]
pub struct Dial<'a> {
    /// The node's shared token, if it requires one.
    pub token: Option<&'a Token>,
    /// The software name the client reports.
    pub agent: &'a str,
    /// Mutual TLS over TCP: the CA the node's certificate must chain to, and this side's own
    /// certificate; `None` for TCP in clear. Unix sockets never take it.
    pub tls: Option<&'a ClientTls>,
    /// Who must answer.
    pub check: &'a PeerCheck,
    /// Where the token may go over TCP in clear, and who may hold a loopback port it goes to.
    pub clear_tokens: ClearTokens,
    /// Shared memory for payloads.
    pub shared_memory: SharedMemory,
    /// Frame, chunk and idle limits.
    pub limits: ConnectionLimits,
}

impl Dial<'_> {
    /// Connects to `endpoint`, checks the peer and that the token may go there
    /// ([`ExchangeError::TokenWithheld`] otherwise, nothing sent), and says hello.
    pub async fn open(&self, endpoint: &Endpoint) -> Result<Exchange, ExchangeError> {
        self.check_literal_address(endpoint)?;
        let socket = endpoint.connect(self.tls).await?;
        self.check_peer(&socket)?;
        self.check_token_may_go(&socket)?;
        // A token only where it is the credential, TCP in clear: on a Unix socket the node takes
        // the kernel's word on who is calling, under TLS the certificate's, so that a process
        // serving a path or address this client was given (by a directory, say), even with a
        // certificate of the CA, learns no token to replay elsewhere.
        let token = match socket {
            Stream::Tcp(_) => self.token.map(Token::as_str),
            Stream::Tls(_) | Stream::Unix(_) => None,
        };
        let mut conn = Connection::new(socket, self.limits);
        let offer = handshake::Offer {
            token,
            agent: self.agent,
            shared_memory: self.shared_memory == SharedMemory::Offer,
        };
        let welcome = handshake::hello(&mut conn, offer).await?;
        Ok(Exchange::new(conn, welcome))
    }

    /// Refuses before connecting where the address is an IP beyond loopback that the token
    /// may not go to in clear: the socket would show the same address, and no packet need
    /// reach it (nor a connection wait out an unroutable one) to know.
    fn check_literal_address(&self, endpoint: &Endpoint) -> Result<(), TokenWithheld> {
        let Endpoint::Tcp(addr) = endpoint else {
            return Ok(());
        };
        let Ok(peer) = addr.parse::<SocketAddr>() else {
            return Ok(());
        };
        if self.tls.is_some() || peer.ip().to_canonical().is_loopback() {
            return Ok(());
        }
        // Beyond loopback, the rule needs no word on who holds the port.
        token_may_go(
            self.token.is_some(),
            Link::ClearTcp { peer },
            self.clear_tokens,
            rustix::process::geteuid().as_raw(),
            || Err(io::Error::other("not connected")),
        )
    }

    /// Checks, on the open link and before any byte is written, that the token may go there
    /// ([`clear_tokens`](Self::clear_tokens)): by the address the socket itself reports (a
    /// name such as `localhost` resolved), and on loopback by who holds the port.
    fn check_token_may_go(&self, socket: &Stream) -> Result<(), ExchangeError> {
        let link = match socket {
            Stream::Tcp(tcp) => Link::ClearTcp {
                peer: tcp.peer_addr()?,
            },
            Stream::Tls(_) => Link::Tls,
            Stream::Unix(_) => Link::Unix,
        };
        let holder = || match socket {
            Stream::Tcp(tcp) => local_peer::tcp_peer(tcp.local_addr()?, tcp.peer_addr()?),
            Stream::Tls(_) | Stream::Unix(_) => Err(io::Error::other("not TCP in clear")),
        };
        Ok(token_may_go(
            self.token.is_some(),
            link,
            self.clear_tokens,
            rustix::process::geteuid().as_raw(),
            holder,
        )?)
    }

    /// Checks who serves `socket` against [`check`](Self::check).
    fn check_peer(&self, socket: &Stream) -> Result<(), ExchangeError> {
        let unix = matches!(socket, Stream::Unix(_));
        let certificate = |expected: &NodeId| {
            let certified = socket.peer_identity().map(|id| id.as_str());
            if certified == Some(expected.as_str()) {
                Ok(())
            } else {
                Err(ExchangeError::NotTheNode {
                    expected: expected.clone(),
                    certified: certified.map(str::to_string),
                })
            }
        };
        match self.check {
            PeerCheck::Any => Ok(()),
            PeerCheck::CertificateAmong(ids) => {
                let certified = socket.peer_identity().map(|id| id.as_str());
                match ids.iter().find(|id| Some(id.as_str()) == certified) {
                    Some(_) => Ok(()),
                    None => Err(ExchangeError::NotTheNode {
                        expected: NodeId::new(
                            ids.iter()
                                .map(NodeId::as_str)
                                .collect::<Vec<_>>()
                                .join(" or "),
                        ),
                        certified: certified.map(str::to_string),
                    }),
                }
            }
            PeerCheck::OwnUserSocket => Ok(socket.require_own_user()?),
            PeerCheck::Node(_) if unix => Ok(socket.require_own_user()?),
            PeerCheck::Node(expected) | PeerCheck::Certificate(expected) => certificate(expected),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// This process's effective user, as the cases see it.
    const OWN: u32 = 1000;
    const LOOPBACK: &str = "127.0.0.1:7070";
    const MAPPED_LOOPBACK: &str = "[::ffff:127.0.0.1]:7070";
    const V6_LOOPBACK: &str = "[::1]:7070";
    const REMOTE: &str = "192.0.2.1:7070";

    /// What the kernel says of the loopback port's holder, in a case.
    #[derive(Debug, Clone, Copy)]
    enum Holder {
        Uid(u32),
        Unseen,
        OtherHost,
        LookupFails,
    }

    /// What a case expects.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Verdict {
        Sent,
        BeyondLoopback,
        OtherLocalUser,
        HolderUnknown,
    }

    fn clear(addr: &str) -> Link {
        Link::ClearTcp {
            peer: addr.parse().unwrap(),
        }
    }

    #[test]
    fn a_token_goes_in_clear_only_where_the_rule_allows_and_to_loopback_held_by_an_allowed_user() {
        use Holder::*;
        use Verdict::*;
        let loopback_only = ClearTokens::default();
        let loopback_also_42 = ClearTokens::LoopbackOnly {
            server: LocalServer::AlsoUser(42),
        };
        let anywhere = ClearTokens::Anywhere {
            server: LocalServer::ThisUserOrRoot,
        };
        #[rustfmt::skip]
        let cases: &[(bool, Link, ClearTokens, Holder, Verdict)] = &[
            // No token: nothing secret leaves, nothing is checked.
            (false, clear(REMOTE), loopback_only, LookupFails, Sent),
            (false, clear(LOOPBACK), loopback_only, Uid(65534), Sent),
            (false, clear(LOOPBACK), loopback_only, LookupFails, Sent),
            // TLS and Unix sockets carry no token.
            (true, Link::Tls, loopback_only, Uid(65534), Sent),
            (true, Link::Unix, loopback_only, Uid(65534), Sent),
            // Beyond loopback: only with the opt-in.
            (true, clear(REMOTE), loopback_only, Uid(OWN), BeyondLoopback),
            (true, clear(REMOTE), loopback_also_42, Uid(OWN), BeyondLoopback),
            (true, clear(REMOTE), anywhere, LookupFails, Sent),
            // Loopback held by this user or root.
            (true, clear(LOOPBACK), loopback_only, Uid(OWN), Sent),
            (true, clear(LOOPBACK), loopback_only, Uid(0), Sent),
            (true, clear(V6_LOOPBACK), loopback_only, Uid(OWN), Sent),
            (true, clear(MAPPED_LOOPBACK), loopback_only, Uid(0), Sent),
            // Loopback held by another user: refused, the opt-in included, unless expected.
            (true, clear(LOOPBACK), loopback_only, Uid(65534), OtherLocalUser),
            (true, clear(MAPPED_LOOPBACK), loopback_only, Uid(65534), OtherLocalUser),
            (true, clear(LOOPBACK), anywhere, Uid(65534), OtherLocalUser),
            (true, clear(LOOPBACK), loopback_also_42, Uid(42), Sent),
            (true, clear(LOOPBACK), loopback_also_42, Uid(43), OtherLocalUser),
            // Loopback whose holder cannot be told: refused.
            (true, clear(LOOPBACK), loopback_only, Unseen, HolderUnknown),
            (true, clear(LOOPBACK), loopback_only, OtherHost, HolderUnknown),
            (true, clear(LOOPBACK), loopback_only, LookupFails, HolderUnknown),
            (true, clear(LOOPBACK), anywhere, LookupFails, HolderUnknown),
        ];
        for &(token, link, rule, holder, expected) in cases {
            let asked = Cell::new(false);
            let lookup = || {
                asked.set(true);
                match holder {
                    Uid(uid) => Ok(TcpPeer::Local { uid }),
                    Unseen => Ok(TcpPeer::Unseen),
                    OtherHost => Ok(TcpPeer::OtherHost),
                    LookupFails => Err(io::Error::other("no sock_diag")),
                }
            };
            let verdict = match token_may_go(token, link, rule, OWN, lookup) {
                Ok(()) => Sent,
                Err(TokenWithheld::BeyondLoopback { .. }) => BeyondLoopback,
                Err(TokenWithheld::OtherLocalUser { .. }) => OtherLocalUser,
                Err(TokenWithheld::HolderUnknown { .. }) => HolderUnknown,
            };
            let case = format!("token {token}, {link:?}, {rule:?}, {holder:?}");
            assert_eq!(verdict, expected, "{case}");
            // The kernel is asked only where its answer decides: a token to loopback in clear.
            let decides = token
                && matches!(link, Link::ClearTcp { peer } if peer.ip().to_canonical().is_loopback());
            assert_eq!(asked.get(), decides, "asked the kernel? {case}");
        }
    }

    #[test]
    fn a_refusal_names_the_address_the_user_and_what_to_do() {
        let addr: SocketAddr = LOOPBACK.parse().unwrap();
        let squatter = token_may_go(
            true,
            Link::ClearTcp { peer: addr },
            ClearTokens::default(),
            OWN,
            || Ok(TcpPeer::Local { uid: 65534 }),
        )
        .unwrap_err();
        let said = squatter.to_string();
        assert!(
            said.contains("127.0.0.1:7070") && said.contains("user 65534") && said.contains("1000"),
            "{said}"
        );
        let remote = token_may_go(true, clear(REMOTE), ClearTokens::default(), OWN, || {
            unreachable!("beyond loopback, the kernel is not asked")
        })
        .unwrap_err()
        .to_string();
        assert!(
            remote.contains("192.0.2.1:7070")
                && remote.contains("in clear")
                && remote.contains("TLS")
                && remote.contains("--insecure"),
            "{remote}"
        );
    }
}
