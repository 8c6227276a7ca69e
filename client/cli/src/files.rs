//! Tensor files: reading and writing Burn's burnpack (`.bpk`) and safetensors (`.safetensors`).
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
use std::fs::File;
use std::io::Read;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};

use burn_std::{BoolStore, Bytes, DType};
use ferry_proto::tensor::meta_of;
use ferry_proto::{MetaError, TensorData, TensorMeta};
use serde::Deserialize;

/// String-metadata key under which ferry records the tensors' order (a JSON array of names).
const ORDER_KEY: &str = "ferry.order";
/// Safetensors metadata key mapping tensor names to the Burn dtype their standard safetensors
/// dtype stands for, where the two differ (a JSON object, e.g. `{"w": "Flex32"}`).
const DTYPES_KEY: &str = "ferry.dtypes";
/// The safetensors crate refuses headers larger than this; so does ferry, before allocating.
const SAFETENSORS_MAX_HEADER: u64 = 100_000_000;

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
/// The returned tensors own their memory: nothing refers back to the file afterwards. Each byte
/// of tensor data is read from disk once, and besides the result at most one tensor's worth of
/// extra memory is held at a time.
pub fn read_tensors(path: &Path) -> Result<Vec<(String, TensorData)>, FileError> {
    let format = FileFormat::from_path(path)?;
    contained(path, || match format {
        FileFormat::Burnpack => read_burnpack(path),
        FileFormat::Safetensors => read_safetensors(path),
    })
}

/// Writes the tensors (names must be unique) atomically: the file is built beside `path` and
/// renamed onto it once complete, so `path` holds either its old contents or all of the new.
///
/// Every tensor is checked with [`ferry_proto::tensor::meta_of`] before anything is written.
pub fn write_tensors(path: &Path, tensors: &[(String, TensorData)]) -> Result<(), FileError> {
    let format = FileFormat::from_path(path)?;
    contained(path, || {
        let mut seen = HashSet::with_capacity(tensors.len());
        for (name, data) in tensors {
            if !seen.insert(name.as_str()) {
                return Err(FileError::DuplicateName { name: name.clone() });
            }
            check_tensor(name, data)?;
        }
        match format {
            FileFormat::Burnpack => write_burnpack(path, tensors),
            FileFormat::Safetensors => write_safetensors(path, tensors),
        }
    })
}

