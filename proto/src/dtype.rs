//! ferry's own stable numeric codes for every Burn `DType` and `QuantScheme` field.
//!
//! Burn's serde derive is not a wire format: renaming a variant in a Burn release would silently
//! change what peers read. Every code here is written down in `PROTOCOL.md`, and decoding checks
//! what Burn itself does not (block extents, block rank, canonical block sizes).

use burn_std::quantization::{
    BlockSize, QuantMode, QuantScheme, QuantStore, QuantValue, ScaleDtype,
};
use burn_std::{BoolStore, DType};
use serde::{Deserialize, Serialize};

use crate::error::DTypeError;

/// The most block dimensions a `QuantScheme` can carry (Burn's `BlockSize::MAX_DIMS`).
pub const MAX_BLOCK_DIMS: usize = BlockSize::MAX_DIMS;

/// Every plain (not quantized) Burn 0.22.1 dtype, in tag order.
pub const PLAIN_DTYPES: [DType; 16] = [
    DType::F64,
    DType::F32,
    DType::Flex32,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::I32,
    DType::I16,
    DType::I8,
    DType::U64,
    DType::U32,
    DType::U16,
    DType::U8,
    DType::Bool(BoolStore::Native),
    DType::Bool(BoolStore::U8),
    DType::Bool(BoolStore::U32),
];

/// Every quantized value type, in code order.
pub const QUANT_VALUES: [QuantValue; 9] = [
    QuantValue::Q8F,
    QuantValue::Q8S,
    QuantValue::Q4F,
    QuantValue::Q4S,
    QuantValue::Q2F,
    QuantValue::Q2S,
    QuantValue::E4M3,
    QuantValue::E5M2,
    QuantValue::E2M1,
];

/// Every scale dtype, in code order.
pub const SCALE_DTYPES: [ScaleDtype; 5] = [
    ScaleDtype::F32,
    ScaleDtype::F16,
    ScaleDtype::BF16,
    ScaleDtype::UE8M0,
    ScaleDtype::UE4M3,
];

/// A dtype as it travels: a tag and, for quantized data, every field of the scheme as a code.
///
/// Codes, not Burn's enums, so that the bytes stay the same whatever Burn's serde derive does.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WireDType {
    /// Which dtype (see [`tag`]).
    pub tag: u8,
    /// Present exactly when `tag` is [`tag::QFLOAT`].
    pub quant: Option<WireQuantScheme>,
}

/// Every field of a `QuantScheme`, as codes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WireQuantScheme {
    /// [`value`] code.
    pub value: u8,
    /// [`store`] code.
    pub store: u8,
    /// The packing dimension, counted from the innermost; 0 for a native store.
    pub packing_dim: u8,
    /// [`mode`] code.
    pub mode: u8,
    /// [`scale`] code of the per-tensor level, [`scale::NONE`] when the scheme stores none.
    pub tensor_scale: u8,
    /// [`scale`] code of the per-block level, [`scale::NONE`] when the scheme has no block level.
    pub block_scale: u8,
    /// The block extents, canonical (no leading 1), empty exactly when there is no block level.
    pub block_size: Vec<u8>,
}

/// Dtype tags.
pub mod tag {
    #![allow(missing_docs)]
    pub const F64: u8 = 1;
    pub const F32: u8 = 2;
    pub const FLEX32: u8 = 3;
    pub const F16: u8 = 4;
    pub const BF16: u8 = 5;
    pub const I64: u8 = 6;
    pub const I32: u8 = 7;
    pub const I16: u8 = 8;
    pub const I8: u8 = 9;
    pub const U64: u8 = 10;
    pub const U32: u8 = 11;
    pub const U16: u8 = 12;
    pub const U8: u8 = 13;
    pub const BOOL_NATIVE: u8 = 14;
    pub const BOOL_U8: u8 = 15;
    pub const BOOL_U32: u8 = 16;
    pub const QFLOAT: u8 = 17;
}

