//! Node-to-node pulls: the target connects to the source with a capability and streams the
//! tensor straight into one preallocated buffer, resuming after a transient drop; a tensor
//! larger than a stripe may come over several connections at once (`striped`).

mod striped;

use std::time::Instant;

use ferry_io::refusal_log::RefusalLog;
use ferry_io::striped::StripedReceive;
use ferry_io::{ConnectionError, Dial, Exchange, ExchangeError, PayloadRoute, RegionUse};
use ferry_io::{HashUse, TensorAssembler};
use ferry_proto::message::FETCH_RANGE_MINOR;
use ferry_proto::{CapabilityToken, ContentHash, ErrorCode};
use ferry_proto::{TensorKey, Untrusted, dtype_name};

use crate::device::{Arrived, IfExists, KnownHash, Payload, TensorDesc};
use crate::engine::TransferPath;
use crate::error::{NodeError, Refusal};
use crate::node::PeerTerms;
use crate::node::{Admission, Direction, FAILED_TRANSFERS, Node};

/// What a client asks a target node to pull.
#[derive(Debug, Clone)]
pub(crate) struct PullRequest {
    /// The source node's address, as this node reaches it.
    pub(crate) source: String,
    /// The capability the source issued for this node.
    pub(crate) capability: CapabilityToken,
    /// The tensor on the source.
    pub(crate) src: TensorKey,
    /// The target device.
    pub(crate) dst_device: u32,
    /// The target name; the source's name when absent.
    pub(crate) dst_name: Option<String>,
    /// What becomes of a tensor already registered under the target name.
    pub(crate) existing: IfExists,
    /// The content hash the source granted the tensor under: what the bytes that arrive must
    /// hash to, and what a tensor this node already holds may stand in for. Required.
    pub(crate) content_hash: Option<ContentHash>,
}

/// A pull's connection to its source, kept across the pulls of one session (a batch goes over
/// one connection), and the helper connections its striped pulls opened beside it.
#[derive(Debug, Default)]
pub(crate) struct PeerLink {
    source: Option<OpenLink>,
    helpers: Vec<OpenLink>,
}

/// A connection to a source, with the terms it was opened on.
#[derive(Debug)]
struct OpenLink {
    addr: String,
    /// What was checked of it before anything was sent, and whether the peer token was sent.
    terms: PeerTerms,
    conn: Exchange,
}

/// The longest wait between two reconnections.
const MAX_BACKOFF: std::time::Duration = std::time::Duration::from_secs(30);

/// The wait before reconnection number `attempt` (from 1): the configured backoff, doubled with
/// each further one, at most [`MAX_BACKOFF`].
fn backoff(first: std::time::Duration, attempt: u32) -> std::time::Duration {
    let doubling = 1u32 << attempt.saturating_sub(1).min(16);
    first.saturating_mul(doubling).min(MAX_BACKOFF)
}

/// How one attempt failed, and what it had received (to resume from).
struct Failed {
    error: AttemptError,
    resume: Option<Receiving>,
}

impl Failed {
    /// A failure no retry mends: nothing to resume.
    fn fatal(error: NodeError) -> Failed {
        Failed {
            error: AttemptError::Fatal(error),
            resume: None,
        }
    }
}

/// How one attempt failed.
enum AttemptError {
    /// The connection dropped or went silent: worth reconnecting and resuming.
    Transient(String),
    /// Anything else: the pull fails.
    Fatal(NodeError),
}

/// The receiver's state across attempts: the buffer with its verified bytes, the admission (with
/// its budget), how the payload completed, and the region it came in (kept, to pass the tensor
/// on without a copy).
struct Receiving {
    assembler: TensorAssembler,
    admission: Admission,
    route: PayloadRoute,
    region: Option<ferry_io::connection::SealedRegion>,
}

