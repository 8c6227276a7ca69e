//! Capabilities: single-use grants this node issues for another node to pull one version of a
//! tensor, how a fetch under one is served ([`FetchLease`]), and how each ends (released, revoked,
//! expired, or with the client that asked for it); and the cap on those a client holds.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ferry_proto::{CapabilityToken, ContentHash, NodeId, TensorKey};

use crate::device::{TensorDesc, Version};
use crate::error::{NodeError, Refusal};
use crate::node::Node;

/// The most capabilities a node keeps outstanding; past it, `Grant` is refused until some are
/// used or expire. With the per-client cap and capabilities revoked with the connection that
/// asked for them, only a node whose every connection asks for its cap reaches it.
const MAX_CAPABILITIES: usize = 65_536;

/// The default [`NodeLimits::max_grants_per_client`](crate::NodeLimits::max_grants_per_client).
pub const DEFAULT_MAX_GRANTS: usize = 64;

/// One client of the node (a connection), as capabilities know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ClientId(u64);

/// A capability this node issued.
///
/// Its life: granted to a client (for one audience node) → fetched by that audience, whole or a
/// stripe per fetch over several connections at once, perhaps resumed → released by a
/// connection that fetched it (every byte arrived and verified), or by the client it was granted
/// to before any fetch began (a dedup never fetched). It also ends when it expires, when its
/// last fetch under way ended and no release or further fetch came within one idle timeout, or,
/// before any fetch, when the connection that asked for it closes.
#[derive(Debug)]
pub(super) struct Capability {
    key: TensorKey,
    /// The version it grants: a fetch of anything else (the tensor was replaced) is refused, so
    /// a resumed transfer can never join two versions.
    version: Version,
    /// That version's payload length, which its fetches are charged against.
    bytes: u64,
    audience: NodeId,
    /// When it ends unless a fetch is under way: its time to live from the grant until a first
    /// fetch ends, then one idle timeout after the last fetch under way ended (for the next
    /// stripe, a resume or the release).
    expires: Instant,
    /// The connection that asked for it.
    granted_to: ClientId,
    /// The connections that began a fetch under it, the latest [`MAX_FETCHERS`]: any of them
    /// may release it (a striped pull fetches over several).
    fetchers: Vec<ClientId>,
    /// What its fetches were charged so far ([`fetch_charge`]), bounded by
    /// [`MAX_FETCHES`] times the payload.
    charged: u64,
    /// Fetches under way now (their leases alive): the capability lapses one idle timeout after
    /// the last one ends, unless it is released or fetched again.
    in_flight: u32,
    /// The connection it was granted to closed while a fetch was under way: it ends with the last
    /// one.
    orphaned: bool,
}

/// How many times over one capability serves its payload, so that it cannot be fetched again
/// and again until it expires: 16 fetches (the first and its resumes: a pull retries three times
/// by default), or the stripes of striped pulls worth 16 payloads ([`fetch_charge`]).
const MAX_FETCHES: u64 = 16;

/// The least share of a payload a ranged fetch is charged (1/1024 of it, and no more than
/// [`MIN_RANGE_CHARGE_CAP`]), so that ranges of nothing are bounded too.
const MIN_RANGE_SHARE: u64 = 1024;

/// The most a ranged fetch's least charge is: stripes of any tensor, however large, fit in its
/// allowance (a stripe is at least 1 KiB, and is charged what it asks beyond this).
const MIN_RANGE_CHARGE_CAP: u64 = 1 << 20;

/// The most connections a capability remembers as its fetchers.
const MAX_FETCHERS: usize = 64;

/// What a fetch is charged, against [`MAX_FETCHES`] times the payload's `bytes` (at least 1): a
/// fetch from any offset a whole payload, a ranged one what it asks for (a range of the hash
/// input covers at most as many payload bytes), at least 1/[`MIN_RANGE_SHARE`] of the payload
/// up to [`MIN_RANGE_CHARGE_CAP`]. A ranged fetch the source answers with the whole rest of the
/// payload is charged the rest of a whole one on top ([`FetchLease::charge_whole`]).
fn fetch_charge(bytes: u64, wants: &FetchWants) -> u64 {
    let whole = bytes.max(1);
    match wants {
        FetchWants::From(_) => whole,
        FetchWants::Input(range) => {
            let least = whole.div_ceil(MIN_RANGE_SHARE).min(MIN_RANGE_CHARGE_CAP);
            range.end.saturating_sub(range.start).min(whole).max(least)
        }
    }
}

