//! What a device stores bit-exact, measured by the device itself: the probe matrix, the probe,
//! and the [`HoldsTable`] that decides what a put or copy to the device accepts.
//!
//! Burn's backends fail by panicking, and their own `dtype_usage` answers are not what they
//! really store (Flex reports nothing for `Flex32`, which it holds exactly; NdArray reports
//! `Flex32` as supported, and panics on it; a GPU backend depends on its adapter). So each device
//! worker, at start, round-trips small tensors of every plain dtype and of every quantization
//! scheme family (value type, store, mode and scale levels: a block's size changes where blocks
//! fall, not what a backend keeps) through `from_data` and `into_data`, one per class of shape
//! ([`ShapeClass`]: a GPU backend that holds an f64 matrix may still fail on an f64 scalar, and
//! one that holds 8-bit values in whole 32-bit words fails on a partial last word), and records
//! which come back with the same dtype, shape and bytes. The table is kept per backend and adapter for the
//! life of the process: the same code on the same adapter answers the same.
//!
//! Quantized probe tensors are made by Flex (`quantize_dynamic`, then `q_into_data`): their bytes
//! are what a Burn user hands to ferry. Schemes in a packed store are not probed (Flex makes
//! native stores only), so no device accepts them: the CPU backends re-pack them anyway.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use burn_backend::quantization::{
    QuantMode, QuantScheme, QuantStore, QuantValue, ScaleDtype, quantizable,
};
use burn_backend::{Backend, DType, TensorData};
use ferry_proto::dtype::{PLAIN_DTYPES, QUANT_VALUES, SCALE_DTYPES};
use ferry_proto::dtype_name;

use crate::backend::{Primitive, contain};

/// What the probe keys a dtype by: a plain dtype as it is, a quantized one by its scheme with the
/// block's size left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HoldsKey {
    /// A plain dtype.
    Plain(DType),
    /// A quantization scheme family.
    Quantized(SchemeFamily),
}

/// A quantization scheme without its block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SchemeFamily {
    value: QuantValue,
    store: QuantStore,
    mode: QuantMode,
    levels: Levels,
}

/// A scheme's scale levels, as stored (a scheme that stores none is its own family: Burn keeps
/// it distinct from an explicit per-tensor F32 scale).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Levels {
    None,
    Tensor(ScaleDtype),
    Block(ScaleDtype),
    BlockAndTensor {
        block: ScaleDtype,
        tensor: ScaleDtype,
    },
}

/// The classes of shape a backend may treat differently; each key is probed on one of each.
/// (A GPU backend packs 8-bit quantized values four to a 32-bit word and fails to read back a
/// count that does not fill its last word, while it holds the same dtype on whole words.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ShapeClass {
    /// Rank 0.
    Scalar,
    /// Some dimension is 0.
    Empty,
    /// A number of elements that is a multiple of [`WHOLE_WORDS`], and, for a block scheme,
    /// block scales that fill whole 32-bit words (a GPU keeps them in a buffer of their own).
    Whole,
    /// Any other number of elements.
    Ragged,
}

/// Elements that fill whole 32-bit words at every packing Burn has (2-bit values: 16 a word).
pub const WHOLE_WORDS: usize = 16;

/// Whether a block scheme's scales on `shape` fill whole 32-bit words (true without a block
/// level: a per-tensor scale is one value whatever the shape, and every probe has one). A block
/// extent of 0, which validation refuses before this is asked, counts as not.
fn block_scales_fill_words(scheme: &QuantScheme, shape: &[usize]) -> bool {
    let Some(block) = scheme.block_scale() else {
        return true;
    };
    let extents = block.size.to_dim_vec(shape.len());
    let blocks = shape
        .iter()
        .zip(extents)
        .try_fold(1usize, |n, (&dim, extent)| {
            (extent != 0).then(|| n.checked_mul(dim.div_ceil(usize::from(extent))))?
        });
    let width = match block.dtype {
        ScaleDtype::F32 => 4,
        ScaleDtype::F16 | ScaleDtype::BF16 => 2,
        ScaleDtype::UE8M0 | ScaleDtype::UE4M3 => 1,
    };
    blocks
        .and_then(|blocks| blocks.checked_mul(width))
        .is_some_and(|bytes| bytes % 4 == 0)
}

