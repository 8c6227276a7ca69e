//! A node's answer: [`Response`], and what its answers carry about tensors and probes.

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::Request;
use super::{ErrorReply, ModelManifest, ModelSummary, NodeStats, TensorKey, Welcome};
use crate::content_hash::ContentHash;
use crate::dtype::WireDType;
use crate::meta::WireMeta;
use crate::secret::{CapabilityToken, NodeId};
use crate::transfer_path::TransferPath;

/// A node's answer.
// Exhaustive on purpose, as `Request` is: a client must handle every answer it can decode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Response {
    /// The connection is open.
    Welcome(Welcome),
    /// The target registered the tensor.
    Stored(TensorInfo),
    /// A tensor follows as chunk frames.
    Tensor {
        /// Where it is and what it is.
        info: TensorInfo,
        /// What follows.
        meta: WireMeta,
    },
    /// The tensor was deleted.
    Deleted(TensorInfo),
    /// The tensors asked for, sorted by device and name.
    Listing(Vec<TensorInfo>),
    /// Node statistics.
    Stats(NodeStats),
    /// The request failed; the connection stays usable unless `code` is fatal.
    Error(ErrorReply),
    /// A `Put` was admitted (name, meta, limits, budget checked; the buffer is allocated): the
    /// client may send its chunk frames now. A refused `Put` gets an `Error` instead, and the
    /// client sends no chunks.
    Ready,
    /// The node's identity.
    Identity {
        /// The node's id, stable for its lifetime.
        node_id: NodeId,
    },
    /// A single-use capability to pull one tensor.
    Capability {
        /// The secret to hand to the target.
        token: CapabilityToken,
        /// Milliseconds until it expires.
        expires_in_ms: u64,
        /// What it grants.
        info: TensorInfo,
        /// The tensor's content hash (see `PROTOCOL.md`: BLAKE3 over its dtype, shape and
        /// bytes, hex).
        content_hash: ContentHash,
    },
    /// The capability is used up.
    Released,
    /// One page of a listing ([`Request::ListPage`]). Added in minor 3.
    Page {
        /// The tensors, sorted by device and name.
        tensors: Vec<TensorInfo>,
        /// Where the next page starts (pass it as `after`); `None` once this page is the last.
        next: Option<TensorKey>,
    },
    /// What a device stores bit-exact ([`Request::Holds`]), as its probe measured: every dtype it
    /// probed on each class of shape, in probe order. Added in minor 5.
    Holds {
        /// Which device.
        device: u32,
        /// Each probed dtype and what came of it.
        dtypes: Vec<HeldDtype>,
    },
    /// Part of a tensor follows as chunk frames, covering payload bytes `start..end` exactly
    /// (never a region): the answer to [`Request::FetchRange`]. `end` reaches past the part asked
    /// for, to the payload's end, where the source sends the rest on this connection instead (a
    /// tensor it would have to copy out of its device for every part). Added in minor 8.
    TensorPart {
        /// Where it is and what it is.
        info: TensorInfo,
        /// The whole tensor's meta.
        meta: WireMeta,
        /// The first payload byte that follows.
        start: u64,
        /// One past the last payload byte that follows.
        end: u64,
    },
    /// What a [`Request::Wait`] for a tensor waited for, once there; `None` where the wait
    /// timed out first (whatever it waited for). Added in minor 9.
    Arrived(Option<TensorInfo>),
    /// A version began: its number ([`Request::ModelBegin`]). Added in minor 9.
    ModelBegun {
        /// The version.
        version: u64,
    },
    /// A model version: committed, opened, deleted, or waited for. Added in minor 9.
    Model(ModelManifest),
    /// The models ([`Request::ModelList`]), sorted by device and prefix. Added in minor 9.
    Models(Vec<ModelSummary>),
}

impl Response {
    /// The answer's name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Response::Welcome(_) => "welcome",
            Response::Stored(_) => "stored",
            Response::Tensor { .. } => "tensor",
            Response::Deleted(_) => "deleted",
            Response::Listing(_) => "listing",
            Response::Stats(_) => "stats",
            Response::Error(_) => "error",
            Response::Ready => "ready",
            Response::Identity { .. } => "identity",
            Response::Capability { .. } => "capability",
            Response::Released => "released",
            Response::Page { .. } => "page",
            Response::Holds { .. } => "holds",
            Response::TensorPart { .. } => "tensor-part",
            Response::Arrived(_) => "arrived",
            Response::ModelBegun { .. } => "model-begun",
            Response::Model(_) => "model",
            Response::Models(_) => "models",
        }
    }
}

/// One probe a device ran at start ([`Response::Holds`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldDtype {
    /// The dtype probed (a quantized one stands for its scheme with any block size).
    pub dtype: WireDType,
    /// The shape probed, standing for its class (PROTOCOL.md §5.5): rank 0, an empty dimension,
    /// whole 32-bit words, or any other.
    pub shape: Vec<u64>,
    /// Why the device does not store it bit-exact; `None` where it does.
    pub refused: Option<String>,
}

/// A registered tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorInfo {
    /// Where it is.
    pub key: TensorKey,
    /// Its dtype.
    pub dtype: WireDType,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Its payload length in bytes.
    pub bytes: u64,
    /// How it got there.
    pub path: TransferPath,
}
