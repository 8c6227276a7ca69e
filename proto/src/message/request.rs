//! What a client asks of a node: [`Request`], and the protocol minor each request arrived in.

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::{ErrorCode, Response};
use super::{Hello, PathsDigest, TensorKey};
use crate::content_hash::ContentHash;
use crate::meta::WireMeta;
use crate::secret::{CapabilityToken, NodeId};

/// The minor that added [`Request::DeleteIf`], which a move between nodes ends with.
pub const DELETE_IF_MINOR: u16 = 3;

/// The minor that added [`Request::FetchRange`] and [`Response::TensorPart`], which a pull
/// spread over several connections asks and is answered with.
pub const FETCH_RANGE_MINOR: u16 = 8;

/// The minor that added [`Request::Wait`] and [`Response::Arrived`], and models: the requests
/// `Model*`, and the responses [`Response::ModelBegun`], [`Response::Model`] and
/// [`Response::Models`].
pub const WAIT_MINOR: u16 = 9;

/// The minor that added [`Request::PutEager`], a put whose payload follows its request at once.
pub const EAGER_PUT_MINOR: u16 = 11;

/// The largest payload a [`Request::PutEager`] may announce. A node that refuses an eager put
/// reads its payload to find the next request, so it reads at most this much for nothing; a
/// larger tensor waits for [`Response::Ready`] with [`Request::Put`]. 4 MiB: one chunk of the
/// default size, so a model's biases, norms and small layers go eagerly, and a transfer that
/// takes longer than a round trip by far waits for one.
pub const EAGER_PUT_MAX_BYTES: u64 = 4 << 20;

/// The longest one [`Request::Wait`] may ask to wait; a client that waits longer asks again.
pub const MAX_WAIT_MS: u32 = 15 * 60 * 1000;

/// What a [`Request::Wait`] waits for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WaitFor {
    /// A tensor registered under the key (a put, a copy, a pull or an insert by the node's own
    /// program): answered [`Response::Arrived`].
    Tensor(TensorKey),
    /// A committed version of the model `prefix` on `device`, newer than `newer_than` (any,
    /// where absent): answered [`Response::Model`].
    Model {
        /// The device.
        device: u32,
        /// The model's prefix.
        prefix: String,
        /// The version it must be newer than.
        newer_than: Option<u64>,
    },
}

