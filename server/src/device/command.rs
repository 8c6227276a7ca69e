//! What a device worker is asked to do ([`Command`]), and the answers that are not tensors.

use burn_backend::TensorData;
use tokio::sync::oneshot;

use ferry_proto::IfExists;

use crate::device::{Exported, HostBytes, Payload, Reservation, TensorDesc, Version};
use crate::engine::TransferPath;
use crate::error::NodeError;

/// Where a command's answer goes.
pub(crate) type Reply<T> = oneshot::Sender<Result<T, NodeError>>;

/// What a device worker is asked to do.
pub(crate) enum Command {
    /// Register a tensor under `name`.
    Insert {
        /// The name.
        name: String,
        /// The tensor.
        payload: Payload,
        /// How it travelled.
        path: TransferPath,
        /// What becomes of a tensor already registered under that name.
        existing: IfExists,
        /// The budget claimed for it, held for as long as the tensor is registered.
        reservation: Reservation,
        /// Answered once registered.
        reply: Reply<TensorDesc>,
    },
    /// A tensor's bytes, for sending; it stays registered. The bytes are shared with the
    /// registered tensor where the backend allows it; otherwise they are read out with
    /// `into_data`.
    ReadHost {
        /// The name.
        name: String,
        /// Only this version ([`NodeError::Changed`] if the name holds another).
        pin: Option<Version>,
        /// The description and bytes.
        reply: Reply<(TensorDesc, HostBytes)>,
    },
    /// A copy of a tensor's bytes, read out with `into_data`, that the caller owns; it stays
    /// registered.
    Read {
        /// The name.
        name: String,
        /// The description, the copy, and the copy's room in the device's budget (given back
        /// when the caller drops it).
        reply: Reply<(TensorDesc, TensorData, Reservation)>,
    },
    /// Hand out a tensor for a copy or move.
    Export {
        /// The name.
        name: String,
        /// Only this version ([`NodeError::Changed`] if the name holds another).
        pin: Option<Version>,
        /// Hand out the primitive rather than its bytes.
        native: bool,
        /// The tensor.
        reply: Reply<Exported>,
    },
    /// Describe a tensor.
    Describe {
        /// The name.
        name: String,
        /// Its description.
        reply: Reply<TensorDesc>,
    },
    /// Unregister a tensor.
    Remove {
        /// The name.
        name: String,
        /// Remove it only if it is still this version (a move removes the version it copied,
        /// never a newer one registered meanwhile).
        pin: Option<Version>,
        /// What was removed.
        reply: Reply<TensorDesc>,
    },
    /// Describe the tensors whose names come after `after`, at most `limit` of them.
    List {
        /// The last name of the previous page; from the first name when absent.
        after: Option<String>,
        /// The most descriptions wanted.
        limit: usize,
        /// The descriptions, sorted by name.
        reply: Reply<Vec<TensorDesc>>,
    },
    /// Count the tensors and what they hold.
    Summary {
        /// The counts.
        reply: Reply<DeviceSummary>,
    },
    /// A tensor whose content hash is `hash`: one whose hash is verified if there is one, else
    /// one registered under that hash as its source stated it (to await with
    /// [`AwaitVerified`](Command::AwaitVerified)).
    FindByHash {
        /// The content hash.
        hash: ferry_proto::ContentHash,
        /// Its description, if any tensor answers to that hash.
        reply: Reply<Option<TensorDesc>>,
    },
    /// Describe a tensor once its content hash is verified (at once if it is).
    AwaitVerified {
        /// The name.
        name: String,
        /// Its description then; dropped unanswered if the tensor goes first.
        reply: oneshot::Sender<TensorDesc>,
    },
    /// The verifier's answer for a stated hash (sent by the worker's own verifier thread).
    Verified {
        /// The tensor's name.
        name: String,
        /// Which registration under that name was checked.
        version: Version,
        /// The hash of the registered bytes.
        computed: ferry_proto::ContentHash,
    },
}

/// What a device holds, in sum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceSummary {
    /// Registered tensors.
    pub tensors: u64,
    /// Their payload bytes.
    pub bytes: u64,
    /// Those whose stated content hash is not verified yet.
    pub hashes_pending: u64,
}
