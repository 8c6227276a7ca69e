//! [`Embedded`]: a store's node in this very process. A model applied from it is handed the
//! node's tensors on the node's device (Flex, wgpu: the same buffers), and one collected into it
//! hands its tensors over (Flex), with no host copy.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use burn_core::tensor::kind::Basic;
use burn_core::tensor::{Device, Tensor, TensorData};
use burn_flex::Flex;
use burn_store::{ApplyResult, ModuleSnapshot, PathFilter, bridge};
use ferry_backend::BackendKind;
use ferry_proto::message::{ModelManifest, PathsDigest};
use ferry_proto::{IfExists, TensorKey};
use ferry_server::{ModelError, ModelPin, ModelWriter, Node, NodeError, Replace};
use tokio::runtime::Handle;

use crate::backend_primitive::into_backend;
use crate::handoff::of_kind;
use crate::shared_data::shared_data;
use crate::store::collect_walk::{CollectWalk, TakeParam};
use crate::store::handoff_apply::HandoffApplier;
use crate::store::link::{Link, Listed, Sending, outside_runtime};
use crate::to_device::check_held;
use crate::{HandoffError, NodeTensors, StoreError, TryToDevice};

/// A node embedded in this process, and the runtime it runs on: a
/// [`FerryStore`](crate::FerryStore) over it blocks on that runtime, from a thread outside it.
#[derive(Debug)]
pub struct Embedded {
    node: Node,
    runtime: Handle,
    /// The model versions this store writes, until committed or aborted.
    writing: Mutex<Vec<ModelWriter>>,
    /// The model versions this store holds for applies, until closed.
    open: Mutex<Vec<ModelPin>>,
}

impl Embedded {
    pub(crate) fn new(node: Node, runtime: Handle) -> Self {
        Self {
            node,
            runtime,
            writing: Mutex::new(Vec::new()),
            open: Mutex::new(Vec::new()),
        }
    }

    /// The writer of a version begun here, taken out.
    fn take_writer(&self, device: u32, prefix: &str, version: u64) -> Option<ModelWriter> {
        let mut writing = lock(&self.writing);
        let at = writing.iter().position(|w| {
            let model = w.model();
            (model.device, model.prefix.as_str(), w.version()) == (device, prefix, version)
        })?;
        Some(writing.swap_remove(at))
    }

    fn block<F: Future>(&self, work: F) -> Result<F::Output, StoreError> {
        outside_runtime()?;
        Ok(self.runtime.block_on(work))
    }

    /// The node's tensor under `key` as a tensor on `device`: handed over where the node's
    /// device has a handoff (Flex, wgpu), else built from its data once `device` holds it; moved
    /// to `device` (natively, or refused by name) where the node's device is another. `Err`
    /// says why not, for the apply's result.
    pub(crate) fn tensor_on<const D: usize, K: Basic + 'static>(
        &self,
        key: &TensorKey,
        device: &Device,
    ) -> Result<Tensor<D, K>, String> {
        // A handed-over tensor records no gradients: a parameter on an autodiff device is built
        // from the data there, as Burn builds one that does.
        if device.is_autodiff() {
            return self.built_from_data(key, device);
        }
        let handed = self
            .block(self.node.tensor::<D, K>(key))
            .map_err(|e| e.to_string())?;
        let tensor = match handed {
            Ok(tensor) => tensor,
            // A device with no handoff (NdArray), or a build whose GPU backend type is not the
            // node's (fusion on one side only): through the data.
            Err(HandoffError::NoHandoff { .. })
            | Err(HandoffError::Node(NodeError::OtherBackend { .. })) => {
                return self.built_from_data(key, device);
            }
            Err(e) => return Err(e.to_string()),
        };
        if tensor.device() == *device {
            return Ok(tensor);
        }
        tensor.try_to_device(device).map_err(|e| e.to_string())
    }

    /// The node's tensor under `key` read as data and built on `device`, once `device` holds
    /// it and it is of kind `K` and rank `D`.
    fn built_from_data<const D: usize, K: Basic + 'static>(
        &self,
        key: &TensorKey,
        device: &Device,
    ) -> Result<Tensor<D, K>, String> {
        let data = self
            .block(self.node.get(key))
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let (dtype, shape) = (data.dtype(), data.shape().to_vec());
        if !of_kind::<K>(&dtype) || shape.len() != D {
            return Err(format!(
                "the node's tensor is now {} of shape {shape:?}",
                ferry_proto::dtype_name(&dtype)
            ));
        }
        check_held(device, &dtype, &shape).map_err(|e| e.to_string())?;
        ferry_proto::contained(|| Tensor::<D, K>::from_data(data, (device, dtype)))
            .map_err(|p| format!("building it panicked: {}", p.message))
    }

    /// Sends `module`'s parameters as `sending`'s adapter makes them (burn-store's collector),
    /// each read off its device as data.
    fn send_adapted<M: ModuleSnapshot>(
        &self,
        module: &M,
        sending: &Sending<'_>,
    ) -> Result<Vec<String>, StoreError> {
        let tensors = module.collect(sending.filter.cloned(), sending.adapter.clone(), false);
        let mut sent = Vec::new();
        for tensor in tensors {
            let path = tensor.name.clone();
            let key = sending.key(&path)?;
            let data = bridge::into_data(tensor).map_err(|e| StoreError::ReadBack {
                path: path.clone(),
                message: e.to_string(),
            })?;
            self.block(self.node.insert(&key, data, IfExists::Refuse))??;
            sent.push(path);
        }
        Ok(sent)
    }

    fn on_flex(&self, device: u32) -> bool {
        self.node
            .device(device)
            .is_ok_and(|d| d.kind() == BackendKind::Flex)
    }
}

