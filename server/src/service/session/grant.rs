//! Grant and Release: a capability this node issues for another node to pull a tensor once,
//! and its release once that node has it (or its client's, where the target did not need it).

use ferry_proto::{CapabilityToken, NodeId, Response, TensorKey};

use super::Session;
use crate::error::NodeError;

impl Session<'_> {
    /// Grants the node `audience` a capability to pull the tensor under `key` once:
    /// [`Response::Capability`].
    pub(super) async fn grant(
        &self,
        key: &TensorKey,
        audience: &NodeId,
    ) -> Result<Response, NodeError> {
        self.node
            .grant(key, audience, self.id)
            .await
            .map(|granted| Response::Capability {
                token: granted.token,
                expires_in_ms: granted.ttl.as_millis() as u64,
                info: granted.desc.to_wire(),
                content_hash: granted.content_hash,
            })
    }

    /// Releases a capability: [`Response::Released`].
    pub(super) fn release(
        &self,
        capability: &CapabilityToken,
        node_id: &NodeId,
    ) -> Result<Response, NodeError> {
        self.node
            // Who may release is bound to connections: the one whose fetch was checked against
            // its certificate, or before any fetch the one it was granted to (a client handing
            // back what its target deduped, which is no node).
            .release(capability, node_id, self.id)
            .map(|()| Response::Released)
    }
}
