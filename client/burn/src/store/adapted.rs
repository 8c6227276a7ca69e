//! An apply through a burn-store `ModuleAdapter` (PyTorch's layouts and names, a dtype cast):
//! burn-store's own `Applier` with the store's adapter, each tensor checked as the adapter makes
//! it (transposed, renamed, cast) against what the device of the parameter it goes to holds
//! bit-exact, before a byte of it is fetched from the node.

use std::sync::Arc;

use burn_pack::{Error as PackError, Tensor as PackTensor};
use burn_store::{ApplyResult, ModuleAdapter, ModuleContext, ModuleSnapshot, PathFilter, bridge};

use crate::store::deferred_tensors;
use crate::store::link::{Link, Listed};
use crate::store::plan::Targets;

/// Applies `listing` (each tensor with the name it is stored under, after the remapper) to
/// `module` through `adapter`, with `filter`, as burn-store's file stores apply a file: the
/// adapter finds a parameter's tensor under its alternative name (`weight` for a norm's
/// `gamma`) and transforms it on its way in; every tensor is built from its data on the
/// parameter's device (not handed over).
pub(crate) fn apply_adapted<L: Link, M: ModuleSnapshot>(
    link: &Arc<L>,
    module: &mut M,
    listing: Vec<(String, Listed)>,
    filter: Option<&PathFilter>,
    adapter: Box<dyn ModuleAdapter>,
) -> ApplyResult {
    // Checked after the adapter, under the parameter's own path: not under the stored name
    // (which an alternative name may differ from), nor at the stored dtype (which a cast
    // adapter changes).
    let checked = Checked {
        adapter,
        targets: Arc::new(Targets::of(module)),
    };
    let tensors = deferred_tensors(link, listing, Arc::new(Targets::none()), None);
    module.apply(tensors, filter.cloned(), Some(Box::new(checked)), false)
}

/// The store's adapter, then ferry's check of what it made.
#[derive(Clone)]
struct Checked {
    adapter: Box<dyn ModuleAdapter>,
    targets: Arc<Targets>,
}

impl ModuleAdapter for Checked {
    fn adapt(&self, tensor: PackTensor, ctx: ModuleContext<'_>) -> PackTensor {
        // burn-store's Applier names the tensor by the parameter's own path before it adapts
        // it (and adapts only a tensor it found for a parameter).
        let path = tensor.name.clone();
        let adapted = self.adapter.adapt(tensor, ctx);
        match self
            .targets
            .check(&path, &adapted.dtype, adapted.shape.as_slice())
        {
            Ok(()) => adapted,
            // The adapted tensor (and the fetch under it) is dropped unread: the Applier
            // reports the refusal as this parameter's `LoadError`.
            Err(why) => {
                let why = format!(
                    "a {} tensor of shape {:?}, as the adapter made it: {why}",
                    ferry_proto::dtype_name(&adapted.dtype),
                    adapted.shape.as_slice()
                );
                let PackTensor {
                    name,
                    dtype,
                    shape,
                    param_id,
                    ..
                } = adapted;
                bridge::deferred(name, dtype, shape, param_id, move || {
                    Err(PackError::ValidationError(why.clone()))
                })
            }
        }
    }

    fn get_alternative_param_name(&self, param_name: &str, module_type: &str) -> Option<String> {
        self.adapter
            .get_alternative_param_name(param_name, module_type)
    }

    fn clone_box(&self) -> Box<dyn ModuleAdapter> {
        Box::new(self.clone())
    }
}
