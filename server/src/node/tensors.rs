//! The tensors a node holds: reading them (`get`, `read`, `read_host`, `take`), removing them
//! (`remove`, `remove_if_content`), describing and listing them, and finding them by content hash.

use std::time::{Duration, Instant};

use burn_backend::TensorData;
use ferry_proto::{ContentHash, TensorKey};

use crate::device::{Command, DeviceHandle, DeviceSummary, HostBytes, TensorDesc, Version};
use crate::error::NodeError;
use crate::node::Node;

/// How long a dedup check waits for a candidate's stated hash to be verified.
const VERIFY_WAIT: Duration = Duration::from_secs(10);

/// The most tensors one listing page holds: a page of the longest names stays far below the
/// control message limit.
pub(crate) const MAX_PAGE: usize = 4096;

impl Node {
    /// The bytes of the tensor under `key`, which stays registered.
    pub async fn get(&self, key: &TensorKey) -> Result<TensorData, NodeError> {
        self.read(key).await.map(|(_, data)| data)
    }

    /// The description and bytes of the tensor under `key`, which stays registered.
    pub async fn read(&self, key: &TensorKey) -> Result<(TensorDesc, TensorData), NodeError> {
        let started = Instant::now();
        let result = self
            .device(key.device)?
            .call(|reply| Command::Read {
                name: key.name.clone(),
                reply,
            })
            .await;
        self.record(
            "get",
            key,
            None,
            "get",
            result.as_ref().map(|(desc, ..)| desc),
            started,
        );
        // The copy's room in the budget is given back as it is handed over.
        result.map(|(desc, data, _copy)| (desc, data))
    }

    /// The tensor under `key` as a description, a checked meta and its bytes for sending: shared
    /// with the registered tensor where the backend allows it (no host copy), read out
    /// otherwise. The tensor stays registered.
    pub(crate) async fn read_host(
        &self,
        key: &TensorKey,
    ) -> Result<(TensorDesc, ferry_proto::TensorMeta, HostBytes), NodeError> {
        self.read_host_pinned(key, None).await
    }

    /// [`read_host`](Self::read_host) of one version only ([`NodeError::Changed`] if the key
    /// holds another now), logged as one transfer.
    pub(crate) async fn read_host_pinned(
        &self,
        key: &TensorKey,
        pin: Option<Version>,
    ) -> Result<(TensorDesc, ferry_proto::TensorMeta, HostBytes), NodeError> {
        let started = Instant::now();
        let result = self
            .device(key.device)?
            .call(|reply| Command::ReadHost {
                name: key.name.clone(),
                pin,
                reply,
            })
            .await;
        self.record(
            "get",
            key,
            None,
            "get",
            result.as_ref().map(|(desc, _)| desc),
            started,
        );
        let (desc, bytes) = result?;
        let meta = ferry_proto::TensorMeta::with_byte_len(
            desc.shape.clone(),
            desc.dtype,
            bytes.len() as u64,
        )?;
        Ok((desc, meta, bytes))
    }

    /// The bytes of the tensor under `key`, which is unregistered once they are read.
    pub async fn take(&self, key: &TensorKey) -> Result<TensorData, NodeError> {
        let (desc, data) = self.read(key).await?;
        // Only the version read goes; one registered meanwhile stays.
        self.remove_pinned(key, Some(desc.version)).await?;
        Ok(data)
    }

    /// Unregisters the tensor under `key`.
    pub async fn remove(&self, key: &TensorKey) -> Result<TensorDesc, NodeError> {
        self.remove_pinned(key, None).await
    }

    /// Unregisters the tensor under `key` only if it is still the version whose content hash,
    /// verified by this node, is `content_hash` ([`NodeError::Changed`] otherwise): the source
    /// side of a move between nodes deletes what it copied, never a newer version.
    pub(crate) async fn remove_if_content(
        &self,
        key: &TensorKey,
        content_hash: &ContentHash,
    ) -> Result<TensorDesc, NodeError> {
        let (desc, hash) = self.describe_verified(key).await?;
        if hash != *content_hash {
            return Err(NodeError::Changed(key.clone()));
        }
        self.remove_pinned(key, Some(desc.version)).await
    }

    /// Unregisters the tensor under `key`, if it is still the version `pin` names: never a
    /// tensor of a committed model version, which only the node deletes
    /// ([`unregister`](Self::unregister)), once replaced and unheld.
    pub(super) async fn remove_pinned(
        &self,
        key: &TensorKey,
        pin: Option<Version>,
    ) -> Result<TensorDesc, NodeError> {
        self.check_version_delete(key)?;
        self.unregister(key, pin).await
    }

    /// Unregisters the tensor under `key`, if it is still the version `pin` names, unchecked.
    pub(super) async fn unregister(
        &self,
        key: &TensorKey,
        pin: Option<Version>,
    ) -> Result<TensorDesc, NodeError> {
        self.device(key.device)?
            .call(|reply| Command::Remove {
                name: key.name.clone(),
                pin,
                reply,
            })
            .await
    }

