//! [`FerryStore`]: burn-store's `ModuleStore` whose other end is a ferry node. A module's
//! parameters go to `NODE/DEVICE` under a prefix (`collect_from`) and come back onto each
//! parameter's own device (`apply_to`), filtered, renamed and reported as burn-store's file
//! stores do, since its own `Applier` applies them.
//!
//! `link.rs` says what a store needs of its node; `connected.rs` is a node over a connection
//! (applied through burn-store's `Applier`, each fetch checked first by `plan.rs` against the
//! parameter's device), `embedded.rs` one in this process (applied by `handoff_apply.rs`,
//! tensors handed over on the node's device); `adapted.rs` applies through a `ModuleAdapter`
//! (PyTorch's layouts) from either; `restore.rs` puts back the running state a refused apply
//! wrote in place; `collect_walk.rs` finds a collect's parameters as burn-store's collector
//! does, and `outgoing.rs` deals them over a connection's senders (a Flex buffer shared as it
//! lies); `window.rs` bounds a collect's
//! host copies, and an apply's tensors that `prefetch.rs` fetches over a connection ahead of
//! the Applier; `module_path.rs` names where a walk over a module is, as burn-store names and
//! filters paths.
//! `embedded.rs` and `handoff_apply.rs` are built with the `node` feature only.

mod adapted;
mod collect_walk;
mod connected;
#[cfg(feature = "node")]
mod embedded;
mod error;
#[cfg(feature = "node")]
mod handoff_apply;
mod link;
pub(crate) mod module_path;
mod outgoing;
mod plan;
mod prefetch;
mod replicas;
pub(crate) mod restore;
mod window;

use std::collections::BTreeMap;
use std::sync::Arc;

use burn_core::tensor::Shape;
use burn_pack::{Error as PackError, Tensor as PackTensor};
use burn_store::{
    ApplyResult, KeyRemapper, ModuleAdapter, ModuleSnapshot, ModuleStore, PathFilter, bridge,
};
use ferry_client::BlockingClient;
use ferry_proto::IfExists;
use ferry_proto::message::ModelManifest;
#[cfg(feature = "node")]
use ferry_server::Node;

pub use connected::Connected;
#[cfg(feature = "node")]
pub use embedded::Embedded;
pub use error::StoreError;
pub use link::Link;
pub use replicas::{NotReplicated, Replica};

use adapted::apply_adapted;
use link::{Listed, Sending, outside_runtime};
use plan::Targets;
use prefetch::Prefetch;
use restore::Before;

/// The most bytes of host copies a collect over a connection keeps in flight by default (read
/// off the device, not yet sent; a Flex parameter is sent from its own buffers, only a
/// quantized one's scale bytes encoded for the send); one larger tensor is let through alone.
pub const DEFAULT_WINDOW: u64 = 32 << 20;

/// What an apply does where the module has a parameter the node does not hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Missing {
    /// Refuse: the module is left as it was (burn-store's default too).
    #[default]
    Refuse,
    /// Apply what is there; the rest keep their values, listed in `ApplyResult::missing`.
    Allow,
}

/// A module's tensors on a ferry node: burn-store's [`ModuleStore`], whose other end is the
/// node's device `device`, each parameter under `PREFIX/PATH` (`PATH` as burn-store names it:
/// `encoder.layers.0.weight`).
///
/// - [`collect_from`](ModuleStore::collect_from) sends every parameter the filter lets through,
///   quantized ones with their scales, and returns once the node holds each of them.
/// - [`apply_to`](ModuleStore::apply_to) fetches the tensors under the prefix (renamed by the
///   remapper) onto each parameter's own device: filters, `ApplyResult` and its `applied`,
///   `skipped`, `missing`, `unused` and `errors` are those of burn-store's file stores. Over a
///   connection burn-store's own `Applier` applies them, each tensor checked before it is
///   fetched against what the parameter's device holds bit-exact (ferry's measured table), so a
///   dtype the device cannot hold is an error in the result, never a panic; from an embedded
///   node each parameter is handed the node's own tensor (Flex, wgpu). All or nothing: an apply
///   with an error (or with a missing tensor, unless [`Missing::Allow`]) leaves the module
///   exactly as it was and says why in
///   [`StoreError::NotApplied`]; a node gone halfway is such an error.
///
/// Both block until the node answered: call them from a thread that drives no async runtime
/// (`spawn_blocking`, or a thread of its own); on a task's thread they refuse with
/// [`StoreError::InsideRuntime`].
///
/// burn-store's `ModuleAdapter`s apply as with its file stores:
/// [`with_from_adapter`](Self::with_from_adapter) (a PyTorch checkpoint put on the node,
/// applied with `PyTorchToBurnAdapter`: linear weights transposed, a norm's `weight`/`bias`
/// found for its `gamma`/`beta`) and [`with_to_adapter`](Self::with_to_adapter). An apply
/// through an adapter, from either end, is burn-store's own `Applier`'s: each tensor is built
/// from its data on the parameter's device (not handed over, even from an embedded node), and
/// checked, as the adapter made it, against what that device holds before a byte is fetched.
/// Not supported: enum-variant skipping (both ends are Burn modules, which name variants
/// alike).
///
/// A panic in a parameter's own `ParamMapper` during an apply through burn-store's `Applier`
/// (over a connection, or through an adapter) aborts the process, as it does with burn-store's
/// file stores (their `Applier` cannot unwind halfway); from an embedded node with no adapter
/// it unwinds, the module untouched.
pub struct FerryStore<L: Link> {
    link: Arc<L>,
    device: u32,
    /// The model's prefix: its versions' tensors are under `PREFIX/.vVERSION/`.
    prefix: String,
    filter: Option<PathFilter>,
    remapper: KeyRemapper,
    if_exists: IfExists,
    missing: Missing,
    window: u64,
    /// Applied to what an apply takes from the node (burn-store's `from_adapter`).
    from_adapter: Option<Box<dyn ModuleAdapter>>,
    /// Applied to what a collect sends (burn-store's `to_adapter`).
    to_adapter: Option<Box<dyn ModuleAdapter>>,
    /// The version `get_tensor` and `keys` last read, held until the next collect or apply,
    /// with its tensors.
    listed: Option<(ModelManifest, BTreeMap<String, PackTensor>)>,
}

