//! Tensor files (`ferry_files`): bit-exact round trips, and errors for corrupt files.
//!
//! Every dtype goes through `.bpk` (quantized included) and every plain one through
//! `.safetensors`; corrupt or foreign files give an error, never a panic and never a wrong tensor.

use ferry_proto::dtype::PLAIN_DTYPES;
use std::path::{Path, PathBuf};

use burn_backend::ops::{FloatTensorOps, QTensorOps};
use burn_backend::quantization::{QuantScheme, QuantStore, QuantValue, ScaleDtype};
use burn_backend::{BoolStore, DType, TensorData, read_sync};
use burn_flex::{Flex, FlexDevice};
use ciborium::Value;
use ferry_files::{FileError, FileFormat, read_tensors, write_tensors};
use ferry_proto::MetaError;

type Tensors = Vec<(String, TensorData)>;

/// Rank 0, an empty dim, and an ordinary matrix.
const SHAPES: [&[usize]; 3] = [&[], &[0, 3], &[3, 5]];

/// Element `i` of a plain tensor: for floats, a cycle through the values a lossy path would
/// disturb (NaN payloads, a signalling NaN, a negative NaN, -0.0, a subnormal, infinity).
fn element(dtype: DType, i: usize, seed: u8) -> Vec<u8> {
    let pick = |cycle: &[u64], fallback: u64| cycle.get(i).copied().unwrap_or(fallback);
    match dtype {
        DType::F64 => pick(
            &[
                0x7ff8_0000_dead_beef,
                0x7ff0_0000_0000_0001,
                0xfff8_0000_0000_1234,
                0x8000_0000_0000_0000,
                0x0000_0000_0000_0001,
                0x7ff0_0000_0000_0000,
            ],
            (1.5f64 + i as f64).to_bits(),
        )
        .to_ne_bytes()
        .to_vec(),
        DType::F32 | DType::Flex32 => (pick(
            &[
                0x7fc0_beef,
                0x7f80_0001,
                0xffc0_1234,
                0x8000_0000,
                0x0000_0001,
                0xff80_0000,
            ],
            u64::from((0.25f32 * i as f32).to_bits()),
        ) as u32)
            .to_ne_bytes()
            .to_vec(),
        DType::F16 => (pick(
            &[0x7e01, 0x7c01, 0xfe12, 0x8000, 0x0001, 0x7c00],
            0x3c00 + i as u64,
        ) as u16)
            .to_ne_bytes()
            .to_vec(),
        DType::BF16 => (pick(
            &[0x7fc1, 0x7f81, 0xffc2, 0x8000, 0x0001, 0x7f80],
            0x3f80 + i as u64,
        ) as u16)
            .to_ne_bytes()
            .to_vec(),
        DType::Bool(BoolStore::Native | BoolStore::U8) => vec![(i % 2) as u8],
        DType::Bool(BoolStore::U32) => ((i % 2) as u32).to_ne_bytes().to_vec(),
        other => (0..other.size())
            .map(|k| (i * 31 + k * 7) as u8 ^ seed)
            .collect(),
    }
}

fn plain(dtype: DType, shape: &[usize], seed: u8) -> TensorData {
    let n: usize = shape.iter().product();
    let bytes: Vec<u8> = (0..n).flat_map(|i| element(dtype, i, seed)).collect();
    TensorData::from_bytes_vec(bytes, shape.to_vec(), dtype)
}

fn shape_label(shape: &[usize]) -> String {
    match shape {
        [] => "scalar".into(),
        dims => dims
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join("x"),
    }
}

/// Every plain dtype on every shape, named so that neither name order nor safetensors' own
/// (by dtype, then name) order is the order they are listed in.
fn plain_set() -> Tensors {
    let mut out = Vec::new();
    for (i, dtype) in PLAIN_DTYPES.into_iter().enumerate() {
        for shape in SHAPES {
            let name = format!("{}.{dtype:?}.{}", 97 - i, shape_label(shape));
            out.push((name, plain(dtype, shape, i as u8)));
        }
    }
    out
}

