//! A tensor file's own metadata (`ferry_files::read_file`, `write_file`): the user's pairs
//! survive a round trip through either format, ferry's own keys stay internal, and a user key
//! equal to one of them is refused rather than lost.
// Test code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn_backend::{DType, TensorData};
use ferry_files::{
    FileError, RESERVED_METADATA_KEYS, SafetensorsOutput, read_file, read_tensors, write_file,
    write_tensors,
};

fn user_metadata() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        (
            "note".to_string(),
            "trained on \"quotes\", ünïcode".to_string(),
        ),
    ])
}

fn tensors() -> Vec<(String, TensorData)> {
    let bytes: Vec<u8> = (0u8..24).collect();
    vec![
        (
            "w".to_string(),
            TensorData::from_bytes_vec(bytes.clone(), vec![2, 3], DType::F32),
        ),
        // Flex32 makes ferry record a dtype (`ferry.dtypes`) as well as the order.
        (
            "flex".to_string(),
            TensorData::from_bytes_vec(bytes[..8].to_vec(), vec![2], DType::Flex32),
        ),
        (
            "a".to_string(),
            TensorData::from_bytes_vec(bytes[..6].to_vec(), vec![3], DType::I16),
        ),
    ]
}

/// The raw `__metadata__` of a safetensors file, as any reader sees it.
fn raw_safetensors_metadata(path: &Path) -> HashMap<String, String> {
    let raw = std::fs::read(path).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&raw).unwrap();
    header.metadata().clone().unwrap_or_default()
}

fn assert_same_tensors(got: &[(String, TensorData)], want: &[(String, TensorData)]) {
    assert_eq!(got.len(), want.len());
    for ((gn, g), (wn, w)) in got.iter().zip(want) {
        assert_eq!(gn, wn);
        assert_eq!(g.dtype(), w.dtype(), "{gn}");
        assert_eq!(g.shape(), w.shape(), "{gn}");
        assert_eq!(g.as_bytes(), w.as_bytes(), "{gn}");
    }
}

#[test]
fn user_metadata_round_trips_through_both_formats_and_ferrys_keys_stay_internal() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["m.safetensors", "m.bpk"] {
        let path = dir.path().join(name);
        write_file(&path, &tensors(), &user_metadata()).unwrap();
        let contents = read_file(&path).unwrap();
        assert_eq!(contents.metadata, user_metadata(), "{name}");
        assert_same_tensors(&contents.tensors, &tensors());
        // Without metadata, none comes back (ferry's own keys are not the user's).
        write_tensors(&path, &tensors()).unwrap();
        assert!(read_file(&path).unwrap().metadata.is_empty(), "{name}");
    }
    // In the safetensors header, the user's pairs lie beside ferry's keys for any reader.
    let path = dir.path().join("m.safetensors");
    write_file(&path, &tensors(), &user_metadata()).unwrap();
    let raw = raw_safetensors_metadata(&path);
    for (key, value) in user_metadata() {
        assert_eq!(raw.get(&key), Some(&value));
    }
    for key in RESERVED_METADATA_KEYS {
        assert!(raw.contains_key(key), "{key} written");
    }
}

#[test]
fn a_reference_writers_metadata_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0u8..16).collect();
    let views = vec![(
        "w",
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4], &data).unwrap(),
    )];
    let path = dir.path().join("foreign.safetensors");
    let metadata: HashMap<String, String> = user_metadata().into_iter().collect();
    safetensors::serialize_to_file(views, Some(metadata), &path).unwrap();
    let contents = read_file(&path).unwrap();
    assert_eq!(contents.metadata, user_metadata());
    assert_eq!(contents.tensors[0].1.as_bytes(), data.as_slice());
    // And written again by ferry, a reference reader finds the same pairs.
    let again = dir.path().join("again.safetensors");
    write_file(&again, &contents.tensors, &contents.metadata).unwrap();
    let raw = raw_safetensors_metadata(&again);
    assert_eq!(raw.get("format").map(String::as_str), Some("pt"));
    assert_eq!(raw.get("note"), user_metadata().get("note"));
}

#[test]
fn a_user_key_equal_to_ferrys_own_is_refused_and_nothing_is_written() {
    let dir = tempfile::tempdir().unwrap();
    for key in RESERVED_METADATA_KEYS {
        let mut metadata = user_metadata();
        metadata.insert(key.to_string(), "[]".to_string());
        for name in ["c.safetensors", "c.bpk"] {
            let path = dir.path().join(name);
            match write_file(&path, &tensors(), &metadata) {
                Err(FileError::ReservedMetadataKey { key: refused }) => assert_eq!(refused, key),
                other => panic!("{name}: expected ReservedMetadataKey, got {other:?}"),
            }
            assert!(!path.exists(), "{name} was written");
        }
        let described = vec![("w".to_string(), DType::F32, vec![2])];
        let path = dir.path().join("out.safetensors");
        assert!(matches!(
            SafetensorsOutput::create(&path, &described, &metadata),
            Err(FileError::ReservedMetadataKey { .. })
        ));
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn metadata_counts_toward_the_safetensors_header_limit() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.safetensors");
    let metadata = BTreeMap::from([("big".to_string(), "x".repeat(100_000_001))]);
    let err = write_file(&path, &tensors(), &metadata).unwrap_err();
    assert!(
        matches!(&err, FileError::Safetensors(m) if m.contains("exceeds the limit")),
        "{err:?}"
    );
    assert!(!path.exists());
    // A file of plain tensors still reads as before.
    write_tensors(&path, &tensors()).unwrap();
    assert_same_tensors(&read_tensors(&path).unwrap(), &tensors());
}
