//! A registered tensor as the node describes it ([`TensorDesc`]), and which registration under
//! its key it is ([`Version`]).

use burn_backend::DType;
use ferry_proto::{TensorInfo, TensorKey, WireDType};

use crate::engine::TransferPath;

/// Which registration under a key a tensor is: every insert takes a new one, never reused while
/// the node runs. Operations that read a tensor and then act on it (a copy, a move, a dedup, a
/// fetch under a capability, a conditional delete) pin the version they read, so that a tensor
/// replaced meanwhile is never mistaken for the one they were about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Version(pub(super) u64);

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// A registered tensor, as the node describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDesc {
    /// Where it is.
    pub key: TensorKey,
    /// Its dtype, quantization scheme included.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its payload length in bytes.
    pub bytes: u64,
    /// How it arrived.
    pub path: TransferPath,
    /// BLAKE3 of its bytes (hex), computed once when it arrived (or stated by the node it came
    /// from, until [`hash_verified`](Self::hash_verified)).
    pub content_hash: String,
    /// Whether this node computed `content_hash` from the bytes it holds. Only verified hashes
    /// answer dedup, and are granted or matched by a conditional delete.
    pub hash_verified: bool,
    /// Which registration under the key this is.
    pub version: Version,
}

impl TensorDesc {
    /// The wire form.
    pub fn to_wire(&self) -> TensorInfo {
        TensorInfo {
            key: self.key.clone(),
            dtype: WireDType::from(self.dtype),
            shape: self.shape.iter().map(|&d| d as u64).collect(),
            bytes: self.bytes,
            path: self.path.name().to_string(),
        }
    }
}