fn native() -> QuantScheme {
    QuantScheme::default().with_store(QuantStore::Native)
}

/// The schemes the task names, plus Burn's default per-tensor level (no level stored).
fn schemes() -> Vec<(&'static str, QuantScheme, Vec<usize>)> {
    vec![
        (
            "q8s.tensor",
            native()
                .with_value(QuantValue::Q8S)
                .per_tensor(ScaleDtype::F32),
            vec![3, 5, 7],
        ),
        ("q8s.default", native().with_value(QuantValue::Q8S), vec![]),
        (
            "q4s.block32.ue8m0",
            native()
                .with_value(QuantValue::Q4S)
                .per_block([32], ScaleDtype::UE8M0),
            vec![8, 64],
        ),
        (
            "e2m1.block16.ue4m3+tensor.f32",
            native()
                .with_value(QuantValue::E2M1)
                .per_block([16], ScaleDtype::UE4M3)
                .per_tensor(ScaleDtype::F32),
            vec![8, 64],
        ),
        (
            "q8f.block4x4.f16",
            native()
                .with_value(QuantValue::Q8F)
                .per_block([4, 4], ScaleDtype::F16),
            vec![8, 64],
        ),
    ]
}

/// A tensor quantized by Flex, exactly as a Burn user would hand it to ferry.
fn quantized(scheme: &QuantScheme, shape: &[usize], seed: u64) -> TensorData {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(6364136223846793005) | 1;
    let values: Vec<f32> = (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    let floats = Flex::float_from_data(TensorData::new(values, shape.to_vec()), &FlexDevice);
    let q = Flex::quantize_dynamic(floats, scheme);
    read_sync(Flex::q_into_data(q)).expect("flex reads back its own quantized tensor")
}

fn quantized_set() -> Tensors {
    schemes()
        .into_iter()
        .enumerate()
        .map(|(i, (name, scheme, shape))| {
            let data = quantized(&scheme, &shape, i as u64 + 1);
            assert_eq!(data.dtype(), DType::QFloat(scheme), "{name}");
            (name.to_string(), data)
        })
        .collect()
}

/// A mix: quantized tensors between plain ones, not in name order.
fn mixed_set() -> Tensors {
    let mut out = vec![("z.first".to_string(), plain(DType::F32, &[2, 3], 1))];
    for (name, data) in quantized_set() {
        out.push((name, data));
        out.push((format!("m.after.{}", out.len()), plain(DType::I8, &[5], 2)));
    }
    out
}

fn assert_same(expected: &[(String, TensorData)], actual: &[(String, TensorData)]) {
    let names = |t: &[(String, TensorData)]| t.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(expected), names(actual), "names and order");
    for ((name, want), (_, got)) in expected.iter().zip(actual) {
        assert_eq!(want.dtype(), got.dtype(), "dtype of {name}");
        assert_eq!(want.shape(), got.shape(), "shape of {name}");
        assert_eq!(want.as_bytes(), got.as_bytes(), "bytes of {name}");
    }
}

fn dir_listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("lists the temp dir")
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    names
}

fn round_trip(file: &str, tensors: &Tensors) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(file);
    write_tensors(&path, tensors).expect("writes");
    assert_eq!(
        dir_listing(dir.path()),
        vec![file.to_string()],
        "no temp file left"
    );
    let back = read_tensors(&path).expect("reads back");
    assert_same(tensors, &back);
    (dir, path)
}

/// Reading `bytes` as a `.bpk` must fail with an error other than a contained panic.
fn assert_refused(bytes: &[u8], file: &str, what: &str) -> FileError {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(file);
    std::fs::write(&path, bytes).expect("writes the corrupt file");
    match read_tensors(&path) {
        Ok(tensors) => panic!("{what}: read {} tensors from a corrupt file", tensors.len()),
        Err(e @ FileError::Panic { .. }) => panic!("{what}: something panicked: {e}"),
        Err(e) => e,
    }
}

