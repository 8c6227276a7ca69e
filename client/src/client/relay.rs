//! One copy to several nodes ([`NodeCopy::run_relayed`]): the targets form a chain, and each
//! pulls every tensor from the nearest node before it that holds it, so that the source sends
//! each byte about once and every target holds the whole set about one tensor after the first.
//! Which node a target pulls from, and whose fault a failure was, are pure functions
//! ([`pick_source`], [`blame`]); the hops only carry them out.

use std::sync::Mutex;

use ferry_proto::{
    ContentHash, ErrorCode, IfExists, NodeId, TensorInfo, TensorKey, Transfer, TransferPath,
};
use futures_util::future::join_all;
use tokio::sync::Notify;

use super::node_copy::CopyItem;
use super::node_copy::GRANT_BUSY_RETRIES;
use super::{Client, ClientError, NodeCopy};

/// A target of a relayed copy: the node's address as the other targets reach it (they may pull
/// from it), a connection it pulls over, and one that grants what it holds to the next.
#[derive(Debug)]
pub struct RelayTarget {
    /// The node's address as the nodes after it in the chain reach it.
    pub addr: String,
    /// The connection that asks this node to pull.
    pub pulls: Client,
    /// The connection that asks this node for capabilities on what it holds.
    pub grants: Client,
}

/// What a node of the chain is to one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holding {
    /// Not yet known: its own pull of it has not ended.
    Pending,
    /// It holds the tensor (the version the copy is of).
    Holds,
    /// It cannot serve it: it refused it, failed to land it, or failed to grant or send it.
    Lost,
}

/// Where a target takes a tensor from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pick {
    /// From this node of the chain (0 is the source).
    From(usize),
    /// The nearest node before it that may still hold it has not landed it yet.
    Wait,
    /// No node before it holds it, nor will.
    Nowhere,
}

/// The node target `target` (1-based; 0 is the source) pulls a tensor from, given what each
/// node of the chain is to it: the nearest before it that holds it; if the nearest that may
/// still hold it is still landing it, wait for it rather than ask further up (the source's link
/// carries each byte about once); nodes that lost it are passed over.
fn pick_source(row: &[Holding], target: usize) -> Pick {
    for node in (0..target.min(row.len())).rev() {
        match row[node] {
            Holding::Holds => return Pick::From(node),
            Holding::Pending => return Pick::Wait,
            Holding::Lost => {}
        }
    }
    Pick::Nowhere
}

/// Which step of a hop failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// The capability, asked of the node pulled from.
    Grant,
    /// The capability was for another version than the one the copy is of.
    Version,
    /// The pull, asked of the target.
    Pull,
}

/// Whose failure it was, and what follows: the target asks another node for this tensor
/// (`SourceLacks`), for every tensor (`Unreachable`: this target could not fetch from it, which
/// may be the target's own link), or every target does (`SourceGone`: this client's connection
/// to it failed); or the nodes after the target pass it over for this tensor (`Target`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blame {
    SourceLacks,
    Unreachable,
    SourceGone,
    Target,
}

/// Whose failure a failed step with `code` (none: the connection failed) was.
fn blame(stage: Stage, code: Option<ErrorCode>) -> Blame {
    match (stage, code) {
        // The granting connection failed.
        (Stage::Grant, None) => Blame::SourceGone,
        // The target could not fetch from the node (its link or the node's: it cannot tell).
        (Stage::Pull, Some(ErrorCode::PeerFailed)) => Blame::Unreachable,
        // The node does not hold it (or not that version, or not now), or sent other bytes.
        (Stage::Grant, Some(_))
        | (Stage::Version, _)
        | (Stage::Pull, Some(ErrorCode::Integrity | ErrorCode::CapabilityRefused)) => {
            Blame::SourceLacks
        }
        // Refused by the target (budget, dtype, a key it holds), or its connection failed.
        (Stage::Pull, _) => Blame::Target,
    }
}

/// What every node of the chain is to every tensor, and the version each tensor is copied at.
struct Chain {
    /// `holds[tensor][node]`, node 0 the source.
    holds: Vec<Vec<Holding>>,
    /// Nodes no target could reach: lost for every tensor, whatever they hold.
    gone: Vec<bool>,
    /// The version each tensor is copied at: the one listed (`tensor_at`), else the first one
    /// granted for it. Every grant is checked against it (taken and compared under this lock,
    /// in one step), so every target lands that version or none.
    version: Vec<Option<ContentHash>>,
}