impl Node {
    /// Pulls a tensor from another node and registers it; answered only once it is registered.
    /// Nothing is registered unless every byte arrived and the whole hashes to the grant.
    pub(crate) async fn pull(
        &self,
        link: &mut PeerLink,
        req: &PullRequest,
    ) -> Result<TensorDesc, NodeError> {
        let started = Instant::now();
        let name = req.dst_name.clone().unwrap_or_else(|| req.src.name.clone());
        let dst = TensorKey::new(req.dst_device, &name);
        let result = self.pull_inner(link, req, &name).await;
        let path = result.as_ref().map_or("pull", |d| d.path.name());
        self.recorder()
            .transfer_ended("pull", path, result.is_ok(), started.elapsed());
        match &result {
            Ok(desc) => {
                tracing::info!(
                op = "pull",
                source = %Untrusted(&req.source),
                key = %req.src,
                dst = %dst,
                dtype = %dtype_name(&desc.dtype),
                bytes = desc.bytes,
                path = desc.path.name(),
                elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
                "transfer done"
                )
            }
            Err(error) => {
                let detail = format!("pull {} from {}: {error}", req.src, req.source);
                FAILED_TRANSFERS.note_in_request(&detail);
            }
        }
        result
    }

    async fn pull_inner(
        &self,
        link: &mut PeerLink,
        req: &PullRequest,
        name: &str,
    ) -> Result<TensorDesc, NodeError> {
        ferry_proto::message::validate_name(name)?;
        ferry_proto::message::validate_name(&req.src.name)?;
        check_source(&req.source)?;
        let tls = self.config().tls.is_some();
        if !self.config().pulls.peers.allows_over(&req.source, tls) {
            return Err(NodeError::NotAllowedPeer(req.source.clone()));
        }
        self.device(req.dst_device)?;
        let Some(granted) = req.content_hash else {
            return Err(NodeError::PullWithoutHash);
        };
        if let Some(held) = self.find_by_hash(granted).await? {
            match self.dedup(held, req.dst_device, name, req.existing).await {
                // The candidate was replaced between finding it and copying it: pull instead.
                Err(NodeError::Changed(key)) => {
                    tracing::info!(%key, "dedup candidate replaced meanwhile; pulling the bytes");
                }
                done => return done,
            }
        }
        let config = self.config();
        // What arrived so far travels from one attempt to the next, and comes back whole from
        // the one that completes.
        let mut resume: Option<Receiving> = None;
        let mut attempt = 0u32;
        let received = loop {
            let failed = match self.attempt(link, req, name, resume).await {
                Ok(received) => break received,
                Err(failed) => failed,
            };
            resume = failed.resume;
            match failed.error {
                AttemptError::Transient(why) if attempt < config.pulls.retries => {
                    attempt += 1;
                    self.recorder().pull_retry();
                    let resume_at = resume.as_ref().map_or(0, |r| r.assembler.received());
                    let detail = format!(
                        "pull dropped; reconnecting (attempt {attempt}, at byte {resume_at}): {why}"
                    );
                    SOURCE_TROUBLE.note(&Untrusted(&req.source).to_string(), &detail);
                    link.source = None;
                    tokio::time::sleep(backoff(config.pulls.retry_backoff, attempt)).await;
                }
                AttemptError::Transient(why) => {
                    link.source = None;
                    // What exactly failed stays in this node's log: a client that names the
                    // source learns only that it could not be reached, never what answered there
                    // (no probing of other services through a node).
                    let detail = format!("pull gave up after {attempt} retries: {why}");
                    SOURCE_TROUBLE.note(&Untrusted(&req.source).to_string(), &detail);
                    return Err(NodeError::Peer {
                        source_addr: req.source.clone(),
                        message: format!("{UNREACHABLE} (after {attempt} retries)"),
                    });
                }
                AttemptError::Fatal(error) => {
                    link.source = None;
                    return Err(error);
                }
            }
        };
        let Receiving {
            assembler,
            admission,
            route,
            region,
        } = received;
        let (data, hash, region) = match route {
            // Chunks: hashed while they arrived and compared with the grant by `attempt`,
            // before it released the capability; the hash is the one it settled.
            PayloadRoute::Chunks => {
                let (data, computed, sealed) = finish_hashed(assembler).await?;
                debug_assert_eq!(computed, granted, "`attempt` compared it with the grant");
                // The region it was received into, where the node shares its receives.
                (data, KnownHash::Computed(computed), sealed)
            }
            // A sealed region from a peer of this host: its bytes cannot change, so the worker
            // registers it under the granted hash and verifies that off the critical path; until
            // it has, the tensor is granted, matched and deduped on by nothing.
            PayloadRoute::Region => (
                assembler.finish().map_err(NodeError::Received)?,
                KnownHash::Stated(granted),
                region,
            ),
        };
        let payload = Payload::Data(Arrived { data, hash, region });
        let desc = self
            .register_payload(admission, payload, TransferPath::Pull)
            .await?;
        self.recorder().pulled();
        Ok(desc)
    }