    /// Describes the tensor under `key`.
    pub async fn describe(&self, key: &TensorKey) -> Result<TensorDesc, NodeError> {
        self.device(key.device)?
            .call(|reply| Command::Describe {
                name: key.name.clone(),
                reply,
            })
            .await
    }

    /// Describes the tensor under `key`, with its content hash, once that hash is verified: at
    /// once where it is, else after the verifier's answer. A version replaced while its hash was
    /// computed is not an error: the question is about whatever the key holds, so the newer one
    /// is waited for in turn, all within [`VERIFY_WAIT`].
    pub(super) async fn describe_verified(
        &self,
        key: &TensorKey,
    ) -> Result<(TensorDesc, ContentHash), NodeError> {
        let deadline = tokio::time::Instant::now() + VERIFY_WAIT;
        loop {
            let desc = self.describe(key).await?;
            if let Some(hash) = desc.content_hash.verified() {
                return Ok((desc, hash));
            }
            let (reply, answer) = tokio::sync::oneshot::channel();
            self.device(key.device)?
                .tell(Command::AwaitVerified {
                    name: key.name.clone(),
                    reply,
                })
                .await?;
            match tokio::time::timeout_at(deadline, answer).await {
                Ok(Ok(verified)) => {
                    if let Some(hash) = verified.content_hash.verified() {
                        return Ok((verified, hash));
                    }
                }
                // Replaced or removed while waiting: asked again.
                Ok(Err(_)) => {}
                Err(_) => return Err(NodeError::StillVerifying(key.clone())),
            }
        }
    }

    /// Finds a registered tensor with these bytes.
    /// Only hashes this node computed itself count: a tensor registered under a hash its source
    /// stated is waited for until the node has recomputed it (a model pulled twice in a row
    /// still costs one transfer), and answers only if the hash held. A tensor whose hash is
    /// still being computed (a put just answered) is no candidate.
    pub(crate) async fn find_by_hash(
        &self,
        content_hash: ContentHash,
    ) -> Result<Option<TensorDesc>, NodeError> {
        let mut pending = Vec::new();
        for device in &self.inner.devices {
            let hash = content_hash;
            let found = device
                .call(|reply| Command::FindByHash { hash, reply })
                .await?;
            match found {
                Some(desc) if desc.content_hash.is_verified() => return Ok(Some(desc)),
                Some(desc) => pending.push(desc),
                None => {}
            }
        }
        for candidate in pending {
            let (reply, answer) = tokio::sync::oneshot::channel();
            let name = candidate.key.name.clone();
            self.device(candidate.key.device)?
                .tell(Command::AwaitVerified { name, reply })
                .await?;
            // A tensor removed meanwhile drops the question unanswered: no candidate. A long
            // queue of verifications is not waited out: pulling the bytes is then cheaper.
            match tokio::time::timeout(VERIFY_WAIT, answer).await {
                Ok(Ok(desc)) if desc.content_hash.verified() == Some(content_hash) => {
                    return Ok(Some(desc));
                }
                Ok(_) => {}
                Err(_) => {
                    tracing::info!(key = %candidate.key, "dedup candidate still unverified; pulling");
                }
            }
        }
        Ok(None)
    }

    /// Describes the tensors on one device, or on all, sorted by device and name.
    pub async fn list(&self, device: Option<u32>) -> Result<Vec<TensorDesc>, NodeError> {
        let mut all = Vec::new();
        let mut after = None;
        loop {
            let (page, next) = self.list_page(device, after.as_ref(), MAX_PAGE).await?;
            all.extend(page);
            match next {
                Some(next) => after = Some(next),
                None => return Ok(all),
            }
        }
    }

    /// One page of [`list`](Self::list): at most `limit` (and at most 4096) tensors
    /// after the key `after`, and where the next page starts (`None` when this is the last).
    pub async fn list_page(
        &self,
        device: Option<u32>,
        after: Option<&TensorKey>,
        limit: usize,
    ) -> Result<(Vec<TensorDesc>, Option<TensorKey>), NodeError> {
        let limit = limit.clamp(1, MAX_PAGE);
        let devices: Vec<&DeviceHandle> = match device {
            Some(index) => vec![self.device(index)?],
            None => self.inner.devices.iter().collect(),
        };
        let mut page = Vec::new();
        for handle in devices {
            let from = match after {
                Some(after) if after.device > handle.index() => continue,
                Some(after) if after.device == handle.index() => Some(after.name.clone()),
                _ => None,
            };
            let want = limit - page.len();
            page.extend(
                handle
                    .call(|reply| Command::List {
                        after: from,
                        limit: want,
                        reply,
                    })
                    .await?,
            );
            if page.len() == limit {
                break;
            }
        }
        let next = (page.len() == limit)
            .then(|| page.last().map(|d: &TensorDesc| d.key.clone()))
            .flatten();
        Ok((page, next))
    }

    /// How many tensors, and bytes, a device holds.
    pub async fn summary(&self, device: u32) -> Result<DeviceSummary, NodeError> {
        self.device(device)?
            .call(|reply| Command::Summary { reply })
            .await
    }
}
