//! A ferry node: device workers that own each hosted device's tensors, the transfer engine that
//! moves tensors between them, and the TCP service that serves them to clients.
//!
//! Embed a [`Node`] to share tensors in process; wrap it in a [`Service`] to serve it on TCP.

pub mod backend;
pub mod device;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod node;
pub mod peer;
pub mod service;
pub mod source;

pub use backend::{BackendKind, DeviceSpec};
pub use device::{Arrived, Existing, KnownHash, TensorDesc};
pub use engine::{TransferPath, TransferPolicy};
pub use error::NodeError;
pub use node::{Admission, Node, NodeConfig, TransferMode};
pub use peer::{PeerLink, PullRequest};
pub use service::{Service, ServiceConfig};
