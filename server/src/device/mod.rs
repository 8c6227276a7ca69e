//! A hosted device: its worker, the single owner of the device and its tensors on its own thread,
//! and the handle through which everything else reaches it.
//!
//! Everything that touches a device's tensors is a `Command` sent to its worker; nothing else
//! holds them. Registration is one map insert on the worker's thread, so a tensor is either
//! wholly registered or not at all.
//!
//! Registered tensors are never written to (the node moves tensors; it computes nothing), so a
//! tensor that arrived as a sealed shared-memory region keeps that region, and is passed on
//! through it without a copy.

mod budget;
mod command;
mod desc;
mod handle;
mod payload;
mod verify;
mod worker;

pub use budget::TENSOR_OVERHEAD;
pub(crate) use budget::{Budget, DeviceLimits, Reservation};
pub use command::DeviceSummary;
pub(crate) use command::{Command, Reply};
pub use desc::{HashState, TensorDesc, Version};
pub use ferry_proto::IfExists;
pub use handle::DeviceHandle;
pub(crate) use payload::{Arrived, Exported, HostBytes, NativeTensor, Payload};
pub(crate) use verify::KnownHash;
pub(crate) use worker::spawn;
