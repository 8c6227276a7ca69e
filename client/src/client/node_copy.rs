//! Node-to-node copies: [`NodeCopy`], which copies or moves tensors from one node to another
//! without their bytes passing through this client, and the calls it is made of (identify,
//! grant, pull, release). The whole life of a capability is here: granted by the source, bound
//! to the target, handed to the target's pull, then settled (given back where the target never
//! fetched, or failed; the copied version deleted on a move).

use ferry_io::Step;
use ferry_proto::message::DELETE_IF_MINOR;
use ferry_proto::{
    CapabilityToken, ContentHash, ErrorCode, IfExists, NodeId, Request, Response, TensorInfo,
    TensorKey, Transfer, TransferPath,
};

use super::batch::per_tensor;
use super::{Client, ClientError, InterruptedCopy, deleted, stored};

/// How many capabilities a copy asks for ahead of their pulls.
const GRANT_WINDOW: usize = 4;

/// How often a grant answered `Busy` (the source still computing the tensor's content hash) is
/// asked again; the source waits up to 10 seconds each time, so this bounds the wait at about 5
/// minutes of hashing (several hundred GB).
pub(super) const GRANT_BUSY_RETRIES: u32 = 30;

/// A capability a source node issued: hand it to the target node's [`Client::pull`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedCapability {
    /// The secret (its `Debug` never shows it).
    pub token: CapabilityToken,
    /// The only node that may use it.
    pub audience: NodeId,
    /// Milliseconds until it expires.
    pub expires_in_ms: u64,
    /// The tensor it grants.
    pub info: TensorInfo,
    /// The content hash of the version granted.
    pub content_hash: ContentHash,
}

impl IssuedCapability {
    /// The request that asks a target node to pull this grant's tensor from the node at
    /// `source` (as the target reaches it) and register it under `dst`.
    fn pull_request(&self, source: &str, dst: &TensorKey, if_exists: IfExists) -> Request {
        Request::Pull {
            source: source.to_string(),
            capability: self.token.clone(),
            src: self.info.key.clone(),
            dst_device: dst.device,
            dst_name: Some(dst.name.clone()),
            overwrite: if_exists.overwrite(),
            content_hash: Some(self.content_hash),
        }
    }

    /// The request that gives it back (or tells the source every byte arrived).
    fn release_request(&self) -> Request {
        Request::Release {
            capability: self.token.clone(),
            node_id: self.audience.clone(),
        }
    }
}

/// The request for a capability on `key` bound to `audience`.
fn grant_request(key: &TensorKey, audience: &NodeId) -> Request {
    Request::Grant {
        key: key.clone(),
        audience: audience.clone(),
    }
}

/// The answer that carries a capability bound to `audience`.
fn capability_for(audience: &NodeId) -> impl FnOnce(Response) -> Option<IssuedCapability> + '_ {
    move |answer| match answer {
        Response::Capability {
            token,
            expires_in_ms,
            info,
            content_hash,
        } => Some(IssuedCapability {
            token,
            audience: audience.clone(),
            expires_in_ms,
            info,
            content_hash,
        }),
        _ => None,
    }
}

/// The answer that a capability is used up.
fn released(answer: Response) -> Option<()> {
    match answer {
        Response::Released => Some(()),
        _ => None,
    }
}

/// One tensor of a [`NodeCopy`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct CopyItem {
    pub(super) src: TensorKey,
    pub(super) dst: TensorKey,
    /// The version it must be, where a directory listed one.
    pub(super) version: Option<ContentHash>,
}

/// A copy (or move) of tensors from one node to another, node to node: the target pulls each
/// tensor straight from the source with a single-use capability bound to the target, so the
/// bytes never pass through this client. Grants and pulls are pipelined; one answer per
/// tensor, in the order they were added. A move deletes a source tensor only after the target
/// registered it, and only the version that was copied.
///
/// ```no_run
/// # async fn run(mut a: ferry_client::Client, mut b: ferry_client::Client) -> Result<(), ferry_client::ClientError> {
/// use ferry_client::{NodeCopy, TensorKey, Transfer};
/// let answers = NodeCopy::new("10.0.0.1:7070")
///     .tensors_to([TensorKey::new(0, "w1"), TensorKey::new(0, "w2")], 1)
///     .transfer(Transfer::Move)
///     .run(&mut a, &mut b)
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a NodeCopy does nothing until it is run"]
pub struct NodeCopy {
    pub(super) source_addr: String,
    pub(super) items: Vec<CopyItem>,
    pub(super) transfer: Transfer,
    pub(super) if_exists: IfExists,
}

impl NodeCopy {
    /// A copy from the node at `source_addr`, the address as the target reaches it.
    pub fn new(source_addr: impl Into<String>) -> Self {
        Self {
            source_addr: source_addr.into(),
            items: Vec::new(),
            transfer: Transfer::Copy,
            if_exists: IfExists::Refuse,
        }
    }