#[test]
fn every_plain_dtype_round_trips_through_bpk() {
    round_trip("plain.bpk", &plain_set());
}

#[test]
fn quantized_tensors_round_trip_through_bpk_with_their_scales() {
    round_trip("mixed.bpk", &mixed_set());
}

#[test]
fn every_plain_dtype_round_trips_through_safetensors() {
    round_trip("plain.safetensors", &plain_set());
}

#[test]
fn order_is_kept_even_between_empty_tensors() {
    let tensors = vec![
        ("b".to_string(), plain(DType::F32, &[0], 0)),
        ("a".to_string(), plain(DType::F32, &[0, 2], 0)),
        ("d".to_string(), plain(DType::U8, &[3], 0)),
        ("c".to_string(), plain(DType::F64, &[], 0)),
    ];
    round_trip("order.bpk", &tensors);
    round_trip("order.safetensors", &tensors);
    round_trip("none.bpk", &Vec::new());
    round_trip("none.safetensors", &Vec::new());
}

#[test]
fn safetensors_from_ferry_read_as_standard_dtypes_elsewhere() {
    let tensors = plain_set();
    let (_dir, path) = round_trip("std.safetensors", &tensors);
    let raw = std::fs::read(&path).expect("reads the file");
    let file = safetensors::SafeTensors::deserialize(&raw).expect("the safetensors crate reads it");
    for (name, data) in &tensors {
        let view = file.tensor(name).expect("every tensor is there");
        use safetensors::Dtype as S;
        let expected = match data.dtype() {
            DType::F64 => S::F64,
            DType::F32 | DType::Flex32 => S::F32,
            DType::F16 => S::F16,
            DType::BF16 => S::BF16,
            DType::I64 => S::I64,
            DType::I32 => S::I32,
            DType::I16 => S::I16,
            DType::I8 => S::I8,
            DType::U64 => S::U64,
            DType::U32 | DType::Bool(BoolStore::U32) => S::U32,
            DType::U16 => S::U16,
            DType::U8 => S::U8,
            DType::Bool(BoolStore::Native | BoolStore::U8) => S::BOOL,
            DType::QFloat(_) => unreachable!("no quantized tensor in the plain set"),
        };
        assert_eq!(view.dtype(), expected, "{name}");
        assert_eq!(view.shape(), data.shape().as_slice(), "{name}");
        assert_eq!(view.data(), data.as_bytes(), "{name}");
    }
}

#[test]
fn foreign_safetensors_are_read_in_data_order_and_odd_dtypes_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let a = plain(DType::I16, &[4], 3);
    let b = plain(DType::F64, &[2, 2], 4);
    let views = vec![
        (
            "a",
            safetensors::tensor::TensorView::new(safetensors::Dtype::I16, vec![4], a.as_bytes())
                .expect("view"),
        ),
        (
            "b",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F64, vec![2, 2], b.as_bytes())
                .expect("view"),
        ),
    ];
    let path = dir.path().join("foreign.safetensors");
    safetensors::serialize_to_file(views, None, &path).expect("writes");
    // Safetensors puts wider dtypes first: the file order is b, a.
    let expected = vec![("b".to_string(), b), ("a".to_string(), a)];
    assert_same(&expected, &read_tensors(&path).expect("reads"));

    let fp8 = [0u8; 4];
    let views = vec![(
        "fp8",
        safetensors::tensor::TensorView::new(safetensors::Dtype::F8_E4M3, vec![4], &fp8)
            .expect("view"),
    )];
    let path = dir.path().join("fp8.safetensors");
    safetensors::serialize_to_file(views, None, &path).expect("writes");
    match read_tensors(&path) {
        Err(FileError::UnsupportedDType { name, dtype }) => {
            assert_eq!(name, "fp8");
            assert_eq!(dtype, "F8_E4M3");
        }
        other => panic!("expected UnsupportedDType, got {other:?}"),
    }
}