    /// One connection's try at the pull, resuming after what `resume` holds; what arrived comes
    /// back either way (a transient failure resumes from it).
    async fn attempt(
        &self,
        link: &mut PeerLink,
        req: &PullRequest,
        name: &str,
        resume: Option<Receiving>,
    ) -> Result<Receiving, Failed> {
        let offset = resume.as_ref().map_or(0, |r| r.assembler.received()) as u64;
        // A source that answers nothing is as gone as one that hung up.
        let idle = self.config().pulls.peer_limits.idle_timeout;
        let source = match self.link_to(link, &req.source).await {
            Ok(source) => source,
            Err(error) => return Err(Failed { error, resume }),
        };
        // A first fetch from a source that answers in parts asks for the first stripe only: a
        // tensor that fits it comes whole, a larger one over several connections from there on.
        let striping = self.config().pulls.striping;
        let first_stripe = resume.is_none()
            && striping.spreads()
            && source.node_minor() >= FETCH_RANGE_MINOR
            && !source.shared_memory();
        let node_id = self.node_id();
        let begin = async {
            if first_stripe {
                let input = 0..striping.stripe_len().get();
                source.fetch_range(&req.capability, node_id, input).await
            } else {
                source.fetch(&req.capability, node_id, offset).await
            }
        };
        let fetch = match tokio::time::timeout(idle, begin).await {
            Ok(Ok(fetch)) => fetch,
            Ok(Err(e)) => {
                let error = classify(&req.source, e);
                return Err(Failed { error, resume });
            }
            Err(_) => {
                let error = AttemptError::Transient(format!("{} did not answer", req.source));
                return Err(Failed { error, resume });
            }
        };
        if fetch.info.key != req.src {
            return Err(Failed::fatal(NodeError::Peer {
                source_addr: req.source.clone(),
                message: format!(
                    "asked for {} but the capability is for {}",
                    req.src, fetch.info.key
                ),
            }));
        }
        let mut r = match resume {
            Some(r) if r.assembler.meta() == &fetch.meta => r,
            Some(_) => {
                return Err(Failed::fatal(NodeError::Peer {
                    source_addr: req.source.clone(),
                    message: "the tensor changed between two attempts".into(),
                }));
            }
            None => self
                .start_receiving(req, name, fetch.meta.clone())
                .map_err(Failed::fatal)?,
        };
        if fetch.range.end < fetch.meta.byte_len() as u64 {
            // The source answered the first stripe only: the rest comes over several
            // connections, and what the whole hashes to is settled once every stripe is in.
            let Receiving {
                assembler,
                admission,
                ..
            } = r;
            let stripe_len = striping.stripe_len();
            let (striped, mut stripes) =
                StripedReceive::new(assembler, stripe_len).map_err(|_| {
                    Failed::fatal(NodeError::Backend("a receive cut in stripes".into()))
                })?;
            let mut first = stripes.remove(0);
            let meta = fetch.meta.clone();
            let mut done = Vec::with_capacity(stripes.len() + 1);
            match fetch.stripe(&mut first).await {
                Ok(()) => done.push(first),
                Err(e) => match classify(&req.source, e) {
                    AttemptError::Fatal(error) => return Err(Failed::fatal(error)),
                    AttemptError::Transient(why) => {
                        let detail = format!("a pull's first stripe dropped; resuming it: {why}");
                        SOURCE_TROUBLE.note(&Untrusted(&req.source).to_string(), &detail);
                        link.source = None;
                        stripes.insert(0, first);
                    }
                },
            }
            let stripes = self
                .fetch_stripes(link, req, &meta, stripes, done)
                .await
                .map_err(Failed::fatal)?;
            let assembler = striped
                .join(stripes)
                .map_err(|e| Failed::fatal(NodeError::Received(e.into())))?;
            r = Receiving {
                assembler,
                admission,
                route: PayloadRoute::Chunks,
                region: None,
            };
        } else {
            let (route, region) = match fetch
                .payload(&mut r.assembler, RegionUse::KeepUnhashed)
                .await
            {
                Ok(done) => done,
                Err(e) => {
                    let error = classify(&req.source, e);
                    return Err(Failed {
                        error,
                        resume: Some(r),
                    });
                }
            };
            r.route = route;
            r.region = region;
        }
        let bytes = r.assembler.meta().byte_len() as u64;
        self.recorder().payload(Direction::Received, r.route, bytes);
        // Chunks are checked by the whole payload's hash (in clear the link vouches for nothing,
        // and a pull checks no chunk CRC: the hash catches noise and a proxy alike; over mutual
        // TLS the hash compared is the one the client relayed from the grant, so a wrong one
        // fails the pull on every link alike), compared with the grant before the capability is
        // released: bytes that are not the ones granted never use it up (the source lets it
        // lapse, or a fetch from 0 may try again). The hash trailed the receive on another
        // thread, so this waits for its last chunk only.
        if r.route == PayloadRoute::Chunks {
            let granted = req
                .content_hash
                .ok_or(Failed::fatal(NodeError::PullWithoutHash))?;
            let (back, computed) = settle_hash(r).await.map_err(Failed::fatal)?;
            r = back;
            if computed != granted {
                self.recorder().integrity_failure();
                return Err(Failed::fatal(NodeError::Integrity {
                    source_addr: req.source.clone(),
                    expected: granted,
                    computed,
                }));
            }
        }
        // Every byte is here and verified: the transfer stands even if the release is lost (the
        // capability then lapses at the source on its own, as it does where a striped pull lost
        // the connection its fetches went over: a new one fetched nothing and may not release).
        let Some(source) = link.source.as_mut().map(|open| &mut open.conn) else {
            return Ok(r);
        };
        let release = source.release(&req.capability, self.node_id());
        match tokio::time::timeout(idle, release).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                let detail = format!("release after a complete pull failed: {error}");
                SOURCE_TROUBLE.note(&Untrusted(&req.source).to_string(), &detail);
            }
            Err(_) => {
                let detail = "release after a complete pull timed out";
                SOURCE_TROUBLE.note(&Untrusted(&req.source).to_string(), detail);
                self.drop_link_after_timeout(link);
            }
        }
        Ok(r)
    }

    /// Admits the tensor a first attempt found and makes its receiver.
    fn start_receiving(
        &self,
        req: &PullRequest,
        name: &str,
        meta: ferry_proto::TensorMeta,
    ) -> Result<Receiving, NodeError> {
        let admission = self.admit(
            req.dst_device,
            name,
            &meta.dtype(),
            meta.shape(),
            meta.byte_len() as u64,
            req.existing,
        )?;
        // Hashed while it arrives, a chunk behind, on another thread.
        let assembler = self.receiver(req.dst_device, meta)?.hashing(HashUse::Check);
        Ok(Receiving {
            assembler,
            admission,
            route: PayloadRoute::Chunks,
            region: None,
        })
    }

    /// A link whose peer stopped answering mid-exchange is out of step: never reuse it.
    fn drop_link_after_timeout(&self, link: &mut PeerLink) {
        link.source = None;
    }

    /// The session's connection to `source`, opened if needed.
    async fn link_to<'a>(
        &self,
        link: &'a mut PeerLink,
        source: &str,
    ) -> Result<&'a mut Exchange, AttemptError> {
        let terms = self.terms_for(source)?;
        // A connection left out of step (a fetch abandoned before its payload) is never reused,
        // nor one opened on other terms (another identity checked, another token sent).
        let kept = link
            .source
            .take()
            .filter(|kept| kept.addr == source && kept.terms == terms && kept.conn.in_step());
        let current = match kept {
            Some(current) => current,
            None => self.dial(source, terms).await?,
        };
        Ok(&mut link.source.insert(current).conn)
    }

    /// The terms this node connects to `source` on, decided on every pull, a reused link
    /// included: the cluster's member list may have changed since the link was opened (or since
    /// this pull was admitted).
    fn terms_for(&self, source: &str) -> Result<PeerTerms, AttemptError> {
        let config = self.config();
        config
            .pulls
            .peers
            .terms(
                source,
                config.tls.is_some(),
                config.pulls.peer_token.as_ref(),
            )
            .ok_or_else(|| AttemptError::Fatal(NodeError::NotAllowedPeer(source.to_string())))
    }

    /// A new connection to `source`, on `terms`.
    async fn dial(&self, source: &str, terms: PeerTerms) -> Result<OpenLink, AttemptError> {
        let config = self.config();
        let dial = Dial {
            token: terms.token.as_ref(),
            agent: crate::node::AGENT,
            tls: config.tls.as_ref().map(|tls| tls.client()),
            check: &terms.check,
            clear_tokens: config.pulls.clear_tokens,
            shared_memory: config.shared_memory,
            limits: config.pulls.peer_limits,
        };
        let endpoint = ferry_io::Endpoint::parse(source);
        let connect = dial.open(&endpoint);
        let conn = tokio::time::timeout(config.pulls.peer_limits.idle_timeout, connect)
            .await
            .map_err(|_| AttemptError::Transient(format!("connecting to {source} timed out")))?
            .map_err(|e| opening_failed(source, e))?;
        Ok(OpenLink {
            addr: source.to_string(),
            terms,
            conn,
        })
    }

    /// Registers a copy of a tensor this node already holds (the verified version `held`
    /// describes) instead of pulling the same bytes; [`NodeError::Changed`] if that version was
    /// replaced meanwhile.
    async fn dedup(
        &self,
        held: TensorDesc,
        dst_device: u32,
        name: &str,
        existing: IfExists,
    ) -> Result<TensorDesc, NodeError> {
        let dst = TensorKey::new(dst_device, name);
        let desc = if held.key == dst {
            held
        } else {
            self.copy_version(&held, &dst, existing).await?
        };
        self.recorder().dedup_hit();
        tracing::info!(key = %dst, from = %desc.key, "pull skipped: same bytes already held");
        Ok(TensorDesc {
            path: TransferPath::Dedup,
            ..desc
        })
    }
}