/// `QuantValue` codes.
pub mod value {
    #![allow(missing_docs)]
    pub const Q8F: u8 = 1;
    pub const Q8S: u8 = 2;
    pub const Q4F: u8 = 3;
    pub const Q4S: u8 = 4;
    pub const Q2F: u8 = 5;
    pub const Q2S: u8 = 6;
    pub const E4M3: u8 = 7;
    pub const E5M2: u8 = 8;
    pub const E2M1: u8 = 9;
}

/// `QuantStore` codes.
pub mod store {
    #![allow(missing_docs)]
    pub const NATIVE: u8 = 1;
    pub const PACKED_NATIVE: u8 = 2;
    pub const PACKED_U32: u8 = 3;
}

/// `QuantMode` codes.
pub mod mode {
    #![allow(missing_docs)]
    pub const SYMMETRIC: u8 = 1;
    pub const LOOKUP: u8 = 2;
}

/// `ScaleDtype` codes; [`scale::NONE`] marks an absent level.
pub mod scale {
    #![allow(missing_docs)]
    pub const NONE: u8 = 0;
    pub const F32: u8 = 1;
    pub const F16: u8 = 2;
    pub const BF16: u8 = 3;
    pub const UE8M0: u8 = 4;
    pub const UE4M3: u8 = 5;
}

impl From<DType> for WireDType {
    fn from(dtype: DType) -> Self {
        let plain = |tag| WireDType { tag, quant: None };
        match dtype {
            DType::F64 => plain(tag::F64),
            DType::F32 => plain(tag::F32),
            DType::Flex32 => plain(tag::FLEX32),
            DType::F16 => plain(tag::F16),
            DType::BF16 => plain(tag::BF16),
            DType::I64 => plain(tag::I64),
            DType::I32 => plain(tag::I32),
            DType::I16 => plain(tag::I16),
            DType::I8 => plain(tag::I8),
            DType::U64 => plain(tag::U64),
            DType::U32 => plain(tag::U32),
            DType::U16 => plain(tag::U16),
            DType::U8 => plain(tag::U8),
            DType::Bool(BoolStore::Native) => plain(tag::BOOL_NATIVE),
            DType::Bool(BoolStore::U8) => plain(tag::BOOL_U8),
            DType::Bool(BoolStore::U32) => plain(tag::BOOL_U32),
            DType::QFloat(scheme) => WireDType {
                tag: tag::QFLOAT,
                quant: Some(WireQuantScheme::from(scheme)),
            },
        }
    }
}

impl From<QuantScheme> for WireQuantScheme {
    fn from(scheme: QuantScheme) -> Self {
        let (store, packing_dim) = match scheme.store {
            QuantStore::Native => (store::NATIVE, 0),
            // A packing dim past u8 cannot describe a real tensor (rank is far below 256); it is
            // clamped so that decoding reports it as out of range rather than wrapping.
            QuantStore::PackedNative(dim) => (store::PACKED_NATIVE, clamp_u8(dim)),
            QuantStore::PackedU32(dim) => (store::PACKED_U32, clamp_u8(dim)),
        };
        let block = scheme.block_scale();
        // `tensor_scale()` resolves a scheme that stores no level to a per-tensor f32 scale, yet
        // such a scheme compares unequal to an explicit `per_tensor(F32)`; keep the difference.
        let stores_no_level = block.is_none() && scheme == bare_scheme(&scheme);
        let tensor_scale = if stores_no_level {
            scale::NONE
        } else {
            scheme.tensor_scale().map_or(scale::NONE, scale_code)
        };
        WireQuantScheme {
            value: value_code(scheme.value),
            store,
            packing_dim,
            mode: match scheme.mode {
                QuantMode::Symmetric => mode::SYMMETRIC,
                QuantMode::Lookup => mode::LOOKUP,
            },
            tensor_scale,
            block_scale: block.map_or(scale::NONE, |b| scale_code(b.dtype)),
            block_size: block.map_or_else(Vec::new, |b| b.size.to_vec()),
        }
    }
}

