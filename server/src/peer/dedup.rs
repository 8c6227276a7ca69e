//! A pull skipped: where this node already holds the bytes the grant names, the target is
//! registered as a copy of that tensor instead.

use ferry_proto::{ContentHash, TensorKey};

use crate::device::{IfExists, TensorDesc};
use crate::engine::TransferPath;
use crate::error::NodeError;
use crate::node::Node;

impl Node {
    /// The target registered as a copy of a tensor this node already holds under `granted`;
    /// `None` where it holds none, or the one it held was replaced meanwhile: then the bytes
    /// are pulled.
    pub(super) async fn held_copy(
        &self,
        granted: ContentHash,
        dst_device: u32,
        name: &str,
        existing: IfExists,
    ) -> Result<Option<TensorDesc>, NodeError> {
        let Some(held) = self.find_by_hash(granted).await? else {
            return Ok(None);
        };
        match self.dedup(held, dst_device, name, existing).await {
            // The candidate was replaced between finding it and copying it: pull instead.
            Err(NodeError::Changed(key)) => {
                tracing::info!(%key, "dedup candidate replaced meanwhile; pulling the bytes");
                Ok(None)
            }
            done => done.map(Some),
        }
    }

    /// Registers a copy of a tensor this node already holds (the verified version `held`
    /// describes) instead of pulling the same bytes; [`NodeError::Changed`] if that version was
    /// replaced meanwhile.
    async fn dedup(
        &self,
        held: TensorDesc,
        dst_device: u32,
        name: &str,
        existing: IfExists,
    ) -> Result<TensorDesc, NodeError> {
        let dst = TensorKey::new(dst_device, name);
        let desc = if held.key == dst {
            held
        } else {
            self.copy_version(&held, &dst, existing).await?
        };
        self.recorder().dedup_hit();
        tracing::info!(key = %dst, from = %desc.key, "pull skipped: same bytes already held");
        Ok(TensorDesc {
            path: TransferPath::Dedup,
            ..desc
        })
    }
}
