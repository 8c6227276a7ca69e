//! One connection's session: the handshake, then each request in turn (put, get, fetch,
//! transfers, listings), answered on the same connection.

use ferry_io::credential::{Scope, Scopes};
use ferry_io::handshake::{self, protocol_error, refuse as fail};
use ferry_io::refusal_log::RefusalLog;
use ferry_io::{
    Connection, ConnectionError, ConnectionLimits, PayloadRoute, RegionUse, Transport, tls,
};
use ferry_proto::{
    CapabilityToken, ErrorCode, ErrorReply, HeldDtype, NodeId, Request, Response, TensorKey,
    TensorMeta, Untrusted,
};
use tokio::sync::broadcast;
use tracing::Instrument;

use super::CLOSED_BEFORE_HELLO;
use super::awaiting_hello::Place;
use super::per_identity::{Holder, IdentitySlot, PerIdentity};
use super::{HANDSHAKE_MAX_BODY, MAX_REQUEST_BODY, ServiceConfig, idle_for};
use crate::device::{Arrived, IfExists, KnownHash};
use crate::error::{NodeError, Refusal};
use crate::holds::Held;
use crate::node::{AGENT, ClientId, Direction, FetchWants, MAX_PAGE, Node, Refused};
use crate::peer::{PeerLink, PullRequest};

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
    pub(super) door: handshake::Door,
    /// The connections each identity holds: this one's, once its hello said who it is.
    pub(super) per_identity: &'a std::sync::Arc<PerIdentity>,
}

// Every line a welcomed client can cause per request by failing it, each kind bounded in rate:
// one line a second at most, carrying how many went unlogged (a client that fails request after
// request, or connects again and again, cannot fill the log).
/// A hello refused because its identity holds its share of the connections.
static AT_IDENTITY_SHARE: RefusalLog =
    RefusalLog::new("hello", "connection refused: its identity holds its share");
/// A put refused before its payload (its meta, its device, its budget).
static PUT_REFUSED: RefusalLog = RefusalLog::new("put", "put refused");
/// A put whose payload broke off or failed its checks.
static UPLOAD_FAILED: RefusalLog = RefusalLog::new("put", "upload failed");
/// A fetch refused (its capability, the identity it speaks for).
static FETCH_REFUSED: RefusalLog = RefusalLog::new("fetch", "fetch refused");