impl ShapeClass {
    /// The class of a tensor of `dtype` on `shape`.
    pub fn of(dtype: &DType, shape: &[usize]) -> ShapeClass {
        let whole_values = || {
            shape
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .is_some_and(|n| n % WHOLE_WORDS == 0)
        };
        let whole_scales = || match dtype {
            DType::QFloat(scheme) => block_scales_fill_words(scheme, shape),
            _ => true,
        };
        if shape.is_empty() {
            ShapeClass::Scalar
        } else if shape.contains(&0) {
            ShapeClass::Empty
        } else if whole_values() && whole_scales() {
            ShapeClass::Whole
        } else {
            ShapeClass::Ragged
        }
    }

    const ALL: [ShapeClass; 4] = [
        ShapeClass::Scalar,
        ShapeClass::Empty,
        ShapeClass::Whole,
        ShapeClass::Ragged,
    ];

    /// The shape a probe of this class is made on, and the block a block scheme's probe uses
    /// there (whole blocks of it).
    fn probe_shape(self, quantized: bool) -> (Vec<usize>, [u8; 1]) {
        match (self, quantized) {
            (ShapeClass::Scalar, _) => (vec![], [16]),
            (ShapeClass::Empty, false) => (vec![0, 3], [16]),
            (ShapeClass::Empty, true) => (vec![0, 64], [16]),
            (ShapeClass::Whole, false) => (vec![4, 8], [16]),
            (ShapeClass::Whole, true) => (vec![8, 64], [16]),
            (ShapeClass::Ragged, _) => (vec![3, 5], [5]),
        }
    }
}

impl HoldsKey {
    /// The key `dtype` is looked up under.
    pub fn of(dtype: &DType) -> HoldsKey {
        let DType::QFloat(scheme) = dtype else {
            return HoldsKey::Plain(*dtype);
        };
        let bare = QuantScheme::default()
            .with_value(scheme.value)
            .with_store(scheme.store)
            .with_mode(scheme.mode);
        let levels = match (scheme.block_scale(), scheme.tensor_scale()) {
            _ if *scheme == bare => Levels::None,
            (Some(block), Some(tensor)) => Levels::BlockAndTensor {
                block: block.dtype,
                tensor,
            },
            (Some(block), None) => Levels::Block(block.dtype),
            (None, tensor) => Levels::Tensor(tensor.unwrap_or(ScaleDtype::F32)),
        };
        HoldsKey::Quantized(SchemeFamily {
            value: scheme.value,
            store: scheme.store,
            mode: scheme.mode,
            levels,
        })
    }

    /// The dtype a probe of this key is made with, with `block` for a block level.
    fn probe_dtype(&self, block: [u8; 1]) -> DType {
        match *self {
            HoldsKey::Plain(dtype) => dtype,
            HoldsKey::Quantized(family) => {
                let bare = QuantScheme::default()
                    .with_value(family.value)
                    .with_store(family.store)
                    .with_mode(family.mode);
                DType::QFloat(match family.levels {
                    Levels::None => bare,
                    Levels::Tensor(scale) => bare.per_tensor(scale),
                    Levels::Block(scale) => bare.per_block(block, scale),
                    Levels::BlockAndTensor {
                        block: scale,
                        tensor,
                    } => bare.per_block(block, scale).per_tensor(tensor),
                })
            }
        }
    }
}

