//! A model version as the node holds it: its [`Manifest`] (each tensor's path, dtype, shape and
//! verified content hash, and the file's metadata), and the [`ModelId`] it belongs to.

use std::collections::BTreeMap;

use burn_backend::DType;
use ferry_proto::message::{ManifestEntry, ModelManifest};
use ferry_proto::{ContentHash, TensorKey, WireMeta};

use super::name::version_name;

/// Which model: a prefix on a device.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ModelId {
    /// The device.
    pub device: u32,
    /// The prefix its tensors are written under.
    pub prefix: String,
}

impl ModelId {
    /// The model `prefix` on `device`.
    pub fn new(device: u32, prefix: impl Into<String>) -> Self {
        Self {
            device,
            prefix: prefix.into(),
        }
    }
}

impl std::fmt::Display for ModelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.device, self.prefix)
    }
}

/// One tensor of a model version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestTensor {
    /// Its path in the model (`encoder.layers.0.weight`).
    pub path: String,
    /// Its dtype, quantization scheme included.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its payload's length.
    pub bytes: u64,
    /// Its content hash, verified by the node from the bytes it holds.
    pub content_hash: ContentHash,
}

/// A committed model version: exactly the tensors an apply of it reads, all verified, and the
/// metadata it was committed with. Immutable: a later collect makes a new version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// The device.
    pub device: u32,
    /// The prefix.
    pub prefix: String,
    /// The version.
    pub version: u64,
    /// Its tensors, sorted by path.
    pub tensors: Vec<ManifestTensor>,
    /// What the collect attached (a `.safetensors` file's `__metadata__`, say).
    pub metadata: BTreeMap<String, String>,
}

impl Manifest {
    /// Which model it is a version of.
    pub fn model(&self) -> ModelId {
        ModelId::new(self.device, self.prefix.clone())
    }

    /// Where the tensor at `path` of this version is held.
    pub fn key(&self, path: &str) -> TensorKey {
        TensorKey::new(self.device, version_name(&self.prefix, self.version, path))
    }

    /// Every tensor's bytes.
    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.bytes).sum()
    }

    /// As the wire says it.
    pub fn to_wire(&self) -> ModelManifest {
        ModelManifest {
            device: self.device,
            prefix: self.prefix.clone(),
            version: self.version,
            tensors: self
                .tensors
                .iter()
                .map(|t| ManifestEntry {
                    path: t.path.clone(),
                    meta: WireMeta {
                        shape: t.shape.iter().map(|&d| d as u64).collect(),
                        dtype: t.dtype.into(),
                        byte_len: t.bytes,
                    },
                    content_hash: t.content_hash,
                })
                .collect(),
            metadata: self.metadata.clone().into_iter().collect(),
        }
    }
}
