//! The opening exchange of every connection, both sides: `Hello` and `Welcome`, the major
//! version, the token, and the features both ends agree on (shared memory only where both
//! offered it and the transport can pass file descriptors).

use std::time::Duration;

use ferry_proto::{
    ErrorCode, ErrorReply, FEATURE_SHM, FEATURES, FrameError, Hello, PROTOCOL_MINOR,
    PROTOCOL_VERSION, ProtoError, Request, Response, Welcome, control,
};

use crate::connection::{Connection, ConnectionError};
use crate::credential::{Credential, Scopes, scopes_for};
use crate::refusal_log::RefusalLog;
use crate::transport::Transport;

/// Why the opening exchange failed, as the connecting side sees it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HelloError {
    /// The connection failed or the node broke the protocol.
    #[error(transparent)]
    Connection(#[from] ConnectionError),
    /// The node refused (another major version, a wrong token, no room).
    #[error("{:?}: {}", .0.code, .0.message)]
    Refused(ErrorReply),
    /// The node answered something other than `Welcome`.
    #[error("unexpected answer to Hello: {0}")]
    Unexpected(String),
}

/// What the connecting side offers.
#[derive(Debug, Clone)]
pub struct Offer<'a> {
    /// The node's token, if it requires one.
    pub token: Option<&'a str>,
    /// The software name to report.
    pub agent: &'a str,
    /// Offer shared memory (taken up only on a transport that can pass descriptors).
    pub shared_memory: bool,
}

/// Says hello over a fresh connection and returns the node's `Welcome`; shared memory is then in
/// force on `conn` exactly where this side offered it and the node agreed, and `conn` talks as
/// of the lower of the two minors.
pub async fn hello<S: Transport>(
    conn: &mut Connection<S>,
    offer: Offer<'_>,
) -> Result<Welcome, HelloError> {
    let mut features: Vec<String> = FEATURES.iter().map(|f| f.to_string()).collect();
    let offered = offer.shared_memory && conn.can_share_memory();
    if offered {
        features.push(FEATURE_SHM.to_string());
    }
    conn.write_request(&Request::Hello(Hello {
        major: PROTOCOL_VERSION,
        minor: PROTOCOL_MINOR,
        features,
        token: offer.token.map(ferry_proto::Token::from),
        agent: offer.agent.to_string(),
    }))
    .await?;
    let welcome = match conn.read_response().await? {
        Response::Welcome(welcome) => welcome,
        Response::Error(reply) => return Err(HelloError::Refused(reply)),
        other => return Err(HelloError::Unexpected(format!("{other:?}"))),
    };
    conn.set_peer_minor(welcome.minor);
    conn.set_shared_memory(offered && welcome.features.iter().any(|f| f == FEATURE_SHM));
    Ok(welcome)
}

/// How a peer reached the accepting side, which decides what proves who it is. A token is the
/// credential only where nothing better is: a client sends one over TCP in clear alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Door {
    /// The node's Unix socket, whose peer the kernel showed to be the node's own user or root
    /// before anything was read: trusted with everything, no token asked. (A client sends no
    /// token there, so a process that serves a socket path it was sent to learns none.)
    OwnUserSocket,
    /// TCP under mutual TLS, the peer's certificate verified: its identity decides
    /// ([`grant::scopes_of`](crate::grant::scopes_of)); no token is asked, and none is sent.
    Certified(crate::tls::Identity),
    /// TCP in clear: the `Hello`'s token decides.
    Clear,
}

impl Door {
    /// The identity a certificate proved, where one did.
    pub fn identity(&self) -> Option<&crate::tls::Identity> {
        match self {
            Door::Certified(identity) => Some(identity),
            Door::OwnUserSocket | Door::Clear => None,
        }
    }
}

