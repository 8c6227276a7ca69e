//! Every dtype and quantization scheme Burn's CPU backends produce crosses ferry's wire byte-exact.
//!
//! Each case runs the whole path: backend `*_into_data` -> [`tensor::into_parts`] -> a `Put`
//! control frame carrying `meta.to_wire()` and chunk frames of a few bytes (so several are used)
//! -> the byte stream fed to [`frame::parse`] in odd-sized reads -> [`TensorMeta::try_from`] ->
//! [`TensorAssembler`] -> `finish` -> `*_from_data` on the target backend -> `*_into_data`. Both
//! the assembled `TensorData` and the target's read-back must equal the source's bytes, dtype
//! and shape. Where a backend cannot hold a dtype, the test pins what predicts that and how the
//! backend fails, so the server can decide before a byte moves.

// burn-ndarray 0.22 marks itself deprecated in favour of burn-flex; ferry still serves it.
#![allow(deprecated)]

use ferry_proto::dtype::{PLAIN_DTYPES as PLAIN, QUANT_VALUES as VALUES, SCALE_DTYPES as SCALES};
use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Once;

use burn_backend::{Backend, DTypeUsage, read_sync};
use burn_flex::{Flex, FlexDevice};
use burn_ndarray::{NdArray, NdArrayDevice};
use burn_std::quantization::{
    QuantMode, QuantScheme, QuantStore, QuantValue, ScaleDtype, quantizable,
};
use burn_std::{BoolStore, Bytes, DType, TensorData};
use bytes::BytesMut;
use ferry_io::{BufferFrom, HashUse, TensorAssembler};
use ferry_proto::control::{decode_request, encode_request};
use ferry_proto::frame::{self, DEFAULT_MAX_BODY, Frame, FrameKind};
use ferry_proto::tensor::into_parts;
use ferry_proto::{MetaError, ProtoError, Request, StreamError, TensorMeta};
use ferry_proto::{dtype_name, meta::expected_byte_len};

/// Payload bytes per chunk frame in most cases: small and odd, so chunks end mid-element.
const CHUNK: usize = 7;
/// Bytes handed to the parser per simulated socket read: odd, so frames straddle reads.
const READ: usize = 13;

fn flex() -> FlexDevice {
    FlexDevice
}

fn ndarray() -> NdArrayDevice {
    NdArrayDevice::Cpu
}

fn native(value: QuantValue) -> QuantScheme {
    QuantScheme::default()
        .with_value(value)
        .with_store(QuantStore::Native)
}

// ---------------------------------------------------------------------------------------------
// Backend access
// ---------------------------------------------------------------------------------------------

/// `*_from_data` then `*_into_data` on backend `B`, whatever kind of tensor `data` is.
fn load<B: Backend>(data: TensorData, device: &B::Device) -> TensorData {
    let read = match data.dtype() {
        DType::F64 | DType::F32 | DType::Flex32 | DType::F16 | DType::BF16 => {
            read_sync(B::float_into_data(B::float_from_data(data, device)))
        }
        DType::I64
        | DType::I32
        | DType::I16
        | DType::I8
        | DType::U64
        | DType::U32
        | DType::U16
        | DType::U8 => read_sync(B::int_into_data(B::int_from_data(data, device))),
        DType::Bool(_) => read_sync(B::bool_into_data(B::bool_from_data(data, device))),
        DType::QFloat(_) => read_sync(B::q_into_data(B::q_from_data(data, device))),
    };
    read.expect("a CPU backend reads its tensors back")
}

/// Quantizes `values` of `shape` on backend `B` with `quantize_dynamic` and reads it back.
fn quantize<B: Backend>(
    values: Vec<f32>,
    shape: &[usize],
    scheme: &QuantScheme,
    device: &B::Device,
) -> TensorData {
    let floats = B::float_from_data(TensorData::new(values, shape.to_vec()), device);
    read_sync(B::q_into_data(B::quantize_dynamic(floats, scheme))).expect("reads back")
}

thread_local! {
    static EXPECTING_PANIC: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, turning a panic into its message. Backends fail by panicking; this keeps the
/// expected ones off stderr while unexpected panics elsewhere still print.
fn catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if !EXPECTING_PANIC.with(Cell::get) {
                default(info);
            }
        }));
    });
    EXPECTING_PANIC.with(|e| e.set(true));
    let result = panic::catch_unwind(AssertUnwindSafe(f));
    EXPECTING_PANIC.with(|e| e.set(false));
    result.map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "<non-string panic>".to_string())
    })
}

// ---------------------------------------------------------------------------------------------
// The wire
// ---------------------------------------------------------------------------------------------

/// The byte stream a sender writes for `data`: a `Put` control frame, then its chunk frames.
/// Returns the stream and how many chunk frames it holds.
fn send(data: TensorData, chunk_size: usize) -> (Vec<u8>, usize) {
    let (meta, payload) = into_parts(data).expect("backend output obeys the byte-length rule");
    let put = Request::Put {
        device: 0,
        name: Some("t".to_string()),
        meta: meta.to_wire(),
        overwrite: false,
    };
    let mut stream = encode_request(&put).unwrap();
    let mut chunks = 0;
    for (offset, piece) in frame::chunks(&payload, chunk_size) {
        stream.extend_from_slice(&frame::encode_chunk(offset, piece));
        chunks += 1;
    }
    assert_eq!(chunks, payload.len().div_ceil(chunk_size), "chunk count");
    (stream, chunks)
}

