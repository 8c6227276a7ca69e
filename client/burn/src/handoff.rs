//! A Burn `Tensor` as the node's Flex primitive and back: the same handle (the same buffer), with
//! the kind and rank checked before Burn would panic on them.

use std::any::TypeId;

use burn_backend::{Backend, DType, DTypeUsage};
use burn_dispatch::{BackendTensor, DispatchKindConversion, DispatchTensor};
use burn_flex::{Flex, FlexDevice};
use burn_tensor::kind::Basic;
use burn_tensor::{Bool, Float, Int, Tensor};
use ferry_proto::dtype_name;
use ferry_server::Primitive;

use crate::HandoffError;

/// The kind that holds `dtype`, and its name.
fn kind_of(dtype: &DType) -> (TypeId, &'static str) {
    match dtype {
        DType::Bool(_) => (TypeId::of::<Bool>(), "Bool"),
        d if d.is_int() || d.is_uint() => (TypeId::of::<Int>(), "Int"),
        _ => (TypeId::of::<Float>(), "Float"),
    }
}

/// The name of kind `K`.
fn name_of<K: 'static>() -> &'static str {
    match TypeId::of::<K>() {
        id if id == TypeId::of::<Bool>() => "Bool",
        id if id == TypeId::of::<Int>() => "Int",
        _ => "Float",
    }
}

/// `tensor`'s Flex primitive: its own handle, no copy.
pub(crate) fn into_flex<const D: usize, K: Basic>(
    tensor: Tensor<D, K>,
) -> Result<Primitive<Flex>, HandoffError> {
    let dispatch = tensor.into_dispatch();
    let backend = <DispatchTensor as DispatchKindConversion<Flex>>::try_into_backend(dispatch)
        .map_err(HandoffError::NotFlex)?;
    // Every variant this build of burn-dispatch has; one it adds (gradients) is not a handoff.
    #[allow(unreachable_patterns)]
    match backend {
        BackendTensor::Float(t) => Ok(Primitive::Float(t)),
        BackendTensor::Int(t) => Ok(Primitive::Int(t)),
        BackendTensor::Bool(t) => Ok(Primitive::Bool(t)),
        BackendTensor::Quantized(t) => Ok(Primitive::Quantized(t)),
        _ => Err(HandoffError::NotFlex(
            "a tensor that records gradients".into(),
        )),
    }
}

/// A `Tensor<D, K>` of `primitive`: its own handle, no copy, once its kind and rank are the
/// ones asked for.
pub(crate) fn from_flex<const D: usize, K: Basic + 'static>(
    primitive: Primitive<Flex>,
) -> Result<Tensor<D, K>, HandoffError> {
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
    // Flex stores some dtypes it cannot compute with (a 4-byte bool store, Flex32): such a
    // tensor would panic at its first operation in the program, so it is not handed out.
    let usage = Flex::dtype_usage(&FlexDevice, dtype);
    let needs_arithmetic = !matches!(dtype, DType::QFloat(_));
    if !usage.contains(DTypeUsage::Storage)
        || (needs_arithmetic && !usage.contains(DTypeUsage::Arithmetic))
    {
        return Err(HandoffError::NotOperable {
            dtype: dtype_name(&dtype),
        });
    }
    // The variant follows the dtype (the node checked it on the way in, too).
    let backend = match primitive {
        Primitive::Float(t) | Primitive::Int(t) | Primitive::Bool(t) => match dtype {
            DType::Bool(_) => BackendTensor::Bool(t),
            d if d.is_int() || d.is_uint() => BackendTensor::Int(t),
            _ => BackendTensor::Float(t),
        },
        Primitive::Quantized(t) => BackendTensor::Quantized(t),
    };
    let dispatch = <DispatchTensor as DispatchKindConversion<Flex>>::from_backend(backend);
    Ok(Tensor::from_dispatch(dispatch))
}