#[test]
fn a_ferry_dtype_record_that_disagrees_with_the_file_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = plain(DType::I32, &[3], 5);
    let views = vec![(
        "w",
        safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![3], data.as_bytes())
            .expect("view"),
    )];
    let metadata =
        std::collections::HashMap::from([("ferry.dtypes".to_string(), r#"{"w":"Flex32"}"#.into())]);
    let path = dir.path().join("lying.safetensors");
    safetensors::serialize_to_file(views, Some(metadata), &path).expect("writes");
    let err = read_tensors(&path).expect_err("I32 data cannot be Flex32");
    assert!(matches!(err, FileError::Safetensors(_)), "{err:?}");
}

#[test]
fn quantized_into_safetensors_is_refused_and_suggests_bpk() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("q.safetensors");
    std::fs::write(&path, b"previous contents").expect("writes");
    let err = write_tensors(&path, &mixed_set()).expect_err("no quantized dtype in safetensors");
    assert!(
        matches!(&err, FileError::QuantizedInSafetensors { name } if name == "q8s.tensor"),
        "{err:?}"
    );
    assert!(err.to_string().contains(".bpk"), "{err}");
    assert_eq!(std::fs::read(&path).expect("reads"), b"previous contents");
    assert_eq!(dir_listing(dir.path()), vec!["q.safetensors".to_string()]);
}

#[test]
fn unknown_extensions_are_refused_naming_the_supported_ones() {
    let dir = tempfile::tempdir().expect("temp dir");
    for file in ["model.pt", "model", "model.bpk.gz", "model.safetensor"] {
        let path = dir.path().join(file);
        for err in [
            write_tensors(&path, &plain_set()).expect_err("writes nothing"),
            read_tensors(&path).expect_err("reads nothing"),
        ] {
            assert!(matches!(err, FileError::UnknownExtension { .. }), "{err:?}");
            let text = err.to_string();
            assert!(
                text.contains(".bpk") && text.contains(".safetensors"),
                "{text}"
            );
        }
    }
    assert!(dir_listing(dir.path()).is_empty());
    assert_eq!(
        FileFormat::from_path(Path::new("A.BPK")).expect("known"),
        FileFormat::Burnpack
    );
    assert_eq!(
        FileFormat::from_path(Path::new("dir.bpk/w.safetensors")).expect("known"),
        FileFormat::Safetensors
    );
}

#[test]
fn duplicate_names_and_inconsistent_tensors_are_refused_before_writing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let twice = vec![
        ("w".to_string(), plain(DType::F32, &[2], 0)),
        ("v".to_string(), plain(DType::F32, &[2], 0)),
        ("w".to_string(), plain(DType::U8, &[2], 0)),
    ];
    let (_, q) = quantized_set().swap_remove(2);
    let mut short = q.as_bytes().to_vec();
    short.pop();
    // `TensorData` does not check quantized lengths (tracel-ai/burn#5836); ferry does.
    let short = TensorData::from_bytes_vec(short, q.shape().clone(), q.dtype());
    for file in ["t.bpk", "t.safetensors"] {
        let path = dir.path().join(file);
        let err = write_tensors(&path, &twice).expect_err("duplicate");
        assert!(
            matches!(&err, FileError::DuplicateName { name } if name == "w"),
            "{err:?}"
        );
        let err = write_tensors(&path, &[("q".to_string(), short.clone())]).expect_err("short");
        assert!(
            matches!(
                &err,
                FileError::Invalid { name, source: MetaError::ByteLenMismatch { .. } } if name == "q"
            ),
            "{err:?}"
        );
    }
    assert!(dir_listing(dir.path()).is_empty());
}

