//! `TensorData` to (meta, payload) and back, and the content hash of a tensor.

use burn_std::{Bytes, DType, TensorData};

use crate::content_hash::ContentHash;
use crate::dtype::dtype_name;
use crate::error::MetaError;
use crate::meta::TensorMeta;

/// The meta of `data`, checked against the byte-length rule (data read from a file or built by
/// hand can be inconsistent; Burn does not check quantized lengths).
pub fn meta_of(data: &TensorData) -> Result<TensorMeta, MetaError> {
    let meta = TensorMeta::with_byte_len(
        data.shape().as_slice().to_vec(),
        data.dtype(),
        data.bytes().len() as u64,
    )?;
    crate::scales::check_scales(&meta, data.as_bytes())?;
    Ok(meta)
}

/// The meta of a payload of `dtype` and `shape` that lies in `parts` (laid end to end: a
/// quantized tensor's values and its scales, kept apart by the backend), checked as
/// [`meta_of`] checks a whole one, without joining the values: the bytes at the end that hold
/// the scales it checks (none for F32 scales) are read where they lie, and gathered only where
/// they span two parts.
pub fn meta_of_parts(
    shape: Vec<usize>,
    dtype: DType,
    parts: &[&[u8]],
) -> Result<TensorMeta, MetaError> {
    let Some(total) = parts
        .iter()
        .try_fold(0u64, |sum, p| sum.checked_add(p.len() as u64))
    else {
        return Err(MetaError::SizeOverflow {
            dtype: dtype_name(&dtype),
            shape,
        });
    };
    let meta = TensorMeta::with_byte_len(shape, dtype, total)?;
    let total = meta.byte_len();
    let tail_len = crate::scales::checked_tail_len(&meta)?.min(total);
    crate::scales::check_scales(&meta, &last_bytes(parts, total, tail_len))?;
    Ok(meta)
}

/// The last `len` bytes of `parts` laid end to end (`total` bytes; at most all of them): where
/// they lie in the last part, that part's own; joined otherwise.
fn last_bytes<'a>(parts: &[&'a [u8]], total: usize, len: usize) -> std::borrow::Cow<'a, [u8]> {
    if let Some(last) = parts.last()
        && let Some(start) = last.len().checked_sub(len)
    {
        return std::borrow::Cow::Borrowed(&last[start..]);
    }
    let mut skip = total.saturating_sub(len);
    let mut tail = Vec::with_capacity(len.min(total));
    for part in parts {
        match part.get(skip..) {
            Some(rest) => {
                tail.extend_from_slice(rest);
                skip = 0;
            }
            None => skip -= part.len(),
        }
    }
    std::borrow::Cow::Owned(tail)
}

/// Splits `data` into its checked meta and its payload, without copying the payload.
pub fn into_parts(data: TensorData) -> Result<(TensorMeta, Bytes), MetaError> {
    let meta = meta_of(&data)?;
    Ok((meta, data.into_bytes()))
}

/// Rebuilds a `TensorData` from a meta and a payload of exactly `meta.byte_len()` bytes, without
/// copying the payload.
pub fn from_parts(meta: &TensorMeta, payload: Bytes) -> Result<TensorData, MetaError> {
    if payload.len() != meta.byte_len() {
        return Err(MetaError::ByteLenMismatch {
            shape: meta.shape().to_vec(),
            dtype: dtype_name(&meta.dtype()),
            expected: meta.byte_len() as u64,
            actual: payload.len() as u64,
        });
    }
    crate::scales::check_scales(meta, &payload)?;
    TensorData::try_from_bytes(payload, meta.shape().to_vec(), meta.dtype()).map_err(|_| {
        MetaError::ByteLenMismatch {
            shape: meta.shape().to_vec(),
            dtype: dtype_name(&meta.dtype()),
            expected: meta.byte_len() as u64,
            actual: meta.byte_len() as u64,
        }
    })
}

/// The content hash of a tensor: BLAKE3 (hex) over its dtype codes, its shape and its bytes, so
/// that two tensors hash alike only when `into_data` would give the same dtype, shape and bytes
/// (two empty tensors of different dtypes do not).
pub fn content_hash(meta: &TensorMeta, payload: &[u8]) -> ContentHash {
    let mut hasher = content_hasher(meta);
    hash_more(&mut hasher, payload);
    hasher.finalize().into()
}

/// Pieces at least this large are hashed over ferry's hashing threads, one per core; smaller
/// ones on the calling thread, where handing them out would cost more than it saves.
pub const PARALLEL_HASH_MIN: usize = 1 << 20;

