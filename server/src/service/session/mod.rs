//! One connection's session: the handshake, then each request in turn, answered on the same
//! connection. Here the session and its loop, and the dispatch: the scopes a request needs, one
//! line per request kind calling that request's function, and a result's answer on the wire.
//! Each request lives in its own file: the handshake (`handshake.rs`), put, get, fetch (of a
//! capability), copy and pull, delete, listings, what the node says of itself (`stat.rs`),
//! capabilities granted and released (`grant.rs`), waiting for a tensor or a model version
//! (`wait.rs`), and models written, committed, opened and deleted (`model.rs`).

use ferry_io::{Connection, ConnectionError, ConnectionLimits, PayloadRoute, Transport};
use ferry_proto::message::EAGER_PUT_MAX_BYTES;
use ferry_proto::{ErrorCode, ErrorReply, ProtoError, Request, Response, StreamError};
use tokio::sync::broadcast;
use tracing::Instrument;

use super::CLOSED_BEFORE_HELLO;
use super::awaiting_hello::Place;
use super::door::credential::{Scope, Scopes};
use super::door::handshake::{Door, refuse as fail};
use super::per_identity::PerIdentity;
use super::{HANDSHAKE_MAX_BODY, MAX_REQUEST_BODY, ServiceConfig, idle_for};
use crate::device::IfExists;
use crate::error::NodeError;
use crate::node::{ClientId, Direction, Node, Refused};
use crate::peer::PeerLink;
use crate::peer::PullRequest;
pub(super) use model::SessionModels;
use put::PayloadComes;

mod copy;
mod delete;
mod fetch;
mod get;
mod grant;
mod handshake;
mod list;
mod model;
mod put;
mod stat;
mod wait;

/// A connection's state: the node it serves, who is on the other end, and the session's own
/// link to a source node (a batch of pulls goes over one).
pub(super) struct Session<'a> {
    pub(super) node: &'a Node,
    pub(super) config: &'a ServiceConfig,
    pub(super) shutdown: broadcast::Receiver<()>,
    pub(super) peer: PeerLink,
    /// Who is on the other end, for logs.
    pub(super) client: &'a str,
    /// Who is on the other end, for the capabilities it asks for, fetches and releases.
    pub(super) id: ClientId,
    /// What its credential allows: nothing until it has said hello.
    pub(super) scopes: Scopes,
    /// When its hello must have come (the TLS handshake, if any, counted in).
    pub(super) hello_by: tokio::time::Instant,
    /// How it came in: the Unix socket (its user checked at accept), TLS (with the identity its
    /// certificate proved) or TCP in clear.
    pub(super) door: Door,
    /// The connections each identity holds: this one's, once its hello said who it is.
    pub(super) per_identity: &'a std::sync::Arc<PerIdentity>,
    /// The model versions it writes and those it holds for applies: given up and let go when
    /// it ends.
    pub(super) models: SessionModels,
}

// Every line a welcomed client can cause per request by failing it is bounded in rate (one line
// a second at most, carrying how many went unlogged): each request's file holds its own logs.

/// The scopes of which a request needs its connection's credential to allow one.
fn scopes_needed(request: &Request) -> &'static [Scope] {
    match request {
        Request::Put { .. }
        | Request::PutEager { .. }
        | Request::Copy { .. }
        | Request::Delete { .. }
        | Request::DeleteIf { .. }
        | Request::ModelBegin { .. }
        | Request::ModelCommit { .. }
        | Request::ModelAbort { .. }
        | Request::ModelDelete { .. }
        | Request::Pull { .. } => &[Scope::Write],
        Request::Fetch { .. } | Request::FetchRange { .. } => &[Scope::Peer],
        // The node that fetched a capability releases it, and so does the client it was granted
        // to when the target did not need it (a dedup): who may is checked per capability.
        Request::Release { .. } => &[Scope::Peer, Scope::Read],
        // A second Hello is refused as a protocol error whatever the scopes.
        Request::Hello(_)
        | Request::Get { .. }
        | Request::List { .. }
        | Request::ListPage { .. }
        | Request::Stat
        | Request::Holds { .. }
        | Request::Identify
        | Request::Wait { .. }
        | Request::ModelOpen { .. }
        | Request::ModelClose { .. }
        | Request::ModelList { .. }
        | Request::Grant { .. } => &[Scope::Read],
    }
}

/// Reads and drops a payload of `len` bytes that followed its request unasked (an eager put
/// refused), if any, so that the next frame read is the next request; a payload that breaks the
/// chunk rules closes the connection.
async fn drop_unasked_payload<S: Transport>(
    conn: &mut Connection<S>,
    len: Option<u64>,
) -> Result<(), ConnectionError> {
    match len {
        None => Ok(()),
        Some(len) => match conn.discard_payload(len).await {
            Ok(()) => Ok(()),
            Err(error) => Err(fail(conn, error).await),
        },
    }
}

