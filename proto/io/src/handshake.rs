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
/// force on `conn` exactly where this side offered it and the node agreed.
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
        token: offer.token.map(str::to_string),
        agent: offer.agent.to_string(),
    }))
    .await?;
    let welcome = match conn.read_response().await? {
        Response::Welcome(welcome) => welcome,
        Response::Error(reply) => return Err(HelloError::Refused(reply)),
        other => return Err(HelloError::Unexpected(format!("{other:?}"))),
    };
    conn.set_shared_memory(offered && welcome.features.iter().any(|f| f == FEATURE_SHM));
    Ok(welcome)
}

/// What the accepting side requires and announces.
#[derive(Debug, Clone)]
pub struct Policy<'a> {
    /// The credentials a `Hello`'s token must match one of; none for no authentication.
    pub credentials: &'a [Credential],
    /// The software name to report.
    pub agent: &'a str,
    /// Agree to shared memory where the peer offers it (and the transport allows it).
    pub shared_memory: bool,
    /// Who is connecting, as logs name it (its address, or its process on a Unix socket).
    pub peer: &'a str,
    /// How long the peer may take to say hello.
    pub deadline: Duration,
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

/// Reads the peer's `Hello` (the first frame, within `policy.deadline`), checks its major version
/// and token, and answers `Welcome` with the features both sides speak.
pub async fn accept<S: Transport>(
    conn: &mut Connection<S>,
    policy: Policy<'_>,
) -> Result<Greeting, ConnectionError> {
    let first = match tokio::time::timeout(policy.deadline, conn.read_request()).await {
        Err(_) => return Err(ConnectionError::IdleTimeout(policy.deadline)),
        Ok(Ok(Some(request))) => request,
        Ok(Ok(None)) => return Ok(Greeting::Closed),
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
        return Ok(Greeting::Refused(ErrorCode::VersionMismatch));
    }
    // Compared as fixed-length digests, in constant time: neither how much of a guess matched
    // nor how long the token is shows in the timing.
    let Some(scopes) = scopes_for(policy.credentials, hello.token.as_deref()) else {
        AUTH_REFUSALS.note(policy.peer, &hello.agent);
        let reply = ErrorReply {
            code: ErrorCode::AuthRefused,
            message: "authentication refused: wrong or missing token".into(),
        };
        conn.write_response(&Response::Error(reply)).await?;
        return Ok(Greeting::Refused(ErrorCode::AuthRefused));
    };
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
        max_body: limits.max_body as u64,
        chunk_size: limits.chunk_size as u64,
    }))
    .await?;
    conn.set_shared_memory(shared_memory);
    Ok(Greeting::Welcomed(hello, scopes))
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
    if let Ok(frame) = control::encode_response(&reply) {
        let _ = tokio::time::timeout(Duration::from_secs(1), conn.write_frame(&frame)).await;
    }
    error
}

/// Refused logins, logged at most once per [`crate::refusal_log::INTERVAL`] with the count of
/// those not logged since: a peer guessing tokens gets each guess refused, but cannot fill the log.
static AUTH_REFUSALS: RefusalLog = RefusalLog::new("hello");
