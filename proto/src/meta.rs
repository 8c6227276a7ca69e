//! `TensorMeta` (shape, dtype, byte length) and the byte-length rule every payload is held to.
//!
//! Burn validates no quantized byte length (tracel-ai/burn#5836) and its backends panic on a
//! wrong one, so nothing from outside reaches Burn before [`expected_byte_len`] agrees with it.

use burn_std::DType;
use burn_std::quantization::{QuantScheme, QuantStore};
use serde::{Deserialize, Serialize};

use crate::dtype::{WireDType, dtype_name};
use crate::error::MetaError;

/// The most dimensions a tensor on the wire may have.
pub const MAX_RANK: usize = 16;

/// What a tensor is, apart from its bytes: validated, in Burn's types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    shape: Vec<usize>,
    dtype: DType,
    byte_len: usize,
}

/// A [`TensorMeta`] as it travels: integers of fixed width and dtype codes, not yet trusted.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WireMeta {
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
    /// The dtype's codes.
    pub dtype: WireDType,
    /// The exact payload length in bytes.
    pub byte_len: u64,
}

impl TensorMeta {
    /// The meta of a tensor of `shape` and `dtype`, its byte length derived by the rule.
    pub fn new(shape: Vec<usize>, dtype: DType) -> Result<Self, MetaError> {
        if shape.len() > MAX_RANK {
            return Err(MetaError::RankTooLarge {
                rank: shape.len(),
                max: MAX_RANK,
            });
        }
        // A scheme built with Burn's API rather than decoded from the wire can be one the decoder
        // refuses (`per_block([1])` canonicalises to a block of no extents, `per_block([0])` has
        // a zero extent): refuse it here as well, so that every meta a sender builds is one a
        // receiver accepts.
        if let DType::QFloat(_) = dtype {
            DType::try_from(&WireDType::from(dtype))?;
        }
        let byte_len = expected_byte_len(&shape, &dtype)?;
        Ok(Self {
            shape,
            dtype,
            byte_len,
        })
    }

    /// The meta of `shape` and `dtype` whose payload is claimed to be `byte_len` bytes: an error
    /// naming shape, dtype, expected and actual length unless the rule agrees.
    pub fn with_byte_len(
        shape: Vec<usize>,
        dtype: DType,
        byte_len: u64,
    ) -> Result<Self, MetaError> {
        let meta = Self::new(shape, dtype)?;
        if meta.byte_len as u64 != byte_len {
            return Err(MetaError::ByteLenMismatch {
                shape: meta.shape,
                dtype: dtype_name(&dtype),
                expected: meta.byte_len as u64,
                actual: byte_len,
            });
        }
        Ok(meta)
    }

    /// Dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The dtype, quantization scheme included.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The exact payload length in bytes.
    pub fn byte_len(&self) -> usize {
        self.byte_len
    }

    /// Number of elements.
    pub fn num_elements(&self) -> usize {
        // Cannot overflow: `new` computed the byte length from this product with checks.
        self.shape.iter().product()
    }

    /// The wire form.
    pub fn to_wire(&self) -> WireMeta {
        WireMeta {
            shape: self.shape.iter().map(|&d| d as u64).collect(),
            dtype: WireDType::from(self.dtype),
            byte_len: self.byte_len as u64,
        }
    }
}

impl TryFrom<&WireMeta> for TensorMeta {
    type Error = MetaError;

    /// Validates everything: rank, each dimension, the dtype codes, and the byte length.
    fn try_from(wire: &WireMeta) -> Result<Self, MetaError> {
        if wire.shape.len() > MAX_RANK {
            return Err(MetaError::RankTooLarge {
                rank: wire.shape.len(),
                max: MAX_RANK,
            });
        }
        let shape = wire
            .shape
            .iter()
            .map(|&dim| usize::try_from(dim).map_err(|_| MetaError::DimTooLarge { dim }))
            .collect::<Result<Vec<_>, _>>()?;
        let dtype = DType::try_from(&wire.dtype)?;
        Self::with_byte_len(shape, dtype, wire.byte_len)
    }
}