impl<L: Link + std::fmt::Debug> std::fmt::Debug for FerryStore<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // An adapter is no `Debug`: whether there is one is what is shown.
        f.debug_struct("FerryStore")
            .field("link", &self.link)
            .field("device", &self.device)
            .field("prefix", &self.prefix)
            .field("filter", &self.filter)
            .field("remapper", &self.remapper)
            .field("if_exists", &self.if_exists)
            .field("missing", &self.missing)
            .field("window", &self.window)
            .field("from_adapter", &self.from_adapter.is_some())
            .field("to_adapter", &self.to_adapter.is_some())
            .finish_non_exhaustive()
    }
}

impl FerryStore<Connected> {
    /// A store on device `device` of the node `client` is connected to, under `prefix` (empty:
    /// the parameters' paths alone).
    pub fn connected(client: BlockingClient, device: u32, prefix: &str) -> Self {
        Self::over(Connected::new(client), device, prefix)
    }

    /// A collect also sends over `more` connections (lanes), each to the node the store's
    /// connection reaches, each with a pipelined batch in flight: while the node registers one
    /// tensor (or faults in new memory for it), another arrives. Each is checked to reach that node
    /// (its id, asked now): [`StoreError::LaneToAnotherNode`] where one does not, and the store
    /// is then dropped with its connections. Before each collect every lane still in step is
    /// asked the node's id again (a round trip): one that failed an earlier collect, or that
    /// the node closed meanwhile (idle past its keepalive), is dropped for good, and the
    /// collect goes on over the rest; a lane failing during a collect fails it. Fetches and
    /// listings keep to the first connection.
    pub fn with_lanes(self, more: Vec<BlockingClient>) -> Result<Self, StoreError> {
        self.link.add_lanes(more)?;
        Ok(self)
    }

    /// Each collect's version goes on to `replicas` once the store's node committed it,
    /// relayed along a chain in the order given (each replica takes every tensor from the
    /// nearest worker before it that holds it, at the content hash the manifest states), so the
    /// store's node sends each byte about once. `from` is the store's node's address as the
    /// replicas reach it. Each replica commits a whole version of its own or keeps nothing of
    /// it, refusing a model it holds unless the store replaces ([`Self::if_exists`]); a collect
    /// that some replica did not take fails with [`StoreError::NotReplicated`], naming each, the
    /// others (and the store's node) holding the version.
    pub fn with_replicas(self, from: impl Into<String>, replicas: Vec<Replica>) -> Self {
        self.link.set_replicas(from.into(), replicas);
        self
    }
}

#[cfg(feature = "node")]
impl FerryStore<Embedded> {
    /// A store on device `device` of `node`, which runs on `runtime`, under `prefix`. A module
    /// collected into it hands a Flex device its own buffers; one applied from it is handed the
    /// node's tensors on a Flex or wgpu device: no host copy either way. An applied module keeps
    /// the buffers it shares alive after the node removed or replaced their tensors, outside the
    /// node's memory budget from then on.
    pub fn embedded(
        node: Node,
        runtime: tokio::runtime::Handle,
        device: u32,
        prefix: &str,
    ) -> Self {
        Self::over(Embedded::new(node, runtime), device, prefix)
    }
}

