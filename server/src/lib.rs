//! A ferry node: device workers that own each hosted device's tensors, the transfer engine that
//! moves tensors between them, and the TCP service that serves them to clients.
//!
//! [`Server::builder`] builds a node with its door exactly as the `ferry-server` binary does
//! (the binary is a command-line front over it): the same defaults (a receive pool with memory
//! kept ready) and the same refusals (beyond loopback only under TLS with a credential and a
//! peer list, unless the program says [`ServerBuilder::insecure`]). Underneath, [`Node`] shares
//! tensors in process and a [`Service`] serves it on TCP and on a Unix socket; what a node does
//! for a client it does through the same `Node` methods.
//!
//! The public surface is what an embedding application needs: the server builder, the node and
//! its configuration
//! ([`NodeConfig`], the devices it hosts as [`DeviceSpec`]s, its [`TransferPolicy`],
//! [`PeerPolicy`] and [`ReceiveBuffers`]), the service, the typed errors, what a device holds
//! ([`TensorDesc`], [`HoldsTable`]) and what can be read of a device ([`DeviceHandle`]), and the
//! cluster, metrics and GPU modules. Everything else (the device actor, admission and
//! registration, the budget's reservations, capabilities, node-to-node pulls, the service's
//! sessions) is internal.
//!
//! Invariant kept by that boundary: nothing outside this crate can hand a node a content hash
//! that it registers as verified. The node hashes what it stores itself (a put, an in-process
//! [`Node::insert`], a pull's bytes as they arrive); a hash a pull's source stated (through
//! shared memory, where the bytes are not hashed on the way) is only a candidate until the node
//! has recomputed it from the registered bytes. Only a hash the node computed answers dedup, is
//! granted, or matches a conditional delete.

pub mod cluster;
mod device;
mod engine;
mod error;
mod launch;
pub mod metrics;
mod node;
mod peer;
mod service;

pub use device::{
    DeviceHandle, DeviceSummary, HashState, IfExists, TENSOR_OVERHEAD, TensorDesc, Version,
};
pub use engine::{TransferPath, TransferPolicy};
pub use error::{NodeError, Refusal};
// What a device's backend is, holds and does, shared with ferry-burn (ferry-backend), at the paths
// it had when it lived here.
pub use ferry_backend::{BackendKind, DeviceSpec, Primitive};
pub use ferry_backend::{gpu, holds};
pub use ferry_proto::{NodeId, Token, Transfer};
// What a `ServerBuilder` is given, so that a program embedding a node needs no other crate.
pub use ferry_io::{ClearTokens, ConnectionLimits, LocalServer, NodeTls, SharedMemory, TlsFiles};
pub use ferry_memory::Pool;
pub use holds::HoldsTable;
pub use launch::{
    ClusterJoin, DEFAULT_RECYCLE, PeerToken, ProcessTuning, Server, ServerBuilder, StartError,
    tune_allocator,
};
pub use node::models::{
    Manifest, ManifestTensor, ModelError, ModelId, ModelPin, ModelWriter, Replace,
};
pub use node::{
    ClusterMembers, DEFAULT_MAX_GRANTS, DEFAULT_MAX_TENSORS, Node, NodeConfig, NodeLimits, Peer,
    PeerPolicy, PullConfig, ReadyMemory, ReceiveBuffers, ReceivePlanError, Striping,
};
// The node's door (service/door/): the credentials it accepts and the scopes it grants to
// certificates, what a `ServerBuilder` is given (so that a program embedding a node needs no
// other crate), with what can be wrong with them.
pub use service::door::certificate_grant::{CertificateGrant, CertificateGrantError};
pub use service::door::credential::{Credential, CredentialError, Scope, Scopes, parse_token_file};
pub use service::{
    BindError, DEFAULT_HELLO_TIMEOUT, DEFAULT_MAX_CONNECTIONS_PER_ADDRESS, Exposure, ExposureError,
    Missing, Service, ServiceConfig,
};