/// One pull of one tensor into one target from one node of the chain, with its capability.
struct Hop<'a> {
    from_addr: &'a str,
    from_key: &'a TensorKey,
    dst: &'a TensorKey,
    audience: &'a NodeId,
    /// Takes the granted version as the tensor's where it has none yet, and answers the one it
    /// has: a grant of any other is given back.
    pin: &'a (dyn Fn(ContentHash) -> ContentHash + Sync),
    if_exists: IfExists,
}

impl Hop<'_> {
    /// Grants on `from`, pulls into `into`; the capability given back where no node used it.
    /// The version pulled, or the failed step.
    async fn run(
        &self,
        from: &mut Client,
        into: &mut Client,
    ) -> Result<TensorInfo, (Stage, ClientError)> {
        // A node still verifying the hash of what it just landed answers `Busy` (each ask
        // waits for it up to the node's bound): asked again, as a copy to one target does.
        let mut grant = from.grant(self.from_key, self.audience).await;
        let mut asked = 0;
        while asked < GRANT_BUSY_RETRIES
            && matches!(&grant, Err(e) if e.code() == Some(ErrorCode::Busy))
        {
            asked += 1;
            grant = from.grant(self.from_key, self.audience).await;
        }
        let grant = grant.map_err(|e| (Stage::Grant, e))?;
        let listed = (self.pin)(grant.content_hash);
        if grant.content_hash != listed {
            // Another version than the one the copy is of: given back, so that it does not
            // count against this connection's outstanding grants.
            let _ = from.release(&grant).await;
            return Err((
                Stage::Version,
                ClientError::NotTheListedVersion {
                    key: self.from_key.clone(),
                    listed,
                    granted: grant.content_hash,
                },
            ));
        }
        match into
            .pull(self.from_addr, &grant, self.dst, self.if_exists)
            .await
        {
            Ok(info) => {
                // A target that held the bytes already never fetched: used up here rather
                // than left to lapse.
                if info.path == TransferPath::Dedup {
                    let _ = from.release(&grant).await;
                }
                Ok(info)
            }
            Err(failed) => {
                let _ = from.release(&grant).await;
                Err((Stage::Pull, failed))
            }
        }
    }
}

impl NodeCopy {
    /// [`run`](Self::run) to several targets at once, relayed: `targets` form a chain after
    /// the source, and each pulls every tensor from the nearest node before it that holds it,
    /// under a capability that node grants for it alone (no token goes further than a copy's
    /// own). The source sends each byte about once, and every target holds the whole set about
    /// one tensor's time after the first does. A target that refuses a tensor (budget, dtype, a
    /// key it holds), or fails, is passed over by those after it; one a target cannot fetch
    /// from (it failed, or no longer holds the version) is asked of the node before it. Every
    /// target lands one version of each tensor (the first granted for it), or nothing: a
    /// source replaced meanwhile is refused ([`ClientError::NotTheListedVersion`], or the
    /// node's `CapabilityRefused` where it was replaced between the grant and the fetch).
    ///
    /// One list of answers per target, in the order given, one answer per tensor in the order
    /// added; a tensor no node before a target could give it is answered
    /// [`ClientError::NoAnswer`]. Only copies: a move to several targets answers every tensor
    /// [`ClientError::Unexpected`]. A connection that fails leaves its client out of step.
    pub async fn run_relayed(
        &self,
        source: &mut Client,
        targets: &mut [RelayTarget],
    ) -> Vec<Vec<Result<TensorInfo, ClientError>>> {
        self.relay(source, targets, &|_, item| Some(item.dst.clone()))
            .await
    }

