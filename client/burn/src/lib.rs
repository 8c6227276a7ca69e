//! ferry in Burn's own terms: a node embedded in a Burn program gives the program's model the
//! tensors that arrived there as `burn_tensor::Tensor`s, and takes the model's tensors, with no
//! host copy (the node's device and the model's are one Flex device: the handoff moves the
//! tensor's handle, not its bytes).
//!
//! [`NodeTensors`] is the handoff; `handoff.rs` turns a tensor into a backend primitive and back,
//! checking kind and rank first (Burn panics on either); `error.rs` holds [`HandoffError`].

mod error;
mod handoff;
mod node;

pub use error::HandoffError;
pub use node::NodeTensors;
