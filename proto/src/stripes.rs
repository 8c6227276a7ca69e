//! Stripes: one tensor's content hash (PROTOCOL.md §7.2) computed a piece at a time, so that
//! pieces received apart (over several connections at once) are each hashed while they arrive
//! and merged into the one hash, never read a second time.
//!
//! A stripe is a fixed-length, aligned piece of the hash's *input* (the meta prefix, then the
//! payload), not of the payload: with a power-of-two length of whole BLAKE3 chunks, every stripe
//! but the last is a complete subtree of BLAKE3's tree and the last one is its right edge, so each
//! stripe's chaining value depends on its bytes and its position only, and the tree above them is
//! fixed by the total length (the hazmat API's "fixed power-of-two subtree size" scheme). The
//! wire's ranged fetch (`Request::FetchRange`) counts in the same coordinates, so a node asks for
//! a stripe before it knows the tensor's meta.

use std::ops::Range;

use blake3::hazmat::{ChainingValue, HasherExt, Mode, left_subtree_len};
use blake3::hazmat::{merge_subtrees_non_root, merge_subtrees_root};

use crate::content_hash::ContentHash;
use crate::meta::TensorMeta;
use crate::tensor::content_hash_prefix;

/// A stripe's length in bytes of the hash's input: a power of two of at least one BLAKE3 chunk
/// (1 KiB), so that every stripe is an aligned subtree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct StripeLen(u64);

impl StripeLen {
    /// What a node stripes by unless told otherwise: long enough that asking for a stripe (one
    /// round trip) is under 1% of receiving it at several GB/s, short enough that four
    /// connections share a 128 MiB tensor evenly.
    pub const DEFAULT: StripeLen = StripeLen(16 << 20);

    /// `bytes`, where it is a power of two of at least 1 KiB.
    pub const fn new(bytes: u64) -> Option<StripeLen> {
        if bytes.is_power_of_two() && bytes >= blake3::CHUNK_LEN as u64 {
            Some(StripeLen(bytes))
        } else {
            None
        }
    }

    /// The length in bytes.
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// A tensor's hash input cut into stripes: two or more (a payload that fits one stripe is not
/// striped at all).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StripePlan {
    prefix: Vec<u8>,
    payload_len: u64,
    stripe_len: StripeLen,
}

impl StripePlan {
    /// `meta`'s hash input cut into stripes of `stripe_len`; `None` where one stripe holds it all.
    pub fn new(meta: &TensorMeta, stripe_len: StripeLen) -> Option<StripePlan> {
        let plan = StripePlan {
            prefix: content_hash_prefix(meta),
            payload_len: meta.byte_len() as u64,
            stripe_len,
        };
        (plan.input_len() > stripe_len.get()).then_some(plan)
    }

    /// The stripe length.
    pub fn stripe_len(&self) -> StripeLen {
        self.stripe_len
    }

    /// The hash input's length: prefix and payload. (A payload's length fits a `usize`, and the
    /// prefix is at most 149 bytes, so this does not overflow.)
    fn input_len(&self) -> u64 {
        self.prefix.len() as u64 + self.payload_len
    }

    /// How many stripes: at least two.
    pub fn count(&self) -> usize {
        self.input_len().div_ceil(self.stripe_len.get()) as usize
    }

    /// Stripe `index`'s place in the hash input.
    pub fn input_range(&self, index: usize) -> Range<u64> {
        let len = self.stripe_len.get();
        let start = (index as u64).saturating_mul(len).min(self.input_len());
        start..start.saturating_add(len).min(self.input_len())
    }

    /// Stripe `index`'s place in the payload (the first stripe begins with the prefix, so its
    /// payload part is shorter).
    pub fn payload_range(&self, index: usize) -> Range<u64> {
        payload_part(
            self.prefix.len() as u64,
            self.payload_len,
            self.input_range(index),
        )
    }

    /// A hasher for stripe `index`, fed its payload part in order.
    pub fn hasher(&self, index: usize) -> StripeHasher {
        let mut hasher = blake3::Hasher::new();
        if index == 0 {
            hasher.update(&self.prefix);
        } else {
            hasher.set_input_offset(self.input_range(index).start);
        }
        StripeHasher { hasher }
    }

    /// The content hash, from every stripe's chaining value in stripe order; `None` unless there
    /// is one for each stripe.
    pub fn merge(&self, stripes: &[StripeDigest]) -> Option<ContentHash> {
        if stripes.len() != self.count() {
            return None;
        }
        // Two stripes or more: the root has two children, each a subtree of whole stripes.
        let total = self.input_len();
        let left = left_subtree_len(total);
        let hash = merge_subtrees_root(
            &self.subtree(stripes, 0, left),
            &self.subtree(stripes, left, total - left),
            Mode::Hash,
        );
        Some(hash.into())
    }

    /// The chaining value of the subtree over input bytes `start..start + len`. Every split of a
    /// subtree longer than a stripe is a power of two no shorter than one (so it falls on a stripe
    /// boundary), and a subtree no longer than a stripe is exactly one stripe.
    fn subtree(&self, stripes: &[StripeDigest], start: u64, len: u64) -> ChainingValue {
        let stripe = self.stripe_len.get();
        if len <= stripe {
            return stripes[(start / stripe) as usize].0;
        }
        let left = left_subtree_len(len);
        merge_subtrees_non_root(
            &self.subtree(stripes, start, left),
            &self.subtree(stripes, start + left, len - left),
            Mode::Hash,
        )
    }
}