/// Every key the probe measures: every plain dtype, and every scheme family in a native store
/// that Burn can quantize.
fn probe_keys() -> Vec<HoldsKey> {
    let mut keys: Vec<HoldsKey> = PLAIN_DTYPES.iter().map(|d| HoldsKey::Plain(*d)).collect();
    let mut levels = vec![Levels::None];
    levels.extend(SCALE_DTYPES.map(Levels::Tensor));
    levels.extend(SCALE_DTYPES.map(Levels::Block));
    for block in SCALE_DTYPES {
        for tensor in SCALE_DTYPES {
            levels.push(Levels::BlockAndTensor { block, tensor });
        }
    }
    for value in QUANT_VALUES {
        for mode in [QuantMode::Symmetric, QuantMode::Lookup] {
            for &levels in &levels {
                let key = HoldsKey::Quantized(SchemeFamily {
                    value,
                    store: QuantStore::Native,
                    mode,
                    levels,
                });
                if matches!(key.probe_dtype([16]), DType::QFloat(scheme) if quantizable(&scheme)) {
                    keys.push(key);
                }
            }
        }
    }
    keys
}

/// A probe tensor: what to round-trip for a key on a class of shape, or why none could be made.
struct Probe {
    key: HoldsKey,
    class: ShapeClass,
    dtype: DType,
    shape: Vec<usize>,
    data: Result<TensorData, String>,
}

/// The probe tensors, made once per process.
fn probes() -> &'static [Probe] {
    static PROBES: OnceLock<Vec<Probe>> = OnceLock::new();
    PROBES.get_or_init(|| {
        probe_keys()
            .into_iter()
            .flat_map(|key| {
                ShapeClass::ALL.map(|class| {
                    let quantized = matches!(key, HoldsKey::Quantized(_));
                    let (shape, block) = class.probe_shape(quantized);
                    let dtype = key.probe_dtype(block);
                    let data = probe_tensor(&dtype, &shape);
                    Probe {
                        key,
                        class,
                        dtype,
                        shape,
                        data,
                    }
                })
            })
            .collect()
    })
}

/// Every probe tensor that could be made (every plain dtype and every scheme family in a native
/// store, on one shape of each class): a dtype matrix for tests (ferry-server's own).
pub fn probe_tensors() -> impl Iterator<Item = &'static TensorData> {
    probes().iter().filter_map(|probe| probe.data.as_ref().ok())
}

/// Deterministic bytes (xorshift), so that every run probes the same tensors.
fn pattern(len: usize, mut state: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// A probe tensor of `dtype`. Floats are arbitrary bit patterns (NaN payloads, infinities,
/// subnormals and -0.0 among them: a backend that canonicalizes any of them does not hold the
/// dtype bit-exact); booleans are 0 and 1 in their store; quantized tensors come from Flex.
fn probe_tensor(dtype: &DType, shape: &[usize]) -> Result<TensorData, String> {
    use burn_backend::BoolStore;
    let n: usize = shape.iter().product();
    let shape = shape.to_vec();
    let bools = |width: usize| -> Vec<u8> {
        (0..n)
            .flat_map(|i| {
                let mut value = vec![0u8; width];
                value[0] = (i % 3 == 0) as u8;
                value
            })
            .collect()
    };
    let bytes = match dtype {
        DType::QFloat(scheme) => return quantized_probe(scheme, shape),
        DType::Bool(BoolStore::Native) | DType::Bool(BoolStore::U8) => bools(1),
        DType::Bool(BoolStore::U32) => bools(4),
        other => pattern(n * other.size(), 0x9e37_79b9_7f4a_7c15),
    };
    Ok(TensorData::from_bytes_vec(bytes, shape, *dtype))
}

/// A tensor quantized by Flex with `scheme`, as Flex's `q_into_data` gives it; `Err` says why
/// Flex could not make one, for a person.
pub fn quantized_probe(scheme: &QuantScheme, shape: Vec<usize>) -> Result<TensorData, String> {
    use burn_backend::ops::{FloatTensorOps, QTensorOps};
    use burn_flex::{Flex, FlexDevice};
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let scheme = *scheme;
    contain("making a probe tensor with Flex", move || {
        let float = TensorData::new(values, shape);
        let tensor = Flex::float_from_data(float, &FlexDevice);
        let q = Flex::quantize_dynamic(tensor, &scheme);
        burn_backend::read_sync(Flex::q_into_data(q))
    })
    .map_err(|e| e.to_string())?
    .map_err(|e| format!("Flex cannot read back its probe tensor: {e:?}"))
}

/// Whether a key came back exactly.
///
/// Exhaustive on purpose: a probe came back exactly or it did not, and whoever reads the table
/// handles both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// Same dtype, shape and bytes.
    Exact,
    /// Not: why, for a person.
    Refused(String),
}

