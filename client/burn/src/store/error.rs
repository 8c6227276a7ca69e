//! `StoreError`: why a model was not sent to a node or not applied from one.

use burn_store::ApplyResult;
use ferry_client::ClientError;
use ferry_proto::message::NameError;
#[cfg(feature = "node")]
use ferry_server::NodeError;

/// Why a [`FerryStore`](crate::FerryStore) call failed. An apply that fails changed nothing in
/// the module; a collect that fails may have sent some of the module's tensors (the node holds
/// whole tensors only, each as sent).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The node, reached over a connection, refused or could not be reached.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The embedded node refused (with the `node` feature only: an embedded node is its only
    /// source).
    #[cfg(feature = "node")]
    #[error(transparent)]
    Node(#[from] NodeError),
    /// A parameter's key is no tensor name (the prefix and the path together).
    #[error("parameter {path:?}: {source}")]
    Name {
        /// The parameter's path in the module.
        path: String,
        /// Why the name is refused.
        source: NameError,
    },
    /// A parameter could not be read back from its device.
    #[error("parameter {path:?} could not be read from its device: {message}")]
    ReadBack {
        /// The parameter's path in the module.
        path: String,
        /// What Burn said.
        message: String,
    },
    /// The apply found errors, or missing tensors where a partial apply was not allowed: the
    /// module was left as it was. The result says what would have been applied and why not.
    #[error("the module was left as it was: {0}")]
    NotApplied(Box<ApplyResult>),
    /// A lane given to a store reaches another node than the store's connection
    /// ([`FerryStore::with_lanes`](crate::FerryStore::with_lanes)).
    #[error("a lane reaches node {lane}, not the store's node {store}")]
    LaneToAnotherNode {
        /// The node the store's connection reaches.
        store: String,
        /// The node the lane reaches.
        lane: String,
    },
    /// Called on a thread that drives an async runtime, where waiting for the node would stall
    /// it. Call it from `tokio::task::spawn_blocking` or a thread of its own.
    #[error(
        "a FerryStore blocks until the node answers: call it from spawn_blocking or a thread of \
         its own, not from an async task"
    )]
    InsideRuntime,
}
