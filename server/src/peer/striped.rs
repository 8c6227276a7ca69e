//! A pull spread over several connections to its source: once the source answered the first
//! stripe of a tensor larger than one, the pull's own connection and helper connections fetch
//! the other stripes side by side, each stripe resumed where it stopped after a drop, until every
//! stripe is in. The hand-off: `first_stripe` cuts the pull's receiver in stripes and receives
//! the one answered, `other_stripes` fetches the rest and joins them.
//!
//! Invariants: each stripe is in exactly one place at a time (the queue, one connection's hands,
//! or the done list), so no two connections write the same bytes; a stripe a connection gave
//! up on goes back to the queue with the bytes it holds, for any connection to resume; a fatal
//! error anywhere stops every connection and fails the pull (the stripes, and with them the
//! receive buffer, are dropped: nothing is registered).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use ferry_io::PayloadRoute;
use ferry_io::exchange::Fetch;
use ferry_io::striped::{StripeReceiver, StripedReceive};
use ferry_proto::stripes::StripeLen;
use ferry_proto::{CapabilityToken, TensorKey, TensorMeta, Untrusted};

use super::failure::{AttemptError, Failed, SOURCE_TROUBLE, UNREACHABLE, classify};
use super::link::{OpenLink, PeerLink};
use super::plan::{self, RetryPolicy};
use super::receive::Receiving;
use super::request::PullRequest;
use crate::error::NodeError;
use crate::node::{Admission, Node};

/// The stripes of one pull: those waiting for a connection and those in.
#[derive(Debug)]
struct StripeQueue {
    state: Mutex<QueueState>,
}

#[derive(Debug, Default)]
struct QueueState {
    waiting: VecDeque<StripeReceiver>,
    done: Vec<StripeReceiver>,
    /// A connection failed for good: the others stop taking stripes.
    failed: bool,
}

impl StripeQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        // Every update is one statement: the state stays consistent under a panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next stripe to fetch, unless none is left or the pull failed.
    fn take(&self) -> Option<StripeReceiver> {
        let mut state = self.lock();
        if state.failed {
            return None;
        }
        state.waiting.pop_front()
    }

    /// A stripe not (wholly) fetched goes back first in line, with what it holds.
    fn give_back(&self, stripe: StripeReceiver) {
        self.lock().waiting.push_front(stripe);
    }

    fn finished(&self, stripe: StripeReceiver) {
        self.lock().done.push(stripe);
    }

    fn fail(&self) {
        self.lock().failed = true;
    }

    fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }
}

/// What every connection of one pull fetches its stripes with.
#[derive(Debug)]
struct StripeFetcher {
    node: Node,
    source: String,
    capability: CapabilityToken,
    src: TensorKey,
    meta: TensorMeta,
    /// The content hash's prefix length: a payload offset plus this is its place in the hash
    /// input, which `FetchRange` counts in.
    prefix: u64,
}

/// A receive cut in stripes once the source answered the first: the stripes still due and those
/// in, for the striped fetch to complete.
pub(super) struct Cut {
    striped: StripedReceive,
    waiting: Vec<StripeReceiver>,
    done: Vec<StripeReceiver>,
    admission: Admission,
    meta: TensorMeta,
    /// The pull's own connection dropped during the first stripe.
    dropped: bool,
}

/// Cuts the receiver in stripes and receives the first, which the source answered on `fetch`;
/// a first stripe dropped goes back to the others, to be resumed.
pub(super) async fn first_stripe(
    source: &str,
    stripe_len: StripeLen,
    fetch: Fetch<'_>,
    r: Receiving,
) -> Result<Cut, Failed> {
    let Receiving {
        assembler,
        admission,
        ..
    } = r;
    let (striped, mut waiting) = StripedReceive::new(assembler, stripe_len)
        .map_err(|_| Failed::fatal(NodeError::Backend("a receive cut in stripes".into())))?;
    let mut first = waiting.remove(0);
    let meta = fetch.meta.clone();
    let mut done = Vec::with_capacity(waiting.len() + 1);
    let mut dropped = false;
    match fetch.stripe(&mut first).await {
        Ok(()) => done.push(first),
        Err(e) => match classify(source, e) {
            AttemptError::Fatal(error) => return Err(Failed::fatal(error)),
            AttemptError::Transient(why) => {
                let detail = format!("a pull's first stripe dropped; resuming it: {why}");
                SOURCE_TROUBLE.note(&Untrusted(source).to_string(), &detail);
                dropped = true;
                waiting.insert(0, first);
            }
        },
    }
    Ok(Cut {
        striped,
        waiting,
        done,
        admission,
        meta,
        dropped,
    })
}

