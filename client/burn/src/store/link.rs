//! `Link`: what a [`FerryStore`](crate::FerryStore) needs of the node at its other end (list,
//! fetch, send a module), over a connection ([`Connected`](crate::Connected)) or in-process
//! ([`Embedded`](crate::Embedded)).

use std::sync::Arc;

use burn_core::tensor::{DType, TensorData};
use burn_store::{ApplyResult, ModuleSnapshot, PathFilter};
use ferry_proto::{IfExists, TensorKey};

use crate::StoreError;

/// A tensor the node lists, as a store reads it.
pub(crate) struct Listed {
    /// Its key on the node.
    pub(crate) key: TensorKey,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
}

/// What a collect sends, and where.
pub(crate) struct Sending<'a> {
    pub(crate) device: u32,
    /// `prefix/` (or nothing), put before each parameter's path.
    pub(crate) prefix: &'a str,
    pub(crate) filter: Option<&'a PathFilter>,
    pub(crate) if_exists: IfExists,
    /// The most bytes of host copies in flight at once.
    pub(crate) window: u64,
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
    /// Every tensor on `device` whose name starts with `prefix`.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn list(&self, device: u32, prefix: &str) -> Result<Vec<Listed>, StoreError>;

    /// The tensor under `key`, its bytes checked as the node checks every tensor.
    #[doc(hidden)]
    fn fetch(&self, key: &TensorKey) -> Result<TensorData, StoreError>;

    /// Applies `listing` (each tensor with the path it applies to) to `module`, through
    /// `filter`, as burn-store's `Applier` does; the caller keeps the module only if whole.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn apply<M: ModuleSnapshot>(
        self: Arc<Self>,
        module: &mut M,
        listing: Vec<(String, Listed)>,
        filter: Option<&PathFilter>,
    ) -> Result<ApplyResult, StoreError>;

    /// Sends `module`'s parameters as `sending` says; how many were sent.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn send<M: ModuleSnapshot>(
        &self,
        module: &M,
        sending: &Sending<'_>,
    ) -> Result<usize, StoreError>;
}

/// The most tensors one listing page asks for.
pub(crate) const PAGE: usize = 1024;

/// Where a listing under `prefix` starts: just after the prefix itself (names sort bytewise, so
/// every name that starts with it follows; the prefix alone, ending in `/`, is no parameter).
pub(crate) fn listing_start(device: u32, prefix: &str) -> Option<TensorKey> {
    (!prefix.is_empty()).then(|| TensorKey::new(device, prefix))
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