/// What a fetch asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FetchWants {
    /// The payload from this offset to its end (`Fetch`).
    From(u64),
    /// The payload bytes in this range of the content hash's input (`FetchRange`: a stripe).
    Input(std::ops::Range<u64>),
}

/// The longest node id or audience accepted.
const MAX_NODE_ID_LEN: usize = 256;

impl Node {
    /// A new client's id, for the capabilities it asks for.
    pub(crate) fn new_client(&self) -> ClientId {
        ClientId(self.inner.next_client.fetch_add(1, Ordering::Relaxed))
    }

    /// A client's connection closed: the capabilities it asked for are revoked (nobody is left
    /// to wait for the copy they were for), those with fetches under way once the last of them
    /// ends (the rest of a striped pull is then refused); so a client that reconnects cannot
    /// pile up capabilities past its cap.
    pub(crate) fn client_gone(&self, client: ClientId) {
        self.capabilities().retain(|_, c| {
            if c.granted_to != client {
                return true;
            }
            c.orphaned = true;
            c.in_flight > 0
        });
    }

    /// Issues a single-use capability for `audience` (a node id) to pull the version of the
    /// tensor under `key` registered now, with its content hash, which this node has verified
    /// (a tensor whose hash is still being verified is waited for).
    pub(crate) async fn grant(
        &self,
        key: &TensorKey,
        audience: &NodeId,
        client: ClientId,
    ) -> Result<Granted, NodeError> {
        if audience.as_str().is_empty() || audience.as_str().len() > MAX_NODE_ID_LEN {
            return Err(NodeError::InvalidNodeId {
                len: audience.as_str().len(),
                max: MAX_NODE_ID_LEN,
            });
        }
        let (desc, content_hash) = self.describe_verified(key).await?;
        let ttl = self.inner.config.limits.capability_ttl;
        let token = CapabilityToken::new(format!("{:032x}", rand::random::<u128>()));
        let now = Instant::now();
        let mut capabilities = self.capabilities();
        capabilities.retain(|_, c| c.in_flight > 0 || c.expires > now);
        let cap = self.inner.config.limits.max_grants_per_client;
        let held = capabilities
            .values()
            .filter(|c| c.granted_to == client)
            .count();
        if held >= cap {
            return Err(NodeError::TooManyGrants { limit: cap });
        }
        if capabilities.len() >= MAX_CAPABILITIES {
            return Err(NodeError::CapabilitiesFull {
                limit: MAX_CAPABILITIES,
            });
        }
        capabilities.insert(
            token.clone(),
            Capability {
                key: key.clone(),
                version: desc.version,
                bytes: desc.bytes,
                audience: audience.clone(),
                expires: now + ttl,
                granted_to: client,
                fetchers: Vec::new(),
                charged: 0,
                in_flight: 0,
                orphaned: false,
            },
        );
        Ok(Granted {
            token,
            ttl,
            desc,
            content_hash,
        })
    }

    /// The capabilities issued and not ended.
    fn capabilities(&self) -> std::sync::MutexGuard<'_, HashMap<CapabilityToken, Capability>> {
        // The map stays consistent under a panic (every update is one statement).
        self.inner
            .capabilities
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Starts serving a fetch of what `wants` asks: the capability must exist, be unexpired, be
    /// bound to `node_id` and have served less than [`MAX_FETCHES`] times its payload. Fetches
    /// may run side by side (the stripes of one pull, or a resume beside a fetch whose
    /// connection has not noticed it is dead). A fetch that sent every byte does not use the
    /// capability up: only the target's release does, once it verified them, so that a target
    /// whose only chunk was lost in flight may fetch it again from offset 0.
    pub(crate) fn begin_fetch(
        &self,
        token: &CapabilityToken,
        node_id: &NodeId,
        client: ClientId,
        wants: &FetchWants,
    ) -> Result<FetchLease, NodeError> {
        let now = Instant::now();
        let mut capabilities = self.capabilities();
        let refused = NodeError::CapabilityRefused;
        let capability = capabilities
            .get_mut(token)
            .ok_or(refused(Refusal::Unknown))?;
        if capability.in_flight == 0 && capability.expires <= now {
            capabilities.remove(token);
            return Err(refused(Refusal::Expired));
        }
        if capability.audience != *node_id {
            return Err(refused(Refusal::OtherNode));
        }
        // The client it was granted to is gone: the fetches under way end it, and none begins.
        if capability.orphaned {
            return Err(refused(Refusal::Unknown));
        }
        let charge = fetch_charge(capability.bytes, wants);
        let allowance = MAX_FETCHES.saturating_mul(capability.bytes.max(1));
        let charged = capability.charged.saturating_add(charge);
        if charged > allowance {
            return Err(refused(Refusal::FetchedTooOften));
        }
        capability.charged = charged;
        if !capability.fetchers.contains(&client) {
            if capability.fetchers.len() == MAX_FETCHERS {
                capability.fetchers.remove(0);
            }
            capability.fetchers.push(client);
        }
        capability.in_flight += 1;
        self.recorder().fetch_started(charge);
        Ok(FetchLease {
            node: self.clone(),
            token: token.clone(),
            key: capability.key.clone(),
            version: capability.version,
            charged: charge,
            load: charge,
        })
    }