/// What a receiver makes of `stream`, read `read_size` bytes at a time.
fn receive(stream: &[u8], read_size: usize) -> TensorData {
    let mut reads = stream.chunks(read_size);
    let mut buf = BytesMut::new();
    let mut next_frame = |buf: &mut BytesMut| -> Frame {
        loop {
            if let Some(frame) = frame::parse(buf, DEFAULT_MAX_BODY).expect("a valid frame") {
                return frame;
            }
            buf.extend_from_slice(reads.next().expect("the stream ended inside a frame"));
        }
    };
    let put = next_frame(&mut buf);
    assert_eq!(put.kind, FrameKind::Control);
    let Request::Put { meta: wire, .. } = decode_request(&put.body).expect("a request") else {
        panic!("not a put");
    };
    let meta = TensorMeta::try_from(&wire).expect("the receiver accepts the sender's meta");
    assert_eq!(meta.to_wire(), wire, "the meta decodes to what was sent");
    let mut assembler =
        TensorAssembler::new(meta, u64::MAX, BufferFrom::Fresh, HashUse::Skip).expect("no limit");
    while !assembler.is_complete() {
        let frame = next_frame(&mut buf);
        assert_eq!(frame.kind, FrameKind::Chunk);
        let chunk = frame.into_chunk().expect("a chunk body");
        assembler
            .accept(chunk.offset, &chunk.data)
            .expect("chunks arrive in order");
    }
    assert!(buf.is_empty(), "bytes left after the last chunk");
    assert!(reads.next().is_none(), "reads left after the last chunk");
    assembler.finish().expect("complete").data
}

/// `data` through the wire: sender's stream, receiver's assembled `TensorData`.
fn over_the_wire(data: TensorData, chunk_size: usize) -> TensorData {
    let (stream, _) = send(data, chunk_size);
    receive(&stream, READ)
}

/// Byte-exact equality of dtype, shape and bytes, reporting the first differing byte.
#[track_caller]
fn assert_same(what: &str, got: &TensorData, want: &TensorData) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let (g, w) = (got.as_bytes(), want.as_bytes());
    assert_eq!(g.len(), w.len(), "{what}: byte length");
    if let Some(i) = g.iter().zip(w).position(|(a, b)| a != b) {
        panic!(
            "{what}: byte {i} of {} differs: got {:#04x}, want {:#04x}",
            w.len(),
            g[i],
            w[i]
        );
    }
}

/// Reads `data` back from `Src`, sends that over the wire, loads it on `Dst` and reads it back:
/// what arrives and what `Dst` holds must both equal what `Src` produced. Returns the source.
#[track_caller]
fn ship<Src: Backend, Dst: Backend>(
    what: &str,
    data: TensorData,
    src: &Src::Device,
    dst: &Dst::Device,
) -> TensorData {
    let source = load::<Src>(data, src);
    ship_read::<Dst>(what, source, dst, CHUNK)
}

/// As [`ship`], for data already read back from its source backend.
#[track_caller]
fn ship_read<Dst: Backend>(
    what: &str,
    source: TensorData,
    dst: &Dst::Device,
    chunk_size: usize,
) -> TensorData {
    let arrived = over_the_wire(source.clone(), chunk_size);
    assert_same(&format!("{what}: assembled"), &arrived, &source);
    let held = load::<Dst>(arrived, dst);
    assert_same(&format!("{what}: read back on the target"), &held, &source);
    source
}

// ---------------------------------------------------------------------------------------------
// Data
// ---------------------------------------------------------------------------------------------

/// splitmix64: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Bit patterns that must survive untouched, placed first in each float tensor: NaN payloads
/// (quiet, signalling, negative), -0.0, subnormals, infinities, extremes.
fn special_bits(dtype: DType) -> Vec<u64> {
    match dtype {
        DType::F64 => vec![
            0x7ff8_0000_dead_beef, // quiet NaN with a payload
            0x7ff0_0000_0000_0001, // signalling NaN
            0xfff8_0000_0000_0042, // negative NaN
            0x8000_0000_0000_0000, // -0.0
            0x0000_0000_0000_0001, // smallest subnormal
            0x000f_ffff_ffff_ffff, // largest subnormal
            0x8000_0000_0000_0003, // negative subnormal
            0x7ff0_0000_0000_0000, // +inf
            0xfff0_0000_0000_0000, // -inf
            0x7fef_ffff_ffff_ffff, // MAX
        ],
        DType::F32 | DType::Flex32 => vec![
            0x7fc0_dead,
            0x7f80_0001,
            0xffc0_0042,
            0x8000_0000,
            0x0000_0001,
            0x007f_ffff,
            0x8000_0003,
            0x7f80_0000,
            0xff80_0000,
            0x7f7f_ffff,
        ],
        DType::F16 => vec![
            0x7e01, 0x7c01, 0xfe42, 0x8000, 0x0001, 0x03ff, 0x8003, 0x7c00, 0xfc00, 0x7bff,
        ],
        DType::BF16 => vec![
            0x7fc1, 0x7f81, 0xffc2, 0x8000, 0x0001, 0x007f, 0x8003, 0x7f80, 0xff80, 0x7f7f,
        ],
        // Integers: MIN, MAX, 0, -1 / all ones (as bits of the element width).
        DType::I64 | DType::I32 | DType::I16 | DType::I8 => {
            let bits = dtype.size() * 8;
            let all = u64::MAX >> (64 - bits);
            vec![1 << (bits - 1), all >> 1, 0, all]
        }
        DType::U64 | DType::U32 | DType::U16 | DType::U8 => {
            let bits = dtype.size() * 8;
            vec![0, u64::MAX >> (64 - bits), 1]
        }
        _ => vec![],
    }
}