/// One probe's outcome.
#[derive(Debug)]
struct Entry {
    key: HoldsKey,
    class: ShapeClass,
    dtype: DType,
    shape: &'static [usize],
    held: Held,
}

/// What one device stores bit-exact, as its probe measured it.
#[derive(Debug)]
pub struct HoldsTable {
    /// What was measured, in probe order (plain dtypes first).
    entries: Vec<Entry>,
    index: HashMap<(HoldsKey, ShapeClass), usize>,
    /// How long the probe took (zero where the table came from the process's cache).
    took: Duration,
}

impl HoldsTable {
    /// Round-trips every probe tensor through `device` and records what came back exactly.
    pub fn measure<B: Backend>(device: &B::Device) -> HoldsTable {
        let started = Instant::now();
        // Most refusals are panics inside the backend, each contained into its reason: hundreds
        // of them (NdArray's probe meets over 800), none worth a backtrace on stderr.
        let _quiet = ferry_proto::contain::QuietPanics::enter();
        let entries: Vec<Entry> = probes()
            .iter()
            .map(|probe| {
                let held = match &probe.data {
                    Ok(data) => round_trip::<B>(data, device),
                    Err(why) => Held::Refused(format!("no probe tensor: {why}")),
                };
                Entry {
                    key: probe.key,
                    class: probe.class,
                    dtype: probe.dtype,
                    shape: &probe.shape,
                    held,
                }
            })
            .collect();
        let index = entries
            .iter()
            .enumerate()
            .map(|(i, e)| ((e.key, e.class), i))
            .collect();
        HoldsTable {
            entries,
            index,
            took: started.elapsed(),
        }
    }

    /// The table of the backend and adapter `identity` names, measured with `measure` the first
    /// time this process asks for it.
    pub fn cached(identity: &str, measure: impl FnOnce() -> HoldsTable) -> Arc<HoldsTable> {
        static TABLES: OnceLock<Mutex<HashMap<String, Arc<HoldsTable>>>> = OnceLock::new();
        let tables = TABLES.get_or_init(Default::default);
        let mut tables = tables.lock().unwrap_or_else(|e| e.into_inner());
        tables
            .entry(identity.to_string())
            .or_insert_with(|| Arc::new(measure()))
            .clone()
    }

    /// Whether `dtype` on `shape` is stored bit-exact; `Err` says why not, for a person.
    pub fn check(&self, dtype: &DType, shape: &[usize]) -> Result<(), String> {
        if let DType::QFloat(scheme) = dtype {
            if scheme.store != QuantStore::Native {
                return Err(
                    "a packed quantized store is not measured: devices are probed with native \
                     stores (the CPU backends re-pack other stores, which changes the bytes)"
                        .into(),
                );
            }
            if !quantizable(scheme) {
                return Err("Burn cannot quantize this combination of scale levels".into());
            }
            // Burn's own rule, whatever the backend: a block level needs at least one scale.
            if scheme.block_size().is_some() && shape.contains(&0) {
                return Err("an empty tensor with block scales has no scale to hold".into());
            }
        }
        let class = ShapeClass::of(dtype, shape);
        let found = self.index.get(&(HoldsKey::of(dtype), class));
        match found.map(|&i| &self.entries[i].held) {
            Some(Held::Exact) => Ok(()),
            Some(Held::Refused(why)) => Err(match class {
                ShapeClass::Whole => why.clone(),
                ShapeClass::Scalar => format!("on a scalar: {why}"),
                ShapeClass::Empty => format!("on an empty tensor: {why}"),
                ShapeClass::Ragged => {
                    format!("on a count of elements that is not a multiple of {WHOLE_WORDS}: {why}")
                }
            }),
            None => Err("not among the dtypes this device measured".into()),
        }
    }

