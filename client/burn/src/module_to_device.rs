//! [`TryModuleToDevice`]: a whole module moved to any device of this process, every parameter
//! checked against what the device holds bit-exact before any of them moves: an error that
//! names the parameter's path and dtype, never a panic.

use burn_core::module::{Module, ModuleMapper, ModuleVisitor, Param, Parameter};
use burn_core::tensor::kind::Basic;
use burn_core::tensor::{Bool, Device, Int, Tensor};
use ferry_proto::dtype_name;

use crate::store::module_path::ModulePath;
use crate::store::restore::Before;
use crate::to_device::{check_held, stays};
use crate::{MoveError, TryToDevice};

/// Why a module was not moved: the first parameter, in the module's order, that could not be.
#[derive(Debug, thiserror::Error)]
#[error("parameter {path:?} ({dtype}) not moved: {source}")]
#[non_exhaustive]
pub struct ModuleMoveError {
    /// The parameter's path, as burn-store names it (`encoder.layers.0.weight`).
    pub path: String,
    /// Its dtype, readable.
    pub dtype: String,
    /// Why it was not moved ([`MoveError::NotHeld`]: found before anything moved).
    pub source: Box<MoveError>,
}

/// A whole module moved to another device of this process without a panic: Burn's
/// `Module::to_device`, each parameter (and running state, such as a batch norm's) moved as
/// [`TryToDevice`] moves a tensor, once every one of them was checked against what the target
/// device holds bit-exact (dtype at its shape, quantized schemes included).
///
/// The module is borrowed, and left as it was where the move is refused. A parameter not
/// initialized yet is initialized where it is first (as Burn's `to_device` does with one a
/// clone shares). Burn shares a module's running state (`RunningState`: a batch norm's running
/// mean and variance) with its clones, and moves it in place: a module moved whole moves that
/// of the module it was moved from too, as Burn's `to_device` on a clone would; a failed move
/// leaves it where it was.
pub trait TryModuleToDevice: Module {
    /// The module on `device`, bit-exact (every parameter's dtype, shape and bytes, scales
    /// included). [`ModuleMoveError`] names the first parameter the device cannot hold
    /// (nothing moved then), or one the backend failed to move (a failure its measured table
    /// did not foresee, such as running out of memory).
    fn try_module_to_device(&self, device: &Device) -> Result<Self, ModuleMoveError>;
}

impl<M: Module> TryModuleToDevice for M {
    fn try_module_to_device(&self, device: &Device) -> Result<Self, ModuleMoveError> {
        let mut checker = Checker {
            device,
            path: ModulePath::default(),
            refused: None,
        };
        self.visit(&mut checker);
        if let Some(refused) = checker.refused {
            return Err(refused);
        }
        let before = Before::of(self);
        let mut mover = Mover {
            device,
            path: ModulePath::default(),
            failed: None,
        };
        let moved = self.clone().map(&mut mover);
        match mover.failed {
            Some(failed) => {
                // The running state moved in place before the failure, put back.
                drop(before.restore(self.clone()));
                Err(failed)
            }
            None => Ok(moved),
        }
    }
}

/// Finds the first parameter the target device cannot hold; moves nothing.
struct Checker<'a> {
    device: &'a Device,
    path: ModulePath,
    refused: Option<ModuleMoveError>,
}

impl Checker<'_> {
    fn check<const D: usize, K: Basic + 'static>(&mut self, param: &Param<Tensor<D, K>>)
    where
        Tensor<D, K>: Parameter,
    {
        if self.refused.is_some() {
            return;
        }
        // What a move takes: the stored value, without its reparameterization (whose own
        // parameters are visited as a module of their own).
        let tensor = param.base();
        if stays(&tensor.device(), self.device) {
            return;
        }
        let dtype = tensor.dtype();
        if let Err(source) = check_held(self.device, &dtype, tensor.shape().as_slice()) {
            self.refused = Some(ModuleMoveError {
                path: self.path.joined(),
                dtype: dtype_name(&dtype),
                source: Box::new(source),
            });
        }
    }
}

impl ModuleVisitor for Checker<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.check(param);
    }

    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
        self.check(param);
    }

    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
        self.check(param);
    }
}

/// Moves every parameter; after a failure, moves no more.
struct Mover<'a> {
    device: &'a Device,
    path: ModulePath,
    failed: Option<ModuleMoveError>,
}

impl Mover<'_> {
    fn relocate<const D: usize, K: Basic + 'static>(
        &mut self,
        param: Param<Tensor<D, K>>,
    ) -> Param<Tensor<D, K>>
    where
        Tensor<D, K>: Parameter,
    {
        if self.failed.is_some() {
            return param;
        }
        // As Burn's `Param::map`: the id, the mapper and the training state kept.
        let (id, tensor, mapper) = param.consume();
        let dtype = tensor.dtype();
        let tensor = match tensor.clone().try_to_device(self.device) {
            Ok(moved) => moved,
            Err(source) => {
                self.failed = Some(ModuleMoveError {
                    path: self.path.joined(),
                    dtype: dtype_name(&dtype),
                    source: Box::new(source),
                });
                tensor
            }
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

impl ModuleMapper for Mover<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        self.relocate(param)
    }

    fn map_int<const D: usize>(&mut self, param: Param<Tensor<D, Int>>) -> Param<Tensor<D, Int>> {
        self.relocate(param)
    }

    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<D, Bool>>,
    ) -> Param<Tensor<D, Bool>> {
        self.relocate(param)
    }
}
