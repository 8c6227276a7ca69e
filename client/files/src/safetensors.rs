//! Safetensors files (`.safetensors`): plain dtypes only, little-endian, the header bounded
//! before it is allocated, Burn's own dtypes recorded in the metadata where they differ, the
//! user's metadata (`__metadata__`) beside ferry's own keys.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::Path;

use burn_std::{BoolStore, DType};
use ferry_proto::tensor::meta_of;
use ferry_proto::{TensorData, TensorMeta};

use super::{
    DTYPES_KEY, FileError, FileParts, ORDER_KEY, SAFETENSORS_MAX_HEADER, apply_recorded_order,
    check_metadata, io_error, order_record, zeroed_for,
};

/// The safetensors dtype a Burn dtype is written as, and the Burn dtype's tag for
/// [`DTYPES_KEY`] where safetensors alone would read back a different Burn dtype.
fn to_safetensors(
    name: &str,
    dtype: DType,
) -> Result<(::safetensors::Dtype, Option<&'static str>), FileError> {
    use ::safetensors::Dtype as S;
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
    dtype: ::safetensors::Dtype,
    tag: Option<&str>,
) -> Result<DType, FileError> {
    use ::safetensors::Dtype as S;
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

/// Where each tensor of a safetensors file ferry writes lies, and the header that says so,
/// computed from the tensors' descriptions alone, so that their bytes can be written (or
/// received) straight into place. The order and the header are the format's own writer's:
/// tensors sorted by descending dtype alignment, then by name; the header built by the crate's
/// own [`::safetensors::tensor::Metadata`] and padded with spaces to 8 bytes.
struct Layout {
    /// The length prefix and the header.
    header: Vec<u8>,
    /// Per tensor, in the order given: its range in the file.
    ranges: Vec<std::ops::Range<usize>>,
    /// The tensors in the order their data lies in the file (indices into the order given).
    data_order: Vec<usize>,
    /// The file's length.
    len: usize,
}

fn layout(
    path: &Path,
    tensors: &[(String, DType, Vec<usize>)],
    user: &BTreeMap<String, String>,
) -> Result<Layout, FileError> {
    check_metadata(user)?;
    let bad = |message: String| FileError::Safetensors(format!("{}: {message}", path.display()));
    let mut seen = std::collections::HashSet::with_capacity(tensors.len());
    let mut described = Vec::with_capacity(tensors.len());
    let mut tags = BTreeMap::new();
    for (index, (name, dtype, shape)) in tensors.iter().enumerate() {
        if name == "__metadata__" {
            return Err(bad(
                "a tensor cannot be named '__metadata__' in safetensors".into(),
            ));
        }
        if !seen.insert(name.as_str()) {
            return Err(FileError::DuplicateName { name: name.clone() });
        }
        let (st, tag) = to_safetensors(name, *dtype)?;
        if let Some(tag) = tag {
            tags.insert(name.as_str(), tag);
        }
        let len = TensorMeta::new(shape.clone(), *dtype)
            .map_err(|source| FileError::Invalid {
                name: name.clone(),
                source,
            })?
            .byte_len();
        described.push((index, st, len));
    }
    // The format's writer's order: descending dtype, then name.
    described
        .sort_by(|(l, ldt, _), (r, rdt, _)| rdt.cmp(ldt).then(tensors[*l].0.cmp(&tensors[*r].0)));
    let mut offset = 0usize;
    let mut infos = Vec::with_capacity(described.len());
    let mut data_ranges = Vec::with_capacity(described.len());
    for &(index, st, len) in &described {
        let end = offset
            .checked_add(len)
            .ok_or_else(|| bad("the tensors' total size overflows".into()))?;
        infos.push((
            tensors[index].0.clone(),
            ::safetensors::tensor::TensorInfo {
                dtype: st,
                shape: tensors[index].2.clone(),
                data_offsets: (offset, end),
            },
        ));
        data_ranges.push((index, offset..end));
        offset = end;
    }
    // The user's pairs, then ferry's own (no key is both: checked above). The header's size
    // limit below counts them all.
    let mut metadata: HashMap<String, String> = user.clone().into_iter().collect();
    metadata.insert(
        ORDER_KEY.to_string(),
        order_record(tensors.iter().map(|(n, _, _)| n.as_str())),
    );
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
    let header = ::safetensors::tensor::Metadata::new(Some(metadata), infos)
        .map_err(|e| bad(e.to_string()))?;
    let mut json = serde_json::to_vec(&header).map_err(|e| bad(e.to_string()))?;
    json.resize(json.len().next_multiple_of(8), b' ');
    if json.len() as u64 > SAFETENSORS_MAX_HEADER {
        return Err(bad(format!(
            "a header of {} bytes exceeds the limit of {SAFETENSORS_MAX_HEADER}",
            json.len()
        )));
    }
    let start = 8 + json.len();
    let len = start
        .checked_add(offset)
        .ok_or_else(|| bad("the file's size overflows".into()))?;
    let mut prefixed = (json.len() as u64).to_le_bytes().to_vec();
    prefixed.extend_from_slice(&json);
    let mut ranges = vec![0..0; tensors.len()];
    let data_order = data_ranges.iter().map(|(i, _)| *i).collect();
    for (index, range) in data_ranges {
        ranges[index] = start + range.start..start + range.end;
    }
    Ok(Layout {
        header: prefixed,
        ranges,
        data_order,
        len,
    })
}

/// A safetensors file being written in place: created beside its path, sized and mapped, its
/// header written; each tensor's bytes go straight into their range ([`buffer`](Self::buffer));
/// [`commit`](Self::commit) renames it onto the path, so the path holds either its old contents
/// or all of the new. Dropped without a commit, it is removed.
pub struct SafetensorsOutput {
    path: std::path::PathBuf,
    file: tempfile::NamedTempFile,
    mapped: ferry_memory::mapped_file::MappedFile,
    layout: Layout,
}

impl SafetensorsOutput {
    /// Lays out `tensors` (name, dtype, shape; names unique), creates the file beside `path` and
    /// writes its header, with `metadata` in its `__metadata__` beside ferry's own keys (one of
    /// which is refused as a user key: [`FileError::ReservedMetadataKey`]).
    pub fn create(
        path: &Path,
        tensors: &[(String, DType, Vec<usize>)],
        metadata: &BTreeMap<String, String>,
    ) -> Result<SafetensorsOutput, FileError> {
        if cfg!(target_endian = "big") {
            return Err(FileError::BigEndian);
        }
        let layout = layout(path, tensors, metadata)?;
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        // Made as any new file (0666 less the umask), not 0600 as temporary files are: it becomes
        // the file at `path`.
        let file = tempfile::Builder::new()
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .tempfile_in(dir)
            .map_err(io_error(path))?;
        let mut mapped = ferry_memory::mapped_file::MappedFile::create(file.as_file(), layout.len)
            .map_err(io_error(path))?;
        let mut header = mapped.take(0, layout.header.len()).ok_or_else(|| {
            FileError::Safetensors(format!("{}: no room for the header", path.display()))
        })?;
        header.copy_from_slice(&layout.header);
        Ok(SafetensorsOutput {
            path: path.to_path_buf(),
            file,
            mapped,
            layout,
        })
    }

    /// The tensors in the order their bytes lie in the file (indices into the order given to
    /// [`create`](Self::create)): the order to fill them in.
    pub fn data_order(&self) -> &[usize] {
        &self.layout.data_order
    }

    /// The range of the file that the `index`-th tensor's bytes go to, as a buffer to write or
    /// receive into; `None` for an index out of range, or one asked for out of
    /// [`data_order`](Self::data_order) or twice.
    pub fn buffer(&mut self, index: usize) -> Option<burn_std::Bytes> {
        let range = self.layout.ranges.get(index)?.clone();
        self.mapped.take(range.start, range.len())
    }

    /// Renames the file onto its path.
    pub fn commit(self) -> Result<(), FileError> {
        let SafetensorsOutput {
            path, file, mapped, ..
        } = self;
        drop(mapped);
        file.persist(&path).map_err(|e| io_error(&path)(e.error))?;
        Ok(())
    }
}

pub(super) fn write_safetensors(
    path: &Path,
    tensors: &[(String, TensorData)],
    metadata: &BTreeMap<String, String>,
) -> Result<(), FileError> {
    let described: Vec<(String, DType, Vec<usize>)> = tensors
        .iter()
        .map(|(name, data)| (name.clone(), data.dtype(), data.shape().to_vec()))
        .collect();
    let mut output = SafetensorsOutput::create(path, &described, metadata)?;
    for index in output.data_order().to_vec() {
        let mut range = output.buffer(index).ok_or_else(|| {
            FileError::Safetensors(format!("{}: a tensor's range was lost", path.display()))
        })?;
        range.copy_from_slice(tensors[index].1.as_bytes());
    }
    output.commit()
}

/// The tensors (in recorded order) and the header's `__metadata__`, ferry's keys included.
pub(super) fn read_safetensors(path: &Path) -> Result<FileParts, FileError> {
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
    let header: ::safetensors::tensor::Metadata =
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

    // The tensors are taken from a private mapping of the file: a put sends them to the socket
    // straight from the page cache, with no copy on the heap. `offset_keys` is data order, and
    // the data is contiguous from the start.
    let mut mapped = ferry_memory::mapped_file::MappedFile::map(&file).map_err(io_error(path))?;
    if mapped.len() as u64 != file_len {
        return Err(bad(format!(
            "it changed while being read ({file_len} bytes, then {})",
            mapped.len()
        )));
    }
    let data_start = 8 + header_len as usize;
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
        let in_file = mapped
            .take(data_start + info.data_offsets.0, len)
            .ok_or_else(|| bad(format!("tensor '{name}' lies outside the file")))?;
        // An element type's alignment is what backends need to use the bytes in place; a tensor
        // the file does not align (other writers need not) is copied into a buffer that is.
        let bytes = if (in_file.as_ptr() as usize).is_multiple_of(dtype.size().max(1)) {
            in_file
        } else {
            let mut aligned = zeroed_for(dtype, meta.byte_len());
            aligned.copy_from_slice(&in_file);
            aligned
        };
        let data = TensorData::try_from_bytes(bytes, info.shape.clone(), dtype)
            .map_err(|e| bad(format!("tensor '{name}': {e}")))?;
        meta_of(&data).map_err(|source| FileError::Invalid {
            name: name.clone(),
            source,
        })?;
        out.push((name, data));
    }
    let record = strings.and_then(|m| m.get(ORDER_KEY)).map(String::as_str);
    let metadata = strings
        .map(|m| m.clone().into_iter().collect())
        .unwrap_or_default();
    Ok((
        apply_recorded_order(out, |(n, _)| n.as_str(), record),
        metadata,
    ))
}
