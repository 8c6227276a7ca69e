//! `CollectWalk`: a walk over a module that finds the parameters a collect sends exactly as
//! burn-store's collector does (the same paths, the same filter, asked before a parameter is
//! touched, each parameter as its mapper saves it) and hands each to a [`TakeParam`]: the
//! connected store's deal, or the embedded store's node.

use burn_core::module::{ModuleVisitor, Param, ParamId, Parameter};
use burn_core::tensor::kind::Basic;
use burn_core::tensor::{Bool, Int, Tensor};
use burn_store::PathFilter;

use crate::store::module_path::ModulePath;

/// What a collect does with each parameter its walk finds.
pub(crate) trait TakeParam {
    /// Whether the collect stopped (it failed): the walk then touches nothing more.
    fn stopped(&self) -> bool;

    /// Takes the parameter at `path`.
    fn take<const D: usize, K: Basic + 'static>(&mut self, path: String, tensor: &Tensor<D, K>);
}

/// Walks a module as burn-store's collector does, handing each parameter the filter lets
/// through to `taker`.
pub(crate) struct CollectWalk<'f, T> {
    taker: T,
    filter: Option<&'f PathFilter>,
    path: ModulePath,
}

impl<'f, T: TakeParam> CollectWalk<'f, T> {
    pub(crate) fn new(taker: T, filter: Option<&'f PathFilter>) -> Self {
        Self {
            taker,
            filter,
            path: ModulePath::default(),
        }
    }

    /// The parameter at the walk's path, as its mapper saves it (`on_save`), so that an apply's
    /// `on_load` meets what it expects, whichever link sent it. The filter is asked first: a
    /// lazy parameter it leaves out stays uninitialized.
    fn param<const D: usize, K: Basic + 'static>(&mut self, param: &Param<Tensor<D, K>>)
    where
        Tensor<D, K>: Parameter,
    {
        if !self.taker.stopped() && self.path.passes(self.filter) {
            let path = self.path.joined();
            self.taker.take(path, &param.transform_for_save().val());
        }
    }

    /// A tensor a module visits at an explicit path (`visit_*_with_path`), as burn-store's
    /// collector takes it: no mapper, the filter matched with the containers entered.
    fn at<const D: usize, K: Basic + 'static>(&mut self, path: &[String], tensor: &Tensor<D, K>) {
        if !self.taker.stopped() && self.path.passes_at(path, self.filter) {
            self.taker.take(path.join("."), tensor);
        }
    }
}

impl<T: TakeParam> ModuleVisitor for CollectWalk<'_, T> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.param(param);
    }

    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
        self.param(param);
    }

    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
        self.param(param);
    }

    fn visit_float_with_path<const D: usize>(
        &mut self,
        path: &[String],
        _id: ParamId,
        tensor: &Tensor<D>,
    ) {
        self.at(path, tensor);
    }

    fn visit_int_with_path<const D: usize>(
        &mut self,
        path: &[String],
        _id: ParamId,
        tensor: &Tensor<D, Int>,
    ) {
        self.at(path, tensor);
    }

    fn visit_bool_with_path<const D: usize>(
        &mut self,
        path: &[String],
        _id: ParamId,
        tensor: &Tensor<D, Bool>,
    ) {
        self.at(path, tensor);
    }
}
