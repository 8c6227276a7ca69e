//! [`Embedded`]: a store's node in this very process. A model applied from it is handed the
//! node's tensors on the node's device (Flex, wgpu: the same buffers), and one collected into it
//! hands its tensors over (Flex), with no host copy.

use burn_core::module::{ModuleVisitor, Param};
use burn_core::tensor::kind::Basic;
use std::sync::Arc;

use burn_core::tensor::{Bool, Device, Int, Tensor, TensorData};
use burn_flex::Flex;
use burn_store::{ApplyResult, ModuleSnapshot, PathFilter};
use ferry_backend::BackendKind;
use ferry_proto::TensorKey;
use ferry_server::{Node, NodeError};
use tokio::runtime::Handle;

use crate::handoff::{into_backend, of_kind};
use crate::shared_data::shared_data;
use crate::store::handoff_apply::HandoffApplier;
use crate::store::link::{Link, Listed, PAGE, Sending, listing_start, outside_runtime};
use crate::store::module_path::ModulePath;
use crate::to_device::check_held;
use crate::{HandoffError, NodeTensors, StoreError, TryToDevice};

/// A node embedded in this process, and the runtime it runs on: a
/// [`FerryStore`](crate::FerryStore) over it blocks on that runtime, from a thread outside it.
#[derive(Debug)]
pub struct Embedded {
    node: Node,
    runtime: Handle,
}

impl Embedded {
    pub(crate) fn new(node: Node, runtime: Handle) -> Self {
        Self { node, runtime }
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

    fn on_flex(&self, device: u32) -> bool {
        self.node
            .device(device)
            .is_ok_and(|d| d.kind() == BackendKind::Flex)
    }
}

impl Link for Embedded {
    #[allow(private_interfaces)]
    fn list(&self, device: u32, prefix: &str) -> Result<Vec<Listed>, StoreError> {
        // Page by page from the prefix, stopping at the first name past it.
        let mut descs = Vec::new();
        let mut after = listing_start(device, prefix);
        loop {
            let (page, next) =
                self.block(self.node.list_page(Some(device), after.as_ref(), PAGE))??;
            let past = page.iter().any(|d| !d.key.name.starts_with(prefix));
            descs.extend(page);
            match next {
                Some(next) if !past => after = Some(next),
                _ => break,
            }
        }
        Ok(descs
            .into_iter()
            .filter(|desc| desc.key.name.starts_with(prefix))
            .map(|desc| Listed {
                key: desc.key,
                dtype: desc.dtype,
                shape: desc.shape,
            })
            .collect())
    }

    #[allow(private_interfaces)]
    fn apply<M: ModuleSnapshot>(
        self: Arc<Self>,
        module: &mut M,
        listing: Vec<(String, Listed)>,
        filter: Option<&PathFilter>,
    ) -> Result<ApplyResult, StoreError> {
        // Each tensor handed over as it is on the node's device (moved to the parameter's own
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
            return Ok(shared_data(primitive)?);
        }
        Ok(self.block(self.node.get(key))??)
    }

    #[allow(private_interfaces)]
    fn send<M: ModuleSnapshot>(
        &self,
        module: &M,
        sending: &Sending<'_>,
    ) -> Result<usize, StoreError> {
        outside_runtime()?;
        let mut sender = Sender {
            link: self,
            sending,
            path: ModulePath::default(),
            sent: 0,
            failed: None,
        };
        module.visit(&mut sender);
        match sender.failed {
            Some(error) => Err(error),
            None => Ok(sender.sent),
        }
    }
}

/// Hands each parameter to the node as it is visited, stopping at the first refusal.
struct Sender<'a> {
    link: &'a Embedded,
    sending: &'a Sending<'a>,
    path: ModulePath,
    sent: usize,
    failed: Option<StoreError>,
}

impl Sender<'_> {
    fn hand<const D: usize, K: Basic + 'static>(&mut self, tensor: Tensor<D, K>) {
        if self.failed.is_some() {
            return;
        }
        if !self.path.passes(self.sending.filter) {
            return;
        }
        let path = self.path.joined();
        match self.insert(&path, tensor) {
            Ok(()) => self.sent += 1,
            Err(error) => self.failed = Some(error),
        }
    }

    fn insert<const D: usize, K: Basic + 'static>(
        &self,
        path: &str,
        tensor: Tensor<D, K>,
    ) -> Result<(), StoreError> {
        let key = self.sending.key(path)?;
        let node = &self.link.node;
        let if_exists = self.sending.if_exists;
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

impl ModuleVisitor for Sender<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    // As burn-store's collector does: the parameter as its mapper saves it (`on_save`), so an
    // apply's `on_load` meets what it expects, whichever link sent it.
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.hand(param.transform_for_save().val());
    }

    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
        self.hand(param.transform_for_save().val());
    }

    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
        self.hand(param.transform_for_save().val());
    }
}
