//! Tensor files: reading and writing Burn's burnpack (`.bpk`) and safetensors (`.safetensors`).
//!
//! [`read_file`] and [`write_file`] (or [`read_tensors`] and [`write_tensors`], tensors only)
//! take a path whose extension names the format ([`FileFormat`]); [`SafetensorsOutput`] lays a
//! new safetensors file out so that tensors can be received straight into it. The `ferry` command
//! line (`ferry put`, `ferry get`) is built on them.
//!
//! A file's user metadata (string pairs: a safetensors header's `__metadata__`, a burnpack file's
//! `metadata` map) is read and written with its tensors ([`FileContents::metadata`]). Ferry's own
//! keys there ([`RESERVED_METADATA_KEYS`]) are internal: left out on reading, made anew on
//! writing, and refused in user metadata ([`FileError::ReservedMetadataKey`]).
//!
//! Everything read from a file is checked against ferry's byte-length rule
//! ([`ferry_proto::tensor::meta_of`]) before it is returned, because neither format's reader
//! checks a quantized tensor's length (tracel-ai/burn#5836) and Burn's backends panic on a wrong
//! one. A file is validated structurally by ferry itself before burn-pack sees it, and whatever
//! might still panic underneath is contained and reported as [`FileError::Panic`].
//!
//! Both formats keep the order the tensors were written in: ferry records it in the file's
//! string metadata (`ferry.order`), since burnpack indexes tensors by name and safetensors sorts
//! them by dtype. A file from another tool is read in the order its data lies in the file.
//!
//! Byte order: Burn's `TensorData` bytes are native-endian. Burnpack stores them as Burn hands
//! them over, as Burn itself does. Safetensors is little-endian by specification, which native
//! order is on every target ferry is built for today (x86_64, aarch64); on a big-endian target
//! safetensors is refused ([`FileError::BigEndian`]) rather than written or read byte-swapped.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use burn_std::{Bytes, DType};
use ferry_proto::tensor::meta_of;
use ferry_proto::{MetaError, TensorData, TensorMeta};

/// String-metadata key under which ferry records the tensors' order (a JSON array of names).
const ORDER_KEY: &str = "ferry.order";
/// Safetensors metadata key mapping tensor names to the Burn dtype their standard safetensors
/// dtype stands for, where the two differ (a JSON object, e.g. `{"w": "Flex32"}`).
const DTYPES_KEY: &str = "ferry.dtypes";
/// The safetensors crate refuses headers larger than this; so does ferry, before allocating.
const SAFETENSORS_MAX_HEADER: u64 = 100_000_000;
/// The metadata keys ferry writes for itself (the order, Burn's dtypes), in either format: not
/// part of a file's user metadata, and refused in it.
pub const RESERVED_METADATA_KEYS: [&str; 2] = [ORDER_KEY, DTYPES_KEY];

/// A file's tensors and its whole string metadata (ferry's keys included), as the formats'
/// readers return them.
type FileParts = (Vec<(String, TensorData)>, BTreeMap<String, String>);

/// What a tensor file holds: its tensors and its user metadata.
#[derive(Debug, Clone, Default)]
pub struct FileContents {
    /// Every tensor, in the order it was written (see the crate's notes on order).
    pub tensors: Vec<(String, TensorData)>,
    /// The file's string metadata, less ferry's own keys ([`RESERVED_METADATA_KEYS`]): a
    /// safetensors header's `__metadata__` (`{"format": "pt"}`, say), a burnpack file's
    /// `metadata` map.
    pub metadata: BTreeMap<String, String>,
}

/// A file format ferry reads and writes, chosen by extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileFormat {
    /// Burn's own container (`.bpk`): every dtype, quantized ones with their scales included.
    Burnpack,
    /// Safetensors (`.safetensors`): plain dtypes only.
    Safetensors,
}

