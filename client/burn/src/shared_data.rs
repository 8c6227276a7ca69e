//! A Flex tensor's bytes where they lie: as `TensorData` that shares its buffer, what a model
//! applied from an embedded node is built from (its parameters read the node's own bytes), and
//! as the buffers a collect sends of a Flex parameter (no host copy before the wire). A write
//! to either side copies first; the other's bytes stay as they are.

#[cfg(feature = "node")]
use std::sync::Arc;

use burn_core::tensor::Tensor;
#[cfg(feature = "node")]
use burn_core::tensor::{AllocationProperty, Bytes, Shape, TensorData};
use burn_flex::Flex;
use burn_tensor::kind::Basic;
use ferry_backend::SharedPayload;
#[cfg(feature = "node")]
use ferry_backend::{BackendError, Primitive};

use crate::backend_primitive::into_backend;

/// A Flex buffer, kept alive by the data built over it.
#[cfg(feature = "node")]
struct SharedBuffer(Arc<Bytes>);

#[cfg(feature = "node")]
impl AsRef<[u8]> for SharedBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// `primitive`'s bytes as `into_data` would give them: a plain tensor's buffer shared where
/// Flex keeps it as one ([`Primitive::shared_host_bytes`]), anything else (a view, a quantized
/// tensor, whose values and scales `into_data` joins) read out as a copy.
#[cfg(feature = "node")]
pub(crate) fn shared_data(primitive: Primitive<Flex>) -> Result<TensorData, BackendError> {
    match primitive.shared_host_bytes() {
        Some(payload) if payload.tail.is_empty() => Ok(TensorData::from_bytes(
            Bytes::from_shared(
                bytes::Bytes::from_owner(SharedBuffer(payload.values)),
                AllocationProperty::Other,
            ),
            Shape::from(payload.shape),
            payload.dtype,
        )),
        _ => primitive.to_data(),
    }
}

/// A parameter's bytes as `into_data` would give them, without copying its values, when it is a
/// Flex tensor whose buffer Flex keeps in that layout: a plain contiguous tensor that spans its
/// buffer (the buffer itself), or a quantized one of one scale level stored one value per byte
/// (its values' buffer, then the scale bytes `into_data` would append, encoded now). `None` for
/// anything else (another backend's, a view, a packed or two-level scheme), which the caller
/// reads out as Burn does.
pub(crate) fn shared_param<const D: usize, K: Basic>(
    tensor: &Tensor<D, K>,
) -> Option<SharedPayload> {
    into_backend::<Flex, D, K>(tensor.clone())
        .ok()?
        .shared_host_bytes()
}

#[cfg(test)]
mod tests {
    use burn_core::tensor::quantization::{QuantScheme, QuantStore, QuantValue, ScaleDtype};
    use burn_core::tensor::{Bool, DType, Device, Int, Tensor, TensorData};
    use burn_dispatch::{BackendTensor, DispatchKindConversion, DispatchTensor};
    use burn_flex::Flex;

    use super::shared_param;

    /// Shared exactly when Flex keeps the tensor as `into_data` gives it: then the bytes (the
    /// values' buffer, then the scale bytes) and dtype are `into_data`'s, and the values lie
    /// where the tensor's do.
    #[test]
    fn a_flex_parameter_kept_as_into_data_gives_it_is_shared_and_a_view_is_not() {
        let device = Device::flex();
        let floats = Tensor::<2>::from_data(TensorData::new(vec![1.5f32; 64], [4, 16]), &device);
        let half = Tensor::<2>::from_data(
            TensorData::new(vec![0.25f32; 6], [2, 3]).convert_dtype(DType::F16),
            (&device, DType::F16),
        );
        let ints = Tensor::<1, Int>::from_data(TensorData::new(vec![3i64, -1, 7], [3]), &device);
        let bools =
            Tensor::<1, Bool>::from_data(TensorData::new(vec![true, false, true], [3]), &device);
        let q8s = QuantScheme::default()
            .with_value(QuantValue::Q8S)
            .with_store(QuantStore::Native);
        let per_tensor = floats.clone().quantize_dynamic(&q8s);
        let per_block = floats
            .clone()
            .quantize_dynamic(&q8s.per_block([16], ScaleDtype::F32));
        let f16_scales = floats
            .clone()
            .quantize_dynamic(&q8s.per_block([16], ScaleDtype::F16));
        let bf16_scales = floats
            .clone()
            .quantize_dynamic(&q8s.per_block([8], ScaleDtype::BF16));
        let views = [
            ("transposed", floats.clone().transpose()),
            ("sliced", floats.clone().slice(1..3)),
            (
                "first rows (its start, a larger buffer)",
                floats.clone().slice(0..2),
            ),
        ];
        let shared = [
            ("f32", shared_param(&floats), floats.clone().into_data()),
            ("f16", shared_param(&half), half.clone().into_data()),
            ("i64", shared_param(&ints), ints.clone().into_data()),
            ("bool", shared_param(&bools), bools.clone().into_data()),
            (
                "Q8S",
                shared_param(&per_tensor),
                per_tensor.clone().into_data(),
            ),
            (
                "Q8S per block",
                shared_param(&per_block),
                per_block.clone().into_data(),
            ),
            (
                "Q8S, F16 scales",
                shared_param(&f16_scales),
                f16_scales.clone().into_data(),
            ),
            (
                "Q8S, BF16 scales",
                shared_param(&bf16_scales),
                bf16_scales.clone().into_data(),
            ),
        ];
        for (label, payload, want) in shared {
            let payload = payload.unwrap_or_else(|| panic!("{label}: shared"));
            assert_eq!(payload.dtype, want.dtype(), "{label}: dtype");
            assert_eq!(payload.shape, want.shape().as_slice(), "{label}: shape");
            let joined = [&payload.values[..], &payload.tail[..]].concat();
            assert!(joined == want.as_bytes(), "{label}: bytes");
        }
        for (label, view) in views {
            assert!(shared_param(&view).is_none(), "{label}: read out");
        }
        // The f32 parameter's payload is its own buffer, not a copy of it.
        let payload = shared_param(&floats).expect("shared");
        let Ok(BackendTensor::Float(flex)) =
            <DispatchTensor as DispatchKindConversion<Flex>>::try_into_backend(
                floats.into_dispatch(),
            )
        else {
            panic!("a Flex float tensor");
        };
        assert_eq!(payload.values.as_ptr(), flex.bytes().as_ptr());
    }
}