/// The scheme with the same value, store and mode and no scale level stored.
fn bare_scheme(scheme: &QuantScheme) -> QuantScheme {
    QuantScheme::default()
        .with_value(scheme.value)
        .with_store(scheme.store)
        .with_mode(scheme.mode)
}

fn clamp_u8(dim: usize) -> u8 {
    u8::try_from(dim).unwrap_or(u8::MAX)
}

fn value_code(v: QuantValue) -> u8 {
    match v {
        QuantValue::Q8F => value::Q8F,
        QuantValue::Q8S => value::Q8S,
        QuantValue::Q4F => value::Q4F,
        QuantValue::Q4S => value::Q4S,
        QuantValue::Q2F => value::Q2F,
        QuantValue::Q2S => value::Q2S,
        QuantValue::E4M3 => value::E4M3,
        QuantValue::E5M2 => value::E5M2,
        QuantValue::E2M1 => value::E2M1,
    }
}

fn scale_code(d: ScaleDtype) -> u8 {
    match d {
        ScaleDtype::F32 => scale::F32,
        ScaleDtype::F16 => scale::F16,
        ScaleDtype::BF16 => scale::BF16,
        ScaleDtype::UE8M0 => scale::UE8M0,
        ScaleDtype::UE4M3 => scale::UE4M3,
    }
}

fn decode_scale(field: &'static str, code: u8) -> Result<Option<ScaleDtype>, DTypeError> {
    Ok(Some(match code {
        scale::NONE => return Ok(None),
        scale::F32 => ScaleDtype::F32,
        scale::F16 => ScaleDtype::F16,
        scale::BF16 => ScaleDtype::BF16,
        scale::UE8M0 => ScaleDtype::UE8M0,
        scale::UE4M3 => ScaleDtype::UE4M3,
        code => return Err(DTypeError::UnknownCode { field, code }),
    }))
}

impl TryFrom<&WireDType> for DType {
    type Error = DTypeError;

    fn try_from(wire: &WireDType) -> Result<Self, DTypeError> {
        let dtype = match wire.tag {
            tag::F64 => DType::F64,
            tag::F32 => DType::F32,
            tag::FLEX32 => DType::Flex32,
            tag::F16 => DType::F16,
            tag::BF16 => DType::BF16,
            tag::I64 => DType::I64,
            tag::I32 => DType::I32,
            tag::I16 => DType::I16,
            tag::I8 => DType::I8,
            tag::U64 => DType::U64,
            tag::U32 => DType::U32,
            tag::U16 => DType::U16,
            tag::U8 => DType::U8,
            tag::BOOL_NATIVE => DType::Bool(BoolStore::Native),
            tag::BOOL_U8 => DType::Bool(BoolStore::U8),
            tag::BOOL_U32 => DType::Bool(BoolStore::U32),
            tag::QFLOAT => {
                let quant = wire.quant.as_ref().ok_or(DTypeError::MissingScheme)?;
                return Ok(DType::QFloat(QuantScheme::try_from(quant)?));
            }
            code => {
                return Err(DTypeError::UnknownCode {
                    field: "dtype tag",
                    code,
                });
            }
        };
        if wire.quant.is_some() {
            return Err(DTypeError::UnexpectedScheme { tag: wire.tag });
        }
        Ok(dtype)
    }
}

impl TryFrom<&WireQuantScheme> for QuantScheme {
    type Error = DTypeError;

