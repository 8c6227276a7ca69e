//! Tensors handed into and out of a node as backend primitives, with no host copy: for a program
//! that embeds a node on its own devices and gives its model the tensors that arrived there.

use std::time::Instant;

use burn_backend::Backend;
use ferry_backend::Primitive;
use ferry_proto::{IfExists, TensorKey, TensorMeta};

use crate::device::{Command, Exported, NativeTensor, Payload, TensorDesc, Version};
use crate::engine::TransferPath;
use crate::error::NodeError;
use crate::node::Node;

impl Node {
    /// Registers `primitive` under `key` as it is (the native path: the device's own
    /// `*_to_device`, which on Flex keeps the very buffer), doing with a tensor already there
    /// what `existing` says. Admitted like a put (the device holds the dtype, the budget has
    /// room) before the primitive is handed over; its content hash is computed by the node.
    /// [`NodeError::OtherBackend`] where `key`'s device is not one of backend `B`.
    pub async fn insert_primitive<B: Backend>(
        &self,
        key: &TensorKey,
        primitive: Primitive<B>,
        existing: IfExists,
    ) -> Result<TensorDesc, NodeError> {
        let started = Instant::now();
        self.check_backend::<B>(key.device)?;
        if !primitive.variant_fits_dtype() {
            return Err(NodeError::Backend(
                "a primitive handed in under another kind than its dtype's".into(),
            ));
        }
        let (dtype, shape) = primitive.dtype_and_shape();
        let bytes = TensorMeta::new(shape.clone(), dtype)?.byte_len() as u64;
        // The budget counts what the tensor keeps alive: a view holds its parent's whole buffer.
        let held = primitive
            .held_host_bytes()
            .map_or(bytes, |held| held.max(bytes));
        let admission = self.admit(key.device, &key.name, &dtype, &shape, held, existing)?;
        let native = NativeTensor::handed_in(primitive, dtype, shape, bytes);
        let result = self
            .register_payload(admission, Payload::Native(native), TransferPath::Put)
            .await;
        self.record("insert", key, None, "native", result.as_ref(), started);
        result
    }

    /// The tensor under `key` as a backend primitive: the registered tensor's own handle (on
    /// Flex, the same buffer), with its description. Nothing is copied, and the node keeps its
    /// tensor (a backend that shares buffers copies on write, so the application's writes never
    /// reach it).
    pub async fn primitive<B: Backend>(
        &self,
        key: &TensorKey,
    ) -> Result<(TensorDesc, Primitive<B>), NodeError> {
        self.check_backend::<B>(key.device)?;
        // Whatever the key holds: a version replaced between the description and the export is
        // described again (a few times at most; then the replacements win and it is `Changed`).
        let mut tries = 0;
        let (desc, exported) = loop {
            let desc = self.describe(key).await?;
            let export = self.device(key.device)?.call(|reply| Command::Export {
                name: key.name.clone(),
                pin: Some(desc.version),
                native: true,
                reply,
            });
            match export.await {
                Err(NodeError::Changed(_)) if tries < 3 => tries += 1,
                exported => break (desc, exported?),
            }
        };
        let other = || NodeError::OtherBackend {
            device: key.device,
            backend: self
                .device(key.device)
                .map_or("unknown", |d| d.kind().name()),
        };
        match exported {
            Exported::Native(native) => Ok((desc, native.into_primitive::<B>().ok_or_else(other)?)),
            Exported::Data(..) => Err(other()),
        }
    }

    /// [`primitive`](Self::primitive), then the version handed out is unregistered (one
    /// registered meanwhile stays).
    pub async fn take_primitive<B: Backend>(
        &self,
        key: &TensorKey,
    ) -> Result<(TensorDesc, Primitive<B>), NodeError> {
        let (desc, primitive) = self.primitive::<B>(key).await?;
        self.remove_pinned(key, Some(desc.version)).await?;
        Ok((desc, primitive))
    }

    /// Unregisters the tensor under `key` only if it is still `version` ([`NodeError::Changed`]
    /// otherwise): what was handed out goes, a tensor registered meanwhile stays.
    pub async fn remove_version(
        &self,
        key: &TensorKey,
        version: Version,
    ) -> Result<TensorDesc, NodeError> {
        self.remove_pinned(key, Some(version)).await
    }

    /// Refuses a device whose worker is not of backend `B`, before anything is handed over.
    fn check_backend<B: Backend>(&self, device: u32) -> Result<(), NodeError> {
        let handle = self.device(device)?;
        if handle.runs::<B>() {
            Ok(())
        } else {
            Err(NodeError::OtherBackend {
                device,
                backend: handle.kind().name(),
            })
        }
    }
}
