//! Waiting for a tensor to arrive: every registration on any device of the node bumps one
//! counter, which waiters watch instead of polling.

use ferry_proto::TensorKey;
use tokio::sync::watch;

use crate::device::TensorDesc;
use crate::error::NodeError;
use crate::node::Node;

/// The node's count of registrations, watched by [`Node::wait_for`].
#[derive(Debug)]
pub(super) struct Arrivals(watch::Sender<u64>);

impl Arrivals {
    pub(super) fn new() -> Self {
        Arrivals(watch::Sender::new(0))
    }

    /// A tensor was registered: every waiter looks again.
    pub(super) fn note(&self) {
        self.0.send_modify(|count| *count = count.wrapping_add(1));
    }
}

impl Node {
    /// The description of the tensor under `key`, once one is registered there: at once if the
    /// key holds one, else after the registration that puts one there (a put, a copy, a pull or
    /// an insert from this process). Waits for as long as it takes; bound it with
    /// `tokio::time::timeout`, and drop it to stop waiting. Any error but `NotFound` (no such
    /// device, the node shutting down) ends the wait.
    pub async fn wait_for(&self, key: &TensorKey) -> Result<TensorDesc, NodeError> {
        // Subscribed before the first look, so a registration between the look and the wait
        // is not missed: it marks the counter changed.
        let mut arrivals = self.inner.arrivals.0.subscribe();
        loop {
            match self.describe(key).await {
                Err(NodeError::NotFound(_)) => {}
                answer => return answer,
            }
            // The sender lives as long as the node, which this call holds.
            if arrivals.changed().await.is_err() {
                return Err(NodeError::ShuttingDown);
            }
        }
    }
}