/// The exact number of bytes a `TensorData` of `shape` and `dtype` holds, with checked arithmetic.
///
/// Plain dtypes: elements times element size. Quantized: the values per the store, then the
/// block scales (one per block, or one for a per-tensor scheme) in the innermost level's scale
/// dtype, then for a two-level scheme the per-tensor scale; nothing padded between, as Burn's
/// `QuantizedBytes` lays them out. Packed sub-byte layouts where Burn's own length formula (which
/// pads each row) and its readers (which unpack flat, innermost dim only) disagree are refused.
pub fn expected_byte_len(shape: &[usize], dtype: &DType) -> Result<usize, MetaError> {
    let overflow = || MetaError::SizeOverflow {
        shape: shape.to_vec(),
        dtype: dtype_name(dtype),
    };
    let numel = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)?;
    let DType::QFloat(scheme) = dtype else {
        return numel.checked_mul(dtype.size()).ok_or_else(overflow);
    };
    let values = quantized_value_bytes(shape, numel, dtype, scheme)?;
    let scales = num_scales(shape, scheme)?
        .checked_mul(scale_size(scheme.scale_dtype()))
        .ok_or_else(overflow)?;
    let global = match (scheme.block_scale(), scheme.tensor_scale()) {
        (Some(_), Some(tensor)) => scale_size(tensor),
        _ => 0,
    };
    values
        .checked_add(scales)
        .and_then(|n| n.checked_add(global))
        .ok_or_else(overflow)
}

fn quantized_value_bytes(
    shape: &[usize],
    numel: usize,
    dtype: &DType,
    scheme: &QuantScheme,
) -> Result<usize, MetaError> {
    let stored_bits = scheme.size_bits_stored();
    let values_per_word = stored_bits / scheme.value.size_bits();
    let word_bytes = stored_bits.div_ceil(8);
    if let QuantStore::PackedNative(dim) | QuantStore::PackedU32(dim) = scheme.store {
        if dim >= shape.len() {
            return Err(MetaError::PackedDimOutOfRange {
                dim,
                shape: shape.to_vec(),
                rank: shape.len(),
            });
        }
        if values_per_word > 1 {
            let ambiguous = |reason| MetaError::AmbiguousPackedLayout {
                dtype: dtype_name(dtype),
                shape: shape.to_vec(),
                reason,
            };
            if dim != 0 {
                return Err(ambiguous(
                    "Burn's readers unpack along the innermost dim only",
                ));
            }
            // Burn's length pads each innermost row to whole words; its readers unpack the
            // values as one flat run. The two agree only when rows need no padding.
            let inner = shape.last().copied().unwrap_or(1);
            if inner % values_per_word != 0 && numel != inner && numel != 0 {
                return Err(ambiguous(
                    "the innermost dim is not a whole number of packed words",
                ));
            }
        }
    }
    // Where rows need no padding (checked above) the per-row and the flat word count agree.
    numel
        .div_ceil(values_per_word)
        .checked_mul(word_bytes)
        .ok_or_else(|| MetaError::SizeOverflow {
            shape: shape.to_vec(),
            dtype: dtype_name(dtype),
        })
}

/// How many block (or per-tensor) scales a quantized tensor of `shape` stores.
pub(crate) fn scale_count(shape: &[usize], scheme: &QuantScheme) -> Result<usize, MetaError> {
    num_scales(shape, scheme)
}

/// Block scales: one per block over the block grid (blocks right-aligned to the shape), or one.
fn num_scales(shape: &[usize], scheme: &QuantScheme) -> Result<usize, MetaError> {
    let Some(block) = scheme.block_size() else {
        return Ok(1);
    };
    let extents = block.as_slice();
    if extents.len() > shape.len() {
        return Err(MetaError::BlockRankExceedsShape {
            block: extents.to_vec(),
            shape: shape.to_vec(),
        });
    }
    let lead = shape.len() - extents.len();
    shape
        .iter()
        .enumerate()
        .try_fold(1usize, |acc, (i, &dim)| {
            let extent = if i < lead {
                1
            } else {
                usize::from(extents[i - lead])
            };
            // Extents are nonzero: the scheme decoder refuses zero, and Burn's builder
            // cannot make one from a valid `BlockSize` either.
            acc.checked_mul(dim.div_ceil(extent.max(1)))
        })
        .ok_or_else(|| MetaError::SizeOverflow {
            shape: shape.to_vec(),
            dtype: dtype_name(&DType::QFloat(*scheme)),
        })
}