impl Link for Embedded {
    fn node(&self) -> String {
        format!("the embedded node {}", self.node.node_id())
    }

    fn begin(&self, device: u32, prefix: &str, replace: bool) -> Result<u64, StoreError> {
        let writer = self
            .node
            .begin_model(device, prefix, Replace::when(replace))?;
        let version = writer.version();
        lock(&self.writing).push(writer);
        Ok(version)
    }

    fn commit(
        &self,
        device: u32,
        prefix: &str,
        version: u64,
        paths: &[String],
    ) -> Result<ModelManifest, StoreError> {
        let writer = self.take_writer(device, prefix, version).ok_or_else(|| {
            NodeError::from(ModelError::NotWriting {
                device,
                prefix: prefix.to_string(),
                version,
            })
        })?;
        let sent = PathsDigest::of(paths.iter().map(String::as_str));
        let manifest = self.block(writer.commit(Some(sent), BTreeMap::new()))??;
        Ok(manifest.to_wire())
    }

    fn abort(&self, device: u32, prefix: &str, version: u64) {
        if let Some(writer) = self.take_writer(device, prefix, version) {
            // Outside a runtime, `block` cannot fail: and where it did, dropping the writer
            // aborts it all the same.
            let _ = self.block(writer.abort());
        }
    }

    fn open(&self, device: u32, prefix: &str) -> Result<ModelManifest, StoreError> {
        let pin = self.node.open_model(device, prefix)?;
        let manifest = pin.manifest().to_wire();
        lock(&self.open).push(pin);
        Ok(manifest)
    }

    fn close(&self, manifest: &ModelManifest) {
        let mut open = lock(&self.open);
        let at = open.iter().position(|pin| {
            let held = pin.manifest();
            (held.device, held.prefix.as_str(), held.version)
                == (manifest.device, manifest.prefix.as_str(), manifest.version)
        });
        // Dropped on the store's runtime: a version it was the last to hold goes there.
        let pin = at.map(|at| open.swap_remove(at));
        drop(open);
        let _guard = self.runtime.enter();
        drop(pin);
    }

    #[allow(private_interfaces)]
    fn apply<M: ModuleSnapshot>(
        self: Arc<Self>,
        module: &mut M,
        listing: Vec<(String, Listed)>,
        filter: Option<&PathFilter>,
        _window: u64,
    ) -> Result<ApplyResult, StoreError> {
        // Each tensor handed over (nothing fetched ahead: there is no wire to wait on) as it is on the node's device (moved to the parameter's own
        // where that is another), with burn-store's filter, checks and result.
        let mut applier = HandoffApplier::new(&self, listing, filter);
        let mapped = module.clone().map(&mut applier);
        *module = mapped;
        Ok(applier.into_result())
    }

    fn fetch(&self, key: &TensorKey) -> Result<TensorData, StoreError> {
        if self.on_flex(key.device) {
            // The registered tensor's own buffer, shared (copy-on-write).
            let (_, primitive) = self.block(self.node.primitive::<Flex>(key))??;
            return Ok(shared_data(primitive).map_err(NodeError::from)?);
        }
        Ok(self.block(self.node.get(key))??)
    }

    #[allow(private_interfaces)]
    fn send<M: ModuleSnapshot>(
        &self,
        module: &M,
        sending: &Sending<'_>,
    ) -> Result<Vec<String>, StoreError> {
        outside_runtime()?;
        if sending.adapter.is_some() {
            return self.send_adapted(module, sending);
        }
        let mut sender = Sender {
            link: self,
            sending,
            sent: Vec::new(),
            failed: None,
        };
        module.visit(&mut CollectWalk::new(&mut sender, sending.filter));
        match sender.failed {
            Some(error) => Err(error),
            None => Ok(sender.sent),
        }
    }
}

/// Hands each parameter a collect's walk finds to the node, stopping at the first refusal.
struct Sender<'a> {
    link: &'a Embedded,
    sending: &'a Sending<'a>,
    /// The paths handed over so far.
    sent: Vec<String>,
    failed: Option<StoreError>,
}

impl Sender<'_> {
    fn insert<const D: usize, K: Basic + 'static>(
        &self,
        path: &str,
        tensor: Tensor<D, K>,
    ) -> Result<(), StoreError> {
        let key = self.sending.key(path)?;
        let node = &self.link.node;
        // A new version holds nothing yet.
        let if_exists = IfExists::Refuse;
        if self.link.on_flex(key.device)
            && let Ok(primitive) = into_backend::<Flex, D, K>(tensor.clone())
        {
            // The parameter's own handle: the node and the module share the buffer.
            self.link
                .block(node.insert_primitive(&key, primitive, if_exists))??;
            return Ok(());
        }
        let data = tensor.try_into_data().map_err(|e| StoreError::ReadBack {
            path: path.to_string(),
            message: format!("{e:?}"),
        })?;
        self.link.block(node.insert(&key, data, if_exists))??;
        Ok(())
    }
}

impl TakeParam for &mut Sender<'_> {
    fn stopped(&self) -> bool {
        self.failed.is_some()
    }

    fn take<const D: usize, K: Basic + 'static>(&mut self, path: String, tensor: &Tensor<D, K>) {
        match self.insert(&path, tensor.clone()) {
            Ok(()) => self.sent.push(path),
            Err(error) => self.failed = Some(error),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