/// The threads content hashes spread over, one per core: ferry's own pool, not rayon's global
/// one, so that a backend's or an application's rayon work (Burn's CPU backends use the global
/// pool) neither delays a hash nor is delayed by one. `None` on one core, or where the threads
/// could not be started: hashes then run on the calling thread, as they would anyway.
fn hashing_threads() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        if cores < 2 {
            return None;
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(cores)
            .thread_name(|i| format!("ferry-hash-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// Feeds `bytes` to a content hasher: over the hashing threads where they are
/// [`PARALLEL_HASH_MIN`] or more (BLAKE3 hashes a large input's subtrees independently, and the
/// hash is the same), on the calling thread otherwise. The caller waits until they are hashed.
pub fn hash_more(hasher: &mut blake3::Hasher, bytes: &[u8]) {
    match hashing_threads() {
        Some(pool) if bytes.len() >= PARALLEL_HASH_MIN => {
            pool.install(|| {
                hasher.update_rayon(bytes);
            });
        }
        _ => {
            hasher.update(bytes);
        }
    }
}

/// [`content_hash`] of a payload that lies in several slices laid end to end, hashed a few MiB at
/// a time; `None` as soon as `stop` returns true (asked between pieces), for a hash nobody needs
/// any more.
pub fn content_hash_parts(
    meta: &TensorMeta,
    parts: &[&[u8]],
    stop: impl Fn() -> bool,
) -> Option<ContentHash> {
    const PIECE: usize = 4 << 20;
    let mut hasher = content_hasher(meta);
    for part in parts {
        for piece in part.chunks(PIECE) {
            if stop() {
                return None;
            }
            hash_more(&mut hasher, piece);
        }
    }
    Some(hasher.finalize().into())
}

/// A BLAKE3 hasher primed with `meta`'s part of the content hash; feed it the payload in order.
pub fn content_hasher(meta: &TensorMeta) -> blake3::Hasher {
    let mut hasher = blake3::Hasher::new();
    hasher.update(&content_hash_prefix(meta));
    hasher
}

/// `meta`'s part of the content hash's input, which the payload follows (PROTOCOL.md §7.2): the
/// dtype tag, a quantized dtype's scheme codes and block extents, the rank and each dimension.
/// At most 1 + 7 + 5 + 8 + 16 × 8 = 149 bytes.
pub fn content_hash_prefix(meta: &TensorMeta) -> Vec<u8> {
    let wire = crate::WireDType::from(meta.dtype());
    let mut prefix = Vec::with_capacity(16 + 8 * meta.shape().len());
    prefix.push(wire.tag);
    if let Some(q) = &wire.quant {
        prefix.extend_from_slice(&[
            q.value,
            q.store,
            q.packing_dim,
            q.mode,
            q.tensor_scale,
            q.block_scale,
            q.block_size.len() as u8,
        ]);
        prefix.extend_from_slice(&q.block_size);
    }
    prefix.extend_from_slice(&(meta.shape().len() as u64).to_le_bytes());
    for &dim in meta.shape() {
        prefix.extend_from_slice(&(dim as u64).to_le_bytes());
    }
    prefix
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A payload checked in parts, split anywhere (the scales across the split included), is
    /// checked exactly as the whole: the same meta, or the same refusal.
    #[test]
    fn a_payload_in_parts_is_checked_as_the_whole_wherever_it_is_split() {
        use burn_std::quantization::{QuantScheme, QuantStore, QuantValue, ScaleDtype};
        let scheme = QuantScheme::default()
            .with_value(QuantValue::Q8S)
            .with_store(QuantStore::Native)
            .per_block([16], ScaleDtype::BF16);
        let dtype = DType::QFloat(scheme);
        // A canonical BF16 scale (1.0), and a NaN code Burn would change.
        for code in [0x3f80u16, 0x7f81] {
            let mut payload = vec![1u8; 32];
            payload.extend_from_slice(&code.to_le_bytes());
            payload.extend_from_slice(&code.to_le_bytes());
            let whole = TensorData::from_bytes_vec(payload.clone(), [2, 16], dtype);
            let want = meta_of(&whole);
            assert_eq!(want.is_ok(), code == 0x3f80, "code {code:#x}");
            for first in 0..=payload.len() {
                for second in first..=payload.len() {
                    let parts = [
                        &payload[..first],
                        &payload[first..second],
                        &payload[second..],
                    ];
                    let got = meta_of_parts(vec![2, 16], dtype, &parts);
                    assert_eq!(got, want, "code {code:#x}, split at {first} and {second}");
                }
            }
        }
        // A length the shape does not have is refused as for a whole payload.
        let short = [&[0u8; 10][..], &[0u8; 3][..]];
        assert!(matches!(
            meta_of_parts(vec![4], DType::F32, &short),
            Err(MetaError::ByteLenMismatch { actual: 13, .. })
        ));
    }

    /// Hashed on every free core or on one, a payload hashes the same: BLAKE3's tree, not the
    /// threads, decides the hash (here after a prefix that is no multiple of its chunks).
    #[test]
    fn a_large_piece_hashed_in_parallel_hashes_as_on_one_thread() {
        let bytes: Vec<u8> = (0..3 * PARALLEL_HASH_MIN + 12_345)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let mut one = blake3::Hasher::new();
        one.update(b"prefix of 17 bytes");
        let mut many = one.clone();
        one.update(&bytes);
        hash_more(&mut many, &bytes);
        assert_eq!(one.finalize(), many.finalize());
    }

    #[test]
    fn a_payload_in_parts_hashes_as_one_and_a_stop_stops() {
        let data = TensorData::new(
            (0..3_000_000).map(|i| i as f32).collect::<Vec<_>>(),
            [3_000_000],
        );
        let (meta, payload) = into_parts(data).unwrap();
        let (head, tail) = payload.split_at(5_000_001);
        let whole = content_hash(&meta, &payload);
        assert_eq!(
            content_hash_parts(&meta, &[head, tail], || false),
            Some(whole)
        );
        assert_eq!(
            content_hash_parts(&meta, &[&payload[..]], || false),
            Some(whole)
        );
        assert_eq!(content_hash_parts(&meta, &[&payload[..]], || true), None);
    }
}