/// A plain-dtype tensor of `shape`: special bit patterns first, then random bits (0/1 for
/// bools), in a buffer aligned for the element type.
fn plain(dtype: DType, shape: &[usize], seed: u64) -> TensorData {
    let numel: usize = shape.iter().product();
    let mut rng = Rng(seed);
    let specials = special_bits(dtype);
    let is_bool = matches!(dtype, DType::Bool(_));
    let elems: Vec<u64> = (0..numel)
        .map(|i| match specials.get(i) {
            Some(&bits) => bits,
            None if is_bool => rng.next() & 1,
            None => rng.next(),
        })
        .collect();
    let bytes = match dtype.size() {
        8 => Bytes::from_elems(elems),
        4 => Bytes::from_elems(elems.iter().map(|&e| e as u32).collect::<Vec<_>>()),
        2 => Bytes::from_elems(elems.iter().map(|&e| e as u16).collect::<Vec<_>>()),
        _ => Bytes::from_elems(elems.iter().map(|&e| e as u8).collect::<Vec<_>>()),
    };
    TensorData::from_bytes(bytes, shape.to_vec(), dtype)
}

/// Floats to quantize: magnitudes that change every 16 values (so blocks get different scales),
/// exact zeros, and one all-zero run of 16 (a zero block scale, which Flex replaces).
fn floats(numel: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..numel)
        .map(|i| {
            let block = i / 16;
            if block == 1 || i % 11 == 0 {
                0.0
            } else {
                rng.unit() * f32::powi(2.0, (block % 9) as i32 - 4)
            }
        })
        .collect()
}

/// Quantizes on Flex and checks the dtype Flex reports: the scheme asked, with a native store.
fn flex_quantized(scheme: QuantScheme, shape: &[usize], seed: u64) -> TensorData {
    let numel = shape.iter().product();
    let data = quantize::<Flex>(floats(numel, seed), shape, &scheme, &flex());
    assert_eq!(
        data.dtype(),
        DType::QFloat(scheme.with_store(QuantStore::Native)),
        "Flex reports the scheme it was asked for"
    );
    data
}

// ---------------------------------------------------------------------------------------------
// Flex -> wire -> Flex
// ---------------------------------------------------------------------------------------------

const PLAIN_SHAPES: [&[usize]; 7] = [
    &[],
    &[1],
    &[0],
    &[2, 0, 3],
    &[3, 5, 7],
    &[17],
    &[2, 3, 2, 1],
];

#[test]
fn every_plain_dtype_crosses_flex_to_flex_exactly() {
    for (i, dtype) in PLAIN.into_iter().enumerate() {
        for shape in PLAIN_SHAPES {
            let made = plain(dtype, shape, i as u64);
            let what = format!("{dtype:?} {shape:?}");
            let source = ship::<Flex, Flex>(&what, made.clone(), &flex(), &flex());
            // Flex itself changes nothing: NaN payloads, -0.0 and subnormals survive from_data.
            assert_same(
                &format!("{what}: Flex keeps what it was given"),
                &source,
                &made,
            );
        }
    }
}

#[test]
fn odd_shapes_use_many_chunks() {
    let data = load::<Flex>(plain(DType::F32, &[3, 5, 7], 9), &flex());
    let (stream, chunks) = send(data.clone(), CHUNK);
    assert_eq!(chunks, (3 * 5 * 7 * 4usize).div_ceil(CHUNK));
    // Every read size, including one byte at a time, assembles the same tensor.
    for read in [1, 2, 3, 16, 17, 24, 25, 1000, stream.len()] {
        assert_same(&format!("read {read}"), &receive(&stream, read), &data);
    }
    // An empty tensor is a Put with no chunk frames at all.
    let empty = load::<Flex>(plain(DType::F32, &[2, 0, 3], 1), &flex());
    let (stream, chunks) = send(empty.clone(), CHUNK);
    assert_eq!(chunks, 0);
    assert_same("empty", &receive(&stream, READ), &empty);
}