fn scale_size(dtype: burn_std::quantization::ScaleDtype) -> usize {
    burn_std::quantization::scale_size(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_std::quantization::{QuantValue, ScaleDtype};

    fn q8s() -> QuantScheme {
        QuantScheme::default()
            .with_value(QuantValue::Q8S)
            .with_store(QuantStore::Native)
    }

    #[test]
    fn plain_lengths() {
        assert_eq!(expected_byte_len(&[], &DType::F32), Ok(4));
        assert_eq!(expected_byte_len(&[2, 0, 3], &DType::F64), Ok(0));
        assert_eq!(expected_byte_len(&[3, 5], &DType::BF16), Ok(30));
        assert_eq!(
            expected_byte_len(&[7], &DType::Bool(burn_std::BoolStore::U32)),
            Ok(28)
        );
    }

    #[test]
    fn quantized_lengths_match_burns_formula_on_native_stores() {
        let shape = burn_std::Shape::new([4, 32]);
        for scheme in [
            q8s(),
            q8s().per_tensor(ScaleDtype::F16),
            q8s().per_block([32], ScaleDtype::F32),
            q8s().per_block([4, 4], ScaleDtype::UE8M0),
            q8s()
                .per_block([16], ScaleDtype::UE4M3)
                .per_tensor(ScaleDtype::F32),
            q8s().with_value(QuantValue::Q4S),
            q8s().with_value(QuantValue::E2M1),
        ] {
            assert_eq!(
                expected_byte_len(shape.as_slice(), &DType::QFloat(scheme)),
                Ok(burn_std::quantization::quantized_data_len(&scheme, &shape)),
                "{scheme:?}"
            );
        }
    }

    #[test]
    fn two_level_scheme_adds_the_global_scale() {
        let scheme = q8s()
            .per_block([4], ScaleDtype::UE4M3)
            .per_tensor(ScaleDtype::F32);
        assert_eq!(
            expected_byte_len(&[8], &DType::QFloat(scheme)),
            Ok(8 + 2 + 4)
        );
    }

    #[test]
    fn overflow_is_an_error_not_a_wrap() {
        assert!(matches!(
            expected_byte_len(&[usize::MAX, 2], &DType::F32),
            Err(MetaError::SizeOverflow { .. })
        ));
        assert!(matches!(
            expected_byte_len(&[usize::MAX / 2 + 1], &DType::F32),
            Err(MetaError::SizeOverflow { .. })
        ));
    }

    #[test]
    fn packed_layouts_burn_reads_inconsistently_are_refused() {
        let q4 = QuantScheme::default()
            .with_value(QuantValue::Q4S)
            .with_store(QuantStore::PackedU32(0));
        // 8 values per u32: [3, 8] pads nothing, [3, 3] would pad every row.
        assert_eq!(
            expected_byte_len(&[3, 8], &DType::QFloat(q4)),
            Ok(3 * 4 + 4)
        );
        assert!(matches!(
            expected_byte_len(&[3, 3], &DType::QFloat(q4)),
            Err(MetaError::AmbiguousPackedLayout { .. })
        ));
        // A single row pads once either way.
        assert_eq!(expected_byte_len(&[3], &DType::QFloat(q4)), Ok(4 + 4));
        let q4_dim1 = q4.with_store(QuantStore::PackedU32(1));
        assert!(matches!(
            expected_byte_len(&[8, 8], &DType::QFloat(q4_dim1)),
            Err(MetaError::AmbiguousPackedLayout { .. })
        ));
        assert!(matches!(
            expected_byte_len(&[8], &DType::QFloat(q4_dim1)),
            Err(MetaError::PackedDimOutOfRange { .. })
        ));
    }

    #[test]
    fn lying_byte_len_names_shape_dtype_and_both_lengths() {
        let err = TensorMeta::with_byte_len(vec![2, 3], DType::QFloat(q8s()), 9).unwrap_err();
        assert_eq!(
            err,
            MetaError::ByteLenMismatch {
                shape: vec![2, 3],
                dtype: dtype_name(&DType::QFloat(q8s())),
                expected: 10,
                actual: 9,
            }
        );
        let text = err.to_string();
        assert!(
            text.contains("[2, 3]") && text.contains("10") && text.contains("9"),
            "{text}"
        );
    }

    #[test]
    fn block_rank_past_the_shape_is_refused() {
        let scheme = q8s().per_block([4, 4], ScaleDtype::F32);
        assert!(matches!(
            expected_byte_len(&[16], &DType::QFloat(scheme)),
            Err(MetaError::BlockRankExceedsShape { .. })
        ));
    }
}
