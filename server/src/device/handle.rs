//! [`DeviceHandle`]: how the rest of the node reaches a device's worker, and what it may know of
//! the device without asking the worker.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn_backend::DType;
use ferry_backend::BackendKind;
use ferry_proto::dtype_name;
use tokio::sync::{mpsc, oneshot};

use crate::device::{Budget, Command, Reply};
use crate::error::NodeError;
use crate::holds::HoldsTable;

/// A hosted device, as the node reaches its worker; what an embedder may read of it without
/// asking the worker. Not `Clone`: the node's handles are the worker's only senders, so that a
/// node dropped stops its workers (a copy kept elsewhere would keep a worker, and the node's
/// drop that waits for it, alive).
#[derive(Debug)]
pub struct DeviceHandle {
    pub(super) index: u32,
    pub(super) kind: BackendKind,
    /// The Burn backend type its worker runs (two kinds may share one, two builds of one kind
    /// may not).
    pub(super) backend: std::any::TypeId,
    pub(super) label: String,
    pub(super) tx: mpsc::Sender<Command>,
    pub(super) budget: Arc<Budget>,
    pub(super) hash_mismatches: Arc<AtomicU64>,
    /// Raised on every registration, removal and verified hash.
    pub(super) changes: Arc<AtomicU64>,
    /// What it stores bit-exact, as it measured at start.
    pub(super) holds: Arc<HoldsTable>,
    /// The most bytes one tensor may take on it: a GPU adapter's largest buffer. `None` for
    /// host memory, where only the node's per-tensor limit and the budget bound a tensor.
    pub(super) largest_tensor: Option<u64>,
}

impl DeviceHandle {
    /// Its index on the node.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Its backend.
    pub fn kind(&self) -> BackendKind {
        self.kind
    }

    /// Whether its worker runs Burn backend `B`: a primitive of `B` can be handed to it, and
    /// its tensors handed out as primitives of `B`.
    pub fn runs<B: burn_backend::Backend>(&self) -> bool {
        self.backend == std::any::TypeId::of::<B>()
    }

    /// Its Burn device, readable.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Its memory budget.
    pub(crate) fn budget(&self) -> &Arc<Budget> {
        &self.budget
    }

    /// Its memory budget in bytes ([`NodeLimits::memory_limit`](crate::NodeLimits::memory_limit)),
    /// if it has one.
    pub fn memory_limit(&self) -> Option<u64> {
        self.budget.limit()
    }

    /// Bytes of its budget claimed now: registered tensors (each with its
    /// [`TENSOR_OVERHEAD`](crate::TENSOR_OVERHEAD)), transfers in flight and host copies being
    /// sent. Never more than [`memory_limit`](Self::memory_limit).
    pub fn memory_used(&self) -> u64 {
        self.budget.used()
    }

    /// Stated content hashes that the registered bytes did not match.
    pub fn hash_mismatches(&self) -> u64 {
        self.hash_mismatches.load(Ordering::Relaxed)
    }

    /// A counter raised on every registration, removal and verified hash on this device: equal
    /// readings mean nothing a listing shows has changed in between.
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// What it stores bit-exact, as it measured at start.
    pub fn holds(&self) -> &Arc<HoldsTable> {
        &self.holds
    }

    /// The most bytes one tensor may take on it (a GPU adapter's largest buffer), if the device
    /// has such a limit.
    pub fn largest_tensor(&self) -> Option<u64> {
        self.largest_tensor
    }

    /// Checks that a tensor of `bytes` (values and scales together) fits in one of this
    /// device's buffers.
    pub(crate) fn check_fits(&self, bytes: u64) -> Result<(), NodeError> {
        match self.largest_tensor {
            Some(limit) if bytes > limit => Err(NodeError::TooLargeForDevice {
                device: format!("{} ({})", self.index, self.kind),
                bytes,
                limit,
            }),
            _ => Ok(()),
        }
    }

    /// Checks that this device stores `dtype` on `shape` exactly, as its probe measured.
    pub(crate) fn check_holds(&self, dtype: &DType, shape: &[usize]) -> Result<(), NodeError> {
        self.holds
            .check(dtype, shape)
            .map_err(|reason| NodeError::UnsupportedDType {
                device: format!("{} ({})", self.index, self.kind),
                dtype: dtype_name(dtype),
                reason,
            })
    }

    /// Queues a command whose answer comes some other way.
    pub(crate) async fn tell(&self, command: Command) -> Result<(), NodeError> {
        self.tx
            .send(command)
            .await
            .map_err(|_| NodeError::DeviceGone(self.index))
    }

    /// Sends a command and waits for its answer.
    pub(crate) async fn call<T>(
        &self,
        make: impl FnOnce(Reply<T>) -> Command,
    ) -> Result<T, NodeError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| NodeError::DeviceGone(self.index))?;
        answer
            .await
            .map_err(|_| NodeError::DeviceGone(self.index))?
    }
}
