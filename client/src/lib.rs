//! The ferry client: the async (and blocking) Rust API to a ferry node, over the connection
//! `ferry-io` provides.

pub mod address;
pub mod blocking;
pub mod client;
pub mod cluster;
pub mod load;
pub mod tensor;

pub use blocking::BlockingClient;
pub use client::{Client, ClientConfig, ClientError, Grant, HeldProbe, NodeCopy, copy_between};
pub use ferry_io::{
    Connection, ConnectionError, ConnectionLimits, Endpoint, PayloadRoute, RegionUse, Stream,
    Transport,
};
pub use ferry_proto::{ErrorCode, TensorData, TensorInfo, TensorKey};
