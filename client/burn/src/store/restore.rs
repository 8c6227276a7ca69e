//! `Before`: a module's values before an apply, put back after a refused one. An apply works on
//! a clone and keeps it only if whole, but Burn shares a module's running state
//! (`RunningState`: a batch norm's running mean and variance) with its clones and maps it in
//! place, so an apply to the clone writes the original's too: a refused apply puts it back.

use std::any::Any;
use std::collections::HashMap;

use burn_core::module::{Module, ModuleMapper, ModuleVisitor, Param, Parameter};
use burn_core::tensor::kind::Basic;
use burn_core::tensor::{Bool, Int, Tensor};

use crate::store::module_path::ModulePath;

/// Every initialized parameter's value (a handle, not the bytes), by path.
pub(crate) struct Before {
    by_path: HashMap<String, Box<dyn Any + Send>>,
}

impl Before {
    /// `module`'s values now; nothing is read or initialized.
    pub(crate) fn of<M: Module>(module: &M) -> Self {
        let mut taker = Taker {
            path: ModulePath::default(),
            by_path: HashMap::new(),
        };
        module.visit(&mut taker);
        Self {
            by_path: taker.by_path,
        }
    }

    /// `module` with every parameter holding its value from before again (the same handles:
    /// each running state written back in place, every other parameter as it was).
    pub(crate) fn restore<M: Module>(mut self, module: M) -> M {
        let mut putter = Putter {
            path: ModulePath::default(),
            by_path: &mut self.by_path,
        };
        module.map(&mut putter)
    }
}

struct Taker {
    path: ModulePath,
    by_path: HashMap<String, Box<dyn Any + Send>>,
}

impl Taker {
    fn take<const D: usize, K: Basic + 'static>(&mut self, param: &Param<Tensor<D, K>>)
    where
        Tensor<D, K>: Parameter,
    {
        if param.is_initialized() {
            self.by_path
                .insert(self.path.joined(), Box::new(param.base()));
        }
    }
}

impl ModuleVisitor for Taker {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.take(param);
    }

    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
        self.take(param);
    }

    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
        self.take(param);
    }
}

struct Putter<'a> {
    path: ModulePath,
    by_path: &'a mut HashMap<String, Box<dyn Any + Send>>,
}

impl Putter<'_> {
    fn put<const D: usize, K: Basic + 'static>(
        &mut self,
        param: Param<Tensor<D, K>>,
    ) -> Param<Tensor<D, K>>
    where
        Tensor<D, K>: Parameter,
    {
        let Some(before) = self.by_path.remove(&self.path.joined()) else {
            return param;
        };
        match before.downcast::<Tensor<D, K>>() {
            Ok(before) => param.map(|_| *before),
            Err(_) => param,
        }
    }
}

impl ModuleMapper for Putter<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        self.put(param)
    }

    fn map_int<const D: usize>(&mut self, param: Param<Tensor<D, Int>>) -> Param<Tensor<D, Int>> {
        self.put(param)
    }

    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<D, Bool>>,
    ) -> Param<Tensor<D, Bool>> {
        self.put(param)
    }
}