/// Runs `f`, turning a panic anywhere under it into [`FileError::Panic`]: a bad file must never
/// take the caller (a node, a CLI mid-batch) down with it.
fn contained<T>(path: &Path, f: impl FnOnce() -> Result<T, FileError>) -> Result<T, FileError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic payload".to_string());
        Err(FileError::Panic {
            path: path.to_path_buf(),
            message,
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

/// The JSON array of the tensors' names, for [`ORDER_KEY`].
fn order_record(tensors: &[(String, TensorData)]) -> String {
    serde_json::Value::from(tensors.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>()).to_string()
}

// ---------------------------------------------------------------------------------------------
// Burnpack
// ---------------------------------------------------------------------------------------------

/// The part of burnpack's CBOR metadata ferry checks; the rest (param ids, scalars) is ignored.
#[derive(Deserialize)]
struct PackMetadata {
    tensors: BTreeMap<String, PackDescriptor>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct PackDescriptor {
    /// Kept raw so that it can be checked before it becomes a `DType` (see `check_block_sizes`).
    dtype: ciborium::Value,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// One tensor of a burnpack file, validated against the file before any of its data is read.
struct Planned {
    name: String,
    start: u64,
    end: u64,
    meta: TensorMeta,
}

fn read_burnpack(path: &Path) -> Result<Vec<(String, TensorData)>, FileError> {
    let bad = |message: String| FileError::Burnpack(format!("{}: {message}", path.display()));
    let planned = plan_burnpack(path, &bad)?;

    let mut tensors: HashMap<String, burn_pack::Tensor> = burn_pack::Reader::from_file_exact(path)
        .and_then(burn_pack::Reader::into_tensors)
        .map_err(|e| pack_error(path, e))?
        .into_iter()
        .map(|t| (t.name.clone(), t))
        .collect();
    // burn-pack reopened the file by name; if it is not the file just validated, stop.
    let changed = || bad("the file changed while it was being read".to_string());
    if tensors.len() != planned.len() {
        return Err(changed());
    }

    let mut out = Vec::with_capacity(planned.len());
    for plan in planned {
        let tensor = tensors.remove(&plan.name).ok_or_else(changed)?;
        let (name, dtype, shape, _, view) = tensor.into_parts().map_err(|e| bad(e.to_string()))?;
        if dtype != plan.meta.dtype()
            || shape.as_slice() != plan.meta.shape()
            || view.len() != plan.meta.byte_len()
        {
            return Err(changed());
        }
        // burn-pack hands out lazy views of the file that re-read the path on access (and on
        // `split`, which GPU backends use on quantized data): a file overwritten later would
        // change or break tensors already returned, and a failed read panics inside `Deref`.
        // So read each view once, fallibly, into memory of ferry's own.
        let mut bytes = zeroed_for(dtype, view.len());
        let read = view
            .read(burn_std::Reader::new())
            .map_err(|e| FileError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::other(format!("tensor '{name}': {e}")),
            })?;
        bytes.copy_from_slice(read);
        drop(view);
        let data = TensorData::try_from_bytes(bytes, shape, dtype)
            .map_err(|e| bad(format!("tensor '{name}': {e}")))?;
        meta_of(&data).map_err(|source| FileError::Invalid {
            name: name.clone(),
            source,
        })?;
        out.push((name, data));
    }
    Ok(out)
}

/// Reads a burnpack header and metadata and checks them against the file: every tensor's range
/// within the file and disjoint from the others, its length per ferry's rule (which burn-pack
/// skips for quantized dtypes), its dtype one Burn can handle without panicking, and the file
/// exactly as long as its tensors. Returns the tensors in order, their data not yet read.
fn plan_burnpack(
    path: &Path,
    bad: &impl Fn(String) -> FileError,
) -> Result<Vec<Planned>, FileError> {
    use burn_pack::{
        FORMAT_VERSION, HEADER_SIZE, Header, MAX_CBOR_RECURSION_DEPTH, MAX_METADATA_SIZE,
        MAX_TENSOR_COUNT, aligned_data_section_start,
    };

    let mut file = File::open(path).map_err(io_error(path))?;
    let file_len = file.metadata().map_err(io_error(path))?.len();
    if file_len < HEADER_SIZE as u64 {
        return Err(bad(format!(
            "{file_len} bytes is too short for a burnpack header ({HEADER_SIZE} bytes)"
        )));
    }
    let mut raw_header = [0u8; HEADER_SIZE];
    file.read_exact(&mut raw_header).map_err(io_error(path))?;
    let header = Header::from_bytes(&raw_header).map_err(|e| bad(e.to_string()))?;
    if header.version > FORMAT_VERSION {
        return Err(bad(format!(
            "format version {} is newer than the {FORMAT_VERSION} this build reads",
            header.version
        )));
    }
    if header.metadata_size > MAX_METADATA_SIZE {
        return Err(bad(format!(
            "metadata of {} bytes exceeds burnpack's limit of {MAX_METADATA_SIZE}",
            header.metadata_size
        )));
    }
    // Checked before allocating: burn-pack would allocate whatever the header claims first.
    let metadata_end = HEADER_SIZE as u64 + u64::from(header.metadata_size);
    if metadata_end > file_len {
        return Err(bad(format!(
            "truncated: the header claims {} bytes of metadata, the file has {}",
            header.metadata_size,
            file_len - HEADER_SIZE as u64
        )));
    }
    let mut raw = vec![0u8; header.metadata_size as usize];
    file.read_exact(&mut raw).map_err(io_error(path))?;
    drop(file);
    let mut rest = raw.as_slice();
    let metadata: PackMetadata =
        ciborium::de::from_reader_with_recursion_limit(&mut rest, MAX_CBOR_RECURSION_DEPTH)
            .map_err(|e| bad(format!("metadata: {e}")))?;
    // The header's size must be the metadata's: bytes past the CBOR mean it lies.
    if !rest.is_empty() {
        return Err(bad(format!(
            "the header claims {} bytes of metadata, its CBOR ends {} bytes earlier",
            header.metadata_size,
            rest.len()
        )));
    }
    drop(raw);
    if metadata.tensors.len() > MAX_TENSOR_COUNT {
        return Err(bad(format!(
            "{} tensors exceeds burnpack's limit of {MAX_TENSOR_COUNT}",
            metadata.tensors.len()
        )));
    }

    let data_start = aligned_data_section_start(header.metadata_size as usize) as u64;
    let mut planned = Vec::with_capacity(metadata.tensors.len());
    for (name, descriptor) in metadata.tensors {
        check_block_sizes(&descriptor.dtype).map_err(|reason| FileError::MalformedDType {
            name: name.clone(),
            reason,
        })?;
        let dtype: DType = descriptor
            .dtype
            .deserialized()
            .map_err(|e| bad(format!("tensor '{name}': dtype: {e}")))?;
        let shape = descriptor
            .shape
            .iter()
            .map(|&dim| usize::try_from(dim).map_err(|_| MetaError::DimTooLarge { dim }))
            .collect::<Result<Vec<_>, _>>();
        let (start, end) = descriptor.data_offsets;
        if end < start {
            return Err(bad(format!(
                "tensor '{name}': data range {start}..{end} ends before it starts"
            )));
        }
        let meta = shape
            .and_then(|shape| TensorMeta::with_byte_len(shape, dtype, end - start))
            .map_err(|source| FileError::Invalid {
                name: name.clone(),
                source,
            })?;
        planned.push(Planned {
            name,
            start,
            end,
            meta,
        });
    }

    planned.sort_by(|a, b| (a.start, a.end, &a.name).cmp(&(b.start, b.end, &b.name)));
    // burn-pack would hand out overlapping ranges as two tensors sharing bytes; its writer never
    // makes them, so they mean a corrupt or hand-crafted file.
    for pair in planned.windows(2) {
        if pair[1].start < pair[0].end {
            return Err(bad(format!(
                "tensors '{}' and '{}' overlap in the data section",
                pair[0].name, pair[1].name
            )));
        }
    }
    let data_len = planned.iter().map(|p| p.end).max().unwrap_or(0);
    let expected = data_start
        .checked_add(data_len)
        .ok_or_else(|| bad("tensor offsets overflow".to_string()))?;
    if file_len < expected {
        return Err(bad(format!(
            "truncated: its tensors need {expected} bytes, the file has {file_len}"
        )));
    }
    if file_len > expected {
        return Err(bad(format!(
            "{} bytes after the last tensor, where burnpack has none",
            file_len - expected
        )));
    }

    let record = metadata.metadata.get(ORDER_KEY).map(String::as_str);
    Ok(apply_recorded_order(planned, |p| p.name.as_str(), record))
}

fn write_burnpack(path: &Path, tensors: &[(String, TensorData)]) -> Result<(), FileError> {
    // burn-pack wants `'static` tensor bytes, but these are borrowed: copying them all up front
    // would double the caller's memory. Instead each tensor is deferred, and a scoped thread
    // copies one tensor at a time as the writer asks for it, in the writer's (= this) order.
    let (sender, receiver) = mpsc::sync_channel::<(usize, Bytes)>(0);
    let receiver = Arc::new(Mutex::new(receiver));
    let entries: Vec<burn_pack::Tensor> = tensors
        .iter()
        .enumerate()
        .map(|(index, (name, data))| {
            let receiver = Arc::clone(&receiver);
            burn_pack::Tensor::deferred(
                name.clone(),
                data.dtype(),
                data.shape().clone(),
                None,
                data.bytes().len(),
                move || {
                    let next = receiver
                        .lock()
                        .map_err(|_| burn_pack::Error::IoError("tensor source failed".into()))?
                        .recv();
                    match next {
                        Ok((sent, bytes)) if sent == index => Ok(bytes),
                        _ => Err(burn_pack::Error::IoError(
                            "tensor source out of step with the writer".into(),
                        )),
                    }
                },
            )
        })
        .collect();
    drop(receiver);
    let writer = burn_pack::Writer::new(entries)
        .with_metadata(ORDER_KEY, &order_record(tensors))
        .auto_extension(false);

    std::thread::scope(|scope| {
        scope.spawn(move || {
            for (index, (_, data)) in tensors.iter().enumerate() {
                let copy = Bytes::from_bytes_vec(data.as_bytes().to_vec());
                // The writer stopped early (and dropped the receiver): so does this.
                if sender.send((index, copy)).is_err() {
                    break;
                }
            }
        });
        // Builds `<name>.<pid>-<n>.tmp` beside `path`, fsyncs it, renames it onto `path`.
        writer.write_to_file(path).map_err(|e| pack_error(path, e))
    })
}

/// burn-pack's error as ferry's: its I/O failures (a missing directory, a full disk) become
/// [`FileError::Io`], though burn-pack keeps only their message, not the original error.
fn pack_error(path: &Path, error: burn_pack::Error) -> FileError {
    match error {
        burn_pack::Error::IoError(message) => FileError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(message),
        },
        other => FileError::Burnpack(format!("{}: {other}", path.display())),
    }
}

// ---------------------------------------------------------------------------------------------
// Safetensors
// ---------------------------------------------------------------------------------------------

/// The safetensors dtype a Burn dtype is written as, and the Burn dtype's tag for
/// [`DTYPES_KEY`] where safetensors alone would read back a different Burn dtype.
fn to_safetensors(
    name: &str,
    dtype: DType,
) -> Result<(safetensors::Dtype, Option<&'static str>), FileError> {
    use safetensors::Dtype as S;
    Ok(match dtype {
        DType::F64 => (S::F64, None),
        DType::F32 => (S::F32, None),
        DType::F16 => (S::F16, None),
        DType::BF16 => (S::BF16, None),
        DType::I64 => (S::I64, None),
        DType::I32 => (S::I32, None),
        DType::I16 => (S::I16, None),
        DType::I8 => (S::I8, None),
        DType::U64 => (S::U64, None),
        DType::U32 => (S::U32, None),
        DType::U16 => (S::U16, None),
        DType::U8 => (S::U8, None),
        DType::Bool(BoolStore::Native) => (S::BOOL, None),
        // Same bits as the standard dtype: other readers get the standard one, ferry gets the
        // Burn dtype back through the metadata.
        DType::Flex32 => (S::F32, Some("Flex32")),
        DType::Bool(BoolStore::U8) => (S::BOOL, Some("Bool(U8)")),
        DType::Bool(BoolStore::U32) => (S::U32, Some("Bool(U32)")),
        DType::QFloat(_) => {
            return Err(FileError::QuantizedInSafetensors {
                name: name.to_string(),
            });
        }
    })
}

/// The Burn dtype of a safetensors tensor, `tag` being its [`DTYPES_KEY`] entry if any.
fn from_safetensors(
    path: &Path,
    name: &str,
    dtype: safetensors::Dtype,
    tag: Option<&str>,
) -> Result<DType, FileError> {
    use safetensors::Dtype as S;
    if let Some(tag) = tag {
        let (burn, carrier) = match tag {
            "Flex32" => (DType::Flex32, S::F32),
            "Bool(U8)" => (DType::Bool(BoolStore::U8), S::BOOL),
            "Bool(U32)" => (DType::Bool(BoolStore::U32), S::U32),
            other => {
                return Err(FileError::Safetensors(format!(
                    "{}: tensor '{name}': unknown Burn dtype '{other}' in {DTYPES_KEY}",
                    path.display()
                )));
            }
        };
        if dtype != carrier {
            return Err(FileError::Safetensors(format!(
                "{}: tensor '{name}' is {dtype:?}, but {DTYPES_KEY} says {tag}, which is stored \
                 as {carrier:?}",
                path.display()
            )));
        }
        return Ok(burn);
    }
    Ok(match dtype {
        S::F64 => DType::F64,
        S::F32 => DType::F32,
        S::F16 => DType::F16,
        S::BF16 => DType::BF16,
        S::I64 => DType::I64,
        S::I32 => DType::I32,
        S::I16 => DType::I16,
        S::I8 => DType::I8,
        S::U64 => DType::U64,
        S::U32 => DType::U32,
        S::U16 => DType::U16,
        S::U8 => DType::U8,
        S::BOOL => DType::Bool(BoolStore::Native),
        other => {
            return Err(FileError::UnsupportedDType {
                name: name.to_string(),
                dtype: format!("{other:?}"),
            });
        }
    })
}

/// A tensor as safetensors' writer sees it, borrowing the caller's bytes.
struct View<'a> {
    dtype: safetensors::Dtype,
    data: &'a TensorData,
}

impl safetensors::View for View<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        self.data.shape().as_slice()
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(self.data.as_bytes())
    }

    fn data_len(&self) -> usize {
        self.data.bytes().len()
    }
}

