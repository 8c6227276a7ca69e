//! The ferry client: the async Rust API to a ferry node, and the frame connection every ferry
//! peer (client, node session, node-to-node pull) speaks through.

pub mod blocking;
pub mod client;
pub mod connection;
pub mod files;
pub mod load;
#[cfg(target_os = "linux")]
pub mod region;
pub mod tensor;
pub mod transport;

pub use blocking::BlockingClient;
pub use client::{Client, ClientConfig, ClientError, Grant, NodeCopy, copy_between};
pub use connection::{Connection, ConnectionError, ConnectionLimits, PayloadRoute, RegionUse};
pub use ferry_proto::{ErrorCode, TensorData, TensorInfo, TensorKey};
pub use transport::{Endpoint, Stream, Transport};