    /// Adds the tensor `src` on the source, to go under `dst` on the target.
    pub fn tensor(mut self, src: TensorKey, dst: TensorKey) -> Self {
        self.items.push(CopyItem {
            src,
            dst,
            version: None,
        });
        self
    }

    /// Adds the tensor `src`, but only the version whose content hash is `version` (the one a
    /// directory listed): refused ([`ClientError::NotTheListedVersion`]) if the source holds
    /// another by now.
    pub fn tensor_at(mut self, src: TensorKey, dst: TensorKey, version: ContentHash) -> Self {
        self.items.push(CopyItem {
            src,
            dst,
            version: Some(version),
        });
        self
    }

    /// Adds each of `keys`, to go to `device` on the target under its own name.
    pub fn tensors_to(mut self, keys: impl IntoIterator<Item = TensorKey>, device: u32) -> Self {
        for src in keys {
            let dst = TensorKey::new(device, src.name.clone());
            self = self.tensor(src, dst);
        }
        self
    }

    /// Copy (the default) or move.
    pub fn transfer(mut self, transfer: Transfer) -> Self {
        self.transfer = transfer;
        self
    }

    /// What becomes of a tensor already under a target key (refused by default).
    pub fn if_exists(mut self, if_exists: IfExists) -> Self {
        self.if_exists = if_exists;
        self
    }

    /// Runs the copy: one answer per tensor, in order. `Err` only where a connection failed or
    /// a node broke the protocol: once the copy has begun, as
    /// [`ClientError::CopyInterrupted`], with the answers it had (final) and the tensors it
    /// had none for. A cancelled or failed run leaves both connections refusing further calls
    /// ([`ClientError::OutOfStep`]), never reading its answers as theirs.
    pub async fn run(
        &self,
        source: &mut Client,
        target: &mut Client,
    ) -> Result<Vec<Result<TensorInfo, ClientError>>, ClientError> {
        // A move ends with a conditional delete on the source: a source too old for one is
        // refused before anything is granted or pulled.
        let speaks = source.exchange.welcome().minor;
        if self.transfer == Transfer::Move && speaks < DELETE_IF_MINOR {
            return Err(ClientError::NodeTooOld {
                what: "a move between nodes (a conditional delete on the source)",
                node: speaks,
                needs: DELETE_IF_MINOR,
            });
        }
        let audience = target.identify().await?;
        let mut from = source.exchange.begin()?;
        // A refusal here drops `from` before it wrote anything: the source stays in step.
        let mut to = target.exchange.begin()?;
        let mut results = Vec::with_capacity(self.items.len());
        match self
            .copy_all(&mut from, &mut to, &audience, &mut results)
            .await
        {
            Ok(()) => {
                from.finish();
                to.finish();
                Ok(results)
            }
            // `from` and `to` dropped unfinished: both connections refuse further calls.
            Err(cause) => Err(ClientError::CopyInterrupted(Box::new(InterruptedCopy {
                unanswered: self.items[results.len()..]
                    .iter()
                    .map(|item| item.src.clone())
                    .collect(),
                answered: results,
                cause,
            }))),
        }
    }

    /// Every tensor in turn, its answer pushed to `results` once final.
    async fn copy_all(
        &self,
        from: &mut Step<'_>,
        to: &mut Step<'_>,
        audience: &NodeId,
        results: &mut Vec<Result<TensorInfo, ClientError>>,
    ) -> Result<(), ClientError> {
        // Few grants ahead of the pulls: a capability's clock runs from its grant, and pulls of
        // large tensors one after another could outlast it.
        for window in self.items.chunks(GRANT_WINDOW) {
            let grants = grant_window(from, window, audience).await?;
            for (item, grant) in window.iter().zip(&grants) {
                if let Ok(grant) = grant {
                    let request = grant.pull_request(&self.source_addr, &item.dst, self.if_exists);
                    to.send(&request).await?;
                }
            }
            for grant in grants {
                let grant = match grant {
                    Ok(grant) => grant,
                    Err(refused) => {
                        results.push(Err(refused));
                        continue;
                    }
                };
                let pulled = per_tensor(to.answer(stored).await)?;
                results.push(settle(from, grant, pulled, self.transfer).await?);
            }
        }
        Ok(())
    }
}