    /// Ends a capability that can never be served again (the version it grants is gone), so
    /// that it stops counting against its client's cap at once.
    pub(crate) fn revoke(&self, token: &CapabilityToken) {
        self.capabilities().remove(token);
    }

    /// Uses a capability up: by a connection that fetched under it once every byte arrived, or
    /// by the client it was granted to before any fetch began (handing back one it did not
    /// need). Nobody else may release it.
    pub(crate) fn release(
        &self,
        token: &CapabilityToken,
        node_id: &NodeId,
        client: ClientId,
    ) -> Result<(), NodeError> {
        let mut capabilities = self.capabilities();
        let allowed = capabilities.get(token).is_some_and(|c| {
            c.audience == *node_id
                && if c.fetchers.is_empty() {
                    c.granted_to == client
                } else {
                    c.fetchers.contains(&client)
                }
        });
        if !allowed {
            return Err(NodeError::CapabilityRefused(Refusal::NotYours));
        }
        capabilities.remove(token);
        Ok(())
    }
}

/// A capability just issued: its token, how long it is valid, the tensor version it is for and
/// that version's verified content hash.
pub(crate) struct Granted {
    pub(crate) token: CapabilityToken,
    pub(crate) ttl: Duration,
    pub(crate) desc: TensorDesc,
    pub(crate) content_hash: ContentHash,
}

/// A fetch in progress under a capability; when the last one under it ends, the capability waits
/// one idle timeout for the fetching node's release or another fetch, and then lapses.
#[derive(Debug)]
pub(crate) struct FetchLease {
    node: Node,
    token: CapabilityToken,
    key: TensorKey,
    version: Version,
    /// What this fetch was charged.
    charged: u64,
    /// What it added to the node's bytes in flight (its first charge), taken off at its drop.
    load: u64,
}

impl FetchLease {
    /// The tensor it grants.
    pub(crate) fn key(&self) -> &TensorKey {
        &self.key
    }

    /// The version it grants.
    pub(crate) fn version(&self) -> Version {
        self.version
    }

    /// Charges this fetch as a whole payload, for a ranged fetch the source answers with the
    /// whole rest of it (a copy out of the device each time); refused, and nothing sent, where
    /// that takes the capability past its allowance.
    pub(crate) fn charge_whole(&mut self) -> Result<(), NodeError> {
        let mut capabilities = self.node.capabilities();
        let Some(capability) = capabilities.get_mut(&self.token) else {
            return Err(NodeError::CapabilityRefused(Refusal::Unknown));
        };
        let whole = capability.bytes.max(1);
        let more = whole.saturating_sub(self.charged);
        let allowance = MAX_FETCHES.saturating_mul(whole);
        let charged = capability.charged.saturating_add(more);
        if charged > allowance {
            // The copy was made all the same: nothing more is served, so that refusals cannot
            // cost a copy each.
            capability.charged = allowance;
            return Err(NodeError::CapabilityRefused(Refusal::FetchedTooOften));
        }
        capability.charged = charged;
        self.charged += more;
        Ok(())
    }
}

impl Drop for FetchLease {
    fn drop(&mut self) {
        self.node.recorder().fetch_ended(self.load);
        // Whatever was read for this fetch is freed with it; the capability stays only long
        // enough for the same node to release it or resume.
        let window = self.node.inner.config.pulls.peer_limits.idle_timeout;
        let mut capabilities = self.node.capabilities();
        if let Some(capability) = capabilities.get_mut(&self.token) {
            capability.in_flight = capability.in_flight.saturating_sub(1);
            if capability.in_flight > 0 {
                return;
            }
            if capability.orphaned {
                capabilities.remove(&self.token);
                return;
            }
            // From the last fetch's end, not from the grant: a striped pull's next stripe, a
            // resume or the release may come after the time to live, which bounds only when a
            // first fetch may begin.
            capability.expires = Instant::now() + window;
        }
    }
}
