//! A Burn `Tensor` as the node's primitive of a backend (Flex; wgpu's cubecl backend with the
//! `wgpu` feature) and back: the same handle (the same buffer), with the kind and rank checked
//! before Burn would panic on them.

use std::any::TypeId;

use burn_backend::{Backend, DType, DTypeUsage, TensorMetadata};
use burn_dispatch::{BackendTensor, DispatchKindConversion, DispatchTensor};
use burn_tensor::kind::Basic;
use burn_tensor::{Bool, Float, Int, Tensor};
use ferry_backend::Primitive;
use ferry_proto::dtype_name;

use crate::HandoffError;

/// The kind that holds `dtype`, and its name.
fn kind_of(dtype: &DType) -> (TypeId, &'static str) {
    match dtype {
        DType::Bool(_) => (TypeId::of::<Bool>(), "Bool"),
        d if d.is_int() || d.is_uint() => (TypeId::of::<Int>(), "Int"),
        _ => (TypeId::of::<Float>(), "Float"),
    }
}

/// Whether `dtype` is held by tensors of kind `K`.
pub(crate) fn of_kind<K: 'static>(dtype: &DType) -> bool {
    kind_of(dtype).0 == TypeId::of::<K>()
}

/// Whether backend `B` stores and computes with the plain `dtype` on `device`.
fn computable<B: Backend>(device: &B::Device, dtype: DType) -> bool {
    let usage = B::dtype_usage(device, dtype);
    usage.contains(DTypeUsage::Storage) && usage.contains(DTypeUsage::Arithmetic)
}

/// The name of kind `K`.
fn name_of<K: 'static>() -> &'static str {
    match TypeId::of::<K>() {
        id if id == TypeId::of::<Bool>() => "Bool",
        id if id == TypeId::of::<Int>() => "Int",
        _ => "Float",
    }
}

/// A `Tensor<D, K>` of `primitive`: its own handle, no copy, once its kind and rank are the
/// ones asked for and its backend can compute with its dtype.
pub(crate) fn from_backend<B, const D: usize, K: Basic + 'static>(
    primitive: Primitive<B>,
) -> Result<Tensor<D, K>, HandoffError>
where
    B: Backend,
    DispatchTensor: DispatchKindConversion<B>,
{
    let (dtype, shape) = primitive.dtype_and_shape();
    if kind_of(&dtype).0 != TypeId::of::<K>() {
        return Err(HandoffError::Kind {
            dtype: dtype_name(&dtype),
            asked: name_of::<K>(),
        });
    }
    if shape.len() != D {
        return Err(HandoffError::Rank { shape, asked: D });
    }
    // A backend may store dtypes it cannot compute with (Flex: a 4-byte bool store, Flex32):
    // such a tensor would panic at its first operation in the program, so it is not handed out.
    let device = match &primitive {
        Primitive::Float(t) => t.device(),
        Primitive::Int(t) => t.device(),
        Primitive::Bool(t) => t.device(),
        Primitive::Quantized(q) => q.device(),
    };
    // A plain tensor must be one the backend computes with. A quantized one is handed out as
    // the node's measured table let the device hold it: backends answer for a quantized dtype
    // with its storage element's usage (none for Q8S's i8 on wgpu), or panic on schemes they
    // cannot name (cubecl, sub-byte native stores), so they are not asked. Whether an operation
    // then computes with it is the backend's (Burn 0.22.1's wgpu kernels do not take a natively
    // stored Q8S tensor).
    let plain = !matches!(dtype, DType::QFloat(_));
    if plain && !computable::<B>(&device, dtype) {
        return Err(HandoffError::NotOperable {
            dtype: dtype_name(&dtype),
        });
    }
    // The node registers each tensor under the variant of its dtype (checked on the way in).
    if !primitive.variant_fits_dtype() {
        return Err(HandoffError::Kind {
            dtype: dtype_name(&dtype),
            asked: name_of::<K>(),
        });
    }
    let backend = match primitive {
        Primitive::Float(t) => BackendTensor::Float(t),
        Primitive::Int(t) => BackendTensor::Int(t),
        Primitive::Bool(t) => BackendTensor::Bool(t),
        Primitive::Quantized(t) => BackendTensor::Quantized(t),
    };
    let dispatch = <DispatchTensor as DispatchKindConversion<B>>::from_backend(backend);
    Ok(Tensor::from_dispatch(dispatch))
}
