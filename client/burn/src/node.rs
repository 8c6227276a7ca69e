//! [`NodeTensors`]: an embedded node's tensors as Burn `Tensor`s, handed in and out with no
//! host copy.

use std::future::Future;

use burn_flex::Flex;
use burn_tensor::Tensor;
use burn_tensor::kind::Basic;
use ferry_proto::{IfExists, TensorKey};
use ferry_server::{Node, TensorDesc};

use crate::HandoffError;
use crate::handoff::{from_flex, into_flex};

/// A node's tensors as Burn `Tensor`s on the Flex device (`Device::flex()`): the node's Flex
/// devices and the program's are one, so a tensor handed over keeps its buffer. A tensor that
/// arrived by a put or a pull is the program's at once; one the program hands in is served to
/// clients and peers like any other.
///
/// The node keeps its tensor when it hands one out ([`tensor`](Self::tensor)): Flex copies a
/// shared buffer before writing to it, so the program's writes never reach the node's.
pub trait NodeTensors {
    /// Registers `tensor` under `key` as it is (no copy of its bytes: the node and the program
    /// share its buffer, and a write by either copies it first), doing with a tensor already
    /// there what `if_exists` says. A view (a slice) keeps its whole parent buffer, and is
    /// counted in the device's budget at that size.
    fn insert_tensor<const D: usize, K: Basic + 'static>(
        &self,
        key: &TensorKey,
        tensor: &Tensor<D, K>,
        if_exists: IfExists,
    ) -> impl Future<Output = Result<TensorDesc, HandoffError>> + Send;

    /// The tensor under `key`, sharing the node's buffer.
    fn tensor<const D: usize, K: Basic + 'static>(
        &self,
        key: &TensorKey,
    ) -> impl Future<Output = Result<Tensor<D, K>, HandoffError>> + Send;

    /// The tensor under `key`, which the node then no longer holds (the version handed out
    /// goes; one registered meanwhile stays). A tensor of another kind or rank than asked is
    /// refused and stays.
    fn take_tensor<const D: usize, K: Basic + 'static>(
        &self,
        key: &TensorKey,
    ) -> impl Future<Output = Result<Tensor<D, K>, HandoffError>> + Send;
}

impl NodeTensors for Node {
    async fn insert_tensor<const D: usize, K: Basic + 'static>(
        &self,
        key: &TensorKey,
        tensor: &Tensor<D, K>,
        if_exists: IfExists,
    ) -> Result<TensorDesc, HandoffError> {
        // A handle, not the bytes: the program keeps its tensor whatever the node answers.
        let primitive = into_flex(tensor.clone())?;
        Ok(self.insert_primitive(key, primitive, if_exists).await?)
    }

    async fn tensor<const D: usize, K: Basic + 'static>(
        &self,
        key: &TensorKey,
    ) -> Result<Tensor<D, K>, HandoffError> {
        let (_, primitive) = self.primitive::<Flex>(key).await?;
        from_flex(primitive)
    }

    async fn take_tensor<const D: usize, K: Basic + 'static>(
        &self,
        key: &TensorKey,
    ) -> Result<Tensor<D, K>, HandoffError> {
        // Checked before anything is removed: a tensor refused stays registered, and only the
        // version handed out goes.
        let (desc, primitive) = self.primitive::<Flex>(key).await?;
        let tensor = from_flex(primitive)?;
        self.remove_version(key, desc.version).await?;
        Ok(tensor)
    }
}