    fn try_from(wire: &WireQuantScheme) -> Result<Self, DTypeError> {
        let value = match wire.value {
            value::Q8F => QuantValue::Q8F,
            value::Q8S => QuantValue::Q8S,
            value::Q4F => QuantValue::Q4F,
            value::Q4S => QuantValue::Q4S,
            value::Q2F => QuantValue::Q2F,
            value::Q2S => QuantValue::Q2S,
            value::E4M3 => QuantValue::E4M3,
            value::E5M2 => QuantValue::E5M2,
            value::E2M1 => QuantValue::E2M1,
            code => {
                return Err(DTypeError::UnknownCode {
                    field: "quant value",
                    code,
                });
            }
        };
        let dim = usize::from(wire.packing_dim);
        let store = match wire.store {
            store::NATIVE if dim == 0 => QuantStore::Native,
            store::NATIVE => return Err(DTypeError::NativeStoreWithPackingDim { dim }),
            store::PACKED_NATIVE => QuantStore::PackedNative(dim),
            store::PACKED_U32 => QuantStore::PackedU32(dim),
            code => {
                return Err(DTypeError::UnknownCode {
                    field: "quant store",
                    code,
                });
            }
        };
        let mode = match wire.mode {
            mode::SYMMETRIC => QuantMode::Symmetric,
            mode::LOOKUP => QuantMode::Lookup,
            code => {
                return Err(DTypeError::UnknownCode {
                    field: "quant mode",
                    code,
                });
            }
        };
        let mut scheme = QuantScheme::default()
            .with_value(value)
            .with_store(store)
            .with_mode(mode);
        if let Some(dtype) = decode_scale("per-tensor scale dtype", wire.tensor_scale)? {
            scheme = scheme.per_tensor(dtype);
        }
        let block_dtype = decode_scale("block scale dtype", wire.block_scale)?;
        match (block_dtype, wire.block_size.as_slice()) {
            (None, []) => {}
            (None, extents) => {
                return Err(DTypeError::BlockSizeWithoutLevel {
                    extents: extents.to_vec(),
                });
            }
            (Some(_), []) => return Err(DTypeError::EmptyBlockSize),
            (Some(dtype), extents) => {
                validate_block_size(extents)?;
                scheme = scheme.per_block(extents, dtype);
            }
        }
        Ok(scheme)
    }
}

/// Checks what `BlockSize::new` would silently fix or divide by: too many dims, a zero extent, or
/// a leading 1 (which Burn drops, so the same block would arrive spelled two ways).
fn validate_block_size(extents: &[u8]) -> Result<(), DTypeError> {
    if extents.len() > MAX_BLOCK_DIMS {
        return Err(DTypeError::BlockTooManyDims {
            dims: extents.len(),
        });
    }
    if extents.contains(&0) {
        return Err(DTypeError::ZeroBlockExtent {
            extents: extents.to_vec(),
        });
    }
    if extents.first() == Some(&1) {
        return Err(DTypeError::NonCanonicalBlockSize {
            extents: extents.to_vec(),
        });
    }
    Ok(())
}