#[test]
fn missing_files_and_directories_are_io_errors() {
    let dir = tempfile::tempdir().expect("temp dir");
    for file in ["absent.bpk", "absent.safetensors"] {
        let err = read_tensors(&dir.path().join(file)).expect_err("no such file");
        assert!(matches!(err, FileError::Io { .. }), "{err:?}");
        let path = dir.path().join("no-such-dir").join(file);
        let err = write_tensors(&path, &plain_set()).expect_err("no such directory");
        assert!(matches!(err, FileError::Io { .. }), "{err:?}");
    }
}

#[test]
fn rewriting_a_file_replaces_it_and_leaves_earlier_reads_alone() {
    let first = mixed_set();
    let (_dir, path) = round_trip("model.bpk", &first);
    let read_before = read_tensors(&path).expect("reads");
    let second = vec![("other".to_string(), plain(DType::U16, &[7], 9))];
    write_tensors(&path, &second).expect("overwrites");
    assert_same(&second, &read_tensors(&path).expect("reads the new file"));
    // What was read before is memory of its own, not a window onto the replaced file.
    assert_same(&first, &read_before);
    let cloned: Tensors = read_before.clone();
    std::fs::remove_file(&path).expect("removes");
    assert_same(&first, &cloned);
}

#[test]
fn safetensors_written_in_place_are_byte_for_byte_what_the_format_crate_writes() {
    // Dtypes that need no ferry record, so that the metadata is one entry (the crate writes a
    // map's entries in hash order): the layout, header and padding must be the crate's own.
    let tensors: Vec<(String, TensorData)> = vec![
        ("w".to_string(), plain(DType::F32, &[3, 5], 1)),
        ("bias".to_string(), plain(DType::I16, &[7], 2)),
        ("mask".to_string(), plain(DType::U8, &[3], 3)),
        ("z".to_string(), plain(DType::F64, &[2, 2], 4)),
    ];
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("ours.safetensors");
    write_tensors(&path, &tensors).expect("writes");
    let st = |d: DType| match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::I16 => safetensors::Dtype::I16,
        DType::U8 => safetensors::Dtype::U8,
        _ => safetensors::Dtype::F64,
    };
    let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d)| {
            let view = safetensors::tensor::TensorView::new(
                st(d.dtype()),
                d.shape().to_vec(),
                d.as_bytes(),
            )
            .expect("view");
            (n.as_str(), view)
        })
        .collect();
    let order = r#"["w","bias","mask","z"]"#.to_string();
    let metadata = std::collections::HashMap::from([("ferry.order".to_string(), order)]);
    let theirs = safetensors::serialize(views, Some(metadata)).expect("serializes");
    assert_eq!(std::fs::read(&path).expect("reads"), theirs);
    assert_same(&tensors, &read_tensors(&path).expect("reads back"));
    assert_eq!(
        dir_listing(dir.path()),
        vec!["ours.safetensors"],
        "no temporary file left"
    );
}

#[test]
fn safetensors_read_through_a_mapping_survive_the_file_being_replaced_or_removed() {
    let first = plain_set();
    let (_dir, path) = round_trip("model.safetensors", &first);
    let read_before = read_tensors(&path).expect("reads");
    let second = vec![("other".to_string(), plain(DType::U16, &[7], 9))];
    // Written beside the file and renamed onto it: the mapping keeps the old file's pages.
    write_tensors(&path, &second).expect("overwrites");
    assert_same(&second, &read_tensors(&path).expect("reads the new file"));
    assert_same(&first, &read_before);
    std::fs::remove_file(&path).expect("removes");
    assert_same(&first, &read_before);
}