/// A request's answer on the wire: its response, or its error's reply.
async fn answer<S: Transport>(
    conn: &mut Connection<S>,
    reply: Result<Response, NodeError>,
) -> Result<(), ConnectionError> {
    conn.write_response(&reply.unwrap_or_else(|e| Response::Error(e.reply())))
        .await
}

impl Session<'_> {
    /// Serves the connection; `place` holds its place among those awaiting a hello until the
    /// peer has said it.
    pub(super) async fn serve<S: Transport>(
        mut self,
        conn: &mut Connection<S>,
        mut place: Place,
    ) -> Result<(), ConnectionError> {
        // Until the peer has said hello (and shown its token), it gets small frames only: an
        // unauthenticated connection cannot make the node buffer a 16 MiB body.
        let limits = conn.limits();
        conn.set_limits(ConnectionLimits {
            max_body: limits.max_body.min(HANDSHAKE_MAX_BODY),
            ..limits
        });
        // Whatever ends a connection before its hello is a stranger's doing: logged at a
        // bounded rate, not a line per connection.
        let welcomed = tokio::select! {
            welcomed = self.handshake(conn) => match welcomed {
                Ok(welcomed) => welcomed,
                Err(error) => {
                    if matches!(error, ConnectionError::IdleTimeout(_)) {
                        self.node.recorder().connection_refused(Refused::HelloDeadline);
                    }
                    CLOSED_BEFORE_HELLO.note(self.client, &error.to_string());
                    return Ok(());
                }
            },
            _ = &mut place.evicted => {
                CLOSED_BEFORE_HELLO.note(self.client, "its slot went to a newer connection");
                return Ok(());
            }
        };
        drop(place);
        // Held for the connection's life: given back as the session ends.
        let Some((scopes, _identity_slot)) = welcomed else {
            return Ok(());
        };
        self.scopes = scopes;
        // Requests are a few KiB at most: no peer makes the node hold a larger control frame,
        // whatever the payloads' limit.
        conn.set_limits(ConnectionLimits {
            max_control_body: limits.max_control_body.min(MAX_REQUEST_BODY),
            ..limits
        });
        let keepalive = self.config.keepalive;
        loop {
            let request = tokio::select! {
                request = conn.read_request() => request,
                () = idle_for(keepalive) => {
                    // Only between requests: a request in progress is bounded by the idle
                    // timeout instead.
                    tracing::info!(client = self.client, ?keepalive, "closing an idle connection");
                    return Ok(());
                }
                _ = self.shutdown.recv() => {
                    let _ = conn.write_response(&Response::Error(NodeError::ShuttingDown.reply())).await;
                    return Ok(());
                }
            };
            let request = match request {
                Ok(Some(request)) => request,
                Ok(None) => return Ok(()),
                Err(error) => return Err(fail(conn, error).await),
            };
            // One span per request: every line a transfer logs carries what and for whom.
            let span = tracing::info_span!("request", op = request.name(), client = self.client);
            let _in_flight = request
                .moves_a_tensor()
                .then(|| self.node.recorder().in_flight());
            self.handle(conn, request).instrument(span).await?;
        }
    }

    /// Answers one request: refused unless the connection's credential allows one of the scopes
    /// it needs, else handed to its own function.
    async fn handle<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        request: Request,
    ) -> Result<(), ConnectionError> {
        // An eager put's payload follows it unasked: one larger than any may be is a protocol
        // error, found before its bytes are read (nothing can be answered before them).
        if let Some(len) = request.payload_follows()
            && len > EAGER_PUT_MAX_BYTES
        {
            let too_large = StreamError::EagerTooLarge {
                len,
                max: EAGER_PUT_MAX_BYTES,
            };
            return Err(fail(conn, ProtoError::from(too_large).into()).await);
        }
        let needed = scopes_needed(&request);
        if !needed.iter().any(|s| self.scopes.allows(*s)) {
            let names: Vec<&str> = needed.iter().map(|s| s.name()).collect();
            let refused = ErrorReply {
                code: ErrorCode::AuthRefused,
                message: format!(
                    "this connection's credential allows {}; {} needs {}",
                    self.scopes,
                    request.name(),
                    names.join(" or ")
                ),
            };
            // A payload that followed unasked is read and dropped before the refusal.
            drop_unasked_payload(conn, request.payload_follows()).await?;
            return conn.write_response(&Response::Error(refused)).await;
        }
        let comes = match request.payload_follows() {
            Some(_) => PayloadComes::AtOnce,
            None => PayloadComes::AfterReady,
        };
        let reply = match request {
            // Those that answer on the connection themselves: a payload comes in or goes out.
            Request::Hello(_) => return Err(handshake::hello_again(conn).await),
            Request::Put {
                device,
                name,
                meta,
                overwrite,
            }
            | Request::PutEager {
                device,
                name,
                meta,
                overwrite,
            } => {
                return self.put(conn, device, name, &meta, overwrite, comes).await;
            }
            Request::Get { key } => return self.get(conn, &key).await,
            Request::Fetch {
                capability,
                node_id,
                offset,
            } => return self.fetch(conn, &capability, &node_id, offset).await,
            Request::FetchRange {
                capability,
                node_id,
                from,
                to,
            } => {
                return self
                    .fetch_range(conn, &capability, &node_id, from, to)
                    .await;
            }
            // It watches the connection while it waits: a peer gone ends it.
            Request::Wait { target, timeout_ms } => {
                return self.wait(conn, target, timeout_ms).await;
            }
            Request::ModelBegin {
                device,
                prefix,
                replace,
            } => self.model_begin(device, &prefix, replace),
            Request::ModelCommit {
                device,
                prefix,
                version,
                sent,
                metadata,
            } => {
                self.model_commit(device, &prefix, version, sent, metadata)
                    .await
            }
            Request::ModelAbort {
                device,
                prefix,
                version,
            } => self.model_abort(device, &prefix, version).await,
            Request::ModelOpen { device, prefix } => self.model_open(device, &prefix),
            Request::ModelClose {
                device,
                prefix,
                version,
            } => self.model_close(device, &prefix, version),
            Request::ModelList { device } => Ok(self.model_list(device)),
            Request::ModelDelete {
                device,
                prefix,
                version,
            } => self.model_delete(device, &prefix, version).await,
            // Those answered by one response, or an error: written below.
            Request::Copy {
                src,
                dst_device,
                dst_name,
                remove_source,
                overwrite,
            } => {
                self.copy(src, dst_device, dst_name, remove_source, overwrite)
                    .await
            }
            Request::Pull {
                source,
                capability,
                src,
                dst_device,
                dst_name,
                overwrite,
                content_hash,
            } => {
                let existing = IfExists::from_overwrite(overwrite);
                self.pull(&PullRequest {
                    source,
                    capability,
                    src,
                    dst_device,
                    dst_name,
                    existing,
                    content_hash,
                })
                .await
            }
            Request::Delete { key } => self.delete(&key).await,
            Request::DeleteIf { key, content_hash } => self.delete_if(&key, &content_hash).await,
            Request::List { device } => self.list_whole(device).await,
            Request::ListPage {
                device,
                after,
                limit,
            } => self.list_page(device, after.as_ref(), limit).await,
            Request::Stat => self.stat().await,
            Request::Holds { device } => self.holds(device),
            Request::Identify => Ok(self.identify()),
            Request::Grant { key, audience } => self.grant(&key, &audience).await,
            Request::Release {
                capability,
                node_id,
            } => self.release(&capability, &node_id),
        };
        answer(conn, reply).await
    }

    /// Counts a payload's bytes sent (a get's, a fetch's) by the route they took.
    fn count_sent(&self, route: PayloadRoute, bytes: usize) {
        self.node
            .recorder()
            .payload(Direction::Sent, route, bytes as u64);
    }
}

