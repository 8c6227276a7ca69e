//! A ferry node: device workers that own each hosted device's tensors, the transfer engine that
//! moves tensors between them, and the TCP service that serves them to clients.
//!
//! Embed a [`Node`] to share tensors in process; wrap it in a [`Service`] to serve it on TCP and
//! on a Unix socket. What a node does for a client it does through the same `Node` methods.
//!
//! The public surface is what an embedding application needs: the node and its configuration,
//! the service, the typed errors, what a device holds ([`TensorDesc`]) and how bytes arrive
//! ([`Arrived`]), the node-to-node pull ([`PullRequest`]) and a source connection
//! ([`SourceConnection`], what a pulling node speaks to its source). Everything else (the device
//! actor, the capability table, the service's sessions) is internal.

mod backend;
pub mod cluster;
mod device;
mod engine;
mod error;
pub mod gpu;
pub mod holds;
pub mod metrics;
mod node;
mod peer;
mod service;
mod source;

pub use backend::{BackendKind, DeviceSpec, Primitive};
pub use device::{
    Arrived, Budget, ContentHash, DeviceHandle, Existing, HostBytes, KnownHash, TENSOR_OVERHEAD,
    TensorDesc, Version,
};
pub use engine::{TransferPath, TransferPolicy};
pub use error::{NodeError, Refusal};
pub use holds::HoldsTable;
pub use node::{
    AGENT, Admission, ClusterMembers, DEFAULT_MAX_GRANTS, DEFAULT_MAX_TENSORS, MAX_PAGE, Node,
    NodeConfig, Peer, PeerPolicy, PeerTerms, ReceiveBuffers, TransferMode,
};
pub use peer::{PeerLink, PullRequest};
pub use service::{
    DEFAULT_HELLO_TIMEOUT, DEFAULT_MAX_CONNECTIONS_PER_ADDRESS, Service, ServiceConfig,
};
pub use source::{Fetch, SourceConfig, SourceConnection, SourceError};
