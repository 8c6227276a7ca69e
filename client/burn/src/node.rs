//! [`NodeTensors`]: an embedded node's tensors as Burn `Tensor`s, handed in and out with no
//! host copy.

use std::future::Future;

use burn_backend::Backend;
#[cfg(feature = "wgpu")]
use burn_dispatch::backends::Cube;
use burn_dispatch::{DispatchKindConversion, DispatchTensor};
use burn_flex::Flex;
use burn_tensor::Tensor;
use burn_tensor::kind::Basic;
use ferry_backend::BackendKind;
use ferry_proto::{IfExists, TensorKey};
use ferry_server::{Node, TensorDesc};

use crate::HandoffError;
use crate::backend_primitive::into_backend;
use crate::handoff::from_backend;

/// A node's tensors as Burn `Tensor`s, handed over with no host copy: on a Flex device
/// (`Device::flex()`; the node's Flex devices and the program's are one, so a tensor keeps its
/// buffer), and with the `wgpu` feature on a wgpu device (the node's device the program opened
/// first: one cubecl device and memory, so a tensor keeps its GPU buffer; a tensor of another
/// GPU device is moved natively onto the node's). A tensor that arrived by a put or a pull is
/// the program's at once; one the program hands in is served to clients and peers like any
/// other. A device of another backend (NdArray) is [`HandoffError::NoHandoff`].
///
/// The node keeps its tensor when it hands one out ([`tensor`](Self::tensor)): Flex copies a
/// shared buffer before writing to it, so the program's writes never reach the node's (cubecl
/// writes in place only into a buffer no other handle holds).
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

/// Which backend's handoff a node's device takes.
enum Native {
    Flex,
    #[cfg(feature = "wgpu")]
    Wgpu,
}

/// The handoff of device `device` of `node`, or why it has none.
fn native_of(node: &Node, device: u32) -> Result<Native, HandoffError> {
    match node.device(device)?.kind() {
        BackendKind::Flex => Ok(Native::Flex),
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => Ok(Native::Wgpu),
        #[allow(unreachable_patterns)]
        backend => Err(HandoffError::NoHandoff { device, backend }),
    }
}

/// The tensor under `key` on backend `B`, with its description.
async fn handed_out<B, const D: usize, K: Basic + 'static>(
    node: &Node,
    key: &TensorKey,
) -> Result<(TensorDesc, Tensor<D, K>), HandoffError>
where
    B: Backend,
    DispatchTensor: DispatchKindConversion<B>,
{
    let (desc, primitive) = node.primitive::<B>(key).await?;
    Ok((desc, from_backend::<B, D, K>(primitive)?))
}

/// The tensor under `key`, handed out by its device's backend.
async fn hand_out<const D: usize, K: Basic + 'static>(
    node: &Node,
    key: &TensorKey,
) -> Result<(TensorDesc, Tensor<D, K>), HandoffError> {
    match native_of(node, key.device)? {
        Native::Flex => handed_out::<Flex, D, K>(node, key).await,
        #[cfg(feature = "wgpu")]
        Native::Wgpu => handed_out::<Cube, D, K>(node, key).await,
    }
}

impl NodeTensors for Node {
    async fn insert_tensor<const D: usize, K: Basic + 'static>(
        &self,
        key: &TensorKey,
        tensor: &Tensor<D, K>,
        if_exists: IfExists,
    ) -> Result<TensorDesc, HandoffError> {
        // A handle, not the bytes: the program keeps its tensor whatever the node answers.
        let handle = tensor.clone();
        let desc = match native_of(self, key.device)? {
            Native::Flex => {
                let primitive =
                    into_backend::<Flex, D, K>(handle).map_err(HandoffError::OtherBackend)?;
                self.insert_primitive(key, primitive, if_exists).await?
            }
            #[cfg(feature = "wgpu")]
            Native::Wgpu => {
                // Moved natively onto the node's device if it is another; the same handle if
                // the program's device is the node's.
                let primitive =
                    into_backend::<Cube, D, K>(handle).map_err(HandoffError::OtherBackend)?;
                self.insert_primitive(key, primitive, if_exists).await?
            }
        };
        Ok(desc)
    }

    async fn tensor<const D: usize, K: Basic + 'static>(
        &self,
        key: &TensorKey,
    ) -> Result<Tensor<D, K>, HandoffError> {
        Ok(hand_out(self, key).await?.1)
    }

    async fn take_tensor<const D: usize, K: Basic + 'static>(
        &self,
        key: &TensorKey,
    ) -> Result<Tensor<D, K>, HandoffError> {
        // Checked before anything is removed: a tensor refused stays registered, and only the
        // version handed out goes.
        let (desc, tensor) = hand_out(self, key).await?;
        self.remove_version(key, desc.version).await?;
        Ok(tensor)
    }
}
