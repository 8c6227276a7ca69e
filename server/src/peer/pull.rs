//! One pull, from the request's checks to the registered tensor: attempts over the session's
//! link, each resuming what the last received, the hand-off to stripes, the hash check and the
//! release, as [`plan`](super::plan) decides them.

use std::time::Instant;

use ferry_io::exchange::Fetch;
use ferry_io::hash_plan::{PulledCheck, pulled_check};
use ferry_io::{Assembled, Exchange, ExchangeError, RegionUse};
use ferry_proto::{ContentHash, NodeId, TensorKey, Untrusted, dtype_name};

use super::failure::{AttemptError, Failed, SOURCE_TROUBLE, UNREACHABLE, classify};
use super::link::PeerLink;
use super::plan::{self, AfterFailure, Receive, Request, RetryPolicy};
use super::receive::{Receiving, finish, settle_hash};
use super::request::{PullRequest, check_source};
use super::striped::first_stripe;
use crate::device::{Arrived, KnownHash, Payload, TensorDesc};
use crate::engine::TransferPath;
use crate::error::NodeError;
use crate::node::{Direction, FAILED_TRANSFERS, Node};

/// One pull of `req` by `node`, over the session's `link`.
pub(super) struct Pull<'a> {
    node: &'a Node,
    link: &'a mut PeerLink,
    req: &'a PullRequest,
    /// The target name: the request's, else the source's.
    name: String,
    /// When a dropped attempt is tried again.
    retries: RetryPolicy,
}

impl<'a> Pull<'a> {
    pub(super) fn new(node: &'a Node, link: &'a mut PeerLink, req: &'a PullRequest) -> Self {
        Pull {
            node,
            link,
            req,
            name: req.dst_name.clone().unwrap_or_else(|| req.src.name.clone()),
            retries: RetryPolicy::of(&node.config().pulls),
        }
    }

    /// Carries the pull out, recorded and logged.
    pub(super) async fn run(mut self) -> Result<TensorDesc, NodeError> {
        let (node, req) = (self.node, self.req);
        let started = Instant::now();
        let dst = TensorKey::new(req.dst_device, &self.name);
        let result = self.outcome().await;
        let path = result.as_ref().map_or("pull", |d| d.path.name());
        node.recorder()
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

    async fn outcome(&mut self) -> Result<TensorDesc, NodeError> {
        let granted = self.check()?;
        let req = self.req;
        let held = self
            .node
            .held_copy(granted, req.dst_device, &self.name, req.existing);
        if let Some(desc) = held.await? {
            return Ok(desc);
        }
        let received = self.receive(granted).await?;
        self.register(received, granted).await
    }

    /// What is checked before anything is sent: the names, the source and whether this node
    /// pulls from it, the target device; the granted hash, required.
    fn check(&self) -> Result<ContentHash, NodeError> {
        let (node, req) = (self.node, self.req);
        ferry_proto::message::validate_name(&self.name)?;
        ferry_proto::message::validate_name(&req.src.name)?;
        check_source(&req.source)?;
        let tls = node.config().tls.is_some();
        if !node.config().pulls.peers.allows_over(&req.source, tls) {
            return Err(NodeError::NotAllowedPeer(req.source.clone()));
        }
        node.device(req.dst_device)?;
        req.content_hash.ok_or(NodeError::PullWithoutHash)
    }

    /// Attempts until one completes, reconnecting after a transient failure as the plan says:
    /// what arrived so far travels from one attempt to the next, and comes back whole from the
    /// one that completes.
    async fn receive(&mut self, granted: ContentHash) -> Result<Receiving, NodeError> {
        let mut resume: Option<Receiving> = None;
        let mut made = 0u32;
        loop {
            let failed = match self.attempt(resume, granted).await {
                Ok(received) => return Ok(received),
                Err(failed) => failed,
            };
            resume = failed.resume;
            self.link.source = None;
            match self.retries.after(failed.error, made) {
                AfterFailure::Retry { attempt, wait, why } => {
                    made = attempt;
                    self.node.recorder().pull_retry();
                    let resume_at = resume.as_ref().map_or(0, |r| r.assembler.received());
                    let detail = format!(
                        "pull dropped; reconnecting (attempt {attempt}, at byte {resume_at}): {why}"
                    );
                    SOURCE_TROUBLE.note(&Untrusted(&self.req.source).to_string(), &detail);
                    tokio::time::sleep(wait).await;
                }
                AfterFailure::GiveUp { retries, why } => {
                    // What exactly failed stays in this node's log: a client that names the
                    // source learns only that it could not be reached, never what answered there
                    // (no probing of other services through a node).
                    let detail = format!("pull gave up after {retries} retries: {why}");
                    SOURCE_TROUBLE.note(&Untrusted(&self.req.source).to_string(), &detail);
                    return Err(NodeError::Peer {
                        source_addr: self.req.source.clone(),
                        message: format!("{UNREACHABLE} (after {retries} retries)"),
                    });
                }
                AfterFailure::Fail(error) => return Err(error),
            }
        }
    }

    /// One connection's try at the pull, resuming after what `resume` holds; what arrived comes
    /// back either way (a transient failure resumes from it).
    async fn attempt(
        &mut self,
        resume: Option<Receiving>,
        granted: ContentHash,
    ) -> Result<Receiving, Failed> {
        let (node, req) = (self.node, self.req);
        // A source that answers nothing is as gone as one that hung up.
        let idle = node.config().pulls.peer_limits.idle_timeout;
        let source = match node.link_to(self.link, &req.source).await {
            Ok(source) => source,
            Err(error) => return Err(Failed { error, resume }),
        };
        let striping = node.config().pulls.striping;
        let traits = plan::Source {
            node_minor: source.node_minor(),
            shared_memory: source.shared_memory(),
        };
        let received = resume.as_ref().map(|r| r.assembler.received() as u64);
        let request = plan::request(received, striping, traits);
        let begin = ask(source, request, req, node.node_id());
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
            None => node
                .start_receiving(req, &self.name, fetch.meta.clone())
                .map_err(Failed::fatal)?,
        };
        let r = match plan::receive(&fetch.range, fetch.meta.byte_len() as u64) {
            // The source answered the first stripe only: the rest comes over several
            // connections, and what the whole hashes to is settled once every stripe is in.
            Receive::Stripes => {
                let cut = first_stripe(&req.source, striping.stripe_len(), fetch, r).await?;
                node.other_stripes(self.link, req, cut).await?
            }
            Receive::Payload => match fetch.payload(&mut r.assembler, RegionUse::Keep).await {
                Ok((route, region)) => {
                    r.route = route;
                    r.region = region;
                    r
                }
                Err(e) => {
                    let error = classify(&req.source, e);
                    return Err(Failed {
                        error,
                        resume: Some(r),
                    });
                }
            },
        };
        let bytes = r.assembler.meta().byte_len() as u64;
        node.recorder().payload(Direction::Received, r.route, bytes);
        let r = self.verify(r, granted).await?;
        self.release().await;
        Ok(r)
    }

