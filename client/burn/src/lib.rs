//! ferry in Burn's own terms.
//!
//! - [`FerryStore`]: burn-store's `ModuleStore` whose other end is a node: a whole module
//!   (quantized or not) sent to a node's device and applied from it, over a connection or from
//!   a node embedded in this process.
//! - [`NodeTensors`]: an embedded node's tensors as `burn_tensor::Tensor`s, handed in and out
//!   with no host copy (the node's Flex device and the program's are one, and so is a wgpu
//!   device the program opened first, with the `wgpu` feature: the handoff moves the tensor's
//!   handle, not its bytes).
//! - [`TryToDevice`]: any tensor to any device of this process, checked against what the
//!   device holds before a byte moves: an error that names the dtype and the device, never a
//!   panic.
//!
//! `store/` holds the store; `node.rs` the handoff, over `handoff.rs` (a tensor as a backend
//! primitive and back, kind and rank checked first: Burn panics on either) and
//! `shared_data.rs` (a node's buffer as data that shares it); `holds.rs` finds what a
//! device of this process holds, which `to_device.rs` checks before a move; `error.rs` holds [`HandoffError`].

mod error;
mod handoff;
mod holds;
mod node;
mod shared_data;
mod store;
mod to_device;

pub use error::HandoffError;
pub use node::NodeTensors;
pub use store::{Connected, DEFAULT_WINDOW, Embedded, FerryStore, Link, Missing, StoreError};
pub use to_device::{MoveError, TryToDevice};