impl FileFormat {
    /// The format named by `path`'s extension (`.bpk` or `.safetensors`, in any letter case).
    pub fn from_path(path: &Path) -> Result<FileFormat, FileError> {
        let extension = path.extension().map(|e| e.to_string_lossy().into_owned());
        match extension.as_deref() {
            Some(e) if e.eq_ignore_ascii_case(burn_pack::EXTENSION) => Ok(FileFormat::Burnpack),
            Some(e) if e.eq_ignore_ascii_case("safetensors") => Ok(FileFormat::Safetensors),
            _ => Err(FileError::UnknownExtension {
                path: path.to_path_buf(),
                extension,
            }),
        }
    }

    /// The canonical extension, without the dot.
    pub fn extension(self) -> &'static str {
        match self {
            FileFormat::Burnpack => burn_pack::EXTENSION,
            FileFormat::Safetensors => "safetensors",
        }
    }
}

/// Why a tensor file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The operating system refused a read or a write.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// The path names no format ferry knows.
    #[error(
        "{}: {}; ferry reads and writes .bpk (burnpack) and .safetensors",
        .path.display(),
        describe_extension(.extension.as_deref())
    )]
    UnknownExtension {
        /// The path.
        path: PathBuf,
        /// Its extension, if it has one.
        extension: Option<String>,
    },
    /// Not a valid burnpack file, or burn-pack failed to write one; the message names the file.
    #[error("burnpack: {0}")]
    Burnpack(String),
    /// Not a valid safetensors file, or safetensors failed to write one; the message names the
    /// file.
    #[error("safetensors: {0}")]
    Safetensors(String),
    /// A tensor whose bytes disagree with its shape and dtype.
    #[error("tensor '{name}': {source}")]
    Invalid {
        /// The tensor.
        name: String,
        /// How they disagree.
        #[source]
        source: MetaError,
    },
    /// A dtype whose quantization scheme is malformed in a way Burn itself would panic on.
    #[error("tensor '{name}': malformed dtype: {reason}")]
    MalformedDType {
        /// The tensor.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A quantized tensor asked to go into a safetensors file.
    #[error(
        "tensor '{name}' is quantized and safetensors has no quantized dtypes; \
         write it to a .bpk (burnpack) file instead"
    )]
    QuantizedInSafetensors {
        /// The tensor.
        name: String,
    },
    /// A safetensors dtype that Burn has no dtype for.
    #[error("tensor '{name}' has dtype {dtype}, which Burn has no dtype for")]
    UnsupportedDType {
        /// The tensor.
        name: String,
        /// The dtype, as the file names it.
        dtype: String,
    },
    /// Two tensors with one name: neither format can hold both.
    #[error("tensor name '{name}' appears more than once")]
    DuplicateName {
        /// The name.
        name: String,
    },
    /// Safetensors data is little-endian and Burn's bytes are native-endian: on a big-endian
    /// target they would need swapping, which ferry does not do.
    #[error("safetensors files are little-endian; this big-endian target cannot use them")]
    BigEndian,
    /// User metadata with a key ferry keeps for itself in the file.
    #[error(
        "metadata key '{key}' is ferry's own (it records the tensors' order and dtypes) and \
         cannot be written as user metadata"
    )]
    ReservedMetadataKey {
        /// The key.
        key: String,
    },
    /// Something under ferry (burn-pack, safetensors, Burn's byte buffers) panicked on this file.
    #[error("{}: reading or writing it panicked: {message}", .path.display())]
    Panic {
        /// The file.
        path: PathBuf,
        /// The panic's message.
        message: String,
    },
}

fn describe_extension(extension: Option<&str>) -> String {
    match extension {
        Some(e) => format!("unsupported extension '.{e}'"),
        None => "no file extension".to_string(),
    }
}

/// Every tensor in the file, in file order, each validated with
/// [`ferry_proto::tensor::meta_of`] (the byte-length rule) before it is returned.
///
/// Either format's tensors are ranges of a private mapping of the file, validated whole first
/// (no copy; see [`ferry_memory::mapped_file::MappedFile`] for the contract: the file must not be
/// truncated while they live); a tensor the file does not align for its element type (16 bytes
/// for a quantized one) is copied.
pub fn read_tensors(path: &Path) -> Result<Vec<(String, TensorData)>, FileError> {
    read_file(path).map(|contents| contents.tensors)
}