#[test]
fn a_tensor_a_foreign_file_leaves_unaligned_is_read_aligned_and_bit_exact() {
    // Three u8, then an f32 pair at data offset 3: no writer of ferry's would, another may.
    let header = br#"{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"b":{"dtype":"F32","shape":[2],"data_offsets":[3,11]}}"#;
    let mut header = header.to_vec();
    // Padded so that the data starts 8-aligned within the file: `b` then starts at 8k + 3.
    while !(8 + header.len()).is_multiple_of(8) {
        header.push(b' ');
    }
    let a = [1u8, 2, 3];
    let b = [1.5f32, -2.25];
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    file.extend_from_slice(&a);
    for x in b {
        file.extend_from_slice(&x.to_le_bytes());
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("unaligned.safetensors");
    std::fs::write(&path, &file).expect("writes");
    let read = read_tensors(&path).expect("reads");
    assert_eq!(read[0].0, "a");
    assert_eq!(read[0].1.as_bytes(), &a);
    assert_eq!(read[1].0, "b");
    assert_eq!(read[1].1.dtype(), DType::F32);
    assert_eq!(read[1].1.as_slice::<f32>().expect("aligned for f32"), &b);
}

// --- corrupt burnpack files -----------------------------------------------------------------

/// `tensors` written as a `.bpk`, as bytes.
fn bpk_bytes(tensors: &[(String, TensorData)]) -> Vec<u8> {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("m.bpk");
    write_tensors(&path, tensors).expect("writes");
    std::fs::read(&path).expect("reads")
}

/// The mixed set and its `.bpk` bytes.
fn mixed_bpk() -> (Tensors, Vec<u8>) {
    let tensors = mixed_set();
    let file = bpk_bytes(&tensors);
    (tensors, file)
}

/// The burnpack layout: 10-byte header (magic u32, version u16, metadata size u32, all LE),
/// CBOR metadata, zero padding to a 256-byte boundary, then the data section.
fn split_bpk(file: &[u8]) -> (Value, Vec<u8>) {
    let size = u32::from_le_bytes(file[6..10].try_into().expect("4 bytes")) as usize;
    let metadata: Value = ciborium::from_reader(&file[10..10 + size]).expect("CBOR metadata");
    let data = file[burn_pack::aligned_data_section_start(size)..].to_vec();
    (metadata, data)
}

fn join_bpk(metadata: &Value, data: &[u8]) -> Vec<u8> {
    let mut cbor = Vec::new();
    ciborium::into_writer(metadata, &mut cbor).expect("encodes");
    let mut out = burn_pack::Header::new(cbor.len() as u32)
        .into_bytes()
        .to_vec();
    out.extend(&cbor);
    out.resize(burn_pack::aligned_data_section_start(cbor.len()), 0);
    out.extend(data);
    out
}

fn field<'a>(map: &'a mut Value, key: &str) -> &'a mut Value {
    map.as_map_mut()
        .expect("a map")
        .iter_mut()
        .find(|(k, _)| k.as_text() == Some(key))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no field {key}"))
}

/// The `(start, end)` data offsets of tensor `name`, relative to the data section.
fn offsets<'a>(metadata: &'a mut Value, name: &str) -> &'a mut Vec<Value> {
    let tensor = field(field(metadata, "tensors"), name);
    field(tensor, "data_offsets")
        .as_array_mut()
        .expect("an offset pair")
}

fn shift(offset: &mut Value, by: i128) {
    let now = i128::from(offset.as_integer().expect("an integer"));
    *offset = Value::Integer((now + by).try_into().expect("fits"));
}

#[test]
fn the_test_understands_the_burnpack_layout() {
    let (_, file) = mixed_bpk();
    let (metadata, data) = split_bpk(&file);
    assert_eq!(join_bpk(&metadata, &data), file);
}

#[test]
fn truncated_bpk_files_are_errors() {
    let (_, file) = mixed_bpk();
    let size = u32::from_le_bytes(file[6..10].try_into().expect("4 bytes")) as usize;
    let data_start = burn_pack::aligned_data_section_start(size);
    let cuts = [
        0,
        1,
        4,
        9,
        10,
        11,
        10 + size / 2,
        10 + size - 1,
        10 + size,
        data_start,
        data_start + 1,
        (data_start + file.len()) / 2,
        file.len() - 1,
    ];
    for cut in cuts {
        assert_refused(&file[..cut], "cut.bpk", &format!("cut at {cut}"));
    }
}

