//! Safetensors files (`.safetensors`): plain dtypes only, little-endian, the header bounded
//! before it is allocated, Burn's own dtypes recorded in the metadata where they differ.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::Path;

use burn_std::{BoolStore, DType};
use ferry_proto::tensor::meta_of;
use ferry_proto::{TensorData, TensorMeta};

use super::{
    DTYPES_KEY, FileError, ORDER_KEY, SAFETENSORS_MAX_HEADER, apply_recorded_order, io_error,
    order_record, zeroed_for,
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

/// A tensor as safetensors' writer sees it, borrowing the caller's bytes.
struct View<'a> {
    dtype: ::safetensors::Dtype,
    data: &'a TensorData,
}

impl ::safetensors::View for View<'_> {
    fn dtype(&self) -> ::safetensors::Dtype {
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

pub(super) fn write_safetensors(
    path: &Path,
    tensors: &[(String, TensorData)],
) -> Result<(), FileError> {
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
    ::safetensors::serialize_to_file(views, Some(metadata), path).map_err(|e| match e {
        ::safetensors::SafeTensorError::IoError(source) => FileError::Io {
            path: path.to_path_buf(),
            source,
        },
        other => FileError::Safetensors(format!("{}: {other}", path.display())),
    })
}

pub(super) fn read_safetensors(path: &Path) -> Result<Vec<(String, TensorData)>, FileError> {
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
