//! A Flex tensor's bytes as `TensorData` that shares its buffer: what a model applied from an
//! embedded node is built from (its parameters read the node's own bytes), and what a collect
//! sends of a Flex parameter (no host copy before the wire). A write to either side copies
//! first; the other's bytes stay as they are.

use std::sync::Arc;

use burn_core::tensor::{AllocationProperty, Bytes, Tensor, TensorData};
use burn_dispatch::{BackendTensor, DispatchKindConversion, DispatchTensor};
use burn_flex::{Flex, FlexTensor};
use burn_tensor::kind::Basic;
#[cfg(feature = "node")]
use ferry_backend::{BackendError, Primitive};

/// A Flex buffer, kept alive by the data built over it.
struct SharedBuffer(Arc<Bytes>);

impl AsRef<[u8]> for SharedBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// `primitive`'s bytes as `into_data` would give them: its buffer shared where
/// [`shared`] can, read out as a copy otherwise.
#[cfg(feature = "node")]
pub(crate) fn shared_data(primitive: Primitive<Flex>) -> Result<TensorData, BackendError> {
    let flex = match &primitive {
        Primitive::Float(t) | Primitive::Int(t) | Primitive::Bool(t) => Some(t),
        Primitive::Quantized(_) => None,
    };
    match flex.and_then(shared) {
        Some(data) => Ok(data),
        None => primitive.to_data(),
    }
}

/// A parameter's bytes as `into_data` would give them, its buffer shared, when it is a plain
/// Flex tensor that spans its whole buffer; `None` for anything else (another backend's, a
/// quantized tensor, a view), which the caller reads out as Burn does.
pub(crate) fn shared_param<const D: usize, K: Basic>(tensor: &Tensor<D, K>) -> Option<TensorData> {
    let dispatch = tensor.clone().into_dispatch();
    let backend =
        <DispatchTensor as DispatchKindConversion<Flex>>::try_into_backend(dispatch).ok()?;
    // Every variant this build of burn-dispatch has; one it adds is read out as Burn does.
    #[allow(unreachable_patterns)]
    match backend {
        BackendTensor::Float(t) | BackendTensor::Int(t) | BackendTensor::Bool(t) => shared(&t),
        _ => None,
    }
}

/// A plain, contiguous tensor that spans its whole buffer, as data sharing that buffer
/// (copy-on-write: a `Bytes` over shared memory copies before its first write).
fn shared(flex: &FlexTensor) -> Option<TensorData> {
    if !spans_its_buffer(flex) {
        return None;
    }
    let shape = flex.layout().shape().clone();
    let bytes = Bytes::from_shared(
        bytes::Bytes::from_owner(SharedBuffer(flex.data_arc())),
        AllocationProperty::Other,
    );
    Some(TensorData::from_bytes(bytes, shape, flex.dtype()))
}

/// Whether `tensor`'s elements are its whole buffer, in order.
fn spans_its_buffer(tensor: &FlexTensor) -> bool {
    let layout = tensor.layout();
    let Some(len) = layout.num_elements().checked_mul(tensor.dtype().size()) else {
        return false;
    };
    layout.is_contiguous() && layout.start_offset() == 0 && tensor.bytes().len() == len
}

#[cfg(test)]
mod tests {
    use burn_core::tensor::quantization::{QuantScheme, QuantStore, QuantValue};
    use burn_core::tensor::{Bool, DType, Device, Int, Tensor, TensorData};

    use burn_dispatch::{BackendTensor, DispatchKindConversion, DispatchTensor};
    use burn_flex::Flex;

    use super::shared_param;

    /// Shared exactly when the tensor is plain Flex and spans its buffer: then the bytes and
    /// dtype are `into_data`'s, and they lie where the tensor's do.
    #[test]
    fn a_plain_flex_parameter_is_shared_and_a_view_or_quantized_one_is_not() {
        let device = Device::flex();
        let floats = Tensor::<2>::from_data(TensorData::new(vec![1.5f32; 12], [3, 4]), &device);
        let half = Tensor::<2>::from_data(
            TensorData::new(vec![0.25f32; 6], [2, 3]).convert_dtype(DType::F16),
            (&device, DType::F16),
        );
        let ints = Tensor::<1, Int>::from_data(TensorData::new(vec![3i64, -1, 7], [3]), &device);
        let bools =
            Tensor::<1, Bool>::from_data(TensorData::new(vec![true, false, true], [3]), &device);
        let scheme = QuantScheme::default()
            .with_value(QuantValue::Q8S)
            .with_store(QuantStore::Native);
        let cases: [(&str, Option<TensorData>, TensorData, bool); 8] = [
            (
                "f32",
                shared_param(&floats),
                floats.clone().into_data(),
                true,
            ),
            ("f16", shared_param(&half), half.clone().into_data(), true),
            ("i64", shared_param(&ints), ints.clone().into_data(), true),
            (
                "bool",
                shared_param(&bools),
                bools.clone().into_data(),
                true,
            ),
            (
                "transposed",
                shared_param(&floats.clone().transpose()),
                floats.clone().transpose().into_data(),
                false,
            ),
            (
                "sliced",
                shared_param(&floats.clone().slice(1..3)),
                floats.clone().slice(1..3).into_data(),
                false,
            ),
            (
                "first rows (its start, a larger buffer)",
                shared_param(&floats.clone().slice(0..2)),
                floats.clone().slice(0..2).into_data(),
                false,
            ),
            (
                "quantized",
                shared_param(&floats.clone().quantize_dynamic(&scheme)),
                floats.clone().quantize_dynamic(&scheme).into_data(),
                false,
            ),
        ];
        for (label, shared, want, is_shared) in cases {
            assert_eq!(shared.is_some(), is_shared, "{label}");
            if let Some(got) = shared {
                assert_eq!(got.dtype(), want.dtype(), "{label}: dtype");
                assert_eq!(got.shape(), want.shape(), "{label}: shape");
                assert!(got.as_bytes() == want.as_bytes(), "{label}: bytes");
            }
        }
        // The f32 parameter's data is its own buffer, not a copy of it.
        let data = shared_param(&floats).expect("shared");
        let dispatch = floats.into_dispatch();
        let Ok(BackendTensor::Float(flex)) =
            <DispatchTensor as DispatchKindConversion<Flex>>::try_into_backend(dispatch)
        else {
            panic!("a Flex float tensor");
        };
        assert_eq!(data.as_bytes().as_ptr(), flex.bytes().as_ptr());
    }
}