/// What the accepting side requires and announces.
#[derive(Debug, Clone)]
pub struct Policy<'a> {
    /// How the peer came in.
    pub door: &'a Door,
    /// The credentials a `Hello`'s token must match one of, in clear; none for no
    /// authentication.
    pub credentials: &'a [Credential],
    /// The scopes granted to certificate identities, under TLS.
    pub grants: &'a [crate::grant::Grant],
    /// The software name to report.
    pub agent: &'a str,
    /// Agree to shared memory where the peer offers it (and the transport allows it).
    pub shared_memory: bool,
    /// Who is connecting, as logs name it (its address, or its process on a Unix socket).
    pub peer: &'a str,
    /// How long the peer may take to say hello.
    pub deadline: Duration,
    /// The largest frame body accepted once the peer is welcomed, which the `Welcome` announces
    /// (until then the connection takes only small frames).
    pub max_body: usize,
}

/// How the opening exchange ended on the accepting side.
#[derive(Debug)]
pub enum Greeting {
    /// Welcomed, with what its credential allows: requests follow.
    Welcomed(Hello, Scopes),
    /// Refused with a reply the peer has been sent (another major version, a wrong token).
    Refused(ErrorCode),
    /// The peer closed before saying anything.
    Closed,
}

/// What a peer's `Hello` showed, before it is welcomed.
#[derive(Debug)]
pub enum Heard {
    /// A `Hello` the policy accepts, with what its credential allows: the caller answers it,
    /// with [`welcome`] or a refusal of its own (a limit on who holds how many connections).
    Credited(Hello, Scopes),
    /// Refused with a reply the peer has been sent (another major version, a wrong token).
    Refused(ErrorCode),
    /// The peer closed before saying anything.
    Closed,
}

/// Reads the peer's `Hello` (the first frame, within `policy.deadline`), checks its major version
/// and token, and answers `Welcome` with the features both sides speak. From the `Hello` on,
/// `conn` talks as of the lower of the two minors.
pub async fn accept<S: Transport>(
    conn: &mut Connection<S>,
    policy: Policy<'_>,
) -> Result<Greeting, ConnectionError> {
    Ok(match hear(conn, &policy).await? {
        Heard::Credited(hello, scopes) => {
            welcome(conn, &policy, &hello).await?;
            Greeting::Welcomed(hello, scopes)
        }
        Heard::Refused(code) => Greeting::Refused(code),
        Heard::Closed => Greeting::Closed,
    })
}

/// The first half of [`accept`]: reads the peer's `Hello` (within `policy.deadline`) and checks
/// its major version and credential, refusing it where they fail; a `Hello` that passes is
/// left unanswered. From the `Hello` on, `conn` talks as of the lower of the two minors.
pub async fn hear<S: Transport>(
    conn: &mut Connection<S>,
    policy: &Policy<'_>,
) -> Result<Heard, ConnectionError> {
    let first = match tokio::time::timeout(policy.deadline, conn.read_request()).await {
        Err(_) => return Err(ConnectionError::IdleTimeout(policy.deadline)),
        Ok(Ok(Some(request))) => request,
        Ok(Ok(None)) => return Ok(Heard::Closed),
        Ok(Err(error)) => return Err(refuse(conn, error).await),
    };
    let Request::Hello(hello) = first else {
        let error = protocol_error("the first message must be Hello");
        return Err(refuse(conn, error).await);
    };
    if hello.major != PROTOCOL_VERSION {
        let reply = ErrorReply {
            code: ErrorCode::VersionMismatch,
            message: format!(
                "client speaks protocol {}, this node speaks {PROTOCOL_VERSION}",
                hello.major
            ),
        };
        conn.write_response(&Response::Error(reply)).await?;
        return Ok(Heard::Refused(ErrorCode::VersionMismatch));
    }
    conn.set_peer_minor(hello.minor);
    // Compared as fixed-length digests, in constant time: neither how much of a guess matched
    // nor how long the token is shows in the timing.
    let scopes = match policy.door {
        Door::OwnUserSocket => Some(crate::credential::Scopes::ALL),
        Door::Certified(identity) => crate::grant::scopes_of(identity, policy.grants),
        Door::Clear => scopes_for(
            policy.credentials,
            hello.token.as_ref().map(ferry_proto::Token::as_str),
        ),
    };
    let Some(scopes) = scopes else {
        AUTH_REFUSALS.note(policy.peer, &hello.agent);
        let message = match policy.door {
            Door::Certified(identity) => {
                format!("authentication refused: this node grants certificate {identity} nothing")
            }
            _ => "authentication refused: wrong or missing token".into(),
        };
        let reply = ErrorReply {
            code: ErrorCode::AuthRefused,
            message,
        };
        conn.write_response(&Response::Error(reply)).await?;
        return Ok(Heard::Refused(ErrorCode::AuthRefused));
    };
    Ok(Heard::Credited(hello, scopes))
}

