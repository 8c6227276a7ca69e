//! A registered tensor as the node describes it ([`TensorDesc`]), which registration under its
//! key it is ([`Version`]), and what the node knows of its content hash ([`HashState`]).

use burn_backend::DType;
use ferry_proto::{ContentHash, TensorInfo, TensorKey, WireDType};

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
    /// Its content hash, as far as this node knows it.
    pub content_hash: HashState,
    /// Which registration under the key this is.
    pub version: Version,
}

/// What a node knows of a registered tensor's content hash (BLAKE3 of its bytes, hex; PROTOCOL
/// §7.2). Only a [`Verified`](HashState::Verified) hash answers dedup, is granted, or is
/// matched by a conditional delete; the others are settled by the device's verifier thread,
/// which reads the registered bytes in place after the transfer was answered.
///
/// A description the node gives, never takes: no public operation accepts a `HashState` (or a
/// [`TensorDesc`]), so making one tells the node nothing. A state a later version adds must be
/// matched with a wildcard arm; [`verified`](HashState::verified) is what most callers want.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HashState {
    /// Computed by this node from the bytes it holds.
    Verified(ContentHash),
    /// Stated by the node the bytes came from (a pull between nodes of one host), being
    /// recomputed: a dedup candidate to wait for, used for nothing else until then.
    Stated(ContentHash),
    /// Being computed: a put is answered once its bytes are registered, its hash after.
    Computing,
}

impl HashState {
    /// The hash, where this node computed it.
    pub fn verified(&self) -> Option<ContentHash> {
        match self {
            HashState::Verified(hash) => Some(*hash),
            HashState::Stated(_) | HashState::Computing => None,
        }
    }

    /// Whether this node computed it.
    pub fn is_verified(&self) -> bool {
        matches!(self, HashState::Verified(_))
    }

    /// The hash the tensor is indexed under as a dedup candidate: verified or stated.
    pub(crate) fn indexed(&self) -> Option<ContentHash> {
        match self {
            HashState::Verified(hash) | HashState::Stated(hash) => Some(*hash),
            HashState::Computing => None,
        }
    }
}

impl TensorDesc {
    /// The wire form.
    pub fn to_wire(&self) -> TensorInfo {
        TensorInfo {
            key: self.key.clone(),
            dtype: WireDType::from(self.dtype),
            shape: self.shape.iter().map(|&d| d as u64).collect(),
            bytes: self.bytes,
            path: self.path,
        }
    }
}