fn write_safetensors(path: &Path, tensors: &[(String, TensorData)]) -> Result<(), FileError> {
    if cfg!(target_endian = "big") {
        return Err(FileError::BigEndian);
    }
    let mut views = Vec::with_capacity(tensors.len());
    let mut tags = BTreeMap::new();
    for (name, data) in tensors {
        if name == "__metadata__" {
            return Err(FileError::Safetensors(format!(
                "{}: a tensor cannot be named '__metadata__' in safetensors",
                path.display()
            )));
        }
        let (dtype, tag) = to_safetensors(name, data.dtype())?;
        if let Some(tag) = tag {
            tags.insert(name.as_str(), tag);
        }
        views.push((name.as_str(), View { dtype, data }));
    }
    let mut metadata = HashMap::from([(ORDER_KEY.to_string(), order_record(tensors))]);
    if !tags.is_empty() {
        let tags: serde_json::Map<String, serde_json::Value> = tags
            .into_iter()
            .map(|(name, tag)| (name.to_string(), serde_json::Value::from(tag)))
            .collect();
        metadata.insert(
            DTYPES_KEY.to_string(),
            serde_json::Value::Object(tags).to_string(),
        );
    }
    // Writes a temporary file beside `path` and renames it onto `path`.
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|e| match e {
        safetensors::SafeTensorError::IoError(source) => FileError::Io {
            path: path.to_path_buf(),
            source,
        },
        other => FileError::Safetensors(format!("{}: {other}", path.display())),
    })
}