/// The second half of [`accept`]: answers a `Hello` that [`hear`] credited with `Welcome`, the
/// features both sides speak.
pub async fn welcome<S: Transport>(
    conn: &mut Connection<S>,
    policy: &Policy<'_>,
    hello: &Hello,
) -> Result<(), ConnectionError> {
    let mut features: Vec<String> = FEATURES
        .iter()
        .filter(|f| hello.features.iter().any(|g| g == *f))
        .map(|f| f.to_string())
        .collect();
    let shared_memory = policy.shared_memory
        && conn.can_share_memory()
        && hello.features.iter().any(|f| f == FEATURE_SHM);
    if shared_memory {
        features.push(FEATURE_SHM.to_string());
    }
    let limits = conn.limits();
    conn.write_response(&Response::Welcome(Welcome {
        major: PROTOCOL_VERSION,
        minor: PROTOCOL_MINOR,
        features,
        agent: policy.agent.to_string(),
        max_body: policy.max_body as u64,
        chunk_size: limits.chunk_size as u64,
    }))
    .await?;
    conn.set_shared_memory(shared_memory);
    Ok(())
}

/// A protocol violation by the peer, as a connection error.
pub fn protocol_error(message: &str) -> ConnectionError {
    ConnectionError::Proto(ProtoError::Frame(FrameError::Malformed(
        message.to_string(),
    )))
}

/// Tells the peer why the connection is being closed (best effort, within a second), and hands
/// the error back.
pub async fn refuse<S: Transport>(
    conn: &mut Connection<S>,
    error: ConnectionError,
) -> ConnectionError {
    let code = match &error {
        ConnectionError::Proto(ProtoError::Frame(FrameError::UnsupportedVersion { .. })) => {
            ErrorCode::VersionMismatch
        }
        _ => ErrorCode::Protocol,
    };
    let reply = Response::Error(ErrorReply {
        code,
        message: error.to_string(),
    });
    // Written as a raw frame: the peer may be mid-way through sending, and only needs the reason.
    // (A reply that cannot be encoded is not sent: the connection closes all the same.)
    if let Ok(frame) = control::encode_response_for(&reply, conn.peer_minor()) {
        let _ = tokio::time::timeout(Duration::from_secs(1), conn.write_frame(&frame)).await;
    }
    error
}

/// Refused logins, logged at most once per [`crate::refusal_log::INTERVAL`] with the count of
/// those not logged since: a peer guessing tokens gets each guess refused, but cannot fill the log.
static AUTH_REFUSALS: RefusalLog = RefusalLog::new("hello", "authentication refused");

#[cfg(test)]
mod tests {
    use ferry_proto::{NodeStats, ProtoError};
    use tokio::io::DuplexStream;

    use super::*;
    use crate::connection::ConnectionLimits;

    fn pair() -> (Connection<DuplexStream>, Connection<DuplexStream>) {
        let (a, b) = tokio::io::duplex(1 << 16);
        let limits = ConnectionLimits::default();
        (Connection::new(a, limits), Connection::new(b, limits))
    }

