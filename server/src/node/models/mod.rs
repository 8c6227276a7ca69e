//! Models: a set of tensors written, committed and applied as one versioned thing. A collect
//! writes a new version's tensors ([`ModelWriter`], under `PREFIX/.vN/`) and commits them as
//! one step: the version's [`Manifest`] (built by the node from the tensors it holds, each hash
//! verified) becomes current at once. An apply holds one version ([`ModelPin`]) and reads
//! exactly its tensors, which nothing changes or deletes while it does; a replaced version's
//! tensors go once no apply holds it. Which step is allowed is decided by `registry.rs` (a state
//! machine without I/O); this file carries its decisions out.
//!
//! `name.rs` says where a version's tensors live, `manifest.rs` what a version is.

mod manifest;
mod name;
mod registry;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use ferry_proto::TensorKey;
use ferry_proto::message::PathsDigest;
use tokio::sync::{Notify, watch};

pub use manifest::{Manifest, ManifestTensor, ModelId};
pub use registry::{ModelError, Replace};
use registry::{Registry, WriteInto};

use crate::error::NodeError;
use crate::node::Node;

/// The node's models: the registry, and what waiters watch.
#[derive(Debug, Default)]
pub(super) struct Models {
    registry: Mutex<Registry>,
    /// Bumped at every commit and delete, for [`Node::wait_for_model`].
    changed: watch::Sender<u64>,
    /// Woken whenever a write into a version ends, for a commit waiting on those in flight.
    writes_ended: Notify,
    /// What was let go outside an async runtime, to delete at the next commit or delete.
    left: Mutex<Vec<Left>>,
}

/// Tensors let go where nothing could delete them (a drop outside an async runtime).
#[derive(Debug)]
enum Left {
    /// A version no apply holds any more.
    Version(Arc<Manifest>),
    /// A version given up while being written.
    Written(ModelId, u64),
}

impl Models {
    fn registry(&self) -> MutexGuard<'_, Registry> {
        // A panic while holding it left no half-made change: every transition checks before it
        // changes anything.
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A write admitted into a version being written: counted there until it is dropped, which the
/// node does once the tensor is registered (or refused), so that a commit waits for it.
#[derive(Debug)]
pub(crate) struct VersionWrite {
    node: Node,
    into: WriteInto,
}

impl Drop for VersionWrite {
    fn drop(&mut self) {
        let models = &self.node.inner.models;
        models.registry().end_write(&self.into);
        models.writes_ended.notify_waiters();
    }
}

impl Node {
    /// Checks a write of `key` against the models: `Some` counts it into the version being
    /// written it belongs to; a write into a committed (or unknown) version is refused.
    pub(crate) fn admit_version_write(
        &self,
        key: &TensorKey,
    ) -> Result<Option<VersionWrite>, NodeError> {
        let version_name = name::parse(&key.name);
        if version_name.is_none() {
            return Ok(None);
        }
        let into = self
            .inner
            .models
            .registry()
            .admit_write(key.device, &key.name, version_name)?;
        Ok(into.map(|into| VersionWrite {
            node: self.clone(),
            into,
        }))
    }

    /// Checks a delete of `key` by a client or a program: never of a committed version's tensor.
    pub(crate) fn check_version_delete(&self, key: &TensorKey) -> Result<(), NodeError> {
        let version_name = name::parse(&key.name);
        if version_name.is_none() {
            return Ok(());
        }
        let registry = self.inner.models.registry();
        Ok(registry.may_delete(key.device, &key.name, version_name)?)
    }

    /// Begins a new version of the model `prefix` on `device`: its tensors are written under
    /// [`ModelWriter::key`], then [`committed`](ModelWriter::commit) as one step. Refused where
    /// the device holds the model and `replace` does not allow replacing it.
    pub fn begin_model(
        &self,
        device: u32,
        prefix: &str,
        replace: Replace,
    ) -> Result<ModelWriter, NodeError> {
        if !name::valid_prefix(prefix) {
            return Err(ModelError::BadPrefix {
                prefix: prefix.to_string(),
            }
            .into());
        }
        self.device(device)?;
        let model = ModelId::new(device, prefix);
        let version = self.inner.models.registry().begin(&model, replace)?;
        Ok(ModelWriter {
            node: self.clone(),
            model,
            version,
            open: true,
        })
    }

    /// Holds the current version of the model `prefix` on `device` for an apply: its tensors stay
    /// as they are until the pin is dropped.
    pub fn open_model(&self, device: u32, prefix: &str) -> Result<ModelPin, NodeError> {
        self.device(device)?;
        let model = ModelId::new(device, prefix);
        let manifest = self.inner.models.registry().pin(&model)?;
        Ok(ModelPin {
            node: self.clone(),
            manifest,
        })
    }