/// A short human-readable name for a dtype, quantization scheme included, for logs and listings.
pub fn dtype_name(dtype: &DType) -> String {
    match dtype {
        DType::QFloat(scheme) => {
            let mut name = format!("qfloat({:?}", scheme.value);
            if scheme.store != QuantStore::Native {
                name.push_str(&format!(", {:?}", scheme.store));
            }
            if scheme.mode != QuantMode::Symmetric {
                name.push_str(&format!(", {:?}", scheme.mode));
            }
            if let Some(block) = scheme.block_scale() {
                name.push_str(&format!(
                    ", block {:?} {:?}",
                    block.size.as_slice(),
                    block.dtype
                ));
            }
            if let Some(tensor) = scheme.tensor_scale() {
                name.push_str(&format!(", tensor {tensor:?}"));
            }
            name.push(')');
            name
        }
        other => other.name().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(dtype: DType) {
        let wire = WireDType::from(dtype);
        let back = DType::try_from(&wire).expect("decodes");
        assert_eq!(back, dtype, "{wire:?}");
    }

    #[test]
    fn every_plain_dtype_round_trips() {
        for dtype in PLAIN_DTYPES {
            round_trip(dtype);
        }
    }

    #[test]
    fn a_scheme_without_levels_stays_distinct_from_explicit_per_tensor_f32() {
        let bare = QuantScheme::default().with_value(QuantValue::Q8S);
        let explicit = bare.per_tensor(ScaleDtype::F32);
        assert_ne!(bare, explicit);
        round_trip(DType::QFloat(bare));
        round_trip(DType::QFloat(explicit));
        assert_ne!(
            WireDType::from(DType::QFloat(bare)),
            WireDType::from(DType::QFloat(explicit))
        );
    }

    #[test]
    fn every_scheme_field_round_trips() {
        let values = [
            QuantValue::Q8F,
            QuantValue::Q8S,
            QuantValue::Q4F,
            QuantValue::Q4S,
            QuantValue::Q2F,
            QuantValue::Q2S,
            QuantValue::E4M3,
            QuantValue::E5M2,
            QuantValue::E2M1,
        ];
        let stores = [
            QuantStore::Native,
            QuantStore::PackedNative(0),
            QuantStore::PackedU32(0),
            QuantStore::PackedU32(2),
        ];
        let scales = [
            ScaleDtype::F32,
            ScaleDtype::F16,
            ScaleDtype::BF16,
            ScaleDtype::UE8M0,
            ScaleDtype::UE4M3,
        ];
        for v in values {
            for s in stores {
                for m in [QuantMode::Symmetric, QuantMode::Lookup] {
                    let base = QuantScheme::default()
                        .with_value(v)
                        .with_store(s)
                        .with_mode(m);
                    round_trip(DType::QFloat(base));
                    for d in scales {
                        round_trip(DType::QFloat(base.per_tensor(d)));
                        round_trip(DType::QFloat(base.per_block([32], d)));
                        round_trip(DType::QFloat(base.per_block([4, 4], d)));
                        round_trip(DType::QFloat(base.per_block([2, 3, 4, 5, 6], d)));
                        round_trip(DType::QFloat(
                            base.per_block([16], d).per_tensor(ScaleDtype::F32),
                        ));
                    }
                }
            }
        }
    }

    fn quant(block_scale: u8, block_size: Vec<u8>) -> WireDType {
        WireDType {
            tag: tag::QFLOAT,
            quant: Some(WireQuantScheme {
                value: value::Q8S,
                store: store::NATIVE,
                packing_dim: 0,
                mode: mode::SYMMETRIC,
                tensor_scale: scale::NONE,
                block_scale,
                block_size,
            }),
        }
    }

    #[test]
    fn bad_codes_are_typed_errors() {
        let unknown = WireDType {
            tag: 200,
            quant: None,
        };
        assert!(matches!(
            DType::try_from(&unknown),
            Err(DTypeError::UnknownCode { code: 200, .. })
        ));
        assert!(matches!(
            DType::try_from(&quant(scale::F32, vec![2, 2, 2, 2, 2, 2])),
            Err(DTypeError::BlockTooManyDims { dims: 6 })
        ));
        assert!(matches!(
            DType::try_from(&quant(scale::F32, vec![4, 0])),
            Err(DTypeError::ZeroBlockExtent { .. })
        ));
        assert!(matches!(
            DType::try_from(&quant(scale::F32, vec![1, 4])),
            Err(DTypeError::NonCanonicalBlockSize { .. })
        ));
        assert!(matches!(
            DType::try_from(&quant(scale::NONE, vec![4])),
            Err(DTypeError::BlockSizeWithoutLevel { .. })
        ));
        assert!(matches!(
            DType::try_from(&quant(scale::F32, vec![])),
            Err(DTypeError::EmptyBlockSize)
        ));
        assert!(matches!(
            DType::try_from(&quant(9, vec![4])),
            Err(DTypeError::UnknownCode { code: 9, .. })
        ));
        let mut q = quant(scale::NONE, vec![]);
        q.tag = tag::F32;
        assert!(matches!(
            DType::try_from(&q),
            Err(DTypeError::UnexpectedScheme { .. })
        ));
    }
}