#[test]
fn truncated_or_padded_safetensors_files_are_errors() {
    let (_dir, path) = round_trip("cut.safetensors", &plain_set());
    let file = std::fs::read(&path).expect("reads");
    let header = u64::from_le_bytes(file[..8].try_into().expect("8 bytes")) as usize;
    for cut in [
        0,
        7,
        8,
        9,
        8 + header / 2,
        8 + header,
        8 + header + 1,
        file.len() - 1,
    ] {
        assert_refused(&file[..cut], "cut.safetensors", &format!("cut at {cut}"));
    }
    let mut long = file.clone();
    long.push(0);
    assert_refused(&long, "long.safetensors", "a trailing byte");
    let mut lie = file.clone();
    lie[..8].copy_from_slice(&(header as u64 + 8).to_le_bytes());
    assert_refused(&lie, "lie.safetensors", "header size + 8");
}

#[test]
fn a_quantized_tensor_one_byte_short_is_an_error_though_burn_pack_accepts_it() {
    let (tensors, file) = mixed_bpk();
    let victim = "q4s.block32.ue8m0";
    let full = tensors
        .iter()
        .find(|(n, _)| n == victim)
        .expect("in the set")
        .1
        .as_bytes()
        .len();

    // The end offset one less: the data is one byte short and nothing else is off.
    let (mut metadata, data) = split_bpk(&file);
    shift(&mut offsets(&mut metadata, victim)[1], -1);
    let short = join_bpk(&metadata, &data);
    let err = assert_refused(&short, "short.bpk", "end offset - 1");
    assert!(
        matches!(
            &err,
            FileError::Invalid {
                name,
                source: MetaError::ByteLenMismatch { expected, actual, .. },
            } if name == victim && *expected == full as u64 && *actual == full as u64 - 1
        ),
        "{err:?}"
    );

    // burn-pack itself reads it, handing out a tensor Burn's backends would panic on.
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("short.bpk");
    std::fs::write(&path, &short).expect("writes");
    let pack = burn_pack::Reader::from_file(&path)
        .and_then(burn_pack::Reader::into_tensors)
        .expect("burn-pack does not check quantized lengths");
    let seen = pack.iter().find(|t| t.name == victim).expect("there");
    assert_eq!(seen.byte_len(), full - 1);

    // The start offset one more: as short, and shifted.
    let (mut metadata, data) = split_bpk(&file);
    shift(&mut offsets(&mut metadata, victim)[0], 1);
    let err = assert_refused(&join_bpk(&metadata, &data), "late.bpk", "start offset + 1");
    assert!(
        matches!(&err, FileError::Invalid { name, .. } if name == victim),
        "{err:?}"
    );

    // The last tensor one byte short, and the file one byte shorter to match.
    let (_, q) = quantized_set().swap_remove(4);
    let tensors = vec![
        ("p".to_string(), plain(DType::F32, &[3], 1)),
        ("q".to_string(), q),
    ];
    let (mut metadata, mut data) = split_bpk(&bpk_bytes(&tensors));
    shift(&mut offsets(&mut metadata, "q")[1], -1);
    data.pop();
    let err = assert_refused(&join_bpk(&metadata, &data), "last.bpk", "last tensor short");
    assert!(
        matches!(&err, FileError::Invalid { name, .. } if name == "q"),
        "{err:?}"
    );
}