/// What a client asks of a node.
// Exhaustive on purpose: a node must answer every request it can decode (PROTOCOL.md §4.1 says
// how a request a peer's minor lacks is kept from it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Opens a connection; answered by [`Response::Welcome`] or an error, then a close.
    Hello(Hello),
    /// Uploads a tensor to `device` under `name` (one is chosen when absent). Answered by
    /// [`Response::Ready`], after which the payload follows as chunk frames, and then by
    /// [`Response::Stored`] once registered; or by an error, and then no chunks follow.
    Put {
        /// Target device index.
        device: u32,
        /// The name, or `None` for a node-chosen one.
        name: Option<String>,
        /// What follows.
        meta: WireMeta,
        /// Replace a tensor already registered under the key instead of refusing.
        overwrite: bool,
    },
    /// Downloads a tensor: answered by [`Response::Tensor`] and its chunk frames.
    Get {
        /// Which tensor.
        key: TensorKey,
    },
    /// Copies (or moves) a tensor between two devices of this node. Answered by
    /// [`Response::Stored`] only after the target registered it; a move deletes the source
    /// only then.
    Copy {
        /// The source.
        src: TensorKey,
        /// The target device.
        dst_device: u32,
        /// The target name; the source's name when absent.
        dst_name: Option<String>,
        /// Delete the source once the target holds the tensor.
        remove_source: bool,
        /// Replace a tensor already registered under the target key instead of refusing.
        overwrite: bool,
    },
    /// Deletes a tensor: answered by [`Response::Deleted`].
    Delete {
        /// Which tensor.
        key: TensorKey,
    },
    /// Lists tensors, on one device or all: answered by [`Response::Listing`].
    List {
        /// One device, or every device when absent.
        device: Option<u32>,
    },
    /// Node statistics: answered by [`Response::Stats`].
    Stat,
    /// The node's identity: answered by [`Response::Identity`].
    Identify,
    /// Asks a source node for a capability that lets the node `audience` pull the tensor under
    /// `key` once: answered by [`Response::Capability`].
    Grant {
        /// The tensor.
        key: TensorKey,
        /// The node id of the only node that may use it.
        audience: NodeId,
    },
    /// Asks a target node to pull a tensor from `source` with a capability the source issued,
    /// and register it on `dst_device`. The bytes go from node to node; answered by
    /// [`Response::Stored`] once the target registered the tensor.
    Pull {
        /// The source node's address, as the target can reach it.
        source: String,
        /// The capability from the source's [`Response::Capability`].
        capability: CapabilityToken,
        /// The tensor on the source.
        src: TensorKey,
        /// The target device.
        dst_device: u32,
        /// The target name; the source's name when absent.
        dst_name: Option<String>,
        /// Replace a tensor already registered under the target key instead of refusing.
        overwrite: bool,
        /// The source's content hash, so a target that already holds the same bytes skips the
        /// transfer.
        content_hash: Option<ContentHash>,
    },
    /// From one node to another: send the tensor a capability names, from `offset` on (a
    /// resumed transfer starts where the verified bytes end). Answered by [`Response::Tensor`]
    /// and chunk frames from `offset`.
    Fetch {
        /// The capability.
        capability: CapabilityToken,
        /// The node id of the node fetching.
        node_id: NodeId,
        /// The first payload byte wanted.
        offset: u64,
    },
    /// From one node to another, after a fetch's last byte arrived and verified: the capability
    /// is used up. Answered by [`Response::Released`]. Until then the source keeps it, so that a
    /// transfer cut after the source sent its last byte can still resume.
    Release {
        /// The capability.
        capability: CapabilityToken,
        /// The node id of the node that fetched.
        node_id: NodeId,
    },
    /// Lists tensors a page at a time, sorted by device and name: at most `limit` of them (the
    /// node may answer fewer), starting after the key `after`. Answered by [`Response::Page`].
    /// Added in minor 3: a listing of any size, where [`Request::List`] is bounded by a frame.
    ListPage {
        /// One device, or every device when absent.
        device: Option<u32>,
        /// The last key of the previous page; the first page when absent.
        after: Option<TensorKey>,
        /// The most tensors wanted in this page.
        limit: u32,
    },
    /// Deletes the tensor under `key` only if it is still the version whose content hash is
    /// `content_hash` (a move between nodes deletes the version it copied, never a newer one
    /// written meanwhile). Answered by [`Response::Deleted`], or an error with code
    /// [`ErrorCode::Changed`] (nothing deleted). Added in minor 3.
    DeleteIf {
        /// Which tensor.
        key: TensorKey,
        /// The content hash of the version to delete (see `PROTOCOL.md` §7.2).
        content_hash: ContentHash,
    },
    /// What a device measured at start that it stores bit-exact: answered by
    /// [`Response::Holds`]. Added in minor 5.
    Holds {
        /// Which device.
        device: u32,
    },
    /// From one node to another: send the part of the tensor a capability names that lies at
    /// `from..to` of its content hash's input (PROTOCOL.md §7.2: the meta's bytes, then the
    /// payload), so that a node asks for a stripe before it knows the meta. Answered by
    /// [`Response::TensorPart`] and chunk frames covering the payload range it names. Added in
    /// minor 8.
    FetchRange {
        /// The capability.
        capability: CapabilityToken,
        /// The node id of the node fetching.
        node_id: NodeId,
        /// The first byte of the hash input wanted.
        from: u64,
        /// One past the last byte of the hash input wanted.
        to: u64,
    },
    /// Waits until what `target` names is there, at most `timeout_ms` milliseconds (at most
    /// [`MAX_WAIT_MS`]): answered at once if it is there already, else as soon as it arrives
    /// (see [`WaitFor`]), or by [`Response::Arrived`] with nothing at the timeout. Added in
    /// minor 9.
    Wait {
        /// What to wait for.
        target: WaitFor,
        /// The longest wait, in milliseconds.
        timeout_ms: u32,
    },
    /// Begins writing a new version of the model `prefix` on `device`: answered by
    /// [`Response::ModelBegun`] with its number, under which its tensors are then put (as
    /// `PREFIX/.vVERSION/PATH`, over any connection) until this connection commits or aborts it;
    /// the connection's end aborts it. Refused with `AlreadyExists` where the device holds the
    /// model and `replace` is false. Added in minor 9.
    ModelBegin {
        /// The device.
        device: u32,
        /// The model's prefix.
        prefix: String,
        /// Replace the model's current version at the commit.
        replace: bool,
    },
    /// Commits a version this connection began: no more puts into it are taken, those in flight
    /// are waited for, every tensor's content hash is verified, and the version must hold
    /// exactly the paths `sent` names; then it becomes the model's current version at once.
    /// Answered by [`Response::Model`] with its manifest; refused (and the version deleted)
    /// otherwise. Added in minor 9.
    ModelCommit {
        /// The device.
        device: u32,
        /// The model's prefix.
        prefix: String,
        /// The version.
        version: u64,
        /// The paths the collect sent.
        sent: PathsDigest,
        /// Key-value pairs kept with the version.
        metadata: Vec<(String, String)>,
    },
    /// Gives up a version this connection began: what was put into it is deleted. Answered by
    /// [`Response::Released`]. Added in minor 9.
    ModelAbort {
        /// The device.
        device: u32,
        /// The model's prefix.
        prefix: String,
        /// The version.
        version: u64,
    },
    /// Holds the current version of the model `prefix` on `device` for an apply: answered by
    /// [`Response::Model`] with its manifest; its tensors stay as they are until this connection
    /// closes it or ends. Added in minor 9.
    ModelOpen {
        /// The device.
        device: u32,
        /// The model's prefix.
        prefix: String,
    },
    /// Lets go a version this connection opened: answered by [`Response::Released`]. Added in
    /// minor 9.
    ModelClose {
        /// The device.
        device: u32,
        /// The model's prefix.
        prefix: String,
        /// The version.
        version: u64,
    },
    /// The models on one device, or on all: answered by [`Response::Models`]. Added in minor 9.
    ModelList {
        /// One device, or every device when absent.
        device: Option<u32>,
    },
    /// Deletes the model `prefix` on `device`: its current version goes now, or once no apply
    /// holds it. Answered by [`Response::Model`] with the version deleted; refused with
    /// `Changed` (nothing deleted) where `version` is given and the current version is another
    /// (a move between nodes deletes the version it copied, never a newer one). Added in minor 9.
    ModelDelete {
        /// The device.
        device: u32,
        /// The model's prefix.
        prefix: String,
        /// The version it must be, if any.
        version: Option<u64>,
    },
    /// [`Request::Put`] whose payload follows at once, as chunk frames, without waiting for
    /// [`Response::Ready`] (an eager send, as against waiting for the receiver's go-ahead):
    /// one round trip less per tensor, for payloads of at most [`EAGER_PUT_MAX_BYTES`] (a
    /// larger one is a protocol error). Answered by [`Response::Stored`], or by an error once
    /// the node has read the payload and dropped it; the connection goes on either way. Added
    /// in minor 11.
    PutEager {
        /// Target device index.
        device: u32,
        /// The name, or `None` for a node-chosen one.
        name: Option<String>,
        /// What follows.
        meta: WireMeta,
        /// Replace a tensor already registered under the key instead of refusing.
        overwrite: bool,
    },
}

