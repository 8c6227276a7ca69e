//! The opening exchange of every connection, the node's half: a peer's `Hello` read within its
//! deadline, its major version and the credential it earns by the door it came in checked, and
//! the `Welcome` with the features both sides speak (shared memory only where both offered it
//! and the transport can pass file descriptors). The connecting side's half (`hello`) is
//! `ferry-io`'s, as a client and a node pulling from a peer both run it.

use std::time::Duration;

use ferry_io::tls::Identity;
use ferry_io::{Connection, ConnectionError, Transport};
use ferry_proto::{
    ErrorCode, ErrorReply, FEATURE_SHM, FEATURES, FrameError, Hello, PROTOCOL_MINOR,
    PROTOCOL_VERSION, ProtoError, Request, Response, Welcome, control,
};

use super::certificate_grant::{self, CertificateGrant};
use super::credential::{Credential, Scopes, scopes_for};
use super::refusal_log::RefusalLog;

/// How a peer reached the accepting side, which decides what proves who it is. A token is the
/// credential only where nothing better is: a client sends one over TCP in clear alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Door {
    /// The node's Unix socket, whose peer the kernel showed to be the node's own user or root
    /// before anything was read: trusted with everything, no token asked. (A client sends no
    /// token there, so a process that serves a socket path it was sent to learns none.)
    OwnUserSocket,
    /// TCP under mutual TLS, the peer's certificate verified: its identity decides
    /// ([`certificate_grant::scopes_of`]); no token is asked, and none is sent.
    Certified(Identity),
    /// TCP in clear: the `Hello`'s token decides.
    Clear,
}

impl Door {
    /// The identity a certificate proved, where one did.
    pub fn identity(&self) -> Option<&Identity> {
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
    pub grants: &'a [CertificateGrant],
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

/// What a peer's `Hello` showed, before it is welcomed.
#[derive(Debug)]
pub enum Heard {
    /// A `Hello` the policy accepts, with what its credential allows: the caller answers it,
    /// with [`welcome`] or a refusal of its own (a limit on who holds how many connections).
    Credited(Hello, Scopes),
    /// Refused with a reply the peer has been sent (another major version, a wrong token).
    Refused,
    /// The peer closed before saying anything.
    Closed,
}

/// The first half of the accepting side's exchange: reads the peer's `Hello` (the first frame,
/// within `policy.deadline`) and checks its major version and credential, refusing it where they
/// fail; a `Hello` that passes is left unanswered. From the `Hello` on, `conn` talks as of the
/// lower of the two minors.
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
        return Ok(Heard::Refused);
    }
    conn.set_peer_minor(hello.minor);
    // Compared as fixed-length digests, in constant time: neither how much of a guess matched
    // nor how long the token is shows in the timing.
    let scopes = match policy.door {
        Door::OwnUserSocket => Some(Scopes::ALL),
        Door::Certified(identity) => certificate_grant::scopes_of(identity, policy.grants),
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
        return Ok(Heard::Refused);
    };
    Ok(Heard::Credited(hello, scopes))
}

/// The second half: answers a `Hello` that [`hear`] credited with `Welcome`, the features both
/// sides speak.
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

/// Refused logins, logged at most once per [`INTERVAL`](super::refusal_log::INTERVAL) with the count of
/// those not logged since: a peer guessing tokens gets each guess refused, but cannot fill the log.
static AUTH_REFUSALS: RefusalLog = RefusalLog::new("hello", "authentication refused");

#[cfg(test)]
mod tests {
    use ferry_io::ConnectionLimits;
    use ferry_proto::{NodeStats, ProtoError};
    use tokio::io::DuplexStream;

    use super::*;

    /// Both halves at once, as a node with no limit on connections per identity would run them:
    /// [`hear`], then [`welcome`] where it credits the `Hello`. Whether the peer was welcomed.
    async fn accept<S: Transport>(
        conn: &mut Connection<S>,
        policy: Policy<'_>,
    ) -> Result<bool, ConnectionError> {
        Ok(match hear(conn, &policy).await? {
            Heard::Credited(hello, _) => {
                welcome(conn, &policy, &hello).await?;
                true
            }
            Heard::Refused | Heard::Closed => false,
        })
    }

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
        assert!(accept(&mut node, policy()).await.unwrap(), "welcomed");
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
}
