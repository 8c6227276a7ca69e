//! `HandoffApplier`: a module applied from an embedded node by handing each tensor over as it
//! is on the node's device (no host copy, quantized tensors and GPU buffers included), with the
//! filter, names, checks and `ApplyResult` of burn-store's own `Applier`.

use std::collections::{HashMap, HashSet};

use burn_core::module::{ModuleMapper, Param, Parameter};
use burn_core::tensor::kind::Basic;
use burn_core::tensor::{Bool, DType, Device, Int, Tensor};
use burn_store::{ApplyError, ApplyResult, PathFilter};

use crate::store::embedded::Embedded;
use crate::store::link::Listed;
use crate::store::module_path::ModulePath;

/// What a parameter of each kind accepts, as burn-store's `Applier` has it: a float parameter
/// any float or quantized dtype, an int one any integer, a bool one a bool. (The `Applier` also
/// takes a U8 or U32 tensor for a bool parameter and converts it; a handoff does not convert,
/// so such a tensor is a `DTypeMismatch` here.)
#[derive(Clone, Copy)]
enum Kind {
    Float,
    Int,
    Bool,
}

impl Kind {
    fn accepts(self, dtype: &DType) -> bool {
        match self {
            Kind::Float => dtype.is_float() || matches!(dtype, DType::QFloat(_)),
            Kind::Int => dtype.is_int() || dtype.is_uint(),
            Kind::Bool => matches!(dtype, DType::Bool(_)),
        }
    }

    fn expected(self, device: &Device) -> DType {
        let settings = device.settings();
        match self {
            Kind::Float => settings.float_dtype.into(),
            Kind::Int => settings.int_dtype.into(),
            Kind::Bool => settings.bool_dtype.into(),
        }
    }
}

/// Walks a module, replacing each parameter the node holds a tensor for (by path, after the
/// remapper) with that tensor, handed over.
pub(crate) struct HandoffApplier<'a> {
    link: &'a Embedded,
    by_path: HashMap<String, Listed>,
    filter: Option<&'a PathFilter>,
    path: ModulePath,
    /// Every parameter's path met, with its containers' types (as burn-store's `Applier` keeps
    /// them, for `missing`).
    visited: HashMap<String, String>,
    consumed: HashSet<String>,
    applied: Vec<String>,
    skipped: HashSet<String>,
    errors: Vec<ApplyError>,
}

impl<'a> HandoffApplier<'a> {
    /// `tensors` by the path each applies to.
    pub(crate) fn new(
        link: &'a Embedded,
        tensors: Vec<(String, Listed)>,
        filter: Option<&'a PathFilter>,
    ) -> Self {
        Self {
            link,
            by_path: tensors.into_iter().collect(),
            filter,
            path: ModulePath::default(),
            visited: HashMap::new(),
            consumed: HashSet::new(),
            applied: Vec::new(),
            skipped: HashSet::new(),
            errors: Vec::new(),
        }
    }

    /// What was applied, skipped, missing, unused and refused, sorted as burn-store sorts it.
    pub(crate) fn into_result(self) -> ApplyResult {
        let errored: HashSet<&str> = self
            .errors
            .iter()
            .map(|e| match e {
                ApplyError::ShapeMismatch { path, .. }
                | ApplyError::DTypeMismatch { path, .. }
                | ApplyError::AdapterError { path, .. }
                | ApplyError::LoadError { path, .. } => path.as_str(),
            })
            .collect();
        let applied: HashSet<&str> = self.applied.iter().map(String::as_str).collect();
        let mut missing: Vec<(String, String)> = self
            .visited
            .into_iter()
            .filter(|(p, _)| {
                !applied.contains(p.as_str())
                    && !self.skipped.contains(p)
                    && !errored.contains(p.as_str())
            })
            .collect();
        missing.sort_by(|a, b| a.0.cmp(&b.0));
        let mut unused: Vec<String> = self
            .by_path
            .keys()
            .filter(|p| !self.consumed.contains(*p))
            .cloned()
            .collect();
        unused.sort();
        let mut skipped: Vec<String> = self.skipped.into_iter().collect();
        skipped.sort();
        ApplyResult {
            applied: self.applied,
            skipped,
            missing,
            unused,
            errors: self.errors,
        }
    }

    /// `param` replaced by the node's tensor for its path, if there is one it may take.
    fn load<const D: usize, K: Basic + 'static>(
        &mut self,
        param: Param<Tensor<D, K>>,
        kind: Kind,
    ) -> Param<Tensor<D, K>>
    where
        Tensor<D, K>: Parameter,
    {
        let path = self.path.joined();
        self.visited
            .entry(path.clone())
            .or_insert_with(|| self.path.containers_joined());
        let Some(listed) = self.by_path.get(&path) else {
            return param;
        };
        self.consumed.insert(path.clone());
        if !self.path.passes(self.filter) {
            self.skipped.insert(path);
            return param;
        }
        // Checked from the node's description, before anything is handed over.
        let device = param.lazy_device();
        if !kind.accepts(&listed.dtype) {
            self.errors.push(ApplyError::DTypeMismatch {
                path,
                expected: kind.expected(&device),
                found: listed.dtype,
            });
            return param;
        }
        let expected = param.lazy_shape();
        if expected.as_slice() != listed.shape.as_slice() {
            self.errors.push(ApplyError::ShapeMismatch {
                path,
                expected,
                found: listed.shape.clone().into(),
            });
            return param;
        }
        match self.link.tensor_on::<D, K>(&listed.key, &device) {
            // Checked again on what was handed over: the node may have replaced the tensor
            // since it was listed.
            Ok(tensor) if tensor.shape() != expected => {
                self.errors.push(ApplyError::ShapeMismatch {
                    path,
                    expected,
                    found: tensor.shape(),
                });
                param
            }
            Ok(tensor) => {
                self.applied.push(path);
                let id = param.id;
                param.transform_for_load(tensor, id)
            }
            Err(message) => {
                self.errors.push(ApplyError::LoadError { path, message });
                param
            }
        }
    }
}

impl ModuleMapper for HandoffApplier<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        self.load(param, Kind::Float)
    }

    fn map_int<const D: usize>(&mut self, param: Param<Tensor<D, Int>>) -> Param<Tensor<D, Int>> {
        self.load(param, Kind::Int)
    }

    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<D, Bool>>,
    ) -> Param<Tensor<D, Bool>> {
        self.load(param, Kind::Bool)
    }
}
