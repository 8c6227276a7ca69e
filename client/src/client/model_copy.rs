//! [`ModelCopy`]: a model's current version copied (or moved) from one node to another, node to
//! node, arriving whole as a new version on the target with the source's metadata, or not at
//! all.

use ferry_proto::message::ModelManifest;
use ferry_proto::{ErrorCode, TensorInfo, TensorKey, Transfer};

use super::node_copy::CopyItem;
use super::{Client, ClientError, NodeCopy, RelayTarget};

/// A model copied between nodes: the source's current version is held while its tensors are
/// pulled by the target (each at the content hash the manifest states) into a new version
/// there, committed with the source's paths and metadata. Any tensor refused gives the target's
/// version up: the target's model is the one it had, or the copy, never a mix. A move deletes
/// the source's model afterwards, only if it is still the version copied.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a ModelCopy does nothing until it is run"]
pub struct ModelCopy {
    source_addr: String,
    src: (u32, String),
    dst: (u32, String),
    replace: bool,
    transfer: Transfer,
}

impl ModelCopy {
    /// The model `prefix` on `device` of the node at `source_addr` (as the target reaches it),
    /// to the same device and prefix on the target.
    pub fn new(source_addr: impl Into<String>, device: u32, prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        Self {
            source_addr: source_addr.into(),
            src: (device, prefix.clone()),
            dst: (device, prefix),
            replace: false,
            transfer: Transfer::Copy,
        }
    }

    /// Where it goes on the target.
    pub fn to(mut self, device: u32, prefix: impl Into<String>) -> Self {
        self.dst = (device, prefix.into());
        self
    }

    /// Replaces the target's model where it has one (refused by default).
    pub fn replace(mut self, replace: bool) -> Self {
        self.replace = replace;
        self
    }

    /// Copy (the default) or move.
    pub fn transfer(mut self, transfer: Transfer) -> Self {
        self.transfer = transfer;
        self
    }

    /// Runs it: the target's new version's manifest. `source` and `target` are connections to
    /// the two nodes. A move to the same device and prefix on the node it comes from (the two
    /// connections answer with one node id) is [`ClientError::ModelMoveOntoItself`], refused
    /// before anything is held.
    pub async fn run(
        &self,
        source: &mut Client,
        target: &mut Client,
    ) -> Result<ModelManifest, ClientError> {
        let (src_device, src_prefix) = (self.src.0, self.src.1.as_str());
        let (dst_device, dst_prefix) = (self.dst.0, self.dst.1.as_str());
        // Only a move to the same device and prefix can land where it came from: ask whether
        // the two connections reach one node (a round trip each) only then.
        if self.transfer == Transfer::Move
            && self.src == self.dst
            && source.identify().await? == target.identify().await?
        {
            return Err(ClientError::ModelMoveOntoItself {
                device: src_device,
                prefix: src_prefix.to_string(),
            });
        }
        let held = source.open_model(src_device, src_prefix).await?;
        let copied = self
            .copy(&held, source, target, dst_device, dst_prefix)
            .await;
        // Let go whatever came of it (a connection the copy broke lets it go by closing).
        if source.in_step() {
            source.close_model(&held).await?;
        }
        let copied = copied?;
        if self.transfer == Transfer::Move {
            let deleted = source
                .delete_model(src_device, src_prefix, Some(held.version))
                .await;
            match deleted {
                Ok(_) => {}
                // Deleted by someone else meanwhile: gone from the source all the same.
                Err(e) if e.code() == Some(ErrorCode::NotFound) => {}
                Err(e) if e.code() == Some(ErrorCode::Changed) => {
                    return Err(ClientError::ModelSourceChanged {
                        prefix: src_prefix.to_string(),
                        version: held.version,
                        stored: Box::new(copied),
                    });
                }
                Err(e) => return Err(e),
            }
        }
        Ok(copied)
    }