impl Request {
    /// The request's name, for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Hello(_) => "hello",
            Request::Put { .. } => "put",
            Request::Get { .. } => "get",
            Request::Copy {
                remove_source: true,
                ..
            } => "move",
            Request::Copy { .. } => "copy",
            Request::Delete { .. } => "delete",
            Request::List { .. } => "list",
            Request::Stat => "stat",
            Request::Identify => "identify",
            Request::Grant { .. } => "grant",
            Request::Pull { .. } => "pull",
            Request::Fetch { .. } => "fetch",
            Request::Release { .. } => "release",
            Request::ListPage { .. } => "list",
            Request::DeleteIf { .. } => "delete",
            Request::Holds { .. } => "holds",
            Request::FetchRange { .. } => "fetch-range",
            Request::Wait { .. } => "wait",
            Request::ModelBegin { .. } => "model-begin",
            Request::ModelCommit { .. } => "model-commit",
            Request::ModelAbort { .. } => "model-abort",
            Request::ModelOpen { .. } => "model-open",
            Request::ModelClose { .. } => "model-close",
            Request::ModelList { .. } => "model-list",
            Request::ModelDelete { .. } => "model-delete",
            // A put, to whoever reads logs and metrics, however its payload was asked for. (A
            // client never sends one to a node too old for it, so no "put needs minor 11" reads
            // oddly.)
            Request::PutEager { .. } => "put",
        }
    }

    /// The protocol minor that added it. A peer of an older minor does not know it:
    /// `control::encode_request_for` refuses to encode it for one, and a client asks such a node
    /// something else or says the node is too old.
    pub fn since_minor(&self) -> u16 {
        // Every variant by name, so that a variant added later cannot default to minor 0.
        match self {
            Request::Hello(_)
            | Request::Put { .. }
            | Request::Get { .. }
            | Request::Copy { .. }
            | Request::Delete { .. }
            | Request::List { .. }
            | Request::Stat
            | Request::Identify
            | Request::Grant { .. }
            | Request::Pull { .. }
            | Request::Fetch { .. }
            | Request::Release { .. } => 0,
            Request::ListPage { .. } => 3,
            Request::DeleteIf { .. } => DELETE_IF_MINOR,
            Request::Holds { .. } => 5,
            Request::FetchRange { .. } => FETCH_RANGE_MINOR,
            Request::Wait { .. }
            | Request::ModelBegin { .. }
            | Request::ModelCommit { .. }
            | Request::ModelAbort { .. }
            | Request::ModelOpen { .. }
            | Request::ModelClose { .. }
            | Request::ModelList { .. }
            | Request::ModelDelete { .. } => WAIT_MINOR,
            Request::PutEager { .. } => EAGER_PUT_MINOR,
        }
    }

    /// The length of the payload that follows the request at once, unasked (a
    /// [`Request::PutEager`]'s): a node that refuses the request reads that much and drops it.
    pub fn payload_follows(&self) -> Option<u64> {
        match self {
            Request::PutEager { meta, .. } => Some(meta.byte_len),
            _ => None,
        }
    }

    /// Whether it moves a tensor's bytes (counted as a transfer in flight).
    pub fn moves_a_tensor(&self) -> bool {
        matches!(
            self,
            Request::Put { .. }
                | Request::PutEager { .. }
                | Request::Get { .. }
                | Request::Copy { .. }
                | Request::Pull { .. }
                | Request::Fetch { .. }
                | Request::FetchRange { .. }
        )
    }
}