    /// The current version of the model `prefix` on `device`, once it is newer than
    /// `newer_than` (any version where `None`): at once if it is, else at the commit that makes
    /// it so. Bound it with `tokio::time::timeout`; drop it to stop waiting.
    pub async fn wait_for_model(
        &self,
        device: u32,
        prefix: &str,
        newer_than: Option<u64>,
    ) -> Result<Arc<Manifest>, NodeError> {
        self.device(device)?;
        let model = ModelId::new(device, prefix);
        // Subscribed before the first look: a commit in between marks it changed.
        let mut changed = self.inner.models.changed.subscribe();
        loop {
            let current = self.inner.models.registry().current(&model);
            if let Some(current) = current.filter(|c| newer_than.is_none_or(|n| c.version > n)) {
                return Ok(current);
            }
            // The sender lives as long as the node, which this call holds.
            if changed.changed().await.is_err() {
                return Err(NodeError::ShuttingDown);
            }
        }
    }

    /// Every model's current version, on `device` or on all, sorted by device and prefix, with
    /// how many applies hold it now.
    pub fn models(&self, device: Option<u32>) -> Vec<(Arc<Manifest>, usize)> {
        self.inner.models.registry().list(device)
    }

    /// Deletes the model `prefix` on `device` (only if its current version is `version`, where
    /// given): that version goes now, or once the last apply holding it ends.
    pub async fn delete_model(
        &self,
        device: u32,
        prefix: &str,
        version: Option<u64>,
    ) -> Result<Arc<Manifest>, NodeError> {
        self.delete_left().await;
        let model = ModelId::new(device, prefix);
        let (deleted, doomed) = self.inner.models.registry().delete(&model, version)?;
        self.inner
            .models
            .changed
            .send_modify(|n| *n = n.wrapping_add(1));
        if let Some(doomed) = doomed {
            self.delete_version(&doomed).await;
        }
        Ok(deleted)
    }

    /// Deletes what drops outside a runtime left.
    async fn delete_left(&self) {
        let left = std::mem::take(
            &mut *self
                .inner
                .models
                .left
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        for item in left {
            match item {
                Left::Version(manifest) => self.delete_version(&manifest).await,
                Left::Written(model, version) => abort(self.clone(), model, version).await,
            }
        }
    }

    /// Deletes later what a drop outside a runtime could not.
    fn leave(&self, item: Left) {
        tracing::info!(
            ?item,
            "deleted at the next model commit or delete (dropped outside a runtime)"
        );
        self.inner
            .models
            .left
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(item);
    }

    /// Deletes a version's tensors, which no apply holds any more.
    async fn delete_version(&self, manifest: &Manifest) {
        for tensor in &manifest.tensors {
            let key = manifest.key(&tensor.path);
            if let Err(error) = self.unregister(&key, None).await {
                tracing::info!(%key, %error, "a replaced model version's tensor was already gone");
            }
        }
    }

    /// Deletes whatever a version being given up holds under its names.
    async fn delete_written(&self, model: &ModelId, version: u64) {
        let dir = name::version_dir(&model.prefix, version);
        let Ok(all) = self.list(Some(model.device)).await else {
            return;
        };
        for desc in all.into_iter().filter(|d| d.key.name.starts_with(&dir)) {
            if let Err(error) = self.unregister(&desc.key, None).await {
                tracing::info!(key = %desc.key, %error, "an aborted model version's tensor was already gone");
            }
        }
    }

    /// Waits until no write into `version` is in flight (it is sealed: none is admitted).
    async fn writes_ended(&self, model: &ModelId, version: u64) {
        let models = &self.inner.models;
        loop {
            let ended = models.writes_ended.notified();
            tokio::pin!(ended);
            // Registered before the count is read: an end in between wakes it.
            ended.as_mut().enable();
            if models.registry().in_flight(model, version) == 0 {
                return;
            }
            ended.await;
        }
    }
}

/// A new version of a model being written: its tensors go under [`key`](Self::key); then
/// [`commit`](Self::commit) makes it current as one step, or [`abort`](Self::abort) deletes what
/// it wrote. Dropped uncommitted, it is aborted: on the runtime it was dropped in, or (dropped
/// outside one) at the node's next model commit or delete.
#[derive(Debug)]
pub struct ModelWriter {
    node: Node,
    model: ModelId,
    version: u64,
    /// Neither committed nor aborted yet.
    open: bool,
}

impl ModelWriter {
    /// The version being written.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Which model.
    pub fn model(&self) -> &ModelId {
        &self.model
    }

    /// Where the tensor at `path` of this version is written.
    pub fn key(&self, path: &str) -> TensorKey {
        TensorKey::new(
            self.model.device,
            name::version_name(&self.model.prefix, self.version, path),
        )
    }

