//! `Dial`: how a client reaches a node and what it checks before it sends anything (the token
//! included): the transport, the peer's identity, then the handshake.

use ferry_proto::{NodeId, Token};

use super::{Exchange, ExchangeError};
use crate::connection::{Connection, ConnectionLimits};
use crate::handshake;
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
    /// Shared memory for payloads.
    pub shared_memory: SharedMemory,
    /// Frame, chunk and idle limits.
    pub limits: ConnectionLimits,
}

impl Dial<'_> {
    /// Connects to `endpoint`, checks the peer, and says hello.
    pub async fn open(&self, endpoint: &Endpoint) -> Result<Exchange, ExchangeError> {
        let socket = endpoint.connect(self.tls).await?;
        self.check_peer(&socket)?;
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