    /// [`run_relayed`](Self::run_relayed) with each tensor under `dst_on(node, item)` on node
    /// `node` of the chain (1-based; `None`: that target takes no part).
    pub(super) async fn relay(
        &self,
        source: &mut Client,
        targets: &mut [RelayTarget],
        dst_on: &DstOn<'_>,
    ) -> Vec<Vec<Result<TensorInfo, ClientError>>> {
        if self.transfer == Transfer::Move {
            let refused = || {
                ClientError::Unexpected(
                    "a move goes to one target: a relayed copy only copies".to_string(),
                )
            };
            return targets
                .iter()
                .map(|_| self.items.iter().map(|_| Err(refused())).collect())
                .collect();
        }
        let mut audiences = Vec::with_capacity(targets.len());
        for target in targets.iter_mut() {
            audiences.push(target.pulls.identify().await);
        }
        let chain = Mutex::new(Chain {
            holds: self
                .items
                .iter()
                .map(|_| {
                    let mut row = vec![Holding::Pending; targets.len() + 1];
                    row[0] = Holding::Holds;
                    row
                })
                .collect(),
            version: self.items.iter().map(|item| item.version).collect(),
            gone: vec![false; targets.len() + 1],
        });
        let changed = Notify::new();
        let mut granting = vec![(self.source_addr.as_str(), tokio::sync::Mutex::new(source))];
        let mut pulling = Vec::with_capacity(targets.len());
        for target in targets.iter_mut() {
            granting.push((
                target.addr.as_str(),
                tokio::sync::Mutex::new(&mut target.grants),
            ));
            pulling.push(&mut target.pulls);
        }
        let hops = pulling
            .into_iter()
            .zip(audiences)
            .enumerate()
            .map(|(at, (pulls, audience))| {
                let hop_of = Relaying {
                    granting: &granting,
                    chain: &chain,
                    changed: &changed,
                    dst_on,
                };
                self.relay_into(at + 1, pulls, audience, hop_of)
            });
        join_all(hops).await
    }

    /// Every tensor into target `target` (1-based), in order, each from the node
    /// [`pick_source`] names; the chain updated and its waiters woken after each.
    async fn relay_into(
        &self,
        target: usize,
        pulls: &mut Client,
        audience: Result<NodeId, ClientError>,
        relaying: Relaying<'_, '_>,
    ) -> Vec<Result<TensorInfo, ClientError>> {
        let Relaying {
            granting,
            chain,
            changed,
            dst_on,
        } = relaying;
        let lock = || chain.lock().unwrap_or_else(|e| e.into_inner());
        let mark = |tensor: usize, node: usize, holding: Holding| {
            lock().holds[tensor][node] = holding;
            changed.notify_waiters();
        };
        let audience = match audience {
            Ok(audience) => audience,
            Err(failed) => {
                // Not even identified: it holds nothing, and the nodes after it pass it over.
                let reason = format!("the target did not say who it is: {failed}");
                return (0..self.items.len())
                    .map(|tensor| {
                        mark(tensor, target, Holding::Lost);
                        Err(no_answer(&self.items[tensor].src, &reason))
                    })
                    .collect();
            }
        };
        // Nodes this target could not fetch from: passed over for every tensor, by it alone.
        let mut unreachable = vec![false; granting.len()];
        let mut answers = Vec::with_capacity(self.items.len());
        for (tensor, item) in self.items.iter().enumerate() {
            let Some(dst) = dst_on(target, item) else {
                mark(tensor, target, Holding::Lost);
                answers.push(Err(no_answer(&item.src, "this target takes no part")));
                continue;
            };
            let mut last_failure = None;
            let answer = loop {
                // Asked to be woken before looking, so that no change between is missed.
                let woken = changed.notified();
                tokio::pin!(woken);
                woken.as_mut().enable();
                let pick = {
                    let chain = lock();
                    let row: Vec<Holding> = chain.holds[tensor]
                        .iter()
                        .zip(chain.gone.iter().zip(&unreachable))
                        .map(|(&holding, (&gone, &unreachable))| {
                            if gone || unreachable {
                                Holding::Lost
                            } else {
                                holding
                            }
                        })
                        .collect();
                    pick_source(&row, target)
                };
                let from = match pick {
                    Pick::From(from) => from,
                    Pick::Wait => {
                        woken.await;
                        continue;
                    }
                    Pick::Nowhere => {
                        mark(tensor, target, Holding::Lost);
                        break Err(last_failure.unwrap_or_else(|| {
                            no_answer(&item.src, "no node before this target holds it")
                        }));
                    }
                };
                let from_key = match from {
                    0 => item.src.clone(),
                    // A node holds a tensor only under the key it was given.
                    relay => match dst_on(relay, item) {
                        Some(key) => key,
                        None => {
                            mark(tensor, relay, Holding::Lost);
                            continue;
                        }
                    },
                };
                let (from_addr, from_client) = &granting[from];
                let hop = Hop {
                    from_addr,
                    from_key: &from_key,
                    dst: &dst,
                    audience: &audience,
                    pin: &|granted| *lock().version[tensor].get_or_insert(granted),
                    if_exists: self.if_exists,
                };
                let mut from_client = from_client.lock().await;
                let ran = hop.run(&mut from_client, pulls).await;
                drop(from_client);
                match ran {
                    Ok(info) => {
                        mark(tensor, target, Holding::Holds);
                        break Ok(info);
                    }
                    Err((stage, failed)) => match blame(stage, failed.code()) {
                        Blame::SourceLacks => {
                            mark(tensor, from, Holding::Lost);
                            last_failure = Some(failed);
                        }
                        Blame::Unreachable => {
                            unreachable[from] = true;
                            last_failure = Some(failed);
                        }
                        Blame::SourceGone => {
                            lock().gone[from] = true;
                            changed.notify_waiters();
                            last_failure = Some(failed);
                        }
                        Blame::Target => {
                            mark(tensor, target, Holding::Lost);
                            break Err(failed);
                        }
                    },
                }
            };
            answers.push(answer);
        }
        answers
    }
}

