//! The ferry client: the async (and blocking) Rust API to a ferry node, over the connection
//! `ferry-io` provides.

pub mod address;
pub mod blocking;
pub mod client;
pub mod cluster;
pub mod etcd_roles;
pub mod tensor;

pub use blocking::{Answer, BlockingClient, Wait};
pub use client::{
    Client, ClientError, Connect, ConnectOptions, HeldProbe, InterruptedCopy, IssuedCapability,
    Lane, ModelCopy, NodeCopy, Payload, Put, PutBatch, PutBatchInLanes, PutTo, RelayTarget,
    TensorParts, Upload,
};
pub use ferry_io::{
    ClearTokens, ClientTls, ConnectionError, ConnectionLimits, Endpoint, LocalServer, PeerCheck,
    SharedMemory, TokenWithheld,
};
pub use ferry_proto::{
    CapabilityToken, ContentHash, DType, ErrorCode, IfExists, NodeId, TensorData, TensorInfo,
    TensorKey, Token, Transfer, TransferPath,
};