/// Every tensor in the file, as [`read_tensors`] reads them, and the file's user metadata (less
/// ferry's own keys, [`RESERVED_METADATA_KEYS`]).
pub fn read_file(path: &Path) -> Result<FileContents, FileError> {
    let format = FileFormat::from_path(path)?;
    contained(path, || {
        let (tensors, mut metadata) = match format {
            FileFormat::Burnpack => read_burnpack(path)?,
            FileFormat::Safetensors => read_safetensors(path)?,
        };
        metadata.retain(|key, _| !RESERVED_METADATA_KEYS.contains(&key.as_str()));
        Ok(FileContents { tensors, metadata })
    })
}

/// Writes the tensors (names must be unique) atomically: the file is built beside `path` and
/// renamed onto it once complete, so `path` holds either its old contents or all of the new.
///
/// Every tensor is checked with [`ferry_proto::tensor::meta_of`] before anything is written.
pub fn write_tensors(path: &Path, tensors: &[(String, TensorData)]) -> Result<(), FileError> {
    write_file(path, tensors, &BTreeMap::new())
}

/// Writes the tensors as [`write_tensors`] does, with `metadata` as the file's user metadata
/// beside ferry's own keys; a key of ferry's ([`RESERVED_METADATA_KEYS`]) is refused
/// ([`FileError::ReservedMetadataKey`]), as is metadata that makes the header larger than the
/// format allows.
pub fn write_file(
    path: &Path,
    tensors: &[(String, TensorData)],
    metadata: &BTreeMap<String, String>,
) -> Result<(), FileError> {
    let format = FileFormat::from_path(path)?;
    check_metadata(metadata)?;
    contained(path, || {
        let mut seen = HashSet::with_capacity(tensors.len());
        for (name, data) in tensors {
            if !seen.insert(name.as_str()) {
                return Err(FileError::DuplicateName { name: name.clone() });
            }
            check_tensor(name, data)?;
        }
        match format {
            FileFormat::Burnpack => write_burnpack(path, tensors, metadata),
            FileFormat::Safetensors => write_safetensors(path, tensors, metadata),
        }
    })
}

/// Refuses user metadata that names one of ferry's own keys, which writing would overwrite.
fn check_metadata(metadata: &BTreeMap<String, String>) -> Result<(), FileError> {
    match RESERVED_METADATA_KEYS
        .iter()
        .find(|key| metadata.contains_key(**key))
    {
        Some(key) => Err(FileError::ReservedMetadataKey {
            key: (*key).to_string(),
        }),
        None => Ok(()),
    }
}