    /// [`run`](Self::run) to several targets at once, relayed along a chain as
    /// [`NodeCopy::run_relayed`] relays tensors: the source's current version is held while each
    /// target begins a new version of its own, takes every tensor from the nearest node before
    /// it that holds it (at the content hash the manifest states), and commits it with the
    /// source's paths and metadata; a target that does not get every tensor gives its version
    /// up ([`ClientError::ModelNotCopied`]), and the others are not held up by it. One answer
    /// per target, in order; `Err` where the source's model could not be held. Only copies.
    pub async fn run_relayed(
        &self,
        source: &mut Client,
        targets: &mut [RelayTarget],
    ) -> Result<Vec<Result<ModelManifest, ClientError>>, ClientError> {
        if self.transfer == Transfer::Move {
            return Err(ClientError::Unexpected(
                "a move goes to one target: a relayed copy only copies".to_string(),
            ));
        }
        let (src_device, src_prefix) = (self.src.0, self.src.1.as_str());
        let (dst_device, dst_prefix) = (self.dst.0, self.dst.1.as_str());
        let held = source.open_model(src_device, src_prefix).await?;
        let mut begun = Vec::with_capacity(targets.len());
        for target in targets.iter_mut() {
            begun.push(
                target
                    .pulls
                    .begin_model(dst_device, dst_prefix, self.replace)
                    .await,
            );
        }
        let versions: Vec<Option<u64>> = begun.iter().map(|b| b.as_ref().ok().copied()).collect();
        // Each tensor under its path; on each target under that target's own new version.
        let mut copy = NodeCopy::new(self.source_addr.clone());
        for entry in &held.tensors {
            let src = TensorKey::new(held.device, held.name_of(&entry.path));
            let dst = TensorKey::new(dst_device, entry.path.clone());
            copy = copy.tensor_at(src, dst, entry.content_hash);
        }
        let dst_on = |node: usize, item: &CopyItem| {
            let version = versions.get(node.checked_sub(1)?).copied().flatten()?;
            let path = &item.dst.name;
            Some(TensorKey::new(
                dst_device,
                format!("{dst_prefix}/.v{version}/{path}"),
            ))
        };
        let answers = copy.relay(source, targets, &dst_on).await;
        // Let go; one that fails is let go when the connection ends, and what the targets got
        // is theirs to commit or give up either way.
        if source.in_step() {
            let _ = source.close_model(&held).await;
        }
        let mut outcome = Vec::with_capacity(targets.len());
        for ((target, begun), answers) in targets.iter_mut().zip(begun).zip(answers) {
            let version = match begun {
                Ok(version) => version,
                Err(refused) => {
                    outcome.push(Err(refused));
                    continue;
                }
            };
            let place = (dst_device, dst_prefix, version);
            outcome.push(finish_version(&held, &mut target.pulls, place, answers).await);
        }
        Ok(outcome)
    }

    async fn copy(
        &self,
        held: &ModelManifest,
        source: &mut Client,
        target: &mut Client,
        dst_device: u32,
        dst_prefix: &str,
    ) -> Result<ModelManifest, ClientError> {
        let version = target
            .begin_model(dst_device, dst_prefix, self.replace)
            .await?;
        let mut copy = NodeCopy::new(self.source_addr.clone());
        for entry in &held.tensors {
            let src = TensorKey::new(held.device, held.name_of(&entry.path));
            let dst = TensorKey::new(
                dst_device,
                format!("{dst_prefix}/.v{version}/{}", entry.path),
            );
            copy = copy.tensor_at(src, dst, entry.content_hash);
        }
        let answers = match copy.run(source, target).await {
            Ok(answers) => answers,
            // The connection to the target broke: its end gives the version up.
            Err(error) => {
                if target.in_step() {
                    target.abort_model(dst_device, dst_prefix, version).await?;
                }
                return Err(error);
            }
        };
        finish_version(held, target, (dst_device, dst_prefix, version), answers).await
    }
}

/// The end of a target's new version once its tensors were answered: committed with the
/// source's paths and metadata if every one landed, else given up
/// ([`ClientError::ModelNotCopied`], naming the first refused). A connection that failed gives
/// the version up by its end.
async fn finish_version(
    held: &ModelManifest,
    target: &mut Client,
    (device, prefix, version): (u32, &str, u64),
    answers: Vec<Result<TensorInfo, ClientError>>,
) -> Result<ModelManifest, ClientError> {
    if let Some((entry, refused)) = held
        .tensors
        .iter()
        .zip(answers)
        .find_map(|(entry, answer)| answer.err().map(|e| (entry, e)))
    {
        if target.in_step() {
            target.abort_model(device, prefix, version).await?;
        }
        return Err(ClientError::ModelNotCopied {
            path: entry.path.clone(),
            cause: Box::new(refused),
        });
    }
    let paths = held.tensors.iter().map(|t| t.path.as_str());
    target
        .commit_model(device, prefix, version, paths, held.metadata.clone())
        .await
}