/// Where node `node` of a chain (1-based) holds `item`: `None` where it takes no part.
pub(super) type DstOn<'a> = dyn Fn(usize, &CopyItem) -> Option<TensorKey> + Sync + 'a;

/// What every hop of one relayed copy shares.
#[derive(Clone, Copy)]
struct Relaying<'g, 'c> {
    /// Node `j`'s granting connection and address, 0 the source: shared by the targets that
    /// pull from it (one at a time).
    granting: &'g [(&'g str, tokio::sync::Mutex<&'c mut Client>)],
    chain: &'g Mutex<Chain>,
    changed: &'g Notify,
    dst_on: &'g DstOn<'g>,
}

/// A tensor a target was given no answer for, and why.
fn no_answer(key: &TensorKey, reason: &str) -> ClientError {
    ClientError::NoAnswer {
        key: key.clone(),
        reason: reason.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Holding::{Holds, Lost, Pending};

    #[test]
    fn pick_source_table() {
        let cases: [(&[Holding], usize, Pick); 9] = [
            (&[Holds, Pending], 1, Pick::From(0)),
            (&[Holds, Holds, Pending], 2, Pick::From(1)),
            (&[Holds, Pending, Pending], 2, Pick::Wait),
            (&[Holds, Lost, Pending], 2, Pick::From(0)),
            (&[Holds, Holds, Lost, Pending], 3, Pick::From(1)),
            (&[Holds, Holds, Holds, Pending], 3, Pick::From(2)),
            (&[Lost, Pending], 1, Pick::Nowhere),
            (&[Lost, Lost, Lost, Pending], 3, Pick::Nowhere),
            (&[Lost, Pending, Lost, Pending], 3, Pick::Wait),
        ];
        for (row, target, expected) in cases {
            assert_eq!(pick_source(row, target), expected, "{row:?} for {target}");
        }
    }

    #[test]
    fn blame_table() {
        let cases = [
            (Stage::Grant, Some(ErrorCode::NotFound), Blame::SourceLacks),
            (Stage::Grant, Some(ErrorCode::Busy), Blame::SourceLacks),
            (Stage::Grant, Some(ErrorCode::Changed), Blame::SourceLacks),
            (Stage::Grant, None, Blame::SourceGone),
            (Stage::Version, None, Blame::SourceLacks),
            (Stage::Pull, Some(ErrorCode::PeerFailed), Blame::Unreachable),
            (Stage::Pull, Some(ErrorCode::Integrity), Blame::SourceLacks),
            (
                Stage::Pull,
                Some(ErrorCode::CapabilityRefused),
                Blame::SourceLacks,
            ),
            (Stage::Pull, Some(ErrorCode::AlreadyExists), Blame::Target),
            (Stage::Pull, Some(ErrorCode::LimitExceeded), Blame::Target),
            (
                Stage::Pull,
                Some(ErrorCode::UnsupportedDType),
                Blame::Target,
            ),
            (Stage::Pull, Some(ErrorCode::ShuttingDown), Blame::Target),
            (Stage::Pull, None, Blame::Target),
        ];
        for (stage, code, expected) in cases {
            assert_eq!(blame(stage, code), expected, "{stage:?} {code:?}");
        }
    }
}
