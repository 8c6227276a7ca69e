//! The opening exchange of every connection, the connecting side's half: `Hello` and the
//! `Welcome` it gets, the major version, the token, and the features both ends agree on (shared
//! memory only where both offered it and the transport can pass file descriptors). A client and
//! a node pulling from a peer both run it; the accepting side's half is the node's own
//! (`ferry-server`).

use ferry_proto::{
    ErrorReply, FEATURE_SHM, FEATURES, Hello, PROTOCOL_MINOR, PROTOCOL_VERSION, Request, Response,
    Welcome,
};

use crate::connection::{Connection, ConnectionError};
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

#[cfg(test)]
mod tests {
    use ferry_proto::{FrameError, ProtoError};
    use tokio::io::DuplexStream;

    use super::*;
    use crate::connection::ConnectionLimits;

    fn pair() -> (Connection<DuplexStream>, Connection<DuplexStream>) {
        let (a, b) = tokio::io::duplex(1 << 16);
        let limits = ConnectionLimits::default();
        (Connection::new(a, limits), Connection::new(b, limits))
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
    async fn a_client_talks_to_an_older_node_as_of_its_minor() {
        for (node_minor, expected) in [
            (5, 5),
            (PROTOCOL_MINOR, PROTOCOL_MINOR),
            // A newer node: talked to as of this side's minor.
            (PROTOCOL_MINOR + 1, PROTOCOL_MINOR),
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
