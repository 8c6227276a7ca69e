//! ferry in Burn's own terms.
//!
//! - [`FerryStore`]: burn-store's `ModuleStore` whose other end is a node: a whole module
//!   (quantized or not) sent to a node's device and applied from it, over a connection or from
//!   a node embedded in this process.
//! - `NodeTensors`: an embedded node's tensors as `burn_tensor::Tensor`s, handed in and out
//!   with no host copy (the node's Flex device and the program's are one, and so is a wgpu
//!   device the program opened first, with the `wgpu` feature: the handoff moves the tensor's
//!   handle, not its bytes).
//! - [`TryToDevice`]: any tensor to any device of this process, checked against what the
//!   device holds before a byte moves: an error that names the dtype and the device, never a
//!   panic. [`TryModuleToDevice`]: a whole module so, every parameter checked before any moves,
//!   an error naming the parameter's path and dtype.
//!
//! Features:
//!
//! - `node` (default): the parts over a node embedded in this process, which link the whole
//!   node (ferry-server): `NodeTensors`, `FerryStore::embedded` (`Embedded`), `HandoffError`,
//!   and `StoreError::Node`. Without it (`default-features = false`) [`TryToDevice`] and
//!   [`FerryStore::connected`] work as with it, and no node is linked: what a device holds
//!   comes from ferry-backend, and a store's node is reached through ferry-client. Checked by
//!   `cargo check -p ferry-burn --no-default-features`, with
//!   `cargo tree -p ferry-burn --no-default-features -e normal | grep ferry-server` empty.
//! - `ndarray`: burn-ndarray devices in the program, checked against what ferry measured
//!   NdArray to hold.
//! - `wgpu`: the program's wgpu devices, each measured on the device itself (ferry-backend's
//!   `wgpu`); with `node`, the node's too (ferry-server's `wgpu`), so tensors are handed over on
//!   the GPU.
//!
//! `store/` holds the store; `node.rs` the handoff, over `handoff.rs` (a tensor as a backend
//! primitive and back, kind and rank checked first: Burn panics on either) and
//! `shared_data.rs` (a Flex buffer as data that shares it: a node's tensor applied, a
//! parameter collected); `holds.rs` finds what a device of this process holds, which
//! `to_device.rs` checks before a move (and `module_to_device.rs` before a module's);
//! `error.rs` holds `HandoffError`. `node.rs`, `handoff.rs`, `error.rs` and the store's
//! `embedded.rs` and `handoff_apply.rs` are built with `node` only.

mod backend_primitive;
#[cfg(feature = "node")]
mod error;
#[cfg(feature = "node")]
mod handoff;
mod holds;
mod module_to_device;
#[cfg(feature = "node")]
mod node;
mod shared_data;
mod store;
mod to_device;

#[cfg(feature = "node")]
pub use error::HandoffError;
pub use module_to_device::{ModuleMoveError, TryModuleToDevice};
#[cfg(feature = "node")]
pub use node::NodeTensors;
#[cfg(feature = "node")]
pub use store::Embedded;
pub use store::{
    Connected, DEFAULT_WINDOW, FerryStore, Link, Missing, NotReplicated, Replica, StoreError,
};
pub use to_device::{MoveError, TryToDevice};
