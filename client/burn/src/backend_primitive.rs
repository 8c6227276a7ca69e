//! A Burn `Tensor` as a backend's own primitive: the same handle (the same buffer), no copy.
//! What a handoff to an embedded node, and a collect's sharing of a Flex parameter, start from.

use burn_backend::Backend;
use burn_dispatch::{BackendTensor, DispatchKindConversion, DispatchTensor};
use burn_tensor::Tensor;
use burn_tensor::kind::Basic;
use ferry_backend::Primitive;

/// `tensor`'s primitive of backend `B`: its own handle, no copy; why not, where it is of another
/// backend or records gradients.
pub(crate) fn into_backend<B, const D: usize, K: Basic>(
    tensor: Tensor<D, K>,
) -> Result<Primitive<B>, String>
where
    B: Backend,
    DispatchTensor: DispatchKindConversion<B>,
{
    let dispatch = tensor.into_dispatch();
    let backend = <DispatchTensor as DispatchKindConversion<B>>::try_into_backend(dispatch)?;
    // Every variant this build of burn-dispatch has; one it adds (gradients) is no primitive.
    #[allow(unreachable_patterns)]
    match backend {
        BackendTensor::Float(t) => Ok(Primitive::Float(t)),
        BackendTensor::Int(t) => Ok(Primitive::Int(t)),
        BackendTensor::Bool(t) => Ok(Primitive::Bool(t)),
        BackendTensor::Quantized(t) => Ok(Primitive::Quantized(t)),
        _ => Err("a tensor that records gradients".into()),
    }
}
