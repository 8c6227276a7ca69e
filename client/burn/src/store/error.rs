//! `StoreError`: why a model was not sent to a node or not applied from one.

use burn_store::ApplyResult;
use ferry_client::{ClientError, ErrorCode};
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
    #[error("the module was left as it was: {}", refusal(.0))]
    NotApplied(Box<ApplyResult>),
    /// A collect failed part way: the version it was writing was given up, and the node's
    /// model is as it was (nothing of this collect was kept).
    #[error(
        "the model was not collected to {prefix} on device {device} of {node}: version {version} was given up, nothing of it kept: {cause}"
    )]
    NotCollected {
        /// The node: its address, or the embedded node's id.
        node: String,
        /// The model's prefix.
        prefix: String,
        /// The device.
        device: u32,
        /// The version given up.
        version: u64,
        /// Why.
        cause: Box<StoreError>,
    },
    /// The store's node committed the collect, but some of its replicas did not take the
    /// version ([`FerryStore::with_replicas`](crate::FerryStore::with_replicas)): each named,
    /// with why; the others hold it.
    #[error(
        "the model {prefix} on device {device} was committed on the store's node, but {} of its {replicas} replicas did not take it: {}",
        .failed.len(),
        crate::store::replicas::describe(.failed)
    )]
    NotReplicated {
        /// The model's prefix.
        prefix: String,
        /// The device.
        device: u32,
        /// How many replicas the store has.
        replicas: usize,
        /// Those that did not take it.
        failed: Vec<crate::store::NotReplicated>,
    },
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

/// Why an apply was refused, without what would have been applied: its errors, then the
/// parameters the node has no tensor for (a few of each, and how many in all).
fn refusal(result: &ApplyResult) -> String {
    const SHOWN: usize = 5;
    fn some<T: std::fmt::Display>(items: impl ExactSizeIterator<Item = T>) -> String {
        let total = items.len();
        let shown: Vec<String> = items.take(SHOWN).map(|i| i.to_string()).collect();
        let more = total.saturating_sub(SHOWN);
        match more {
            0 => shown.join("; "),
            n => format!("{}; and {n} more", shown.join("; ")),
        }
    }
    let mut parts = Vec::new();
    if !result.errors.is_empty() {
        parts.push(format!(
            "{} errors: {}",
            result.errors.len(),
            some(result.errors.iter())
        ));
    }
    if !result.missing.is_empty() {
        parts.push(format!(
            "{} parameters the node has no tensor for: {}",
            result.missing.len(),
            some(result.missing.iter().map(|(path, _)| path))
        ));
    }
    parts.join("; ")
}

impl StoreError {
    /// The node's error code, where the node refused (over a connection or embedded), however
    /// deep the refusal sits: `e.code() == Some(ErrorCode::AlreadyExists)` matches a collect
    /// refused because the prefix holds a model, over either link.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            StoreError::Client(e) => e.code(),
            #[cfg(feature = "node")]
            StoreError::Node(e) => Some(e.code()),
            StoreError::NotCollected { cause, .. } => cause.code(),
            StoreError::NotReplicated { failed, .. } => failed.first().and_then(|f| f.cause.code()),
            _ => None,
        }
    }
}