/// What a client hears of a source it named that could not be reached or did not answer hello
/// as a ferry node: one message for both, so that a node does not tell a closed port from an open
/// one, nor what answered there.
const UNREACHABLE: &str = "peer unreachable or not a ferry node";

/// What went wrong with a pull's source (a drop, a retry, a source that is no ferry node, a
/// failed release): a client with the write scope can point pull after pull at a source that
/// fails, so one line a second at most, each naming the source and carrying how many went
/// unlogged.
pub(super) static SOURCE_TROUBLE: RefusalLog =
    RefusalLog::new("pull", "trouble with a pull's source");

/// The longest source address a pull accepts.
const MAX_SOURCE_LEN: usize = 1024;

/// A source address fit to connect to and to log: not empty, bounded, no control characters.
fn check_source(source: &str) -> Result<(), NodeError> {
    if source.is_empty() || source.len() > MAX_SOURCE_LEN || source.chars().any(char::is_control) {
        return Err(NodeError::InvalidSource(Untrusted(source).to_string()));
    }
    Ok(())
}

/// How opening a link failed, as the client that named the source may learn it: a ferry node's
/// own refusal as it said it, anything else (which could be the banner of whatever service
/// listens there, or its certificate) only as "not a ferry node", the details in this node's
/// log.
fn opening_failed(source: &str, error: ExchangeError) -> AttemptError {
    match error {
        ExchangeError::Connection(ConnectionError::Proto(_)) | ExchangeError::Unexpected(_) => {
            let detail = format!("the source did not answer hello as a ferry node: {error}");
            SOURCE_TROUBLE.note(&Untrusted(source).to_string(), &detail);
            AttemptError::Fatal(NodeError::Peer {
                source_addr: source.to_string(),
                message: UNREACHABLE.into(),
            })
        }
        // A source whose certificate names another node than the one listed there.
        ExchangeError::NotTheNode { .. } => {
            let detail =
                format!("refused: the source is not the peer listed at its address: {error}");
            SOURCE_TROUBLE.note(&Untrusted(source).to_string(), &detail);
            AttemptError::Fatal(NodeError::NotAllowedPeer(source.to_string()))
        }
        // The peer token may not go there (beyond loopback in clear, or to a loopback port
        // another local user holds): nothing was sent, and no retry changes that. The client
        // that named the source hears why; the address is one this node was told to pull from.
        ExchangeError::TokenWithheld(withheld) => {
            let detail = format!("the peer token was withheld: {withheld}");
            SOURCE_TROUBLE.note(&Untrusted(source).to_string(), &detail);
            AttemptError::Fatal(NodeError::Peer {
                source_addr: source.to_string(),
                message: withheld.to_string(),
            })
        }
        // A certificate that fails (the source's, or ours as it judged it) or a Unix socket
        // served by another user: no retry changes that, so none is made.
        ExchangeError::Connection(ConnectionError::Io(e))
            if e.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            let detail = format!("the source's identity did not check: {e}");
            SOURCE_TROUBLE.note(&Untrusted(source).to_string(), &detail);
            AttemptError::Fatal(NodeError::Peer {
                source_addr: source.to_string(),
                message: UNREACHABLE.into(),
            })
        }
        other => classify(source, other),
    }
}

