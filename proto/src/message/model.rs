//! A model on the wire: a committed version's manifest ([`ModelManifest`]), a listing's line
//! ([`ModelSummary`]), and the digest of a collect's paths that its commit is checked against
//! ([`PathsDigest`]).

use serde::{Deserialize, Serialize};

use crate::content_hash::ContentHash;
use crate::meta::WireMeta;

/// One tensor of a model version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Its path in the model (`encoder.layers.0.weight`); held under `PREFIX/.vVERSION/PATH`.
    pub path: String,
    /// Its dtype, shape and byte length.
    pub meta: WireMeta,
    /// Its content hash, verified by the node from the bytes it holds.
    pub content_hash: ContentHash,
}

/// A committed model version: exactly the tensors an apply of it reads, and the metadata its
/// collect attached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelManifest {
    /// The device.
    pub device: u32,
    /// The prefix.
    pub prefix: String,
    /// The version.
    pub version: u64,
    /// Its tensors, sorted by path.
    pub tensors: Vec<ManifestEntry>,
    /// Key-value pairs, sorted by key (a `.safetensors` file's `__metadata__`, say).
    pub metadata: Vec<(String, String)>,
}

impl ModelManifest {
    /// The name the tensor at `path` of this version is held under.
    pub fn name_of(&self, path: &str) -> String {
        format!("{}/.v{}/{path}", self.prefix, self.version)
    }

    /// Every tensor's bytes.
    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.meta.byte_len).sum()
    }
}

/// A model in a listing: its current version, and how many applies hold it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSummary {
    /// The device.
    pub device: u32,
    /// The prefix.
    pub prefix: String,
    /// The current version.
    pub version: u64,
    /// How many tensors it has.
    pub tensors: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Applies holding it now.
    pub applies: u64,
}

/// What a commit is checked against: how many tensors the collect sent, and a digest of their
/// paths (BLAKE3 over each path, sorted, each ended by a zero byte), so that a commit of a large
/// model fits a request and still proves the version holds exactly the tensors sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathsDigest {
    /// How many paths.
    pub count: u64,
    /// Their digest.
    pub digest: ContentHash,
}

impl PathsDigest {
    /// The digest of `paths` (in any order; a path given twice counts once).
    pub fn of<'a>(paths: impl IntoIterator<Item = &'a str>) -> Self {
        let sorted: std::collections::BTreeSet<&str> = paths.into_iter().collect();
        let mut hasher = blake3::Hasher::new();
        for path in &sorted {
            hasher.update(path.as_bytes());
            hasher.update(&[0]);
        }
        Self {
            count: sorted.len() as u64,
            digest: hasher.finalize().into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PathsDigest;

    #[test]
    fn a_digest_names_a_set_of_paths() {
        let ab = PathsDigest::of(["a", "b"]);
        assert_eq!(ab, PathsDigest::of(["b", "a", "a"]));
        assert_eq!(ab.count, 2);
        // The separator keeps "a","b" apart from "ab" and from "a\0b"-like splits.
        assert_ne!(ab, PathsDigest::of(["ab"]));
        assert_ne!(PathsDigest::of(["a", "bc"]), PathsDigest::of(["ab", "c"]));
        assert_ne!(ab, PathsDigest::of(["a", "c"]));
    }
}