    /// Chunks are checked by the whole payload's hash (in clear the link vouches for nothing,
    /// and a pull checks no chunk CRC: the hash catches noise and a proxy alike; over mutual
    /// TLS the hash compared is the one the client relayed from the grant, so a wrong one
    /// fails the pull on every link alike), compared with the grant before the capability is
    /// released: bytes that are not the ones granted never use it up (the source lets it
    /// lapse, or a fetch from 0 may try again). The hash trailed the receive on another
    /// thread, so this waits for its last chunk only.
    async fn verify(&self, r: Receiving, granted: ContentHash) -> Result<Receiving, Failed> {
        match pulled_check(r.route) {
            PulledCheck::ByDevice => Ok(r),
            PulledCheck::BeforeRelease => {
                let (back, computed) = settle_hash(r).await.map_err(Failed::fatal)?;
                if computed != granted {
                    self.node.recorder().integrity_failure();
                    return Err(Failed::fatal(NodeError::Integrity {
                        source_addr: self.req.source.clone(),
                        expected: granted,
                        computed,
                    }));
                }
                Ok(back)
            }
        }
    }

    /// Every byte is here and verified: the transfer stands even if the release is lost (the
    /// capability then lapses at the source on its own, as it does where a striped pull lost
    /// the connection its fetches went over: a new one fetched nothing and may not release).
    async fn release(&mut self) {
        let (node, req) = (self.node, self.req);
        let idle = node.config().pulls.peer_limits.idle_timeout;
        let Some(source) = self.link.source.as_mut().map(|open| &mut open.conn) else {
            return;
        };
        let release = source.release(&req.capability, node.node_id());
        match tokio::time::timeout(idle, release).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                let detail = format!("release after a complete pull failed: {error}");
                SOURCE_TROUBLE.note(&Untrusted(&req.source).to_string(), &detail);
            }
            Err(_) => {
                let detail = "release after a complete pull timed out";
                SOURCE_TROUBLE.note(&Untrusted(&req.source).to_string(), detail);
                node.drop_link_after_timeout(self.link);
            }
        }
    }

    /// Registers what arrived.
    async fn register(
        &self,
        received: Receiving,
        granted: ContentHash,
    ) -> Result<TensorDesc, NodeError> {
        let Receiving {
            assembler,
            admission,
            route,
            region,
        } = received;
        let Assembled {
            data,
            hash,
            sealed,
            checksums,
        } = finish(assembler).await?;
        let hash = match (pulled_check(route), hash) {
            // Chunks: hashed while they arrived and compared with the grant by `verify`, before
            // the release; the hash is the one it settled.
            (PulledCheck::BeforeRelease, Some(computed)) => {
                debug_assert_eq!(computed, granted, "`verify` compared it with the grant");
                KnownHash::Computed(computed)
            }
            // A sealed region from a peer of this host: its bytes cannot change, so the device
            // registers it under the granted hash and verifies that off the critical path; until
            // it has, the tensor is granted, matched and deduped on by nothing.
            _ => KnownHash::Stated(granted),
        };
        // The region it came in, or the one it was received into, where the node shares its
        // receives.
        let region = region.or(sealed);
        let payload = Payload::Data(Arrived {
            data,
            hash,
            region,
            checksums,
        });
        let desc = self
            .node
            .register_payload(admission, payload, TransferPath::Pull)
            .await?;
        self.node.recorder().pulled();
        Ok(desc)
    }
}

/// Asks `source` for what `request` says.
async fn ask<'s>(
    source: &'s mut Exchange,
    request: Request,
    req: &PullRequest,
    node_id: &NodeId,
) -> Result<Fetch<'s>, ExchangeError> {
    match request {
        Request::FirstStripe { len } => source.fetch_range(&req.capability, node_id, 0..len).await,
        Request::Whole => source.fetch(&req.capability, node_id, 0).await,
        Request::Resume { from } => source.fetch(&req.capability, node_id, from).await,
    }
}