#[cfg(test)]
mod tests {
    use ferry_proto::message::PathsDigest;
    use ferry_proto::{
        CapabilityToken, ContentHash, DType, Hello, NodeId, Request, TensorKey, TensorMeta, WaitFor,
    };

    use super::scopes_needed;
    use crate::service::door::credential::Scope::{self, Peer, Read, Write};

    /// Every request kind, each with the scopes of which it needs one (as `scopes_needed`
    /// said when the session was split per request).
    #[test]
    fn each_request_needs_its_scopes() {
        let key = TensorKey::new(0, "t");
        let capability = CapabilityToken::new("c");
        let node_id = NodeId::new("n");
        let hash = ContentHash::from_digest([0; 32]);
        let meta = TensorMeta::new(vec![2], DType::F32).unwrap().to_wire();
        let table: [(Request, &[Scope]); KINDS] = [
            (
                Request::Hello(Hello {
                    major: 1,
                    minor: 0,
                    features: Vec::new(),
                    token: None,
                    agent: "test".into(),
                }),
                &[Read],
            ),
            (
                Request::Put {
                    device: 0,
                    name: None,
                    meta: meta.clone(),
                    overwrite: false,
                },
                &[Write],
            ),
            (Request::Get { key: key.clone() }, &[Read]),
            (
                Request::Copy {
                    src: key.clone(),
                    dst_device: 1,
                    dst_name: None,
                    remove_source: true,
                    overwrite: false,
                },
                &[Write],
            ),
            (Request::Delete { key: key.clone() }, &[Write]),
            (Request::List { device: None }, &[Read]),
            (Request::Stat, &[Read]),
            (Request::Identify, &[Read]),
            (
                Request::Grant {
                    key: key.clone(),
                    audience: node_id.clone(),
                },
                &[Read],
            ),
            (
                Request::Pull {
                    source: "127.0.0.1:1".into(),
                    capability: capability.clone(),
                    src: key.clone(),
                    dst_device: 0,
                    dst_name: None,
                    overwrite: false,
                    content_hash: None,
                },
                &[Write],
            ),
            (
                Request::Fetch {
                    capability: capability.clone(),
                    node_id: node_id.clone(),
                    offset: 0,
                },
                &[Peer],
            ),
            (
                Request::Release {
                    capability: capability.clone(),
                    node_id: node_id.clone(),
                },
                &[Peer, Read],
            ),
            (
                Request::ListPage {
                    device: Some(0),
                    after: None,
                    limit: 10,
                },
                &[Read],
            ),
            (
                Request::DeleteIf {
                    key: key.clone(),
                    content_hash: hash,
                },
                &[Write],
            ),
            (Request::Holds { device: 0 }, &[Read]),
            (
                Request::FetchRange {
                    capability,
                    node_id,
                    from: 0,
                    to: 1,
                },
                &[Peer],
            ),
            (
                Request::Wait {
                    target: WaitFor::Tensor(key.clone()),
                    timeout_ms: 1,
                },
                &[Read],
            ),
            (
                Request::ModelBegin {
                    device: 0,
                    prefix: "m".into(),
                    replace: false,
                },
                &[Write],
            ),
            (
                Request::ModelCommit {
                    device: 0,
                    prefix: "m".into(),
                    version: 0,
                    sent: PathsDigest::of(["w"]),
                    metadata: Vec::new(),
                },
                &[Write],
            ),
            (
                Request::ModelAbort {
                    device: 0,
                    prefix: "m".into(),
                    version: 0,
                },
                &[Write],
            ),
            (
                Request::ModelOpen {
                    device: 0,
                    prefix: "m".into(),
                },
                &[Read],
            ),
            (
                Request::ModelClose {
                    device: 0,
                    prefix: "m".into(),
                    version: 0,
                },
                &[Read],
            ),
            (Request::ModelList { device: None }, &[Read]),
            (
                Request::ModelDelete {
                    device: 0,
                    prefix: "m".into(),
                    version: None,
                },
                &[Write],
            ),
            (
                Request::PutEager {
                    device: 0,
                    name: None,
                    meta,
                    overwrite: false,
                },
                &[Write],
            ),
        ];
        let mut seen = [false; KINDS];
        for (request, scopes) in &table {
            assert_eq!(scopes_needed(request), *scopes, "{}", request.name());
            seen[kind(request)] = true;
        }
        assert!(
            seen.iter().all(|&s| s),
            "a request kind is missing from the table"
        );
    }

    /// How many kinds of request there are.
    const KINDS: usize = 25;

    /// A request's kind, by variant: a variant added later fails to compile here until the table
    /// above names its scopes.
    fn kind(request: &Request) -> usize {
        match request {
            Request::Hello(_) => 0,
            Request::Put { .. } => 1,
            Request::Get { .. } => 2,
            Request::Copy { .. } => 3,
            Request::Delete { .. } => 4,
            Request::List { .. } => 5,
            Request::Stat => 6,
            Request::Identify => 7,
            Request::Grant { .. } => 8,
            Request::Pull { .. } => 9,
            Request::Fetch { .. } => 10,
            Request::Release { .. } => 11,
            Request::ListPage { .. } => 12,
            Request::DeleteIf { .. } => 13,
            Request::Holds { .. } => 14,
            Request::FetchRange { .. } => 15,
            Request::Wait { .. } => 16,
            Request::ModelBegin { .. } => 17,
            Request::ModelCommit { .. } => 18,
            Request::ModelAbort { .. } => 19,
            Request::ModelOpen { .. } => 20,
            Request::ModelClose { .. } => 21,
            Request::ModelList { .. } => 22,
            Request::ModelDelete { .. } => 23,
            Request::PutEager { .. } => 24,
        }
    }
}
