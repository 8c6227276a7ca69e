//! Admission: everything checked, and the budget claimed, before a tensor's bytes arrive
//! ([`Node::admit`]), carried as one [`Admission`] to the tensor's registration.

use std::time::Instant;

use burn_backend::TensorData;
use ferry_backend::BackendKind;
use ferry_io::{BufferFrom, HashUse, Purpose, TensorAssembler};
use ferry_proto::message::validate_name;
use ferry_proto::{TensorKey, TensorMeta};

use crate::device::{Arrived, Command, IfExists, Payload, Reservation, TensorDesc};
use crate::engine::TransferPath;
use crate::error::NodeError;
use crate::node::models::VersionWrite;
use crate::node::{Node, ReceiveBuffers};

/// A tensor admitted to a device: what [`Node::admit`] checked and claimed for it, carried to its
/// registration, so that it is registered where, under the name and on the terms it was admitted
/// for.
#[derive(Debug)]
pub(crate) struct Admission {
    /// The device and name it was admitted under.
    key: TensorKey,
    /// Whether it may replace a tensor registered under that name.
    existing: IfExists,
    /// Held while the bytes arrive and then by the registered tensor.
    reservation: Reservation,
    /// Counted in the model version it writes into, if any, until it is registered or dropped:
    /// a commit waits for it.
    version_write: Option<VersionWrite>,
}

/// Why this node receives a tensor: with the device, what decides the hash its receiver
/// computes ([`HashUse::for_purpose`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Receive {
    /// A client's put, into a model version or not ([`Admission::writes_a_model`]).
    Put {
        /// Whether it goes into a model version.
        into_model: bool,
    },
    /// A pull from a peer, checked against its grant.
    Pull,
}

impl Admission {
    /// Whether the tensor goes into a model version (whose commit waits for its hash).
    pub(crate) fn writes_a_model(&self) -> bool {
        self.version_write.is_some()
    }
}

impl Node {
    /// A fresh name for a tensor put without one.
    pub(crate) fn fresh_name(&self) -> String {
        // Random, not a counter: a counter restarting with the node would hand out names that
        // earlier uploads (or users) already hold.
        format!("tensor-{:032x}", rand::random::<u128>())
    }

    /// Everything checked before a tensor of `dtype`, `shape` and `bytes` may go to `device`:
    /// the name, the per-tensor limit, what the backend holds, what one of the device's buffers
    /// takes (a GPU's), the device's budget, and (for a
    /// tensor that may not replace another) its tensor cap. The returned admission's reservation
    /// is held while the bytes arrive and then by the registered tensor.
    pub(crate) fn admit(
        &self,
        device: u32,
        name: &str,
        dtype: &burn_backend::DType,
        shape: &[usize],
        bytes: u64,
        existing: IfExists,
    ) -> Result<Admission, NodeError> {
        validate_name(name)?;
        let key = TensorKey::new(device, name);
        let version_write = self.admit_version_write(&key)?;
        let limit = self.inner.config.limits.max_tensor_bytes;
        if bytes > limit {
            return Err(NodeError::TensorTooLarge { bytes, limit });
        }
        let handle = self.device(device)?;
        handle.check_holds(dtype, shape)?;
        handle.check_fits(bytes)?;
        let reservation = handle.budget().reserve_tensor(bytes, existing)?;
        Ok(Admission {
            key,
            existing,
            reservation,
            version_write,
        })
    }

    /// Registers `data` under `key`, after checking it against the byte-length rule and the
    /// device, doing with a tensor already there what `existing` says. Answered once registered.
    pub async fn insert(
        &self,
        key: &TensorKey,
        data: TensorData,
        existing: IfExists,
    ) -> Result<TensorDesc, NodeError> {
        let meta = ferry_proto::tensor::meta_of(&data)?;
        let admission = self.admit(
            key.device,
            &key.name,
            &meta.dtype(),
            meta.shape(),
            meta.byte_len() as u64,
            existing,
        )?;
        self.register(admission, Arrived::new(data)).await
    }

    /// A receiver for a payload of `meta` bound for `device`, its buffer preallocated (refused
    /// over the node's largest tensor), by the device's backend:
    /// - Flex keeps the buffer as the tensor's memory as it is: one as the node's
    ///   [`ReceiveBuffers`] say (from its receive pool, a new region to seal and share, or
    ///   recycled memory); a pooled one goes back when the tensor is deleted.
    /// - A GPU copies the buffer to the device and drops it: the pool, where there is one, is
    ///   its staging area, each buffer back as soon as the tensor is built and ready for the
    ///   next, so a model streamed to a GPU reuses a few ready buffers instead of faulting in
    ///   fresh host memory tensor after tensor.
    /// - NdArray takes a plain allocation over as its own without a copy, and would keep any
    ///   other as borrowed storage that every operation copies: a plain one.
    ///
    /// It hashes what arrives as [`HashUse::for_purpose`] decides for `purpose`.
    pub(crate) fn receiver(
        &self,
        device: u32,
        meta: TensorMeta,
        purpose: Receive,
    ) -> Result<TensorAssembler, NodeError> {
        let max = self.config().limits.max_tensor_bytes;
        let buffers = &self.config().receive_buffers;
        let kind = self.device(device)?.kind();
        let from = match (kind, buffers) {
            (BackendKind::Flex | BackendKind::Wgpu, ReceiveBuffers::Pool(pool)) => {
                BufferFrom::Pool(pool)
            }
            (BackendKind::Flex, ReceiveBuffers::Shareable { min_bytes })
                if meta.byte_len() >= *min_bytes =>
            {
                BufferFrom::Region
            }
            (BackendKind::Flex, _) => BufferFrom::Recycled,
            (BackendKind::Wgpu | BackendKind::NdArray, _) => BufferFrom::Fresh,
        };
        let purpose = match purpose {
            Receive::Put { into_model } => Purpose::Put {
                device_lends_bytes: kind.shares_registered_bytes(&meta.dtype()),
                into_model,
            },
            Receive::Pull => Purpose::Pull,
        };
        let hash_use = HashUse::for_purpose(purpose);
        Ok(TensorAssembler::new(meta, max, from, hash_use)?)
    }

    /// Registers validated bytes where [`admit`](Self::admit) gave `admission`, logged as one
    /// transfer (a put).
    pub(crate) async fn register(
        &self,
        admission: Admission,
        arrived: Arrived,
    ) -> Result<TensorDesc, NodeError> {
        let started = Instant::now();
        let key = admission.key.clone();
        let result = self
            .register_payload(admission, Payload::Data(arrived), TransferPath::Put)
            .await;
        self.record("put", &key, None, "put", result.as_ref(), started);
        result
    }

    /// Registers `payload`, which travelled by `path`, where `admission` says; not logged.
    pub(crate) async fn register_payload(
        &self,
        admission: Admission,
        payload: Payload,
        path: TransferPath,
    ) -> Result<TensorDesc, NodeError> {
        let Admission {
            key,
            existing,
            reservation,
            version_write,
        } = admission;
        // An arrival, whether or not it drew from the pool: the start amount's time is over.
        if let Some(pool) = self.config().receive_buffers.pool() {
            pool.note_arrival();
        }
        let registered = self
            .device(key.device)?
            .call(|reply| Command::Insert {
                name: key.name,
                payload,
                path,
                existing,
                reservation,
                reply,
            })
            .await;
        // Registered (or refused): a commit of its model version no longer waits for it.
        drop(version_write);
        let registered = registered?;
        self.inner.arrivals.note();
        Ok(registered)
    }
}