/// Runs `f`, turning a panic anywhere under it into [`FileError::Panic`]: a bad file must never
/// take the caller (a node, a CLI mid-batch) down with it.
fn contained<T>(path: &Path, f: impl FnOnce() -> Result<T, FileError>) -> Result<T, FileError> {
    ferry_proto::contained(f).unwrap_or_else(|panic| {
        Err(FileError::Panic {
            path: path.to_path_buf(),
            message: panic.message,
        })
    })
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> FileError + '_ {
    move |source| FileError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The dtype sanity check, then the byte-length rule.
fn check_tensor(name: &str, data: &TensorData) -> Result<TensorMeta, FileError> {
    let dtype = data.dtype();
    let value = ciborium::Value::serialized(&dtype).map_err(|e| FileError::MalformedDType {
        name: name.to_string(),
        reason: e.to_string(),
    })?;
    check_block_sizes(&value).map_err(|reason| FileError::MalformedDType {
        name: name.to_string(),
        reason,
    })?;
    meta_of(data).map_err(|source| FileError::Invalid {
        name: name.to_string(),
        source,
    })
}

/// Refuses a serialized `BlockSize` that Burn could not have built, before anything touches it.
///
/// `BlockSize` is `{storage: [u8; 5], len: u8}` and its accessors slice `storage[..len]`, so a
/// deserialized `len` over 5 panics in Burn (and in ferry-proto's dtype codes, `Debug`, ...).
/// Burn fills unused storage with 1 and compares the filler too, so other filler would make a
/// dtype that looks like a Burn scheme yet compares unequal to it. The walk is generic over the
/// serialized form because `DType` nests the block size a few levels deep.
fn check_block_sizes(value: &ciborium::Value) -> Result<(), String> {
    use ciborium::Value;
    match value {
        Value::Map(entries) => {
            let field = |key: &str| {
                entries
                    .iter()
                    .find(|(k, _)| k.as_text() == Some(key))
                    .map(|(_, v)| v)
            };
            if let (Some(storage), Some(len)) = (field("storage"), field("len")) {
                let storage: Vec<u64> = storage
                    .as_array()
                    .map(|items| {
                        items
                            .iter()
                            .filter_map(|v| v.as_integer().and_then(|i| u64::try_from(i).ok()))
                            .collect()
                    })
                    .unwrap_or_default();
                let len = len
                    .as_integer()
                    .and_then(|i| usize::try_from(i).ok())
                    .ok_or("a block size length that is not a small integer")?;
                let max = burn_std::quantization::BlockSize::MAX_DIMS;
                if storage.len() != max {
                    return Err(format!("a block size with {} storage slots", storage.len()));
                }
                if len > max {
                    return Err(format!("a block size of {len} dims (at most {max})"));
                }
                if storage[len..].iter().any(|&filler| filler != 1) {
                    return Err(format!("a block size with filler {:?}", &storage[len..]));
                }
            }
            entries
                .iter()
                .try_for_each(|(k, v)| check_block_sizes(k).and_then(|()| check_block_sizes(v)))
        }
        Value::Array(items) => items.iter().try_for_each(check_block_sizes),
        Value::Tag(_, inner) => check_block_sizes(inner),
        _ => Ok(()),
    }
}

/// A zeroed native buffer of `len` bytes, aligned for `dtype`'s elements so that backends can use
/// it in place (NdArray panics on a misaligned buffer). Quantized data is bytes plus scales that
/// Burn reads unaligned, so it needs no alignment.
fn zeroed_for(dtype: DType, len: usize) -> Bytes {
    let size = match dtype {
        DType::QFloat(_) => 1,
        plain => plain.size(),
    };
    // A plain tensor's length is a whole number of elements (the byte-length rule was checked).
    match size {
        8 if len.is_multiple_of(8) => Bytes::from_elems(vec![0u64; len / 8]),
        4 if len.is_multiple_of(4) => Bytes::from_elems(vec![0u32; len / 4]),
        2 if len.is_multiple_of(2) => Bytes::from_elems(vec![0u16; len / 2]),
        _ => Bytes::from_elems(vec![0u8; len]),
    }
}

/// Puts `items` in the order recorded under [`ORDER_KEY`] when that record is exactly a
/// permutation of their (unique) names, and otherwise leaves them in file order: a record that
/// does not match (another tool renamed or added a tensor) says nothing about the tensors.
fn apply_recorded_order<T>(
    mut items: Vec<T>,
    name: impl Fn(&T) -> &str,
    record: Option<&str>,
) -> Vec<T> {
    let Some(order) = record.and_then(|r| serde_json::from_str::<Vec<String>>(r).ok()) else {
        return items;
    };
    let position: HashMap<&str, usize> = order
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    let permutation = order.len() == items.len()
        && position.len() == order.len()
        && items.iter().all(|item| position.contains_key(name(item)));
    if permutation {
        items.sort_by_key(|item| position.get(name(item)).copied());
    }
    items
}

/// The JSON array of the tensors' names, in order, for [`ORDER_KEY`].
fn order_record<'a>(names: impl Iterator<Item = &'a str>) -> String {
    serde_json::Value::from(names.collect::<Vec<_>>()).to_string()
}

mod burnpack;
mod safetensors;

use self::burnpack::{read_burnpack, write_burnpack};
pub use self::safetensors::SafetensorsOutput;
use self::safetensors::{read_safetensors, write_safetensors};
