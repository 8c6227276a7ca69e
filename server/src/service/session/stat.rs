//! Stat, Holds and Identify: what the node says of itself (its statistics, what a device stores
//! bit-exact, its id).

use ferry_proto::{HeldDtype, Response};

use super::Session;
use crate::error::NodeError;
use crate::holds::Held;

impl Session<'_> {
    /// The node's statistics: [`Response::Stats`].
    pub(super) async fn stat(&self) -> Result<Response, NodeError> {
        self.node.stats().await.map(Response::Stats)
    }

    /// What `device` measured at start that it stores bit-exact: [`Response::Holds`].
    pub(super) fn holds(&self, device: u32) -> Result<Response, NodeError> {
        self.node.holds(device).map(|table| Response::Holds {
            device,
            dtypes: table
                .entries()
                .map(|(dtype, shape, held)| HeldDtype {
                    dtype: dtype.into(),
                    shape: shape.iter().map(|&d| d as u64).collect(),
                    refused: match held {
                        Held::Exact => None,
                        Held::Refused(why) => Some(why.clone()),
                    },
                })
                .collect(),
        })
    }

    /// The node's id: [`Response::Identity`].
    pub(super) fn identify(&self) -> Response {
        Response::Identity {
            node_id: self.node.node_id().clone(),
        }
    }
}