impl Node {
    /// The stripes after the first, over the pull's own connection and its helpers, joined
    /// into the whole tensor's receiver.
    pub(super) async fn other_stripes(
        &self,
        link: &mut PeerLink,
        req: &PullRequest,
        cut: Cut,
    ) -> Result<Receiving, Failed> {
        if cut.dropped {
            link.source = None;
        }
        let stripes = self
            .fetch_stripes(link, req, &cut.meta, cut.waiting, cut.done)
            .await
            .map_err(Failed::fatal)?;
        let assembler = cut
            .striped
            .join(stripes)
            .map_err(|e| Failed::fatal(NodeError::Received(e.into())))?;
        Ok(Receiving {
            assembler,
            admission: cut.admission,
            route: PayloadRoute::Chunks,
            region: None,
        })
    }

    /// Fetches every stripe in `waiting` over the pull's own connection (in `link`) and up to
    /// the configured number of helper connections, `done` holding those already in; all the
    /// stripes once each is complete.
    async fn fetch_stripes(
        &self,
        link: &mut PeerLink,
        req: &PullRequest,
        meta: &TensorMeta,
        waiting: Vec<StripeReceiver>,
        done: Vec<StripeReceiver>,
    ) -> Result<Vec<StripeReceiver>, NodeError> {
        let striping = self.config().pulls.striping;
        let helpers = plan::helper_connections(striping.connections(), waiting.len());
        let queue = Arc::new(StripeQueue {
            state: Mutex::new(QueueState {
                waiting: waiting.into(),
                done,
                failed: false,
            }),
        });
        let fetcher = Arc::new(StripeFetcher {
            node: self.clone(),
            source: req.source.clone(),
            capability: req.capability.clone(),
            src: req.src.clone(),
            meta: meta.clone(),
            prefix: ferry_proto::tensor::content_hash_prefix(meta).len() as u64,
        });
        // Helper connections kept from the session's earlier pulls of this source are reused,
        // if opened on the terms the node's policy gives the source now.
        let terms = self.terms_for(&req.source).ok();
        let mut kept: Vec<OpenLink> = std::mem::take(&mut link.helpers)
            .into_iter()
            .filter(|kept| {
                kept.addr == req.source
                    && terms.as_ref() == Some(&kept.terms)
                    && kept.conn.in_step()
            })
            .collect();
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..helpers {
            let (fetcher, queue, conn) = (fetcher.clone(), queue.clone(), kept.pop());
            tasks.spawn(async move { fetcher.run(conn, &queue).await });
        }
        drop(kept);
        // The pull's own connection, alongside the helpers.
        let (own, conn) = fetcher.run(link.source.take(), &queue).await;
        link.source = conn;
        if let Err(error) = own {
            queue.fail();
            return Err(error);
        }
        while let Some(joined) = tasks.join_next().await {
            let (helped, conn) = joined.map_err(|e| {
                queue.fail();
                NodeError::Backend(format!("a stripe's task: {e}"))
            })?;
            if let Err(error) = helped {
                queue.fail();
                return Err(error);
            }
            link.helpers.extend(conn.filter(|c| c.conn.in_step()));
        }
        // Stripes a helper gave up on (after its retries), the pull's own connection fetches.
        if queue.waiting() > 0 {
            let (own, conn) = fetcher.run(link.source.take(), &queue).await;
            link.source = conn;
            own?;
        }
        let mut state = queue.lock();
        if !state.waiting.is_empty() {
            return Err(NodeError::Peer {
                source_addr: req.source.clone(),
                message: format!(
                    "{UNREACHABLE} ({} stripes of {} not fetched after {} retries each)",
                    state.waiting.len(),
                    state.waiting.len() + state.done.len(),
                    self.config().pulls.retries
                ),
            });
        }
        Ok(std::mem::take(&mut state.done))
    }
}

