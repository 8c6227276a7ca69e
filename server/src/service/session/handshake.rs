//! The handshake: a connection's `Hello` heard and answered (its token, its identity's share of
//! the connections), a second `Hello` refused, and the node a fetch speaks for.

use ferry_io::{Connection, ConnectionError, Transport, tls};
use ferry_proto::{ErrorCode, ErrorReply, NodeId, Response, Untrusted};

use super::Session;
use crate::error::{NodeError, Refusal};
use crate::node::{AGENT, Refused};
use crate::service::door::credential::Scopes;
use crate::service::door::handshake::{self, protocol_error, refuse as fail};
use crate::service::door::refusal_log::RefusalLog;
use crate::service::per_identity::{Holder, IdentitySlot};

/// A hello refused because its identity holds its share of the connections.
static AT_IDENTITY_SHARE: RefusalLog =
    RefusalLog::new("hello", "connection refused: its identity holds its share");

/// Refuses a `Hello` after the first, as a protocol error: the connection is closed.
pub(super) async fn hello_again<S: Transport>(conn: &mut Connection<S>) -> ConnectionError {
    let error = protocol_error("Hello may only open a connection");
    fail(conn, error).await
}

impl Session<'_> {
    /// The first frame must be a `Hello` with the right major version and a token the node
    /// accepts, of an identity that holds less than its share of the connections; what that
    /// token allows and the identity's slot, or `None` where the peer was refused or left.
    pub(super) async fn handshake<S: Transport>(
        &self,
        conn: &mut Connection<S>,
    ) -> Result<Option<(Scopes, IdentitySlot)>, ConnectionError> {
        let policy = handshake::Policy {
            door: &self.door,
            credentials: &self.config.credentials,
            grants: &self.config.grants,
            agent: AGENT,
            shared_memory: self.node.config().shared_memory == ferry_io::SharedMemory::Offer,
            peer: self.client,
            deadline: self
                .hello_by
                .saturating_duration_since(tokio::time::Instant::now()),
            // What the connection takes once welcomed, not the small frames it takes until then.
            max_body: self.config.limits.max_body,
        };
        let (hello, scopes) = match handshake::hear(conn, &policy).await? {
            handshake::Heard::Credited(hello, scopes) => (hello, scopes),
            handshake::Heard::Refused | handshake::Heard::Closed => return Ok(None),
        };
        let asks_credentials =
            !self.config.credentials.is_empty() || self.node.config().tls.is_some();
        let holder = Holder::of(
            &self.door,
            &hello,
            &self.config.credentials,
            asks_credentials,
        );
        let slot = match self.per_identity.enter(holder.clone()) {
            Ok(slot) => slot,
            Err(share) => {
                AT_IDENTITY_SHARE.note(self.client, &holder.to_string());
                self.node
                    .recorder()
                    .connection_refused(Refused::IdentityShare);
                let reply = ErrorReply {
                    code: ErrorCode::LimitExceeded,
                    message: format!(
                        "the node serves at most {share} connections of one credential at once \
                         ({holder} holds them; the rest are kept for others): close some or try \
                         again later"
                    ),
                };
                conn.write_response(&Response::Error(reply)).await?;
                return Ok(None);
            }
        };
        handshake::welcome(conn, &policy, &hello).await?;
        Ok(Some((scopes, slot)))
    }

    /// The node a fetch speaks for, which its capability must be bound to: on a TLS link the
    /// identity a node's certificate proved (a claim on the wire naming another, or a client's
    /// certificate, is refused); elsewhere (a Unix socket of this node's own user, who can read
    /// its key anyway; TCP in clear) only the claim.
    pub(super) fn speaks_for<'c>(&'c self, claimed: &'c NodeId) -> Result<&'c NodeId, NodeError> {
        let Some(certified) = self.door.identity() else {
            return Ok(claimed);
        };
        if certified.role() != tls::Role::Node {
            return Err(NodeError::CapabilityRefused(Refusal::NotANode {
                certified: certified.to_string(),
            }));
        }
        if certified.as_str() != claimed.as_str() {
            return Err(NodeError::CapabilityRefused(Refusal::NotCertified {
                claimed: Untrusted(claimed.as_str()).to_string(),
                certified: certified.to_string(),
            }));
        }
        Ok(claimed)
    }
}