    fn policy() -> Policy<'static> {
        Policy {
            door: &Door::Clear,
            credentials: &[],
            grants: &[],
            agent: "test node",
            shared_memory: false,
            peer: "test",
            deadline: Duration::from_secs(5),
            max_body: ConnectionLimits::default().max_body,
        }
    }

    fn hello_of(minor: u16) -> Request {
        Request::Hello(Hello {
            major: PROTOCOL_VERSION,
            minor,
            features: Vec::new(),
            token: None,
            agent: "a client".to_string(),
        })
    }

    fn newer_than_peer(result: Result<(), ConnectionError>) -> bool {
        matches!(
            result,
            Err(ConnectionError::Proto(ProtoError::Frame(
                FrameError::NewerThanPeer { .. }
            )))
        )
    }

    #[tokio::test]
    async fn a_node_answers_an_older_client_as_of_its_minor() {
        let (mut client, mut node) = pair();
        client.write_request(&hello_of(6)).await.unwrap();
        let greeting = accept(&mut node, policy()).await.unwrap();
        assert!(matches!(greeting, Greeting::Welcomed(..)));
        assert_eq!(node.peer_minor(), 6);
        assert!(matches!(
            client.read_response().await.unwrap(),
            Response::Welcome(Welcome {
                minor: PROTOCOL_MINOR,
                ..
            })
        ));
        // The answer goes as a node of minor 6 sends it: without the fields of minor 7.
        let stats = Response::Stats(NodeStats {
            agent: "test node".to_string(),
            uptime_ms: 1234,
            ..NodeStats::default()
        });
        node.write_response(&stats).await.unwrap();
        let frame = client.read_frame().await.unwrap().unwrap();
        let as_of_6 = control::encode_response_for(&stats, 6).unwrap();
        assert_eq!(&frame.body[..], &as_of_6[ferry_proto::frame::HEADER_LEN..]);
        let Response::Stats(got) = control::decode_response_from(&frame.body, 6).unwrap() else {
            panic!("not stats");
        };
        assert_eq!((got.agent.as_str(), got.uptime_ms), ("test node", 0));
    }

    #[tokio::test]
    async fn a_node_never_sends_a_client_what_its_minor_lacks() {
        let (mut client, mut node) = pair();
        client.write_request(&hello_of(2)).await.unwrap();
        accept(&mut node, policy()).await.unwrap();
        client.read_response().await.unwrap();
        let page = Response::Page {
            tensors: Vec::new(),
            next: None,
        };
        assert!(newer_than_peer(node.write_response(&page).await));
        let busy = Response::Error(ErrorReply {
            code: ErrorCode::Busy,
            message: "try again".to_string(),
        });
        node.write_response(&busy).await.unwrap();
        client.set_peer_minor(2);
        let Response::Error(reply) = client.read_response().await.unwrap() else {
            panic!("not an error");
        };
        assert_eq!(reply.code, ErrorCode::LimitExceeded);
    }

    #[tokio::test]
    async fn a_client_talks_to_an_older_node_as_of_its_minor() {
        for (node_minor, expected) in [
            (5, 5),
            (PROTOCOL_MINOR, PROTOCOL_MINOR),
            (9, PROTOCOL_MINOR),
        ] {
            let (mut client, mut node) = pair();
            let older_node = async {
                assert!(matches!(
                    node.read_request().await.unwrap(),
                    Some(Request::Hello(_))
                ));
                let welcome = Response::Welcome(Welcome {
                    major: PROTOCOL_VERSION,
                    minor: node_minor,
                    features: Vec::new(),
                    agent: "a node".to_string(),
                    max_body: 1 << 20,
                    chunk_size: 1 << 16,
                });
                node.write_response(&welcome).await.unwrap();
            };
            let offer = Offer {
                token: None,
                agent: "a client",
                shared_memory: false,
            };
            let (welcome, ()) = tokio::join!(hello(&mut client, offer), older_node);
            assert_eq!(welcome.unwrap().minor, node_minor);
            assert_eq!(client.peer_minor(), expected);
            let holds = client.write_request(&Request::Holds { device: 0 }).await;
            assert_eq!(
                newer_than_peer(holds),
                expected < 5,
                "node minor {node_minor}"
            );
        }
    }
}
