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
/// Its life: granted to a client (for one audience node) → fetched by that audience, perhaps
/// resumed → released by the connection that fetched it (every byte arrived and verified), or by
/// the client it was granted to before any fetch began (a dedup never fetched). It also ends
/// when it expires, when a fetch ended and no release or resume came within one idle timeout,
/// or, before any fetch, when the connection that asked for it closes.
#[derive(Debug)]
pub(super) struct Capability {
    key: TensorKey,
    /// The version it grants: a fetch of anything else (the tensor was replaced) is refused, so
    /// a resumed transfer can never join two versions.
    version: Version,
    audience: NodeId,
    expires: Instant,
    /// The connection that asked for it.
    granted_to: ClientId,
    /// The connection of the latest fetch, once one began.
    fetcher: Option<ClientId>,
    /// Counts fetches; only the latest may touch the capability when it ends, so a resume can
    /// take over from a fetch whose connection has not noticed it is dead.
    generation: u64,
    /// A fetch is under way now (its lease is alive).
    in_flight: bool,
    /// The connection it was granted to closed while a fetch was under way: it ends with that
    /// fetch.
    orphaned: bool,
}

/// The most fetches one capability serves: the first and its resumes (a pull retries three
/// times by default), so that a capability cannot be fetched again and again until it expires.
const MAX_FETCHES: u64 = 16;

/// The longest node id or audience accepted.
const MAX_NODE_ID_LEN: usize = 256;

impl Node {
    /// A new client's id, for the capabilities it asks for.
    pub(crate) fn new_client(&self) -> ClientId {
        ClientId(self.inner.next_client.fetch_add(1, Ordering::Relaxed))
    }

    /// A client's connection closed: the capabilities it asked for are revoked (nobody is left
    /// to wait for the copy they were for), those with a fetch under way once it ends; so a
    /// client that reconnects cannot pile up capabilities past its cap.
    pub(crate) fn client_gone(&self, client: ClientId) {
        self.capabilities().retain(|_, c| {
            if c.granted_to != client {
                return true;
            }
            c.orphaned = true;
            c.in_flight
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
        capabilities.retain(|_, c| c.expires > now);
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
                audience: audience.clone(),
                expires: now + ttl,
                granted_to: client,
                fetcher: None,
                generation: 0,
                in_flight: false,
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

    /// Starts serving a fetch (from any offset): the capability must exist, be unexpired, be
    /// bound to `node_id` and have served fewer than [`MAX_FETCHES`]. A new fetch takes over
    /// from an earlier one still under way. A fetch that sent every byte does not use the
    /// capability up: only the target's release does, once it verified them, so that a target
    /// whose only chunk was lost in flight may fetch it again from offset 0.
    pub(crate) fn begin_fetch(
        &self,
        token: &CapabilityToken,
        node_id: &NodeId,
        client: ClientId,
    ) -> Result<FetchLease, NodeError> {
        let now = Instant::now();
        let mut capabilities = self.capabilities();
        let refused = NodeError::CapabilityRefused;
        let capability = capabilities
            .get_mut(token)
            .ok_or(refused(Refusal::Unknown))?;
        if capability.expires <= now {
            capabilities.remove(token);
            return Err(refused(Refusal::Expired));
        }
        if capability.audience != *node_id {
            return Err(refused(Refusal::OtherNode));
        }
        if capability.generation >= MAX_FETCHES {
            return Err(refused(Refusal::FetchedTooOften));
        }
        capability.generation += 1;
        capability.fetcher = Some(client);
        capability.in_flight = true;
        Ok(FetchLease {
            node: self.clone(),
            token: token.clone(),
            key: capability.key.clone(),
            version: capability.version,
            generation: capability.generation,
        })
    }

    /// Ends a capability that can never be served again (the version it grants is gone), so
    /// that it stops counting against its client's cap at once.
    pub(crate) fn revoke(&self, token: &CapabilityToken) {
        self.capabilities().remove(token);
    }

    /// Uses a capability up: by the connection of its latest fetch once every byte arrived, or
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
                && match c.fetcher {
                    Some(fetcher) => fetcher == client,
                    None => c.granted_to == client,
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

/// A fetch in progress under a capability; when it ends, the capability waits one idle timeout
/// for the fetching node's release or a resume, and then lapses.
#[derive(Debug)]
pub(crate) struct FetchLease {
    node: Node,
    token: CapabilityToken,
    key: TensorKey,
    version: Version,
    generation: u64,
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
}

impl Drop for FetchLease {
    fn drop(&mut self) {
        // Whatever was read for this fetch is freed with it; the capability stays only long
        // enough for the same node to release it or resume.
        let window = self.node.inner.config.pulls.peer_limits.idle_timeout;
        let mut capabilities = self.node.capabilities();
        if let Some(capability) = capabilities.get_mut(&self.token)
            && capability.generation == self.generation
        {
            if capability.orphaned {
                capabilities.remove(&self.token);
                return;
            }
            capability.in_flight = false;
            capability.expires = capability.expires.min(Instant::now() + window);
        }
    }
}
