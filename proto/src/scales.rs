//! Which stored quantization scales come back from Burn byte for byte.
//!
//! Burn keeps a quantized tensor's scales as `f32` and encodes them again when the tensor is
//! read out, so a stored scale survives only if its encoding is the one Burn's encoder gives for
//! the value it decodes to. Some encodings are not (several NaN codes of an 8-bit float, say):
//! a node would register such a tensor and later hand back other bytes. A payload with one is
//! refused instead. Which codes are canonical is asked of Burn itself, once per scale dtype.

use std::sync::OnceLock;

use burn_std::quantization::{
    QuantScheme, QuantStore, QuantValue, QuantizedBytes, ScaleDtype, global_scale_dtype,
};
use burn_std::{Bytes, DType};

use crate::dtype::dtype_name;
use crate::error::MetaError;
use crate::meta::TensorMeta;

/// For each code of a one- or two-byte scale dtype, whether Burn encodes back to it.
struct Canonical {
    width: usize,
    codes: Vec<bool>,
}

fn width(dtype: ScaleDtype) -> usize {
    match dtype {
        ScaleDtype::F32 => 4,
        ScaleDtype::F16 | ScaleDtype::BF16 => 2,
        ScaleDtype::UE8M0 | ScaleDtype::UE4M3 => 1,
    }
}

/// Decodes one stored scale `code` of `dtype` the way Burn reads a quantized tensor, and encodes
/// the value back the way Burn writes one. Asked of a one-element Q8S tensor with a per-tensor
/// scale of that dtype: Burn decodes and encodes scales by their dtype alone, whatever the
/// values or the store (and its readers do not support every store).
fn round_trip(dtype: ScaleDtype, code: &[u8]) -> Option<Vec<u8>> {
    let scheme = QuantScheme::default()
        .with_value(QuantValue::Q8S)
        .with_store(QuantStore::Native)
        .per_tensor(dtype);
    let mut stored = vec![0u8];
    stored.extend_from_slice(code);
    std::panic::catch_unwind(move || {
        let (_, decoded) = QuantizedBytes {
            bytes: Bytes::from_bytes_vec(stored),
            scheme,
            shape: [1].into(),
        }
        .into_vec_i8();
        let encoded = QuantizedBytes::new(vec![0i8], [1], scheme, &decoded.block, None).bytes;
        encoded.get(1..1 + code.len()).map(<[u8]>::to_vec)
    })
    .ok()
    .flatten()
}

fn table(scheme: &QuantScheme) -> Option<&'static Canonical> {
    static ONE_BYTE: [OnceLock<Canonical>; 2] = [OnceLock::new(), OnceLock::new()];
    static TWO_BYTE: [OnceLock<Canonical>; 2] = [OnceLock::new(), OnceLock::new()];
    let dtype = scheme.scale_dtype();
    let slot = match dtype {
        ScaleDtype::F32 => return None,
        ScaleDtype::UE8M0 => &ONE_BYTE[0],
        ScaleDtype::UE4M3 => &ONE_BYTE[1],
        ScaleDtype::F16 => &TWO_BYTE[0],
        ScaleDtype::BF16 => &TWO_BYTE[1],
    };
    Some(slot.get_or_init(move || {
        let width = width(dtype);
        let codes = (0..1usize << (8 * width))
            .map(|code| {
                let bytes = &code.to_ne_bytes()[..width];
                round_trip(dtype, bytes).is_some_and(|back| back == bytes)
            })
            .collect();
        Canonical { width, codes }
    }))
}

/// How many bytes at a payload's end [`check_scales`] reads: the scales whose encodings it
/// checks, and after them a two-level scheme's per-tensor scale (0 where nothing is checked).
pub fn checked_tail_len(meta: &TensorMeta) -> Result<usize, MetaError> {
    let DType::QFloat(scheme) = meta.dtype() else {
        return Ok(0);
    };
    let Some(canonical) = table(&scheme) else {
        return Ok(0);
    };
    let global = if global_scale_dtype(&scheme).is_some() {
        4
    } else {
        0
    };
    let count = crate::meta::scale_count(meta.shape(), &scheme)?;
    Ok(count.saturating_mul(canonical.width).saturating_add(global))
}

/// Checks that every block (or per-tensor) scale stored in `payload` is an encoding Burn gives
/// back unchanged. `payload` has the length the meta declares. F32 scales (and the per-tensor
/// scale of a two-level scheme, always F32) need no check: they round-trip bit for bit.
pub fn check_scales(meta: &TensorMeta, payload: &[u8]) -> Result<(), MetaError> {
    let DType::QFloat(scheme) = meta.dtype() else {
        return Ok(());
    };
    let Some(canonical) = table(&scheme) else {
        return Ok(());
    };
    let global = if global_scale_dtype(&scheme).is_some() {
        4
    } else {
        0
    };
    let count = crate::meta::scale_count(meta.shape(), &scheme)?;
    let scales_len = count.saturating_mul(canonical.width);
    let end = payload.len().saturating_sub(global);
    let start = end.saturating_sub(scales_len);
    let scales = payload.get(start..end).unwrap_or_default();
    for (index, code) in scales.chunks_exact(canonical.width).enumerate() {
        let mut word = [0u8; std::mem::size_of::<usize>()];
        word[..code.len()].copy_from_slice(code);
        let value = usize::from_ne_bytes(word);
        if !canonical.codes.get(value).copied().unwrap_or(false) {
            return Err(MetaError::NonCanonicalScale {
                dtype: dtype_name(&meta.dtype()),
                index: index as u64,
                code: code.to_vec(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tables do not depend on which scheme asked first: a packed E2M1 scheme (whose values
    /// Burn cannot unpack on the host) asking first must not spoil UE4M3 for everyone after.
    #[test]
    fn the_tables_are_the_scale_dtypes_own() {
        let packed = QuantScheme::default()
            .with_value(QuantValue::E2M1)
            .with_store(QuantStore::PackedU32(0))
            .per_block([16], ScaleDtype::UE4M3);
        let table = table(&packed).expect("a one-byte dtype");
        assert_eq!(table.codes.len(), 256);
        let canonical = table.codes.iter().filter(|&&c| c).count();
        assert!(canonical >= 254, "{canonical} canonical UE4M3 codes");
        // 1.0 in UE4M3 (exponent bias 7): 0_0111_000.
        assert!(table.codes[0x38]);
    }
}