#[test]
fn lying_sizes_and_overlaps_are_errors() {
    let (_, file) = mixed_bpk();
    let size = u32::from_le_bytes(file[6..10].try_into().expect("4 bytes"));
    for lie in [size - 1, size + 1, size + 300, u32::MAX, 0] {
        let mut bad = file.clone();
        bad[6..10].copy_from_slice(&lie.to_le_bytes());
        assert_refused(&bad, "lie.bpk", &format!("metadata size {lie} for {size}"));
    }

    // Two tensors sharing bytes: the second's range moved onto the first's.
    let (mut metadata, data) = split_bpk(&file);
    let first = offsets(&mut metadata, "z.first").clone();
    let second = offsets(&mut metadata, "m.after.2");
    second[0] = first[0].clone();
    second[1] = first[0].clone();
    shift(&mut second[1], 5);
    let err = assert_refused(&join_bpk(&metadata, &data), "overlap.bpk", "overlap");
    assert!(err.to_string().contains("overlap"), "{err}");

    // Bytes after the last tensor.
    let mut long = file.clone();
    long.push(0);
    assert_refused(&long, "long.bpk", "a trailing byte");

    // A block size of more dims than Burn can hold (its accessors would panic).
    let (mut metadata, data) = split_bpk(&file);
    let tensor = field(field(&mut metadata, "tensors"), "q4s.block32.ue8m0");
    let scheme = field(field(tensor, "dtype"), "QFloat");
    let block = field(field(field(scheme, "block"), "size"), "len");
    *block = Value::Integer(9u8.into());
    let err = assert_refused(&join_bpk(&metadata, &data), "block.bpk", "block len 9");
    assert!(matches!(err, FileError::MalformedDType { .. }), "{err:?}");
}

/// Deterministic noise.
fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

#[test]
fn random_garbage_is_an_error() {
    let (_, file) = mixed_bpk();
    for (i, len) in [1usize, 9, 10, 64, 300, 5000].into_iter().enumerate() {
        let garbage = noise(len, i as u64);
        assert_refused(&garbage, "g.bpk", &format!("{len} random bytes"));
        assert_refused(&garbage, "g.safetensors", &format!("{len} random bytes"));
        // A real header in front of random metadata and data.
        let mut headed = file[..10].to_vec();
        headed.extend(&garbage);
        assert_refused(&headed, "h.bpk", &format!("header + {len} random bytes"));
        // A real header and metadata in front of random data of the wrong length.
        let mut body = file[..file.len() - 1].to_vec();
        body.extend(noise(len.min(200) + 2, i as u64 + 100));
        assert_refused(&body, "b.bpk", &format!("metadata + {len} random bytes"));
    }
    assert_refused(&[], "empty.bpk", "an empty file");
    assert_refused(&[], "empty.safetensors", "an empty file");
}

#[test]
fn every_byte_of_the_header_flipped_errs_or_reads_the_same_tensors() {
    let (tensors, file) = mixed_bpk();
    let size = u32::from_le_bytes(file[6..10].try_into().expect("4 bytes")) as usize;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("flip.bpk");
    let mut refused = 0;
    for at in 0..10 + size {
        let mut bad = file.clone();
        bad[at] ^= 0xff;
        std::fs::write(&path, &bad).expect("writes");
        match read_tensors(&path) {
            Err(e @ FileError::Panic { .. }) => panic!("byte {at}: something panicked: {e}"),
            Err(_) => refused += 1,
            // Burnpack has no checksum: a flip in a name or the order record can go unnoticed,
            // but never one that changes a tensor's dtype, shape or bytes.
            Ok(back) => {
                assert_eq!(back.len(), tensors.len(), "byte {at}");
                for ((name, want), (_, got)) in tensors.iter().zip(&back) {
                    assert_eq!(want.dtype(), got.dtype(), "byte {at}: {name}");
                    assert_eq!(want.shape(), got.shape(), "byte {at}: {name}");
                    assert_eq!(want.as_bytes(), got.as_bytes(), "byte {at}: {name}");
                }
            }
        }
    }
    assert!(
        refused > size / 2,
        "only {refused} of {} flips noticed",
        10 + size
    );
}
