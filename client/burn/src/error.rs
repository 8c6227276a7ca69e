//! `HandoffError`: why a tensor could not be handed between a node and a Burn program.

use ferry_server::NodeError;

/// Why a handoff failed. Nothing was registered, removed or converted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandoffError {
    /// The node refused (no such tensor, no room, a device of another backend, ...).
    #[error(transparent)]
    Node(#[from] NodeError),
    /// The tensor is of another kind than the one asked for (a float asked as `Int`, ...).
    #[error("a {dtype} tensor is not a {asked} tensor")]
    Kind {
        /// The tensor's dtype, readable.
        dtype: String,
        /// The kind asked for.
        asked: &'static str,
    },
    /// The tensor has another rank than the one asked for.
    #[error("a tensor of shape {shape:?} has rank {}, not {asked}", shape.len())]
    Rank {
        /// The tensor's shape.
        shape: Vec<usize>,
        /// The rank asked for.
        asked: usize,
    },
    /// The device stores the plain dtype but cannot compute with it (Flex: a 4-byte bool
    /// store, Flex32): a tensor handed out would panic at its first operation. Quantized
    /// tensors are handed out as the device holds them; whether an operation computes with one
    /// is the backend's (Burn 0.22.1's wgpu kernels do not take a natively stored Q8S tensor).
    #[error("the device stores {dtype} but cannot compute with it; read it as data instead")]
    NotOperable {
        /// The dtype, readable.
        dtype: String,
    },
    /// The tensor is not of the node device's backend (another backend, or a tensor that
    /// records gradients): a handoff with no copy needs the node's own backend.
    #[error(
        "the tensor is not of the node device's backend ({0}); only such tensors are handed over \
         without a copy"
    )]
    OtherBackend(String),
    /// The node's device is of a backend whose tensors this build does not hand over: read
    /// them as data instead.
    #[error(
        "device {device} is {backend}, whose tensors are not handed over (Flex's are, and wgpu's \
         with ferry-burn's `wgpu` feature): read them as data instead"
    )]
    NoHandoff {
        /// The node's device index.
        device: u32,
        /// Its backend.
        backend: ferry_backend::BackendKind,
    },
}