/// Grants for one window of a copy, pipelined: a tensor whose content hash the source is still
/// computing (a large put just before) is asked again (each ask waits for it up to the node's
/// bound, then says `Busy`); a version other than the one listed is given back at once.
async fn grant_window(
    from: &mut Step<'_>,
    window: &[CopyItem],
    audience: &NodeId,
) -> Result<Vec<Result<IssuedCapability, ClientError>>, ClientError> {
    for item in window {
        from.send(&grant_request(&item.src, audience)).await?;
    }
    let mut grants = Vec::with_capacity(window.len());
    for _ in window {
        grants.push(per_tensor(from.answer(capability_for(audience)).await)?);
    }
    for (item, grant) in window.iter().zip(grants.iter_mut()) {
        let mut asked = 0;
        while asked < GRANT_BUSY_RETRIES
            && matches!(grant, Err(e) if e.code() == Some(ErrorCode::Busy))
        {
            asked += 1;
            from.send(&grant_request(&item.src, audience)).await?;
            *grant = per_tensor(from.answer(capability_for(audience)).await)?;
        }
        // A source that grants another tensor than the one asked for is believed in nothing: a
        // move would delete what the grant names.
        if let Ok(granted) = &*grant
            && granted.info.key != item.src
        {
            let _ = release(from, granted).await?;
            *grant = Err(ClientError::Unexpected(format!(
                "asked for a capability on {}, granted one on {}",
                item.src, granted.info.key
            )));
        }
        if let (Some(listed), Ok(granted)) = (item.version, &*grant)
            && granted.content_hash != listed
        {
            // Given back: it would count against this client's outstanding grants until it
            // lapsed. A refusal means it is gone already.
            let _ = release(from, granted).await?;
            *grant = Err(ClientError::NotTheListedVersion {
                key: item.src.clone(),
                listed,
                granted: granted.content_hash,
            });
        }
    }
    Ok(grants)
}

/// Gives a capability back within a running exchange; the inner `Err` is the node's refusal.
async fn release(
    from: &mut Step<'_>,
    grant: &IssuedCapability,
) -> Result<Result<(), ClientError>, ClientError> {
    from.send(&grant.release_request()).await?;
    per_tensor(from.answer(released).await)
}

/// The end of a capability once the target answered its pull:
/// - a pull that failed leaves it unused (or used: then the source says so, and that is fine):
///   given back, so that it does not count against this client's outstanding grants;
/// - a target that already held the bytes never fetched (a dedup): used up here rather than
///   left to lapse;
/// - a move deletes the version it copied, and only that one: a newer version written to the
///   source meanwhile stays, and the move says so ([`ClientError::SourceChanged`]).
async fn settle(
    from: &mut Step<'_>,
    grant: IssuedCapability,
    pulled: Result<TensorInfo, ClientError>,
    transfer: Transfer,
) -> Result<Result<TensorInfo, ClientError>, ClientError> {
    let info = match pulled {
        Ok(info) => info,
        Err(failed) => {
            let _ = release(from, &grant).await?;
            return Ok(Err(failed));
        }
    };
    // The target registered the tensor: a refused release (the capability lapsed meanwhile)
    // changes nothing about that.
    if info.path == TransferPath::Dedup {
        let _ = release(from, &grant).await?;
    }
    if transfer == Transfer::Move {
        let request = Request::DeleteIf {
            key: grant.info.key.clone(),
            content_hash: grant.content_hash,
        };
        from.send(&request).await?;
        match per_tensor(from.answer(deleted).await)? {
            Ok(_) => {}
            Err(changed) if changed.code() == Some(ErrorCode::Changed) => {
                return Ok(Err(ClientError::SourceChanged {
                    key: grant.info.key,
                    stored: Box::new(info),
                }));
            }
            Err(refused) => return Ok(Err(refused)),
        }
    }
    Ok(Ok(info))
}

impl Client {
    /// The node's id (what a capability is bound to).
    pub async fn identify(&mut self) -> Result<NodeId, ClientError> {
        let id = self
            .exchange
            .call(&Request::Identify, |answer| match answer {
                Response::Identity { node_id } => Some(node_id),
                _ => None,
            })
            .await?;
        Ok(id)
    }

    /// Asks this (source) node for a single-use capability that lets the node `audience` pull
    /// the tensor under `key`. [`NodeCopy`] runs the whole copy; this is one step of it.
    pub async fn grant(
        &mut self,
        key: &TensorKey,
        audience: &NodeId,
    ) -> Result<IssuedCapability, ClientError> {
        let request = grant_request(key, audience);
        Ok(self
            .exchange
            .call(&request, capability_for(audience))
            .await?)
    }

    /// Asks this (target) node to pull `grant`'s tensor from the node at `source` (as this node
    /// reaches it) and register it under `dst`. Answered once the target registered it; the
    /// bytes never pass through this client.
    pub async fn pull(
        &mut self,
        source: &str,
        grant: &IssuedCapability,
        dst: &TensorKey,
        if_exists: IfExists,
    ) -> Result<TensorInfo, ClientError> {
        let request = grant.pull_request(source, dst, if_exists);
        Ok(self.exchange.call(&request, stored).await?)
    }

    /// Gives back a capability this connection was granted and no node fetched, which uses it
    /// up.
    pub async fn release(&mut self, grant: &IssuedCapability) -> Result<(), ClientError> {
        Ok(self
            .exchange
            .call(&grant.release_request(), released)
            .await?)
    }
}
