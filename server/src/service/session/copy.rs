//! Copy and Pull: a tensor copied (or moved) between two devices of this node, or pulled from
//! another node under a capability that node granted.

use ferry_proto::{Response, TensorKey, Transfer};

use super::Session;
use crate::device::IfExists;
use crate::error::NodeError;
use crate::peer::PullRequest;

impl Session<'_> {
    /// Copies `src` to `dst_device` (under `dst_name`, else its own name), deleting the source
    /// once the target holds it where `remove_source` (a move): [`Response::Stored`].
    pub(super) async fn copy(
        &self,
        src: TensorKey,
        dst_device: u32,
        dst_name: Option<String>,
        remove_source: bool,
        overwrite: bool,
    ) -> Result<Response, NodeError> {
        let mode = Transfer::from_remove_source(remove_source);
        let existing = IfExists::from_overwrite(overwrite);
        let dst = TensorKey::new(dst_device, dst_name.unwrap_or_else(|| src.name.clone()));
        self.node
            .copy(&src, &dst, mode, existing)
            .await
            .map(|desc| Response::Stored(desc.to_wire()))
    }

    /// Pulls a tensor from another node over the session's link to it, and registers it:
    /// [`Response::Stored`].
    pub(super) async fn pull(&mut self, request: &PullRequest) -> Result<Response, NodeError> {
        self.node
            .pull(&mut self.peer, request)
            .await
            .map(|desc| Response::Stored(desc.to_wire()))
    }
}