    /// Commits the version: no more writes are admitted, those in flight are waited for, and
    /// every tensor written is described with its verified content hash; where `sent` is given
    /// (the paths the collect sent), the version must hold exactly those. Then the version becomes current at once, and the one it replaces goes once no
    /// apply holds it. Refused (and what was written deleted) where the tensors are not those
    /// expected, a newer version was committed meanwhile, or one was and replacing was not
    /// allowed.
    pub async fn commit(
        mut self,
        sent: Option<PathsDigest>,
        metadata: BTreeMap<String, String>,
    ) -> Result<Arc<Manifest>, NodeError> {
        self.open = false;
        let node = self.node.clone();
        node.delete_left().await;
        let built = self.build(sent, metadata).await;
        let committed = built.and_then(|manifest| {
            let mut registry = node.inner.models.registry();
            Ok((registry.commit(manifest.clone())?, manifest))
        });
        match committed {
            Ok((replaced, manifest)) => {
                node.inner
                    .models
                    .changed
                    .send_modify(|n| *n = n.wrapping_add(1));
                if let Some(replaced) = replaced {
                    node.delete_version(&replaced).await;
                }
                Ok(manifest)
            }
            Err(error) => {
                node.inner
                    .models
                    .registry()
                    .abort(&self.model, self.version);
                node.delete_written(&self.model, self.version).await;
                Err(error)
            }
        }
    }

    /// Seals the version, waits for its writes, and describes what they left.
    async fn build(
        &self,
        sent: Option<PathsDigest>,
        metadata: BTreeMap<String, String>,
    ) -> Result<Arc<Manifest>, NodeError> {
        let node = &self.node;
        node.inner
            .models
            .registry()
            .seal(&self.model, self.version)?;
        node.writes_ended(&self.model, self.version).await;
        let dir = name::version_dir(&self.model.prefix, self.version);
        let mut tensors = Vec::new();
        for desc in node.list(Some(self.model.device)).await? {
            let Some(path) = desc.key.name.strip_prefix(&dir) else {
                continue;
            };
            // However long the device's verifier takes: a large tensor's hash may outlast one
            // wait, and giving up would throw the upload away.
            let (desc, content_hash) = loop {
                match node.describe_verified(&desc.key).await {
                    Err(NodeError::StillVerifying(_)) => continue,
                    verified => break verified?,
                }
            };
            tensors.push(ManifestTensor {
                path: path.to_string(),
                dtype: desc.dtype,
                shape: desc.shape,
                bytes: desc.bytes,
                content_hash,
            });
        }
        if let Some(sent) = sent {
            let held = PathsDigest::of(tensors.iter().map(|t| t.path.as_str()));
            if held != sent {
                return Err(NodeError::ModelIncomplete {
                    model: self.model.clone(),
                    version: self.version,
                    held: held.count,
                    sent: sent.count,
                });
            }
        }
        Ok(Arc::new(Manifest {
            device: self.model.device,
            prefix: self.model.prefix.clone(),
            version: self.version,
            tensors,
            metadata,
        }))
    }

    /// Gives the version up: no more writes are admitted, and what was written is deleted.
    pub async fn abort(mut self) {
        self.open = false;
        abort(self.node.clone(), self.model.clone(), self.version).await;
    }
}

/// Gives up writing a version: sealed, its writes waited for, what they left deleted.
async fn abort(node: Node, model: ModelId, version: u64) {
    // Sealed already where a commit began: then only the deletion is left.
    let _ = node.inner.models.registry().seal(&model, version);
    node.writes_ended(&model, version).await;
    node.inner.models.registry().abort(&model, version);
    node.delete_written(&model, version).await;
}

impl Drop for ModelWriter {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        let (node, model, version) = (self.node.clone(), self.model.clone(), self.version);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(abort(node, model, version));
            }
            Err(_) => {
                // No runtime to delete on: no more writes; deleted at the next commit or delete.
                let _ = node.inner.models.registry().seal(&model, version);
                node.leave(Left::Written(model, version));
            }
        }
    }
}

/// A model version held for an apply: its [`Manifest`], and its tensors under
/// [`key`](Self::key), unchanged until it is dropped.
#[derive(Debug)]
pub struct ModelPin {
    node: Node,
    manifest: Arc<Manifest>,
}

impl ModelPin {
    /// The version held.
    pub fn manifest(&self) -> &Arc<Manifest> {
        &self.manifest
    }

    /// Where the tensor at `path` of the version held is.
    pub fn key(&self, path: &str) -> TensorKey {
        self.manifest.key(path)
    }
}

impl Drop for ModelPin {
    fn drop(&mut self) {
        let doomed = self
            .node
            .inner
            .models
            .registry()
            .unpin(&self.manifest.model(), self.manifest.version);
        let Some(doomed) = doomed else {
            return;
        };
        let node = self.node.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move { node.delete_version(&doomed).await });
            }
            Err(_) => node.leave(Left::Version(doomed)),
        }
    }
}