impl<L: Link> FerryStore<L> {
    fn over(link: L, device: u32, prefix: &str) -> Self {
        let prefix = prefix.trim_end_matches('/').to_string();
        Self {
            link: Arc::new(link),
            device,
            prefix,
            filter: None,
            remapper: KeyRemapper::new(),
            if_exists: IfExists::Refuse,
            missing: Missing::Refuse,
            window: DEFAULT_WINDOW,
            from_adapter: None,
            to_adapter: None,
            listed: None,
        }
    }

    /// Only the parameters `filter` matches are sent and applied (burn-store's `PathFilter`).
    pub fn with_filter(mut self, filter: PathFilter) -> Self {
        self.filter = Some(filter);
        self
    }

    /// The node's names are renamed by `remapper` before an apply matches them to the
    /// module's paths (as file stores rename on load).
    pub fn remap(mut self, remapper: KeyRemapper) -> Self {
        self.remapper = remapper;
        self
    }

    /// An apply transforms what it takes from the node with `adapter` (burn-store's
    /// `ModuleAdapter`, as its file stores' `with_from_adapter`): `PyTorchToBurnAdapter` applies
    /// a PyTorch checkpoint put on the node (`ferry put model.safetensors NODE/DEVICE`), linear
    /// weights transposed and a norm's `weight` and `bias` found for its `gamma` and `beta`.
    /// Names are matched after the remapper; each tensor is checked, as the adapter made it,
    /// against what the parameter's device holds bit-exact before it is fetched.
    pub fn with_from_adapter(mut self, adapter: impl ModuleAdapter + 'static) -> Self {
        self.from_adapter = Some(Box::new(adapter));
        self
    }

    /// A collect transforms what it sends with `adapter` (as burn-store's file stores'
    /// `with_to_adapter`): `BurnToPyTorchAdapter` puts a module on the node in PyTorch's layouts
    /// and names. Every tensor is then read off its device and sent as data (a copy), where
    /// otherwise a Flex parameter goes from its own buffer (over a connection) or is handed
    /// over (to an embedded node).
    pub fn with_to_adapter(mut self, adapter: impl ModuleAdapter + 'static) -> Self {
        self.to_adapter = Some(Box::new(adapter));
        self
    }

    /// What a collect does where the node holds a model under the prefix: refuse (the
    /// default, as burn-store's file stores refuse to overwrite), or replace it
    /// ([`IfExists::Replace`]): the new version becomes current at its commit, and the old one's
    /// tensors go once no apply holds them.
    pub fn if_exists(mut self, if_exists: IfExists) -> Self {
        self.if_exists = if_exists;
        self
    }

    /// What an apply does where the module has a parameter the node does not hold.
    pub fn missing(mut self, missing: Missing) -> Self {
        self.missing = missing;
        self
    }

    /// The most bytes of host copies a collect over a connection keeps in flight (default
    /// [`DEFAULT_WINDOW`]): of views, packed or two-level quantized parameters, parameters of
    /// another backend than Flex, or every parameter through a `to_adapter`; any other Flex
    /// parameter goes from its own buffers, and holds room only for a quantized one's scale
    /// bytes, encoded for the send. With lanes, this times the connections, shared between
    /// them. An apply over a connection fetches tensors ahead of burn-store's Applier, in the order it
    /// applies them and in pipelined batches, up to this many bytes arrived and not yet applied.
    pub fn window(mut self, bytes: u64) -> Self {
        self.window = bytes;
        self
    }

    /// The tensors of the version `manifest` names, each with the path it applies to, renamed
    /// by the remapper.
    fn renamed_listing(
        &self,
        manifest: &ModelManifest,
    ) -> Result<Vec<(String, Listed)>, StoreError> {
        let listed = link::listed(manifest)?;
        // Renamed as names only (burn-store's remapper renames its tensors, in order).
        let names = listed
            .iter()
            .map(|(path, l)| {
                PackTensor::deferred(path.clone(), l.dtype, l.shape.clone(), None, 0, || {
                    Err(PackError::IoError("a name, not a tensor".into()))
                })
            })
            .collect();
        let (_, renamed) = self.remapper.remap(names);
        Ok(renamed
            .into_iter()
            .zip(listed)
            .map(|((path, _), (_, listed))| (path, listed))
            .collect())
    }

