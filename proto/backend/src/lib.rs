//! What ferry knows about Burn's backends: the backends a device can be, the calls into them
//! with panics contained, what each holds bit-exact as measured, and GPU devices.
//!
//! Both a node (`ferry-server`, whose device workers host devices of these backends) and a Burn
//! program (`ferry-burn`, which checks a move between its own devices against the same
//! measurements) need this, and the program need not link the node for it.
//!
//! - `backend.rs`: [`BackendKind`] (Flex, NdArray, burn-cubecl's on the wgpu runtime), the
//!   device spec ([`DeviceSpec`]), a tensor of any kind on a backend ([`Primitive`]) whose calls
//!   turn a backend's panic into a [`BackendError`], and a registered tensor's bytes lent
//!   without a copy ([`SharedPayload`]).
//! - [`holds`]: what a device stores bit-exact, measured by a probe of the device itself
//!   ([`HoldsTable`]), cached per backend and adapter for the process's life.
//! - [`gpu`]: GPU device specs (`wgpu:0`, `vulkan:cpu`, `gl:default`) and, with the `wgpu`
//!   feature, opening one without a panic.
//!
//! Features: `wgpu` (off by default) compiles burn-wgpu and burn-cubecl in: `gpu::open`,
//! `gpu::Backend`, and [`Primitive::confirm_written`]'s check of a GPU buffer. ferry-server's
//! and ferry-burn's `wgpu` features turn it on.

mod backend;
pub mod gpu;
pub mod holds;

pub use backend::{BackendError, BackendKind, DeviceSpec, Primitive, SharedPayload};
pub use holds::HoldsTable;