    /// What was measured: each probe's dtype and shape (a quantized dtype stands for its scheme
    /// with any block size, a shape for its [`ShapeClass`]) and whether it came back.
    pub fn entries(&self) -> impl Iterator<Item = (DType, &[usize], &Held)> {
        self.entries.iter().map(|e| (e.dtype, e.shape, &e.held))
    }

    /// How many probes ran, and how many came back exactly.
    pub fn counts(&self) -> (usize, usize) {
        let exact = self
            .entries
            .iter()
            .filter(|e| e.held == Held::Exact)
            .count();
        (self.entries.len(), exact)
    }

    /// How long the probe took.
    pub fn took(&self) -> Duration {
        self.took
    }
}

/// Whether `device` gives `data` back with the same dtype, shape and bytes.
fn round_trip<B: Backend>(data: &TensorData, device: &B::Device) -> Held {
    let back = Primitive::<B>::from_data(data.clone(), device).and_then(|p| p.to_data());
    match back {
        Err(e) => Held::Refused(format!("the backend fails on it ({e})")),
        Ok(back) if back.dtype() != data.dtype() => Held::Refused(format!(
            "the backend gives it back as {}",
            dtype_name(&back.dtype())
        )),
        Ok(back) if back.shape() != data.shape() => {
            Held::Refused("the backend gives it back in another shape".into())
        }
        Ok(back) if back.as_bytes() != data.as_bytes() => {
            Held::Refused("the backend gives other bytes back".into())
        }
        Ok(_) => Held::Exact,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_probe_key_is_its_own_dtypes_key() {
        for key in probe_keys() {
            assert_eq!(HoldsKey::of(&key.probe_dtype([16])), key);
            assert_eq!(HoldsKey::of(&key.probe_dtype([5])), key);
        }
    }

    #[test]
    fn every_probe_is_of_the_class_it_stands_for() {
        for probe in probes() {
            assert_eq!(
                ShapeClass::of(&probe.dtype, &probe.shape),
                probe.class,
                "{:?} on {:?}",
                probe.dtype,
                probe.shape
            );
        }
    }

    #[test]
    fn block_scales_that_end_mid_word_make_a_shape_ragged() {
        let q8 = QuantScheme::default()
            .with_store(QuantStore::Native)
            .with_value(QuantValue::Q8S);
        let class = |scale, shape: &[usize]| {
            ShapeClass::of(&DType::QFloat(q8.per_block([16], scale)), shape)
        };
        // 32 values fill whole words; their two block scales do in F32 and F16, not in UE8M0.
        assert_eq!(class(ScaleDtype::F32, &[1, 32]), ShapeClass::Whole);
        assert_eq!(class(ScaleDtype::F16, &[1, 32]), ShapeClass::Whole);
        assert_eq!(class(ScaleDtype::UE8M0, &[1, 32]), ShapeClass::Ragged);
        assert_eq!(class(ScaleDtype::F16, &[1, 48]), ShapeClass::Ragged);
        assert_eq!(class(ScaleDtype::UE8M0, &[8, 64]), ShapeClass::Whole);
        // A block extent of 0 is never whole (validation refuses it first).
        let zero = DType::QFloat(q8.per_block([0], ScaleDtype::F32));
        assert_eq!(ShapeClass::of(&zero, &[4, 16]), ShapeClass::Ragged);
    }

    #[test]
    fn a_block_size_does_not_change_the_key() {
        let scheme = QuantScheme::default()
            .with_store(QuantStore::Native)
            .with_value(QuantValue::Q4S);
        let a = DType::QFloat(scheme.per_block([32], ScaleDtype::F16));
        let b = DType::QFloat(scheme.per_block([4, 4], ScaleDtype::F16));
        assert_eq!(HoldsKey::of(&a), HoldsKey::of(&b));
        let per_tensor = DType::QFloat(scheme.per_tensor(ScaleDtype::F32));
        assert_ne!(
            HoldsKey::of(&DType::QFloat(scheme)),
            HoldsKey::of(&per_tensor)
        );
    }
}