    /// Applies the version `manifest` names to `module`, whole or not at all.
    fn apply_version<M: ModuleSnapshot>(
        &self,
        manifest: &ModelManifest,
        module: &mut M,
    ) -> Result<ApplyResult, StoreError> {
        let listing = self.renamed_listing(manifest)?;
        // Applied to a copy (parameters are shared handles: cheap), kept only if whole.
        let before = Before::of(module);
        let mut applied = module.clone();
        let filter = self.filter.as_ref();
        let result = match &self.from_adapter {
            Some(adapter) => {
                apply_adapted(&self.link, &mut applied, listing, filter, adapter.clone())
            }
            None => self
                .link
                .clone()
                .apply(&mut applied, listing, filter, self.window)?,
        };
        let whole = result.errors.is_empty()
            && (self.missing == Missing::Allow || result.missing.is_empty());
        if !whole {
            // The running state the copy shares with the module, written in place, put back.
            *module = before.restore(module.clone());
            return Err(StoreError::NotApplied(Box::new(result)));
        }
        *module = applied;
        Ok(result)
    }

    /// Lets go the version `get_tensor` and `keys` held, if any.
    fn let_go(&mut self) {
        if let Some((manifest, _)) = self.listed.take() {
            self.link.close(&manifest);
        }
    }
}

/// `listing` as burn-store tensors, each fetched through `link` only when its bytes are drawn,
/// once `targets` says the device of the parameter it goes to holds it: taken from `ahead`
/// where it fetched it first.
pub(crate) fn deferred_tensors<L: Link>(
    link: &Arc<L>,
    listing: Vec<(String, Listed)>,
    targets: Arc<Targets>,
    ahead: Option<Arc<Prefetch>>,
) -> Vec<PackTensor> {
    listing
        .into_iter()
        .map(|(path, listed)| {
            let link = link.clone();
            let targets = targets.clone();
            let ahead = ahead.clone();
            let Listed {
                key, dtype, shape, ..
            } = listed;
            let checked_as = path.clone();
            let declared = shape.clone();
            bridge::deferred(path, dtype, Shape::from(shape), None, move || {
                targets
                    .check(&checked_as, &dtype, &declared)
                    .map_err(PackError::ValidationError)?;
                let fetched = ahead.as_ref().and_then(|ahead| ahead.take(&key));
                fetched
                    .unwrap_or_else(|| link.fetch(&key))
                    .map_err(|e| PackError::ValidationError(e.to_string()))
            })
        })
        .collect()
}

impl<L: Link> ModuleStore for FerryStore<L> {
    type Error = StoreError;

    fn collect_from<M: ModuleSnapshot>(&mut self, module: &M) -> Result<(), StoreError> {
        outside_runtime()?;
        self.let_go();
        let (device, prefix) = (self.device, self.prefix.as_str());
        let replace = self.if_exists == IfExists::Replace;
        let version = self.link.begin(device, prefix, replace)?;
        let into = format!("{prefix}/.v{version}/");
        let sending = Sending {
            device,
            prefix: &into,
            filter: self.filter.as_ref(),
            window: self.window,
            adapter: self.to_adapter.clone(),
        };
        match self.link.send(module, &sending) {
            // Committed whole, or given up by the node with nothing of it kept.
            Ok(paths) => {
                self.link.commit(device, prefix, version, &paths)?;
                self.link.replicate(device, prefix, replace)
            }
            Err(error) => {
                self.link.abort(device, prefix, version);
                Err(StoreError::NotCollected {
                    node: self.link.node(),
                    prefix: self.prefix.clone(),
                    device,
                    version,
                    cause: Box::new(error),
                })
            }
        }
    }

    fn apply_to<M: ModuleSnapshot>(&mut self, module: &mut M) -> Result<ApplyResult, StoreError> {
        outside_runtime()?;
        self.let_go();
        // The current version, held while it is applied: nothing of it changes meanwhile.
        let manifest = self.link.open(self.device, &self.prefix)?;
        let applied = self.apply_version(&manifest, module);
        self.link.close(&manifest);
        applied
    }

    fn get_tensor(&mut self, name: &str) -> Result<Option<&PackTensor>, StoreError> {
        Ok(self.get_all_tensors()?.get(name))
    }

    fn get_all_tensors(&mut self) -> Result<&BTreeMap<String, PackTensor>, StoreError> {
        let listed = match self.listed.take() {
            Some(listed) => listed,
            None => {
                // Held until the next collect or apply: the tensors are fetched when drawn.
                let manifest = self.link.open(self.device, &self.prefix)?;
                let listing = match self.renamed_listing(&manifest) {
                    Ok(listing) => listing,
                    Err(error) => {
                        self.link.close(&manifest);
                        return Err(error);
                    }
                };
                let tensors =
                    deferred_tensors(&self.link, listing, Arc::new(Targets::none()), None);
                let tensors = tensors.into_iter().map(|t| (t.name.clone(), t)).collect();
                (manifest, tensors)
            }
        };
        Ok(&self.listed.insert(listed).1)
    }

    fn keys(&mut self) -> Result<Vec<String>, StoreError> {
        Ok(self.get_all_tensors()?.keys().cloned().collect())
    }
}