/// The payload bytes of the hash input's range `input` for a prefix of `prefix` bytes and a
/// payload of `payload_len`: clamped to the payload, empty where `input` lies in the prefix or
/// past the end, and `start <= end` whatever `input` is (a range a peer asked for may be any).
pub fn payload_part(prefix: u64, payload_len: u64, input: Range<u64>) -> Range<u64> {
    let start = input.start.saturating_sub(prefix).min(payload_len);
    let end = input.end.saturating_sub(prefix).min(payload_len).max(start);
    start..end
}

/// One stripe's hash while its payload part arrives.
#[derive(Debug, Clone)]
pub struct StripeHasher {
    hasher: blake3::Hasher,
}

impl StripeHasher {
    /// Feeds the next bytes of the stripe's payload part.
    pub fn update(&mut self, bytes: &[u8]) {
        self.hasher.update(bytes);
    }

    /// The stripe's chaining value, once all of its part was fed.
    pub fn finish(&self) -> StripeDigest {
        StripeDigest(self.hasher.finalize_non_root())
    }
}

/// A stripe's chaining value: what [`StripePlan::merge`] joins into the content hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StripeDigest(ChainingValue);

#[cfg(test)]
mod tests {
    use burn_std::{DType, QuantScheme};

    use super::*;
    use crate::tensor::content_hash;

    fn striped_hash(meta: &TensorMeta, payload: &[u8], len: StripeLen) -> Option<ContentHash> {
        let plan = StripePlan::new(meta, len)?;
        let digests: Vec<StripeDigest> = (0..plan.count())
            .map(|i| {
                let part = plan.payload_range(i);
                let mut hasher = plan.hasher(i);
                // Fed in two pieces: a stripe's hash does not depend on how its bytes came.
                let mid = (part.start + part.end) / 2;
                hasher.update(&payload[part.start as usize..mid as usize]);
                hasher.update(&payload[mid as usize..part.end as usize]);
                hasher.finish()
            })
            .collect();
        plan.merge(&digests)
    }

    /// For payload lengths around every stripe and tree boundary, prefixes of several lengths
    /// (rank 0 to 5, a quantized scheme) and stripe lengths from one chunk up, the stripes merge
    /// into exactly the content hash computed in one go.
    #[test]
    fn stripes_merge_into_the_content_hash() {
        let dtypes = [
            DType::U8,
            DType::QFloat(
                QuantScheme::default().with_value(burn_std::quantization::QuantValue::Q8S),
            ),
        ];
        let mut checked = 0;
        for stripe in [1024u64, 2048, 8192] {
            let len = StripeLen::new(stripe).unwrap();
            for dtype in dtypes {
                for rank in [1usize, 2, 5] {
                    for total in [
                        stripe - 1,
                        stripe,
                        stripe + 1,
                        2 * stripe,
                        3 * stripe - 7,
                        3 * stripe,
                        4 * stripe + 1,
                        7 * stripe + 513,
                        9 * stripe,
                        16 * stripe + 1024,
                    ] {
                        let Some((meta, payload)) = payload_of(dtype, rank, total) else {
                            continue;
                        };
                        let whole = content_hash(&meta, &payload);
                        let input = content_hash_prefix(&meta).len() as u64 + payload.len() as u64;
                        match striped_hash(&meta, &payload, len) {
                            Some(hash) => {
                                assert_eq!(
                                    hash, whole,
                                    "{dtype:?} rank {rank}, {total} B / {stripe}"
                                );
                                checked += 1;
                            }
                            None => assert!(input <= stripe, "{input} > {stripe} not striped"),
                        }
                    }
                }
            }
        }
        assert!(checked > 100, "{checked}");
    }

    /// A tensor of `dtype` and rank `rank` whose payload is about `target` bytes (exactly, for a
    /// byte dtype), filled with a pattern; `None` where the meta is refused.
    fn payload_of(dtype: DType, rank: usize, target: u64) -> Option<(TensorMeta, Vec<u8>)> {
        let n = target as usize;
        let mut shape = vec![1; rank];
        shape[rank - 1] = n;
        let meta = TensorMeta::new(shape, dtype).ok()?;
        let payload = (0..meta.byte_len()).map(|i| (i * 31 % 251) as u8).collect();
        Some((meta, payload))
    }

    #[test]
    fn a_stripe_length_is_a_power_of_two_of_whole_chunks() {
        assert_eq!(StripeLen::new(1024).map(StripeLen::get), Some(1024));
        assert_eq!(StripeLen::new(16 << 20), Some(StripeLen::DEFAULT));
        for bad in [0, 1, 512, 1000, 3072, (16 << 20) + 1] {
            assert_eq!(StripeLen::new(bad), None, "{bad}");
        }
    }

    #[test]
    fn payload_parts_are_clamped_whatever_is_asked() {
        assert_eq!(payload_part(20, 100, 0..50), 0..30);
        assert_eq!(payload_part(20, 100, 10..15), 0..0);
        assert_eq!(payload_part(20, 100, 50..500), 30..100);
        // A range a peer sent backwards is the empty one at its start.
        let (from, to) = (90, 40);
        assert_eq!(payload_part(20, 100, from..to), 70..70);
        assert_eq!(payload_part(20, 100, u64::MAX - 1..u64::MAX), 100..100);
    }

    /// The stripes cover the payload exactly, in order, without overlap.
    #[test]
    fn stripes_tile_the_payload() {
        let meta = TensorMeta::new(vec![3, 5000], DType::F32).unwrap();
        let plan = StripePlan::new(&meta, StripeLen::new(4096).unwrap()).unwrap();
        let mut next = 0;
        for i in 0..plan.count() {
            let part = plan.payload_range(i);
            assert_eq!(part.start, next);
            assert!(part.end > part.start);
            next = part.end;
        }
        assert_eq!(next, meta.byte_len() as u64);
        assert_eq!(plan.merge(&[]), None);
    }
}