fn read_safetensors(path: &Path) -> Result<Vec<(String, TensorData)>, FileError> {
    if cfg!(target_endian = "big") {
        return Err(FileError::BigEndian);
    }
    let bad = |message: String| FileError::Safetensors(format!("{}: {message}", path.display()));
    let mut file = File::open(path).map_err(io_error(path))?;
    let file_len = file.metadata().map_err(io_error(path))?.len();
    if file_len < 8 {
        return Err(bad(format!("{file_len} bytes is too short for a header")));
    }
    let mut raw_len = [0u8; 8];
    file.read_exact(&mut raw_len).map_err(io_error(path))?;
    let header_len = u64::from_le_bytes(raw_len);
    if header_len > SAFETENSORS_MAX_HEADER {
        return Err(bad(format!(
            "a header of {header_len} bytes exceeds the limit of {SAFETENSORS_MAX_HEADER}"
        )));
    }
    if 8 + header_len > file_len {
        return Err(bad(format!(
            "truncated: the header claims {header_len} bytes, the file has {}",
            file_len - 8
        )));
    }
    let mut raw = vec![0u8; header_len as usize];
    file.read_exact(&mut raw).map_err(io_error(path))?;
    // The crate's own header type validates what it parses: offsets contiguous from 0, each
    // range exactly shape x dtype long. Parsing just the header (rather than handing the crate
    // the whole file) lets the data go straight from disk into aligned buffers, read once.
    let header: safetensors::tensor::Metadata =
        serde_json::from_slice(&raw).map_err(|e| bad(format!("header: {e}")))?;
    drop(raw);
    let expected = 8 + header_len + header.data_len() as u64;
    if file_len != expected {
        return Err(bad(format!(
            "its header describes {expected} bytes, the file has {file_len}"
        )));
    }

    let strings = header.metadata().as_ref();
    let tags: HashMap<String, String> = match strings.and_then(|m| m.get(DTYPES_KEY)) {
        Some(json) => serde_json::from_str(json).map_err(|e| bad(format!("{DTYPES_KEY}: {e}")))?,
        None => HashMap::new(),
    };
    let names = header.offset_keys();
    if let Some(stray) = tags.keys().find(|t| header.info(t).is_none()) {
        return Err(bad(format!(
            "{DTYPES_KEY} names '{stray}', which is not in the file"
        )));
    }

    // `offset_keys` is data order, and the data is contiguous from the start: read straight on.
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let info = header
            .info(&name)
            .ok_or_else(|| bad(format!("tensor '{name}' vanished from its own header")))?;
        let dtype = from_safetensors(path, &name, info.dtype, tags.get(&name).map(String::as_str))?;
        let len = info.data_offsets.1 - info.data_offsets.0;
        let meta =
            TensorMeta::with_byte_len(info.shape.clone(), dtype, len as u64).map_err(|source| {
                FileError::Invalid {
                    name: name.clone(),
                    source,
                }
            })?;
        let mut bytes = zeroed_for(dtype, meta.byte_len());
        file.read_exact(&mut bytes).map_err(io_error(path))?;
        let data = TensorData::try_from_bytes(bytes, info.shape.clone(), dtype)
            .map_err(|e| bad(format!("tensor '{name}': {e}")))?;
        meta_of(&data).map_err(|source| FileError::Invalid {
            name: name.clone(),
            source,
        })?;
        out.push((name, data));
    }
    let record = strings.and_then(|m| m.get(ORDER_KEY)).map(String::as_str);
    Ok(apply_recorded_order(out, |(n, _)| n.as_str(), record))
}
