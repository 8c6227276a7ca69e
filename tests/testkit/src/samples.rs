//! Tensors of every dtype and quantization scheme the CPU backends produce, for tests and benches.
//!
//! Plain tensors carry awkward values (NaN payloads, -0.0, subnormals, extremes); quantized ones
//! are made by Flex's own `quantize_dynamic` and read back with `q_into_data`, so their bytes are
//! exactly what a Burn user would hand to ferry.

use burn_backend::ops::{FloatTensorOps, QTensorOps};
use burn_backend::quantization::{QuantScheme, QuantStore, QuantValue, ScaleDtype, quantizable};
use burn_backend::{BoolStore, DType, TensorData, bf16, f16, read_sync};
use burn_flex::{Flex, FlexDevice};
use ferry_proto::dtype::{PLAIN_DTYPES, QUANT_VALUES as VALUES, SCALE_DTYPES as SCALES};

/// A named sample tensor.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Says what it is (dtype, scheme, shape), usable as a tensor name.
    pub name: String,
    /// The tensor.
    pub data: TensorData,
}

/// Deterministic pseudo-random values in [-1, 1), so every run moves the same bytes.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// The shapes every plain dtype is tried on: rank 0, an empty dim, odd sizes, a larger one.
pub fn plain_shapes() -> Vec<Vec<usize>> {
    vec![vec![], vec![0, 3], vec![3, 5, 7], vec![64, 33]]
}

fn shape_name(shape: &[usize]) -> String {
    if shape.is_empty() {
        return "scalar".into();
    }
    shape
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("x")
}

fn special_f64(i: usize, v: f32) -> f64 {
    match i % 11 {
        0 => f64::from_bits(0x7ff8_0000_dead_beef),
        1 => -0.0,
        2 => f64::MIN_POSITIVE / 4.0,
        3 => f64::MAX,
        4 => f64::NEG_INFINITY,
        _ => f64::from(v) * 1e3,
    }
}

fn special_f32(i: usize, v: f32) -> f32 {
    match i % 11 {
        0 => f32::from_bits(0x7fc0_beef),
        1 => -0.0,
        2 => f32::MIN_POSITIVE / 4.0,
        3 => f32::MAX,
        4 => f32::NEG_INFINITY,
        _ => v * 1e3,
    }
}

fn bytes_of<T: bytemuck::NoUninit>(values: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(values).to_vec()
}