impl StripeFetcher {
    /// Takes stripes from `queue` and fetches each over `conn` (connecting where it is `None`)
    /// until none is left. A dropped connection is opened again, up to the pull's retries, its
    /// stripe given back meanwhile for any connection to resume; past them, or where it cannot
    /// be opened at all, this connection stops, its stripes left for others. `Err` only for a
    /// fetch that no retry mends (a refused capability, bytes that break the protocol). Gives
    /// back the connection, where it is still open.
    async fn run(
        &self,
        mut conn: Option<OpenLink>,
        queue: &StripeQueue,
    ) -> (Result<(), NodeError>, Option<OpenLink>) {
        let mut failures = 0u32;
        loop {
            // Connected before taking a stripe, so that no stripe waits in the hands of a
            // connection still being opened while the others run out of work.
            let (mut open, new) = match conn.take() {
                Some(open) => (open, false),
                None => match self.connect().await {
                    Ok(open) => (open, true),
                    // A connection refused (the source's per-address limit, say) only means one
                    // connection fewer: its stripes are left to the others, and a pull whose
                    // every connection failed reports the stripes not fetched.
                    Err(AttemptError::Fatal(error)) => {
                        let detail = format!("a stripe connection could not be opened: {error}");
                        SOURCE_TROUBLE.note(&Untrusted(&self.source).to_string(), &detail);
                        return (Ok(()), None);
                    }
                    Err(AttemptError::Transient(why)) => {
                        if !self.wait_to_retry(&mut failures, &why).await {
                            return (Ok(()), None);
                        }
                        continue;
                    }
                },
            };
            let Some(mut stripe) = queue.take() else {
                // A connection opened here that fetched nothing is not given back: the pull's
                // release goes on a connection that fetched under the capability.
                return (Ok(()), (!new).then_some(open));
            };
            match self.fetch(&mut open, &mut stripe).await {
                Ok(()) => {
                    queue.finished(stripe);
                    conn = Some(open);
                }
                Err(AttemptError::Transient(why)) => {
                    queue.give_back(stripe);
                    drop(open);
                    if !self.wait_to_retry(&mut failures, &why).await {
                        return (Ok(()), None);
                    }
                }
                // No retry mends it: every other connection stops taking stripes.
                Err(AttemptError::Fatal(error)) => {
                    queue.give_back(stripe);
                    queue.fail();
                    return (Err(error), None);
                }
            }
        }
    }

    /// Counts a transient failure and waits the backoff before the next try; `false` once the
    /// pull's retries are spent.
    async fn wait_to_retry(&self, failures: &mut u32, why: &str) -> bool {
        let Some(retry) = RetryPolicy::of(&self.node.config().pulls).retry(*failures) else {
            let detail = format!("a stripe connection gave up: {why}");
            SOURCE_TROUBLE.note(&Untrusted(&self.source).to_string(), &detail);
            return false;
        };
        *failures = retry.attempt;
        self.node.recorder().pull_retry();
        let detail =
            format!("a stripe's connection dropped; reconnecting (attempt {failures}): {why}");
        SOURCE_TROUBLE.note(&Untrusted(&self.source).to_string(), &detail);
        tokio::time::sleep(retry.wait).await;
        true
    }

    /// A new connection to the source, on the terms the node's policy gives it now.
    async fn connect(&self) -> Result<OpenLink, AttemptError> {
        let terms = self.node.terms_for(&self.source)?;
        self.node.dial(&self.source, terms).await
    }

    /// Fetches the rest of `stripe` over `open`.
    async fn fetch(
        &self,
        open: &mut OpenLink,
        stripe: &mut StripeReceiver,
    ) -> Result<(), AttemptError> {
        let idle = self.node.config().pulls.peer_limits.idle_timeout;
        let input = stripe.next_offset() + self.prefix..stripe.payload_range().end + self.prefix;
        let begin = open
            .conn
            .fetch_range(&self.capability, self.node.node_id(), input);
        let fetch = match tokio::time::timeout(idle, begin).await {
            Ok(Ok(fetch)) => fetch,
            Ok(Err(e)) => return Err(classify(&self.source, e)),
            Err(_) => {
                return Err(AttemptError::Transient(format!(
                    "{} did not answer",
                    self.source
                )));
            }
        };
        if fetch.info.key != self.src || fetch.meta != self.meta {
            return Err(AttemptError::Fatal(NodeError::Peer {
                source_addr: self.source.clone(),
                message: "the tensor changed between two stripes".into(),
            }));
        }
        fetch
            .stripe(stripe)
            .await
            .map_err(|e| classify(&self.source, e))
    }
}
