//! [`FerryStore`]: burn-store's `ModuleStore` whose other end is a ferry node. A module's
//! parameters go to `NODE/DEVICE` under a prefix (`collect_from`) and come back onto each
//! parameter's own device (`apply_to`), filtered, renamed and reported as burn-store's file
//! stores do, since its own `Applier` applies them.
//!
//! `link.rs` says what a store needs of its node; `connected.rs` is a node over a connection
//! (applied through burn-store's `Applier`, each fetch checked first by `plan.rs` against the
//! parameter's device), `embedded.rs` one in this process (applied by `handoff_apply.rs`,
//! tensors handed over on the node's device); `window.rs` bounds a collect's host copies;
//! `module_path.rs` names where a walk over a module is, as burn-store names and filters paths.
//! `embedded.rs` and `handoff_apply.rs` are built with the `node` feature only.

mod connected;
#[cfg(feature = "node")]
mod embedded;
mod error;
#[cfg(feature = "node")]
mod handoff_apply;
mod link;
mod module_path;
mod plan;
mod window;

use std::collections::BTreeMap;
use std::sync::Arc;

use burn_core::tensor::Shape;
use burn_pack::{Error as PackError, Tensor as PackTensor};
use burn_store::{ApplyResult, KeyRemapper, ModuleSnapshot, ModuleStore, PathFilter, bridge};
use ferry_client::BlockingClient;
use ferry_proto::IfExists;
#[cfg(feature = "node")]
use ferry_server::Node;

pub use connected::Connected;
#[cfg(feature = "node")]
pub use embedded::Embedded;
pub use error::StoreError;
pub use link::Link;

use link::{Listed, Sending, outside_runtime};
use plan::Targets;

/// The most bytes of host copies a collect over a connection keeps in flight by default (read
/// off the device, not yet sent); one larger tensor is let through alone.
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
/// Not supported: burn-store's `ModuleAdapter`s (PyTorch's layouts; a store between two Burn
/// programs needs none) and enum-variant skipping (both ends are Burn modules, which name
/// variants alike). Over a connection, a panic in a parameter's own `ParamMapper` during an
/// apply aborts the process, as it does with burn-store's file stores (their `Applier` cannot
/// unwind halfway); from an embedded node it unwinds, the module untouched.
#[derive(Debug)]
pub struct FerryStore<L: Link> {
    link: Arc<L>,
    device: u32,
    /// `PREFIX/`, or empty.
    prefix: String,
    filter: Option<PathFilter>,
    remapper: KeyRemapper,
    if_exists: IfExists,
    missing: Missing,
    window: u64,
    /// The node's listing under the prefix, as `get_tensor` and `keys` last read it.
    listed: Option<BTreeMap<String, PackTensor>>,
}

impl FerryStore<Connected> {
    /// A store on device `device` of the node `client` is connected to, under `prefix` (empty:
    /// the parameters' paths alone).
    pub fn connected(client: BlockingClient, device: u32, prefix: &str) -> Self {
        Self::over(Connected::new(client), device, prefix)
    }

    /// A collect also sends over `more` connections (lanes), each to the node the store's
    /// connection reaches, one tensor in flight on each: while the node registers one tensor
    /// (or faults in new memory for it), another arrives. Each is checked to reach that node
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
        let prefix = match prefix.trim_end_matches('/') {
            "" => String::new(),
            trimmed => format!("{trimmed}/"),
        };
        Self {
            link: Arc::new(link),
            device,
            prefix,
            filter: None,
            remapper: KeyRemapper::new(),
            if_exists: IfExists::Replace,
            missing: Missing::Refuse,
            window: DEFAULT_WINDOW,
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

    /// What a collect does where the node already holds a tensor under a key (default:
    /// replace it).
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
    /// [`DEFAULT_WINDOW`]); with lanes, this times the connections, shared between them.
    pub fn window(mut self, bytes: u64) -> Self {
        self.window = bytes;
        self
    }

    /// The node's tensors under the prefix, each with the path it applies to (prefix
    /// removed, renamed by the remapper).
    fn renamed_listing(&self) -> Result<Vec<(String, Listed)>, StoreError> {
        let listed: Vec<(String, Listed)> = self
            .link
            .list(self.device, &self.prefix)?
            .into_iter()
            .filter_map(|listed| {
                let path = listed.key.name.strip_prefix(&self.prefix)?.to_string();
                Some((path, listed))
            })
            .collect();
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
}

/// `listing` as burn-store tensors, each fetched through `link` only when its bytes are drawn,
/// once `targets` says the device of the parameter it goes to holds it.
pub(crate) fn deferred_tensors<L: Link>(
    link: &Arc<L>,
    listing: Vec<(String, Listed)>,
    targets: Arc<Targets>,
) -> Vec<PackTensor> {
    listing
        .into_iter()
        .map(|(path, listed)| {
            let link = link.clone();
            let targets = targets.clone();
            let Listed { key, dtype, shape } = listed;
            let checked_as = path.clone();
            let declared = shape.clone();
            bridge::deferred(path, dtype, Shape::from(shape), None, move || {
                targets
                    .check(&checked_as, &dtype, &declared)
                    .map_err(PackError::ValidationError)?;
                link.fetch(&key)
                    .map_err(|e| PackError::ValidationError(e.to_string()))
            })
        })
        .collect()
}

impl<L: Link> ModuleStore for FerryStore<L> {
    type Error = StoreError;

    fn collect_from<M: ModuleSnapshot>(&mut self, module: &M) -> Result<(), StoreError> {
        self.listed = None;
        let sending = Sending {
            device: self.device,
            prefix: &self.prefix,
            filter: self.filter.as_ref(),
            if_exists: self.if_exists,
            window: self.window,
        };
        self.link.send(module, &sending).map(drop)
    }

    fn apply_to<M: ModuleSnapshot>(&mut self, module: &mut M) -> Result<ApplyResult, StoreError> {
        outside_runtime()?;
        // Read now, not from an earlier listing: the node may hold newer tensors.
        let listing = self.renamed_listing()?;
        // Applied to a copy (parameters are shared handles: cheap), kept only if whole.
        let mut applied = module.clone();
        let result = self
            .link
            .clone()
            .apply(&mut applied, listing, self.filter.as_ref())?;
        let whole = result.errors.is_empty()
            && (self.missing == Missing::Allow || result.missing.is_empty());
        if !whole {
            return Err(StoreError::NotApplied(Box::new(result)));
        }
        *module = applied;
        Ok(result)
    }

    fn get_tensor(&mut self, name: &str) -> Result<Option<&PackTensor>, StoreError> {
        Ok(self.get_all_tensors()?.get(name))
    }

    fn get_all_tensors(&mut self) -> Result<&BTreeMap<String, PackTensor>, StoreError> {
        if self.listed.is_none() {
            let tensors = deferred_tensors(
                &self.link,
                self.renamed_listing()?,
                Arc::new(Targets::none()),
            );
            self.listed = Some(tensors.into_iter().map(|t| (t.name.clone(), t)).collect());
        }
        Ok(self.listed.get_or_insert_default())
    }

    fn keys(&mut self) -> Result<Vec<String>, StoreError> {
        Ok(self.get_all_tensors()?.keys().cloned().collect())
    }
}
