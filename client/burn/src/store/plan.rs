//! `Targets`: where each parameter of a module lives (device and shape), read before an apply
//! so that a tensor is checked against the device it is going to, before a byte is fetched.

use std::collections::HashMap;

use burn_core::module::{ModuleVisitor, Param};
use burn_core::tensor::{Bool, DType, Device, Int, Tensor};
use burn_store::ModuleSnapshot;

use crate::holds::check_holds;
use crate::store::module_path::ModulePath;

/// A module's parameters by path (as burn-store names them: field names joined by `.`).
pub(crate) struct Targets {
    by_path: HashMap<String, Device>,
    /// The paths in the order a visit of the module (burn-store's Applier's too) meets them.
    order: Vec<String>,
}

impl Targets {
    /// Where `module`'s parameters live; no tensor is read.
    pub(crate) fn of<M: ModuleSnapshot>(module: &M) -> Self {
        let mut visitor = Visitor {
            path: ModulePath::default(),
            by_path: HashMap::new(),
            order: Vec::new(),
        };
        module.visit(&mut visitor);
        Self {
            by_path: visitor.by_path,
            order: visitor.order,
        }
    }

    /// No module: nothing to check against (a listing read for its own sake).
    pub(crate) fn none() -> Self {
        Self {
            by_path: HashMap::new(),
            order: Vec::new(),
        }
    }

    /// The parameters' paths in the order burn-store's Applier draws their tensors: a visit's.
    pub(crate) fn order(&self) -> &[String] {
        &self.order
    }

    /// Whether the device of the parameter at `path` holds `dtype` at `shape` bit-exact, as
    /// ferry measured it. `Err` says why not. A path that is no parameter of the module is
    /// never applied (burn-store counts it unused), so there is nothing to check. This holds
    /// for a tensor found under the parameter's own path: an apply through an adapter (whose
    /// alternative names reach a parameter under another name, and whose casts change the
    /// dtype) checks after the adapter, under the parameter's path (`adapted.rs`); and the store
    /// does no enum-variant skipping (which would name paths otherwise than this visitor does).
    pub(crate) fn check(&self, path: &str, dtype: &DType, shape: &[usize]) -> Result<(), String> {
        let Some(device) = self.by_path.get(path) else {
            return Ok(());
        };
        check_holds(device, dtype, shape).map_err(|why| format!("{device:?} cannot hold it: {why}"))
    }
}

struct Visitor {
    path: ModulePath,
    by_path: HashMap<String, Device>,
    order: Vec<String>,
}

impl Visitor {
    fn record(&mut self, device: Device) {
        let path = self.path.joined();
        self.order.push(path.clone());
        self.by_path.insert(path, device);
    }
}

impl ModuleVisitor for Visitor {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.record(param.lazy_device());
    }

    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
        self.record(param.lazy_device());
    }

    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
        self.record(param.lazy_device());
    }
}
