//! A pull's receiver, kept across its attempts: the admitted tensor's buffer with the bytes it
//! holds, hashed as they arrive, and the hash settled off the runtime.

use ferry_io::{Assembled, PayloadRoute, TensorAssembler};

use super::request::PullRequest;
use crate::error::NodeError;
use crate::node::{Admission, Node, Receive};

/// The receiver's state across attempts: the buffer with its verified bytes, the admission (with
/// its budget), how the payload completed, and the region it came in (kept, to pass the tensor
/// on without a copy).
pub(super) struct Receiving {
    pub(super) assembler: TensorAssembler,
    pub(super) admission: Admission,
    pub(super) route: PayloadRoute,
    pub(super) region: Option<ferry_io::connection::SealedRegion>,
}

impl Node {
    /// Admits the tensor a first attempt found and makes its receiver.
    pub(super) fn start_receiving(
        &self,
        req: &PullRequest,
        name: &str,
        meta: ferry_proto::TensorMeta,
    ) -> Result<Receiving, NodeError> {
        let admission = self.admit(
            req.dst_device,
            name,
            &meta.dtype(),
            meta.shape(),
            meta.byte_len() as u64,
            req.existing,
        )?;
        // Hashed while it arrives, a chunk behind, on another thread, to be checked.
        let assembler = self.receiver(req.dst_device, meta, Receive::Pull)?;
        Ok(Receiving {
            assembler,
            admission,
            route: PayloadRoute::Chunks,
            region: None,
        })
    }
}

/// The content hash of every byte received, off the runtime (the hashing thread may still be a
/// chunk or two behind the receiver), with the receiver back.
pub(super) async fn settle_hash(
    mut received: Receiving,
) -> Result<(Receiving, ferry_proto::ContentHash), NodeError> {
    let (received, hash) = tokio::task::spawn_blocking(move || {
        let hash = received.assembler.settle_hash();
        (received, hash)
    })
    .await
    .map_err(|e| NodeError::Backend(format!("hashing task: {e}")))?;
    Ok((received, hash.map_err(NodeError::Received)?))
}

/// The assembled tensor, with its content hash where it was computed (settled before the
/// release) and the region it was received into (sealed), off the runtime where that waits.
pub(super) async fn finish(assembler: TensorAssembler) -> Result<Assembled, NodeError> {
    if assembler.finishes_at_once() {
        return assembler.finish().map_err(NodeError::Received);
    }
    tokio::task::spawn_blocking(move || assembler.finish())
        .await
        .map_err(|e| NodeError::Backend(format!("hashing task: {e}")))?
        .map_err(NodeError::Received)
}