/// One tensor of `dtype` (not quantized) on `shape`.
pub fn plain(dtype: DType, shape: &[usize], seed: u64) -> TensorData {
    let n: usize = shape.iter().product();
    let v = values(n, seed);
    let shape = shape.to_vec();
    let ints = |scale: f32| v.iter().map(move |x| (x * scale) as i64);
    match dtype {
        DType::F64 => TensorData::new(
            v.iter()
                .enumerate()
                .map(|(i, &x)| special_f64(i, x))
                .collect(),
            shape,
        ),
        DType::F32 => TensorData::new(
            v.iter()
                .enumerate()
                .map(|(i, &x)| special_f32(i, x))
                .collect(),
            shape,
        ),
        DType::Flex32 => {
            let f: Vec<f32> = v
                .iter()
                .enumerate()
                .map(|(i, &x)| special_f32(i, x))
                .collect();
            TensorData::from_bytes_vec(bytes_of(&f), shape, DType::Flex32)
        }
        DType::F16 => TensorData::new(v.iter().map(|&x| f16::from_f32(x * 100.0)).collect(), shape),
        DType::BF16 => {
            TensorData::new(v.iter().map(|&x| bf16::from_f32(x * 1e10)).collect(), shape)
        }
        DType::I64 => TensorData::new(ints(9e18).collect::<Vec<i64>>(), shape),
        DType::I32 => TensorData::new(ints(2e9).map(|x| x as i32).collect::<Vec<_>>(), shape),
        DType::I16 => TensorData::new(ints(3e4).map(|x| x as i16).collect::<Vec<_>>(), shape),
        DType::I8 => TensorData::new(ints(127.0).map(|x| x as i8).collect::<Vec<_>>(), shape),
        DType::U64 => TensorData::new(
            v.iter()
                .map(|&x| ((x + 1.0) * 9e18) as u64)
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::U32 => TensorData::new(
            v.iter()
                .map(|&x| ((x + 1.0) * 2e9) as u32)
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::U16 => TensorData::new(
            v.iter()
                .map(|&x| ((x + 1.0) * 3e4) as u16)
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::U8 => TensorData::new(
            v.iter()
                .map(|&x| ((x + 1.0) * 127.0) as u8)
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::Bool(BoolStore::Native) => {
            TensorData::new(v.iter().map(|&x| x > 0.0).collect::<Vec<_>>(), shape)
        }
        DType::Bool(BoolStore::U8) => {
            let b: Vec<u8> = v.iter().map(|&x| u8::from(x > 0.0)).collect();
            TensorData::from_bytes_vec(b, shape, dtype)
        }
        DType::Bool(BoolStore::U32) => {
            let b: Vec<u32> = v.iter().map(|&x| u32::from(x > 0.0)).collect();
            TensorData::from_bytes_vec(bytes_of(&b), shape, dtype)
        }
        DType::QFloat(_) => panic!("plain() makes plain dtypes; use quantized()"),
    }
}

/// Every plain dtype Burn 0.22.1 has.
pub fn plain_dtypes() -> Vec<DType> {
    PLAIN_DTYPES.to_vec()
}

/// Every plain dtype on every plain shape.
pub fn plain_matrix() -> Vec<Sample> {
    let mut out = Vec::new();
    for (d, dtype) in plain_dtypes().into_iter().enumerate() {
        for shape in plain_shapes() {
            out.push(Sample {
                name: format!(
                    "{}-{}",
                    dtype.name().replace(['(', ')'], "_"),
                    shape_name(&shape)
                ),
                data: plain(dtype, &shape, d as u64),
            });
        }
    }
    out
}

/// The quantization schemes the matrix covers, with a label: every value type per-tensor with
/// each scale dtype; Q8S, Q4S and E2M1 per-block `[32]`, `[16]`, `[4, 4]` with each scale dtype; and
/// two-level block `[16]` + per-tensor F32 for every block dtype Burn allows under a global scale.
pub fn schemes() -> Vec<(String, QuantScheme)> {
    let native = QuantScheme::default().with_store(QuantStore::Native);
    let mut out = Vec::new();
    for value in VALUES {
        for scale in SCALES {
            out.push((
                format!("{value:?}-tensor-{scale:?}"),
                native.with_value(value).per_tensor(scale),
            ));
        }
    }
    for value in [QuantValue::Q8S, QuantValue::Q4S, QuantValue::E2M1] {
        for block in [&[32u8][..], &[16], &[4, 4]] {
            for scale in SCALES {
                let b: Vec<String> = block.iter().map(|e| e.to_string()).collect();
                out.push((
                    format!("{value:?}-block{}-{scale:?}", b.join("x")),
                    native.with_value(value).per_block(block, scale),
                ));
            }
        }
        for scale in SCALES {
            let scheme = native
                .with_value(value)
                .per_block([16], scale)
                .per_tensor(ScaleDtype::F32);
            if quantizable(&scheme) {
                out.push((format!("{value:?}-block16-{scale:?}+tensor-F32"), scheme));
            }
        }
    }
    out
}

/// A tensor of `shape` quantized by Flex with `scheme`, as Flex's `q_into_data` gives it.
pub fn quantized(scheme: &QuantScheme, shape: &[usize], seed: u64) -> TensorData {
    let n: usize = shape.iter().product();
    let float = TensorData::new(values(n, seed), shape.to_vec());
    let device = FlexDevice;
    let tensor = Flex::float_from_data(float, &device);
    let q = Flex::quantize_dynamic(tensor, scheme);
    read_sync(Flex::q_into_data(q)).expect("flex reads back its own quantized tensor")
}

/// Every scheme of [`schemes`] on a rank-2 shape that every block divides, plus per-tensor
/// schemes on a scalar and on an odd 3-d shape.
pub fn quantized_matrix() -> Vec<Sample> {
    let mut out = Vec::new();
    for (i, (label, scheme)) in schemes().into_iter().enumerate() {
        let mut shapes = vec![vec![8usize, 64]];
        if scheme.block_size().is_none() {
            shapes.push(vec![]);
            shapes.push(vec![3, 5, 7]);
        }
        for shape in shapes {
            out.push(Sample {
                name: format!("q-{label}-{}", shape_name(&shape)),
                data: quantized(&scheme, &shape, i as u64),
            });
        }
    }
    out
}

/// The plain and the quantized matrix together.
pub fn full_matrix() -> Vec<Sample> {
    let mut all = plain_matrix();
    all.extend(quantized_matrix());
    all
}
