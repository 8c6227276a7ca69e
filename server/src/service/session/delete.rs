//! Delete and DeleteIf: a tensor unregistered, whatever its version or only the version of a
//! content hash.

use ferry_proto::{ContentHash, Response, TensorKey};

use super::Session;
use crate::error::NodeError;

impl Session<'_> {
    /// Deletes the tensor under `key`: [`Response::Deleted`].
    pub(super) async fn delete(&self, key: &TensorKey) -> Result<Response, NodeError> {
        self.node
            .remove(key)
            .await
            .map(|desc| Response::Deleted(desc.to_wire()))
    }

    /// Deletes the tensor under `key` only if it is still the version of `content_hash`:
    /// [`Response::Deleted`], or [`NodeError::Changed`] and nothing deleted.
    pub(super) async fn delete_if(
        &self,
        key: &TensorKey,
        content_hash: &ContentHash,
    ) -> Result<Response, NodeError> {
        self.node
            .remove_if_content(key, content_hash)
            .await
            .map(|desc| Response::Deleted(desc.to_wire()))
    }
}