/// The scopes of which a request needs its connection's credential to allow one.
fn scopes_needed(request: &Request) -> &'static [Scope] {
    match request {
        Request::Put { .. }
        | Request::Copy { .. }
        | Request::Delete { .. }
        | Request::DeleteIf { .. }
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
        | Request::Grant { .. } => &[Scope::Read],
    }
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

    /// The first frame must be a `Hello` with the right major version and a token the node
    /// accepts, of an identity that holds less than its share of the connections; what that
    /// token allows and the identity's slot, or `None` where the peer was refused or left.
    async fn handshake<S: Transport>(
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
            handshake::Heard::Refused(_) | handshake::Heard::Closed => return Ok(None),
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
    fn speaks_for<'c>(&'c self, claimed: &'c NodeId) -> Result<&'c NodeId, NodeError> {
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

    async fn handle<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        request: Request,
    ) -> Result<(), ConnectionError> {
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
            return conn.write_response(&Response::Error(refused)).await;
        }
        let node = self.node;
        let reply = match request {
            Request::Hello(_) => {
                let error = protocol_error("Hello may only open a connection");
                return Err(fail(conn, error).await);
            }
            Request::Put {
                device,
                name,
                meta,
                overwrite,
            } => {
                let existing = IfExists::from_overwrite(overwrite);
                return self.put(conn, device, name, &meta, existing).await;
            }
            Request::Get { key } => return self.get(conn, &key).await,
            Request::Copy {
                src,
                dst_device,
                dst_name,
                remove_source,
                overwrite,
            } => {
                let mode = ferry_proto::Transfer::from_remove_source(remove_source);
                let existing = IfExists::from_overwrite(overwrite);
                let dst = TensorKey::new(dst_device, dst_name.unwrap_or_else(|| src.name.clone()));
                node.copy(&src, &dst, mode, existing)
                    .await
                    .map(|desc| Response::Stored(desc.to_wire()))
            }
            Request::Delete { key } => node
                .remove(&key)
                .await
                .map(|desc| Response::Deleted(desc.to_wire())),
            Request::List { device } => self.list_whole(device).await,
            Request::ListPage {
                device,
                after,
                limit,
            } => node
                .list_page(device, after.as_ref(), limit as usize)
                .await
                .map(|(page, next)| Response::Page {
                    tensors: page.iter().map(|d| d.to_wire()).collect(),
                    next,
                }),
            Request::DeleteIf { key, content_hash } => node
                .remove_if_content(&key, &content_hash)
                .await
                .map(|desc| Response::Deleted(desc.to_wire())),
            Request::Stat => node.stats().await.map(Response::Stats),
            Request::Holds { device } => node.holds(device).map(|table| Response::Holds {
                device,
                dtypes: table
                    .entries()
                    .map(|(dtype, shape, held)| HeldDtype {
                        dtype: dtype.into(),
                        shape: shape.iter().map(|&d| d as u64).collect(),
                        refused: match held {
                            Held::Exact => None,
                            Held::Refused(why) => Some(why.clone()),
                        },
                    })
                    .collect(),
            }),
            Request::Identify => Ok(Response::Identity {
                node_id: node.node_id().clone(),
            }),
            Request::Grant { key, audience } => {
                node.grant(&key, &audience, self.id)
                    .await
                    .map(|granted| Response::Capability {
                        token: granted.token,
                        expires_in_ms: granted.ttl.as_millis() as u64,
                        info: granted.desc.to_wire(),
                        content_hash: granted.content_hash,
                    })
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
                let request = PullRequest {
                    source,
                    capability,
                    src,
                    dst_device,
                    dst_name,
                    existing: IfExists::from_overwrite(overwrite),
                    content_hash,
                };
                node.pull(&mut self.peer, &request)
                    .await
                    .map(|desc| Response::Stored(desc.to_wire()))
            }
            Request::Fetch {
                capability,
                node_id,
                offset,
            } => {
                let wants = FetchWants::From(offset);
                return self.fetch(conn, &capability, &node_id, wants).await;
            }
            Request::FetchRange {
                capability,
                node_id,
                from,
                to,
            } => {
                let wants = FetchWants::Input(from..to);
                return self.fetch(conn, &capability, &node_id, wants).await;
            }
            Request::Release {
                capability,
                node_id,
            } => node
                // Who may release is bound to connections: the one whose fetch was checked
                // against its certificate, or before any fetch the one it was granted to (a
                // client handing back what its target deduped, which is no node).
                .release(&capability, &node_id, self.id)
                .map(|()| Response::Released),
        };
        conn.write_response(&reply.unwrap_or_else(|e| Response::Error(e.reply())))
            .await?;
        Ok(())
    }

    async fn put<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        device: u32,
        name: Option<String>,
        wire: &ferry_proto::WireMeta,
        existing: IfExists,
    ) -> Result<(), ConnectionError> {
        let node = self.node;
        let started = std::time::Instant::now();
        let name = name.unwrap_or_else(|| node.fresh_name());
        // Everything about the tensor is checked, and its budget claimed, before one byte of it
        // is read or its buffer allocated.
        let admitted = TensorMeta::try_from(wire)
            .map_err(NodeError::from)
            .and_then(|meta| {
                let bytes = meta.byte_len() as u64;
                let admission =
                    node.admit(device, &name, &meta.dtype(), meta.shape(), bytes, existing)?;
                // Hashed as it arrives (trailing the chunk checksums) only where the device
                // would otherwise hash it before registering; else after the answer (see
                // `put_receiver`). A region is not hashed here: its handoff stays O(1).
                let assembler = node.put_receiver(device, meta)?;
                Ok((assembler, admission))
            });
        let (mut assembler, admission) = match admitted {
            Ok(admitted) => admitted,
            Err(error) => {
                node.recorder()
                    .transfer_ended("put", "-", false, started.elapsed());
                PUT_REFUSED.note_in_request(&format!("{device}/{name}: {error}"));
                conn.write_response(&Response::Error(error.reply())).await?;
                return Ok(());
            }
        };
        conn.write_response(&Response::Ready).await?;
        let region = match conn
            .read_payload_keeping(&mut assembler, RegionUse::Keep)
            .await
        {
            Ok((route, region)) => {
                let bytes = assembler.meta().byte_len() as u64;
                node.recorder().payload(Direction::Received, route, bytes);
                region
            }
            Err(error) => {
                // The rest of the stream cannot be trusted to line up with frames: report and
                // close. Nothing was registered; the buffer and the reservation go first, not
                // after the report (which may wait on the peer).
                drop(assembler);
                drop(admission);
                node.recorder()
                    .transfer_ended("put", "-", false, started.elapsed());
                UPLOAD_FAILED.note_in_request(&format!("{device}/{name}: {error}"));
                return Err(fail(conn, error).await);
            }
        };
        // Off the runtime: the hashing thread's last chunk is waited for, and sealing a region
        // it was received into reads it once (its checksum) and asks the kernel to seal it.
        let finished = tokio::task::spawn_blocking(move || assembler.finish_recorded())
            .await
            .map_err(|e| NodeError::Backend(format!("finishing a put: {e}")))
            .and_then(|finished| finished.map_err(NodeError::Received));
        let reply = match finished {
            Ok((data, hash, sealed)) => {
                let arrived = Arrived {
                    data,
                    hash: hash.map_or(KnownHash::Unknown, KnownHash::Computed),
                    // The region it came in, or the one it was received into
                    // (`--shareable-receives`).
                    region: region.or(sealed),
                };
                node.register(admission, arrived)
                    .await
                    .map(|desc| Response::Stored(desc.to_wire()))
            }
            Err(error) => Err(error),
        };
        conn.write_response(&reply.unwrap_or_else(|e| Response::Error(e.reply())))
            .await?;
        Ok(())
    }

    /// Serves a node-to-node fetch under a capability: from an offset to the end (`Fetch`), or
    /// the part of the payload in a range of the content hash's input (`FetchRange`, a stripe),
    /// which is sent from where it starts to the payload's end instead where the bytes are a
    /// copy read out of the device for this fetch (a copy per stripe would cost more than the
    /// stripes gain).
    async fn fetch<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        capability: &CapabilityToken,
        node_id: &NodeId,
        wants: FetchWants,
    ) -> Result<(), ConnectionError> {
        let mut lease = match self
            .speaks_for(node_id)
            .and_then(|node_id| self.node.begin_fetch(capability, node_id, self.id, &wants))
        {
            Ok(lease) => lease,
            Err(error) => {
                FETCH_REFUSED.note_in_request(&format!("for {}: {error}", node_id.as_str()));
                return conn.write_response(&Response::Error(error.reply())).await;
            }
        };
        let read = self
            .node
            .read_host_pinned(lease.key(), Some(lease.version()))
            .await;
        let (desc, meta, bytes) = match read {
            Ok(read) => read,
            // The version granted is gone for good: so is the capability.
            Err(NodeError::Changed(key) | NodeError::NotFound(key)) => {
                self.node.revoke(capability);
                let error = NodeError::CapabilityRefused(Refusal::VersionGone(key));
                return conn.write_response(&Response::Error(error.reply())).await;
            }
            Err(error) => return conn.write_response(&Response::Error(error.reply())).await,
        };
        let len = bytes.len();
        match wants {
            FetchWants::From(offset) => {
                let Ok(start) = usize::try_from(offset).map(|o| o.min(len)) else {
                    let error = NodeError::OffsetOutOfRange {
                        offset,
                        bytes: len as u64,
                    };
                    return conn.write_response(&Response::Error(error.reply())).await;
                };
                conn.write_response(&Response::Tensor {
                    info: desc.to_wire(),
                    meta: meta.to_wire(),
                })
                .await?;
                // A failed write drops the lease (the capability waits briefly for a resume) and
                // the host copy read for it.
                let route = conn
                    .write_payload_known(&bytes.parts(), start, bytes.known())
                    .await?;
                self.count_sent(route, len - start);
            }
            FetchWants::Input(input) => {
                let prefix = ferry_proto::tensor::content_hash_prefix(&meta).len() as u64;
                let part = ferry_proto::stripes::payload_part(prefix, len as u64, input);
                // Within the payload, so within a `usize`.
                let start = part.start as usize;
                let end = if bytes.lent() {
                    part.end as usize
                } else {
                    // The whole rest, charged as a whole payload: it cost a copy of it.
                    if let Err(error) = lease.charge_whole() {
                        return conn.write_response(&Response::Error(error.reply())).await;
                    }
                    len
                };
                conn.write_response(&Response::TensorPart {
                    info: desc.to_wire(),
                    meta: meta.to_wire(),
                    start: start as u64,
                    end: end as u64,
                })
                .await?;
                conn.write_payload_part(&bytes.parts(), start..end, bytes.known())
                    .await?;
                self.count_sent(PayloadRoute::Chunks, end - start);
            }
        }
        self.node.recorder().fetch_served();
        drop(lease);
        Ok(())
    }

    /// The old, unpaged listing: bounded to what one answer holds.
    async fn list_whole(&self, device: Option<u32>) -> Result<Response, NodeError> {
        let (page, next) = self.node.list_page(device, None, MAX_PAGE).await?;
        if let Some(next) = next
            && !self
                .node
                .list_page(device, Some(&next), 1)
                .await?
                .0
                .is_empty()
        {
            let indexes: Vec<u32> = match device {
                Some(index) => vec![index],
                None => self.node.devices().iter().map(|d| d.index()).collect(),
            };
            let mut tensors = 0u64;
            for index in indexes {
                tensors += self.node.summary(index).await?.tensors;
            }
            return Err(NodeError::ListingTooLarge {
                tensors,
                limit: MAX_PAGE,
            });
        }
        Ok(Response::Listing(
            page.iter().map(|d| d.to_wire()).collect(),
        ))
    }

    fn count_sent(&self, route: PayloadRoute, bytes: usize) {
        self.node
            .recorder()
            .payload(Direction::Sent, route, bytes as u64);
    }

    async fn get<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        key: &TensorKey,
    ) -> Result<(), ConnectionError> {
        match self.node.read_host(key).await {
            Ok((desc, meta, bytes)) => {
                conn.write_response(&Response::Tensor {
                    info: desc.to_wire(),
                    meta: meta.to_wire(),
                })
                .await?;
                let route = conn
                    .write_payload_known(&bytes.parts(), 0, bytes.known())
                    .await?;
                self.count_sent(route, bytes.len());
            }
            Err(error) => conn.write_response(&Response::Error(error.reply())).await?,
        }
        Ok(())
    }
}