/// Which failures are worth a reconnection: a connection that dropped, closed, failed or went
/// silent. A refused capability, a corrupt chunk or a bad description are not.
fn classify(source: &str, error: ExchangeError) -> AttemptError {
    match error {
        ExchangeError::Connection(
            ConnectionError::Io(_)
            | ConnectionError::Closed
            | ConnectionError::IdleTimeout(_)
            | ConnectionError::PayloadDeadline { .. },
        )
        | ExchangeError::OutOfStep => AttemptError::Transient(error.to_string()),
        ExchangeError::Refused(ferry_proto::ErrorReply {
            code: ErrorCode::CapabilityRefused,
            message,
        }) => AttemptError::Fatal(NodeError::CapabilityRefused(Refusal::BySource {
            source_addr: source.to_string(),
            message,
        })),
        // A source that sends from host copies answers `Busy` while its share of them is taken
        // (other fetches in flight): asked again after the backoff, as a dropped link is.
        ExchangeError::Refused(ferry_proto::ErrorReply {
            code: ErrorCode::ShuttingDown | ErrorCode::Busy,
            message,
        }) => AttemptError::Transient(message),
        other => AttemptError::Fatal(NodeError::Peer {
            source_addr: source.to_string(),
            message: other.to_string(),
        }),
    }
}

/// The content hash of every byte received, off the runtime (the hashing thread may still be a
/// chunk or two behind the receiver), with the receiver back.
async fn settle_hash(
    mut received: Receiving,
) -> Result<(Receiving, ferry_proto::ContentHash), NodeError> {
    let (received, hash) = tokio::task::spawn_blocking(move || {
        let hash = received.assembler.settle_hash();
        (received, hash)
    })
    .await
    .map_err(|e| NodeError::Backend(format!("hashing task: {e}")))?;
    Ok((received, hash.map_err(NodeError::Received)?))
}

/// The assembled tensor, its content hash (settled before the release, or computed now) and the
/// region it was received into (sealed), off the runtime.
async fn finish_hashed(
    assembler: ferry_io::TensorAssembler,
) -> Result<
    (
        burn_backend::TensorData,
        ferry_proto::ContentHash,
        ferry_io::assembler::Sealed,
    ),
    NodeError,
> {
    tokio::task::spawn_blocking(move || assembler.finish_hashed_sealed())
        .await
        .map_err(|e| NodeError::Backend(format!("hashing task: {e}")))?
        .map_err(NodeError::Received)
}
