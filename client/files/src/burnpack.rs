//! Burn's burnpack files (`.bpk`): the header and CBOR metadata validated against the file before
//! any tensor is taken from it (as ranges of a private mapping, like a safetensors file's), and
//! written through burn-pack.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::sync::{Arc, Mutex, mpsc};

use burn_std::{Bytes, DType};
use ferry_proto::tensor::meta_of;
use ferry_proto::{MetaError, TensorData, TensorMeta};
use serde::Deserialize;

use super::{
    FileError, FileParts, ORDER_KEY, apply_recorded_order, check_block_sizes, io_error,
    order_record, zeroed_for,
};

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

/// The tensors (in recorded order) and the file's `metadata` map, ferry's key included.
pub(super) fn read_burnpack(path: &Path) -> Result<FileParts, FileError> {
    let bad = |message: String| FileError::Burnpack(format!("{}: {message}", path.display()));
    let mut file = File::open(path).map_err(io_error(path))?;
    let Plan {
        tensors: planned,
        file_len,
        metadata,
    } = plan_burnpack(path, &mut file, &bad)?;

    // The tensors are taken from a private mapping of the very file just validated: a put sends
    // them to the socket straight from the page cache, with no copy into new memory (which
    // costs more than the network here).
    let mut mapped = ferry_memory::mapped_file::MappedFile::map(&file).map_err(io_error(path))?;
    if mapped.len() as u64 != file_len {
        return Err(bad(format!(
            "it changed while being read ({file_len} bytes, then {})",
            mapped.len()
        )));
    }
    // Ranges are taken in file order (the mapping hands them out that way); the result keeps
    // the plan's (recorded) order.
    let mut by_start: Vec<usize> = (0..planned.len()).collect();
    by_start.sort_by_key(|&i| planned[i].start);
    let mut taken: Vec<Option<Bytes>> = planned.iter().map(|_| None).collect();
    for i in by_start {
        let plan = &planned[i];
        let offset = usize::try_from(plan.start).map_err(|_| bad("offset overflow".into()))?;
        let in_file = mapped
            .take(offset, plan.meta.byte_len())
            .ok_or_else(|| bad(format!("tensor '{}' lies outside the file", plan.name)))?;
        taken[i] = Some(in_file);
    }
    let mut out = Vec::with_capacity(planned.len());
    for (plan, in_file) in planned.into_iter().zip(taken) {
        let name = plan.name;
        let in_file = in_file.ok_or_else(|| bad(format!("tensor '{name}' was not taken")))?;
        let dtype = plan.meta.dtype();
        // The alignment backends need to use the bytes in place (a quantized tensor's scales are
        // f32 after its values); a tensor the file does not align is copied into a buffer that
        // is (burn-pack aligns its tensors; other writers need not).
        let align = match dtype {
            DType::QFloat(_) => 16,
            plain => plain.size().max(1),
        };
        let bytes = if (in_file.as_ptr() as usize).is_multiple_of(align) {
            in_file
        } else {
            let mut aligned = zeroed_for(dtype, in_file.len());
            aligned.copy_from_slice(&in_file);
            aligned
        };
        let data = TensorData::try_from_bytes(bytes, plan.meta.shape().to_vec(), dtype)
            .map_err(|e| bad(format!("tensor '{name}': {e}")))?;
        meta_of(&data).map_err(|source| FileError::Invalid {
            name: name.clone(),
            source,
        })?;
        out.push((name, data));
    }
    Ok((out, metadata))
}

/// A burnpack file checked against itself: its tensors in order (their data not yet read), its
/// length, and its string metadata.
struct Plan {
    tensors: Vec<Planned>,
    file_len: u64,
    metadata: BTreeMap<String, String>,
}

/// Reads a burnpack header and metadata and checks them against the file: every tensor's range
/// within the file and disjoint from the others, its length per ferry's rule (which burn-pack
/// skips for quantized dtypes), its dtype one Burn can handle without panicking, and the file
/// exactly as long as its tensors. Returns the tensors in order (their `start` from the file's
/// beginning), their data not yet read, the file's length, and its string metadata ([`Plan`]).
fn plan_burnpack(
    path: &Path,
    file: &mut File,
    bad: &impl Fn(String) -> FileError,
) -> Result<Plan, FileError> {
    use burn_pack::{
        FORMAT_VERSION, HEADER_SIZE, Header, MAX_CBOR_RECURSION_DEPTH, MAX_METADATA_SIZE,
        MAX_TENSOR_COUNT, aligned_data_section_start,
    };

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

    // From the file's beginning (no overflow: every end was checked against the file above).
    for plan in &mut planned {
        plan.start += data_start;
        plan.end += data_start;
    }
    let record = metadata.metadata.get(ORDER_KEY).map(String::as_str);
    Ok(Plan {
        tensors: apply_recorded_order(planned, |p| p.name.as_str(), record),
        file_len,
        metadata: metadata.metadata,
    })
}

/// Writes the tensors with `metadata` (no key of ferry's: checked by the caller) beside ferry's
/// order record in the file's `metadata` map.
pub(super) fn write_burnpack(
    path: &Path,
    tensors: &[(String, TensorData)],
    metadata: &BTreeMap<String, String>,
) -> Result<(), FileError> {
    // burn-pack's writer does not hold its reader's limit; a file with more metadata than that
    // could be written and never read back.
    let metadata_len: usize = metadata.iter().map(|(k, v)| k.len() + v.len()).sum();
    if metadata_len as u64 > u64::from(burn_pack::MAX_METADATA_SIZE) {
        return Err(FileError::Burnpack(format!(
            "{}: {metadata_len} bytes of metadata exceed burnpack's limit of {}",
            path.display(),
            burn_pack::MAX_METADATA_SIZE
        )));
    }
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
    let writer = metadata
        .iter()
        .fold(burn_pack::Writer::new(entries), |writer, (key, value)| {
            writer.with_metadata(key, value)
        })
        .with_metadata(
            ORDER_KEY,
            &order_record(tensors.iter().map(|(n, _)| n.as_str())),
        )
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
