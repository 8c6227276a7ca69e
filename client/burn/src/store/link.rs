//! `Link`: what a [`FerryStore`](crate::FerryStore) needs of the node at its other end (a model
//! version begun, committed or aborted; one held for an apply; a tensor fetched; a module sent),
//! over a connection ([`Connected`](crate::Connected)) or in-process
//! ([`Embedded`](crate::Embedded)).

use std::sync::Arc;

use burn_core::tensor::{DType, TensorData};
use burn_store::{ApplyResult, ModuleAdapter, ModuleSnapshot, PathFilter};
use ferry_client::ClientError;
use ferry_proto::TensorKey;
use ferry_proto::message::ModelManifest;

use crate::StoreError;

/// A tensor the node lists, as a store reads it.
pub(crate) struct Listed {
    /// Its key on the node.
    pub(crate) key: TensorKey,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    /// Its payload's size.
    pub(crate) bytes: u64,
}

/// What a collect sends, and where.
pub(crate) struct Sending<'a> {
    pub(crate) device: u32,
    /// `PREFIX/.vVERSION/`: the version being written, put before each parameter's path.
    pub(crate) prefix: &'a str,
    pub(crate) filter: Option<&'a PathFilter>,
    /// The most bytes of host copies in flight at once.
    pub(crate) window: u64,
    /// What each tensor goes through on its way (burn-store's `to_adapter`), if anything.
    pub(crate) adapter: Option<Box<dyn ModuleAdapter>>,
}

impl Sending<'_> {
    /// The key of the parameter at `path`.
    pub(crate) fn key(&self, path: &str) -> Result<TensorKey, StoreError> {
        let name = format!("{}{path}", self.prefix);
        ferry_proto::message::validate_name(&name).map_err(|source| StoreError::Name {
            path: path.to_string(),
            source,
        })?;
        Ok(TensorKey::new(self.device, name))
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::Connected {}
    #[cfg(feature = "node")]
    impl Sealed for crate::Embedded {}
}

/// The node at a store's other end. Sealed: [`Connected`](crate::Connected) and, with the
/// `node` feature, `Embedded` are the two there are.
pub trait Link: sealed::Sealed + Send + Sync + 'static {
    /// Which node, for errors: its address, or the embedded node's id.
    #[doc(hidden)]
    fn node(&self) -> String;

    /// Begins writing a new version of the model `prefix` on `device`: its number.
    #[doc(hidden)]
    fn begin(&self, device: u32, prefix: &str, replace: bool) -> Result<u64, StoreError>;

    /// Commits a version begun here, which must hold exactly `paths`: its manifest.
    #[doc(hidden)]
    fn commit(
        &self,
        device: u32,
        prefix: &str,
        version: u64,
        paths: &[String],
    ) -> Result<ModelManifest, StoreError>;

    /// Passes the version of `prefix` just committed on to the link's replicas, if it has any
    /// (only a [`Connected`](crate::Connected) store can).
    #[doc(hidden)]
    fn replicate(&self, device: u32, prefix: &str, replace: bool) -> Result<(), StoreError> {
        let _ = (device, prefix, replace);
        Ok(())
    }

    /// Gives up a version begun here: what was written into it goes.
    #[doc(hidden)]
    fn abort(&self, device: u32, prefix: &str, version: u64);

    /// Holds the current version of the model `prefix` on `device` for an apply: its manifest.
    #[doc(hidden)]
    fn open(&self, device: u32, prefix: &str) -> Result<ModelManifest, StoreError>;

    /// Lets go a version opened here.
    #[doc(hidden)]
    fn close(&self, manifest: &ModelManifest);

    /// The tensor under `key`, its bytes checked as the node checks every tensor.
    #[doc(hidden)]
    fn fetch(&self, key: &TensorKey) -> Result<TensorData, StoreError>;

    /// Applies `listing` (each tensor with the path it applies to) to `module`, through
    /// `filter`, as burn-store's `Applier` does, with at most `window` bytes fetched ahead of
    /// the Applier and not yet drawn; the caller keeps the module only if whole.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn apply<M: ModuleSnapshot>(
        self: Arc<Self>,
        module: &mut M,
        listing: Vec<(String, Listed)>,
        filter: Option<&PathFilter>,
        window: u64,
    ) -> Result<ApplyResult, StoreError>;

    /// Sends `module`'s parameters as `sending` says: the paths sent.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn send<M: ModuleSnapshot>(
        &self,
        module: &M,
        sending: &Sending<'_>,
    ) -> Result<Vec<String>, StoreError>;
}

/// A manifest's tensors, each with its path and where the version holds it.
pub(crate) fn listed(manifest: &ModelManifest) -> Result<Vec<(String, Listed)>, StoreError> {
    manifest
        .tensors
        .iter()
        .map(|entry| {
            let meta = ferry_proto::TensorMeta::try_from(&entry.meta)
                .map_err(|e| ClientError::from(ferry_proto::ProtoError::from(e)))?;
            let key = TensorKey::new(manifest.device, manifest.name_of(&entry.path));
            let listed = Listed {
                key,
                dtype: meta.dtype(),
                shape: meta.shape().to_vec(),
                bytes: meta.byte_len() as u64,
            };
            Ok((entry.path.clone(), listed))
        })
        .collect()
}

/// Refuses to block on a thread that drives an async runtime (a task's thread), where waiting
/// would stall the very runtime that has to answer. A thread that merely has a runtime's
/// context, such as one of `spawn_blocking`'s, may block: tokio's own check decides, probed
/// with an empty future (its refusal is a panic, contained and quiet here).
pub(crate) fn outside_runtime() -> Result<(), StoreError> {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return Ok(());
    };
    let _quiet = ferry_proto::contain::QuietPanics::enter();
    ferry_proto::contained(|| handle.block_on(async {})).map_err(|_| StoreError::InsideRuntime)
}