#[test]
fn per_tensor_schemes_cross_flex_to_flex_exactly() {
    let mut cases = 0;
    for (v, value) in VALUES.into_iter().enumerate() {
        // The scheme storing no level (an implicit f32 per-tensor scale) travels distinct from an
        // explicit per_tensor(F32).
        let mut schemes = vec![native(value)];
        schemes.extend(SCALES.map(|s| native(value).per_tensor(s)));
        for scheme in schemes {
            for shape in [&[][..], &[1], &[3, 5, 7], &[4, 8]] {
                let what = format!("{} {shape:?}", dtype_name(&DType::QFloat(scheme)));
                let source = flex_quantized(scheme, shape, v as u64);
                ship_read::<Flex>(&what, source, &flex(), CHUNK);
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 9 * 6 * 4);
}

#[test]
fn per_block_schemes_cross_flex_to_flex_exactly() {
    let mut cases = 0;
    for (v, value) in VALUES.into_iter().enumerate() {
        for scale in SCALES {
            for (block, shape) in [
                (&[32][..], &[3, 5, 32][..]),
                (&[32], &[64]),
                (&[16], &[3, 5, 32]),
                (&[4, 4], &[3, 8, 12]),
                (&[4, 4], &[4, 4]),
            ] {
                let scheme = native(value).per_block(block, scale);
                let what = format!("{} {shape:?}", dtype_name(&DType::QFloat(scheme)));
                let source = flex_quantized(scheme, shape, v as u64 + 100);
                ship_read::<Flex>(&what, source, &flex(), 64);
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 9 * 5 * 5);
}

#[test]
fn two_level_schemes_cross_flex_to_flex_exactly() {
    // `quantizable` admits a block level under an f32 per-tensor level only for block dtypes no
    // wider than f16: F16 and UE4M3.
    let admitted: Vec<ScaleDtype> = SCALES
        .into_iter()
        .filter(|&d| {
            quantizable(
                &native(QuantValue::Q8S)
                    .per_block([16], d)
                    .per_tensor(ScaleDtype::F32),
            )
        })
        .collect();
    assert_eq!(admitted, [ScaleDtype::F16, ScaleDtype::UE4M3]);
    for (v, value) in VALUES.into_iter().enumerate() {
        // Flex quantizes and reads back every block dtype under an f32 global, including those
        // `quantizable` declines (F32, BF16, UE8M0), and the wire carries them all exactly.
        for block_dtype in SCALES {
            let scheme = native(value)
                .per_block([16], block_dtype)
                .per_tensor(ScaleDtype::F32);
            for shape in [&[4, 48][..], &[2, 3, 16]] {
                let what = format!("{} {shape:?}", dtype_name(&DType::QFloat(scheme)));
                let source = flex_quantized(scheme, shape, v as u64 + 200);
                // values, one block scale per 16 values, then the f32 global: nothing between.
                let numel: usize = shape.iter().product();
                assert_eq!(
                    source.as_bytes().len(),
                    numel + numel / 16 * burn_std::quantization::scale_size(block_dtype) + 4
                );
                ship_read::<Flex>(&what, source, &flex(), CHUNK);
            }
        }
        // A narrow (F16/BF16) global level: Flex quantizes, then panics reading it back.
        for global in [ScaleDtype::F16, ScaleDtype::BF16] {
            let scheme = native(value)
                .per_block([16], ScaleDtype::UE4M3)
                .per_tensor(global);
            assert!(!quantizable(&scheme));
            let err = catch(|| flex_quantized(scheme, &[4, 48], 1)).expect_err("panics");
            assert!(
                err.contains("stores its per-tensor scale as f32"),
                "{global:?}: {err}"
            );
        }
    }
}

#[test]
fn lookup_mode_and_packed_store_requests() {
    // Lookup mode travels in the dtype (Flex computes it as symmetric).
    for value in [QuantValue::Q8S, QuantValue::Q4S, QuantValue::E2M1] {
        for scheme in [
            native(value)
                .with_mode(QuantMode::Lookup)
                .per_tensor(ScaleDtype::F32),
            native(value)
                .with_mode(QuantMode::Lookup)
                .per_block([16], ScaleDtype::F16),
        ] {
            let source = flex_quantized(scheme, &[2, 32], 300);
            ship_read::<Flex>(&dtype_name(&DType::QFloat(scheme)), source, &flex(), CHUNK);
        }
    }
    // Asked for a packed store, Flex emits a native one (one byte per value).
    for store in [QuantStore::PackedU32(0), QuantStore::PackedNative(0)] {
        let scheme = native(QuantValue::Q4S)
            .with_store(store)
            .per_block([8], ScaleDtype::F32);
        let source = flex_quantized(scheme, &[2, 32], 301);
        assert_eq!(source.as_bytes().len(), 64 + 8 * 4);
        ship_read::<Flex>(&format!("{store:?} asked"), source, &flex(), CHUNK);
    }
}

#[test]
fn empty_quantized_tensors() {
    // Per-tensor: an empty tensor is its one scale and crosses exactly.
    for value in VALUES {
        for scale in SCALES {
            let scheme = native(value).per_tensor(scale);
            for shape in [&[0][..], &[2, 0, 3]] {
                let source = flex_quantized(scheme, shape, 400);
                assert_eq!(
                    source.as_bytes().len(),
                    burn_std::quantization::scale_size(scale)
                );
                ship_read::<Flex>(&format!("{scheme:?} {shape:?}"), source, &flex(), CHUNK);
            }
        }
    }
    // Block scales on an empty tensor: Flex panics quantizing it, and it also panics loading the
    // zero-byte payload the byte-length rule admits for it (no values, no blocks). The wire
    // accepts such a meta; a receiver must contain the backend's panic.
    let scheme = native(QuantValue::Q8S).per_block([32], ScaleDtype::F32);
    let err = catch(|| flex_quantized(scheme, &[0, 32], 1)).expect_err("Flex panics");
    assert!(err.contains("at least one scale factor"), "{err}");
    let dtype = DType::QFloat(scheme);
    let meta = TensorMeta::new(vec![0, 32], dtype).expect("the wire admits it");
    assert_eq!(meta.byte_len(), 0);
    let assembled = TensorAssembler::new(meta, 1 << 20, BufferFrom::Fresh, HashUse::Skip)
        .unwrap()
        .finish()
        .expect("zero bytes is complete")
        .data;
    assert_eq!(assembled.dtype(), dtype);
    assert!(assembled.as_bytes().is_empty());
    let err = catch(|| load::<Flex>(assembled.clone(), &flex())).expect_err("Flex panics");
    assert!(err.contains("at least one scale factor"), "{err}");
    // NdArray, in contrast, loads it and reads back the same zero bytes.
    let back = catch(|| load::<NdArray>(assembled.clone(), &ndarray())).expect("NdArray loads it");
    assert_same("empty block-quantized on NdArray", &back, &assembled);
}

#[test]
fn a_large_tensor_crosses_exactly() {
    let shape = [256, 1024];
    let source = load::<Flex>(plain(DType::F32, &shape, 77), &flex());
    let (stream, chunks) = send(source.clone(), 4093);
    assert_eq!(chunks, (256 * 1024 * 4usize).div_ceil(4093));
    let arrived = receive(&stream, 65_521);
    assert_same("f32 [256, 1024]: assembled", &arrived, &source);
    assert_same(
        "f32 [256, 1024]: on Flex",
        &load::<Flex>(arrived.clone(), &flex()),
        &source,
    );
    assert_same(
        "f32 [256, 1024]: on NdArray",
        &load::<NdArray>(arrived, &ndarray()),
        &source,
    );
    for scheme in [
        native(QuantValue::Q8S).per_tensor(ScaleDtype::F32),
        native(QuantValue::Q8S).per_block([32], ScaleDtype::F16),
    ] {
        let source = flex_quantized(scheme, &shape, 78);
        let what = dtype_name(&source.dtype());
        let (stream, _) = send(source.clone(), 4093);
        let arrived = receive(&stream, 65_521);
        assert_same(&what, &arrived, &source);
        assert_same(&what, &load::<Flex>(arrived.clone(), &flex()), &source);
        assert_same(&what, &load::<NdArray>(arrived, &ndarray()), &source);
    }
}

// ---------------------------------------------------------------------------------------------
// Across backends
// ---------------------------------------------------------------------------------------------

/// The plain dtypes NdArray holds.
const NDARRAY_PLAIN: [DType; 11] = [
    DType::F64,
    DType::F32,
    DType::I64,
    DType::I32,
    DType::I16,
    DType::I8,
    DType::U64,
    DType::U32,
    DType::U16,
    DType::U8,
    DType::Bool(BoolStore::Native),
];

/// Q8F/Q8S schemes NdArray holds: per-tensor and per-block with every scale dtype, and
/// two-level with every block dtype under an f32 global.
fn ndarray_schemes() -> Vec<(QuantScheme, Vec<usize>)> {
    let mut schemes = Vec::new();
    for value in [QuantValue::Q8F, QuantValue::Q8S] {
        schemes.push((native(value), vec![3, 5, 7]));
        schemes.push((native(value), vec![]));
        for scale in SCALES {
            schemes.push((native(value).per_tensor(scale), vec![3, 5, 7]));
            schemes.push((native(value).per_tensor(scale), vec![]));
            schemes.push((native(value).per_block([32], scale), vec![3, 64]));
            schemes.push((native(value).per_block([16], scale), vec![2, 3, 16]));
            schemes.push((native(value).per_block([4, 4], scale), vec![8, 12]));
            schemes.push((
                native(value)
                    .per_block([16], scale)
                    .per_tensor(ScaleDtype::F32),
                vec![4, 48],
            ));
        }
    }
    schemes
}

#[test]
fn flex_to_ndarray_is_exact_for_what_ndarray_holds() {
    for (i, dtype) in NDARRAY_PLAIN.into_iter().enumerate() {
        for shape in PLAIN_SHAPES {
            let what = format!("{dtype:?} {shape:?} Flex -> NdArray");
            ship::<Flex, NdArray>(
                &what,
                plain(dtype, shape, 500 + i as u64),
                &flex(),
                &ndarray(),
            );
        }
    }
    for (i, (scheme, shape)) in ndarray_schemes().into_iter().enumerate() {
        let source = flex_quantized(scheme, &shape, 600 + i as u64);
        let what = format!("{} {shape:?} Flex -> NdArray", dtype_name(&source.dtype()));
        ship_read::<NdArray>(&what, source, &ndarray(), CHUNK);
    }
}

#[test]
fn ndarray_to_flex_is_exact() {
    for (i, dtype) in NDARRAY_PLAIN.into_iter().enumerate() {
        for shape in PLAIN_SHAPES {
            let what = format!("{dtype:?} {shape:?} NdArray -> Flex");
            let made = plain(dtype, shape, 700 + i as u64);
            let source = ship::<NdArray, Flex>(&what, made.clone(), &ndarray(), &flex());
            assert_same(
                &format!("{what}: NdArray keeps what it was given"),
                &source,
                &made,
            );
        }
    }
    for (i, (scheme, shape)) in ndarray_schemes().into_iter().enumerate() {
        let numel = shape.iter().product();
        let values = floats(numel, 800 + i as u64);
        if !quantizable(&scheme) {
            // NdArray refuses to quantize what `quantizable` declines (it still loads such data
            // made by Flex exactly, see above).
            let err = catch(|| quantize::<NdArray>(values, &shape, &scheme, &ndarray()))
                .expect_err("NdArray panics");
            assert!(
                err.contains("a per-tensor scale cannot absorb"),
                "{scheme:?}: {err}"
            );
            continue;
        }
        let source = quantize::<NdArray>(values, &shape, &scheme, &ndarray());
        assert_eq!(source.dtype(), DType::QFloat(scheme));
        let what = format!("{} {shape:?} NdArray -> Flex", dtype_name(&source.dtype()));
        ship_read::<Flex>(&what, source, &flex(), CHUNK);
    }
}

/// Whether `dtype` arrives intact on backend `B`: loaded without a panic, read back exactly.
fn holds<B: Backend>(data: &TensorData, device: &B::Device) -> bool {
    let arrived = over_the_wire(data.clone(), 64);
    match catch(|| load::<B>(arrived, device)) {
        Ok(back) => {
            assert_same("a backend that loads it keeps it exactly", &back, data);
            true
        }
        Err(_) => false,
    }
}

/// Every dtype Flex can produce, as Flex produced it.
fn every_dtype_from_flex() -> Vec<TensorData> {
    let mut all: Vec<TensorData> = PLAIN
        .into_iter()
        .map(|d| load::<Flex>(plain(d, &[4, 8], 900), &flex()))
        .collect();
    for value in VALUES {
        for mode in [QuantMode::Symmetric, QuantMode::Lookup] {
            let base = native(value).with_mode(mode);
            all.push(flex_quantized(base, &[4, 32], 901));
            for scale in SCALES {
                all.push(flex_quantized(base.per_tensor(scale), &[4, 32], 902));
                all.push(flex_quantized(base.per_block([32], scale), &[4, 32], 903));
                all.push(flex_quantized(base.per_block([4, 4], scale), &[4, 32], 904));
                all.push(flex_quantized(
                    base.per_block([16], scale).per_tensor(ScaleDtype::F32),
                    &[4, 32],
                    905,
                ));
            }
        }
    }
    all
}

/// Where `supports_dtype` disagrees with what the backend really holds: `(dtype, says, holds)`.
fn mispredictions<B: Backend>(device: &B::Device) -> Vec<(String, bool, bool)> {
    every_dtype_from_flex()
        .iter()
        .filter_map(|data| {
            let says = B::supports_dtype(device, data.dtype());
            let held = holds::<B>(data, device);
            (says != held).then(|| (dtype_name(&data.dtype()), says, held))
        })
        .collect()
}

#[test]
fn ndarray_supports_dtype_predicts_what_it_cannot_hold() {
    let device = ndarray();
    // The dtypes the server must refuse before sending a byte to an NdArray device.
    for dtype in [
        DType::F16,
        DType::BF16,
        DType::Bool(BoolStore::U8),
        DType::Bool(BoolStore::U32),
    ] {
        assert!(!NdArray::supports_dtype(&device, dtype), "{dtype:?}");
        assert!(NdArray::dtype_usage(&device, dtype).is_empty(), "{dtype:?}");
        let data = load::<Flex>(plain(dtype, &[3, 4], 1), &flex());
        let err = catch(|| load::<NdArray>(over_the_wire(data, CHUNK), &device))
            .expect_err("NdArray panics on it");
        assert!(err.contains("Unsupported dtype"), "{dtype:?}: {err}");
    }
    for dtype in NDARRAY_PLAIN {
        assert!(NdArray::supports_dtype(&device, dtype), "{dtype:?}");
    }
    for value in VALUES {
        for (scheme, _) in ndarray_schemes() {
            let scheme = scheme.with_value(value);
            let q8 = matches!(value, QuantValue::Q8F | QuantValue::Q8S);
            assert_eq!(
                NdArray::supports_dtype(&device, DType::QFloat(scheme)),
                q8 && quantizable(&scheme),
                "{scheme:?}"
            );
        }
    }

    // Over everything Flex produces, supports_dtype is wrong in exactly these cases:
    // - Flex32: claimed, but from_data panics `Unsupported dtype Flex32` (a false positive: the
    //   server cannot rely on supports_dtype alone and must also contain the panic);
    // - two-level Q8F/Q8S with an F32, BF16 or UE8M0 block level under an f32 global: declined
    //   (`quantizable` is false), yet NdArray loads and reads them back exactly (false negatives,
    //   which only cost a refusal).
    let mut wrong = mispredictions::<NdArray>(&device);
    wrong.sort();
    let mut expected = vec![(dtype_name(&DType::Flex32), true, false)];
    for value in [QuantValue::Q8F, QuantValue::Q8S] {
        for block in [ScaleDtype::F32, ScaleDtype::BF16, ScaleDtype::UE8M0] {
            let scheme = native(value)
                .per_block([16], block)
                .per_tensor(ScaleDtype::F32);
            expected.push((dtype_name(&DType::QFloat(scheme)), false, true));
        }
    }
    expected.sort();
    assert_eq!(wrong, expected);
}

#[test]
fn flex_supports_dtype_is_not_a_storage_check() {
    let device = flex();
    // Flex holds every dtype it produces, yet answers false for Flex32, Bool(U32) and every
    // quantized dtype: quantized dtypes report `Storage` only (no `Arithmetic`), and Flex32 and
    // Bool(U32) report nothing at all. A storage check on Flex needs another predicate.
    let mut wrong = mispredictions::<Flex>(&device);
    assert!(
        wrong.iter().all(|(_, says, holds)| !says && *holds),
        "{wrong:?}"
    );
    wrong.retain(|(name, _, _)| !name.starts_with("qfloat"));
    wrong.sort();
    let mut expected = vec![
        (dtype_name(&DType::Flex32), false, true),
        (dtype_name(&DType::Bool(BoolStore::U32)), false, true),
    ];
    expected.sort();
    assert_eq!(wrong, expected);
    for data in every_dtype_from_flex() {
        let dtype = data.dtype();
        if let DType::QFloat(scheme) = dtype {
            let usage = Flex::dtype_usage(&device, dtype);
            if quantizable(&scheme) {
                assert!(
                    usage.contains(DTypeUsage::Storage) && !usage.contains(DTypeUsage::Arithmetic),
                    "{dtype:?}"
                );
            } else {
                assert!(usage.is_empty(), "{dtype:?}");
            }
        }
    }
}

#[test]
fn bool_bytes_other_than_0_and_1() {
    // The wire does not look at element values: a Bool(Native) byte of 2 arrives as sent. Flex
    // keeps it; NdArray panics on it. A server that wants to refuse it must check the payload.
    let made = TensorData::from_bytes(
        Bytes::from_elems(vec![0u8, 1, 2, 255]),
        vec![4],
        DType::Bool(BoolStore::Native),
    );
    let source = ship::<Flex, Flex>("bool 2", made.clone(), &flex(), &flex());
    assert_same("Flex keeps bool bytes", &source, &made);
    let arrived = over_the_wire(made, CHUNK);
    assert!(catch(|| load::<NdArray>(arrived, &ndarray())).is_err());
}

// ---------------------------------------------------------------------------------------------
// Lying lengths
// ---------------------------------------------------------------------------------------------

#[test]
fn a_quantized_payload_one_byte_off_is_refused_with_the_facts() {
    for scheme in [
        native(QuantValue::Q8S).per_block([4], ScaleDtype::F32),
        native(QuantValue::Q4S)
            .per_block([16], ScaleDtype::UE4M3)
            .per_tensor(ScaleDtype::F32),
        native(QuantValue::E2M1).per_tensor(ScaleDtype::UE8M0),
    ] {
        let source = flex_quantized(scheme, &[2, 16], 1000);
        let dtype = source.dtype();
        let expected = source.as_bytes().len() as u64;
        assert_eq!(expected_byte_len(&[2, 16], &dtype), Ok(expected as usize));
        let (meta, _) = into_parts(source.clone()).unwrap();
        for actual in [expected - 1, expected + 1] {
            let want = MetaError::ByteLenMismatch {
                shape: vec![2, 16],
                dtype: dtype_name(&dtype),
                expected,
                actual,
            };
            let mut wire = meta.to_wire();
            wire.byte_len = actual;
            assert_eq!(TensorMeta::try_from(&wire), Err(want.clone()));
            assert_eq!(
                TensorMeta::with_byte_len(vec![2, 16], dtype, actual),
                Err(want.clone())
            );
            let text = want.to_string();
            assert!(
                text.contains("[2, 16]")
                    && text.contains(&dtype_name(&dtype))
                    && text.contains(&expected.to_string())
                    && text.contains(&actual.to_string()),
                "{text}"
            );
            // Burn builds such a TensorData without complaint; ferry refuses to send it.
            let mut bytes = source.as_bytes().to_vec();
            bytes.resize(actual as usize, 0);
            let lying = TensorData::from_bytes_vec(bytes, vec![2, 16], dtype);
            assert_eq!(into_parts(lying).map(|_| ()), Err(want));
        }
        // A stream whose chunks add up to one byte more or less than the meta is refused too.
        let payload = source.as_bytes();
        let mut assembler =
            TensorAssembler::new(meta.clone(), 1 << 20, BufferFrom::Fresh, HashUse::Skip).unwrap();
        assembler.accept(0, &payload[..payload.len() - 1]).unwrap();
        assert_eq!(
            assembler.accept(payload.len() as u64 - 1, &[0, 0]),
            Err(StreamError::PastEnd {
                offset: expected - 1,
                len: 2,
                total: expected,
            })
        );
        assert_eq!(
            assembler.finish().map(|_| ()),
            Err(ProtoError::Stream(StreamError::Incomplete {
                received: expected - 1,
                total: expected,
            }))
        );
    }
}

#[test]
fn partial_blocks_cross_exactly() {
    // Flex refuses to quantize a shape that is not a whole number of blocks, but data with a
    // partial last block (built by hand, or by another producer) has a length by the rule (the
    // block grid rounds up), crosses the wire, and both backends load and read it back exactly.
    let err = catch(|| {
        flex_quantized(
            native(QuantValue::Q8S).per_block([32], ScaleDtype::F32),
            &[48],
            1,
        )
    })
    .expect_err("Flex panics");
    assert!(err.contains("not a whole number of"), "{err}");
    for (block, shape, scales) in [
        (&[32][..], &[48][..], 2),
        (&[4, 4], &[3, 5], 2),
        (&[4, 4], &[2, 5, 6], 2 * 2 * 2),
    ] {
        let scheme = native(QuantValue::Q8S).per_block(block, ScaleDtype::F32);
        let numel: usize = shape.iter().product();
        let values: Vec<i8> = (0..numel).map(|i| (i as i8).wrapping_mul(37)).collect();
        let scale_values: Vec<f32> = (0..scales).map(|i| 0.5 / (i + 1) as f32).collect();
        let data = TensorData::quantized(values, shape.to_vec(), scheme, &scale_values, None);
        assert_eq!(data.as_bytes().len(), numel + scales * 4);
        assert_eq!(
            expected_byte_len(shape, &data.dtype()),
            Ok(numel + scales * 4)
        );
        let what = format!("{block:?} over {shape:?}");
        ship_read::<Flex>(&what, data.clone(), &flex(), CHUNK);
        ship_read::<NdArray>(&what, data, &ndarray(), CHUNK);
    }
}

/// Regression for a `meta` fuzz finding: a two-level E2M1 tensor whose UE4M3 block scale was
/// stored in a code Burn decodes and re-encodes differently came back from Flex as other bytes.
/// Now every scale code is either refused up front (`NonCanonicalScale`) or comes back from Flex
/// byte for byte, for each scale dtype that is not F32.
#[test]
fn scale_codes_burn_would_change_are_refused_and_the_rest_come_back_exactly() {
    let schemes = [
        native(QuantValue::E2M1)
            .per_block([16], ScaleDtype::UE4M3)
            .per_tensor(ScaleDtype::F32),
        native(QuantValue::Q4S).per_block([16], ScaleDtype::UE8M0),
        native(QuantValue::Q8S).per_block([16], ScaleDtype::F16),
        native(QuantValue::Q8S).per_block([16], ScaleDtype::BF16),
    ];
    for scheme in schemes {
        let width = match scheme.scale_dtype() {
            ScaleDtype::F16 | ScaleDtype::BF16 => 2,
            _ => 1,
        };
        let (mut refused, mut kept) = (0, 0);
        // Every code of a one-byte dtype; a spread of two-byte codes, NaNs and infinities among them.
        let codes: Vec<u32> = if width == 1 {
            (0..256).collect()
        } else {
            (0..65536)
                .step_by(61)
                .chain([0x7c00, 0x7c01, 0x7e00, 0xfc00, 0xffff, 0x7f80, 0x7fc1])
                .collect()
        };
        for code in codes {
            let code_bytes = &code.to_le_bytes()[..width];
            let shape = [2usize, 16];
            let mut payload = vec![1u8; 32];
            for _ in 0..2 {
                payload.extend_from_slice(code_bytes);
            }
            if burn_std::quantization::global_scale_dtype(&scheme).is_some() {
                payload.extend_from_slice(&1.0f32.to_ne_bytes());
            }
            let meta = TensorMeta::with_byte_len(
                shape.to_vec(),
                DType::QFloat(scheme),
                payload.len() as u64,
            )
            .expect("the length is right");
            match ferry_proto::scales::check_scales(&meta, &payload) {
                Ok(()) => {
                    kept += 1;
                    let data =
                        TensorData::from_bytes_vec(payload.clone(), shape, DType::QFloat(scheme));
                    let back = catch(|| load::<Flex>(data, &flex())).expect("Flex takes it");
                    assert_eq!(back.as_bytes(), &payload[..], "{scheme:?} code {code:#x}");
                }
                Err(MetaError::NonCanonicalScale { .. }) => refused += 1,
                Err(other) => panic!("{other}"),
            }
        }
        assert!(kept > 0, "{scheme:?}: some codes are canonical");
        println!("{scheme:?}: {kept} codes kept, {refused} refused");
    }
}
