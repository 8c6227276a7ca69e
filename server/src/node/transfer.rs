//! In-node transfers: a copy or a move of one tensor from one device of the node to another (or
//! to another name), by the path the policy chooses, and a dedup'd pull's copy of a version.

use std::time::Instant;

use ferry_proto::{TensorKey, Transfer};

use crate::device::{Arrived, Command, Exported, IfExists, Payload, TensorDesc};
use crate::engine::{TransferPath, choose_path};
use crate::error::NodeError;
use crate::node::Node;

impl Node {
    /// Copies or moves the tensor under `src` to `dst` (another device, another name, or
    /// both), doing with a tensor already under `dst` what `existing` says. Answered only after
    /// the target registered it; a move deletes the source only then, and a failed transfer
    /// leaves the source as it was.
    pub async fn copy(
        &self,
        src: &TensorKey,
        dst: &TensorKey,
        mode: Transfer,
        existing: IfExists,
    ) -> Result<TensorDesc, NodeError> {
        let started = Instant::now();
        let mut path = None;
        // The version described here is the one copied (and, for a move, removed). One
        // replaced before its bytes were handed out is `Changed` with nothing done: the request
        // is for whatever the key holds, so the newer version is described and tried in turn
        // (a few times at most; then the replacements win and the answer is `Changed`).
        let mut tries = 0;
        let result = loop {
            let attempt = match self.describe(src).await {
                Ok(desc) => {
                    self.transfer(&desc, dst, mode, existing, None, &mut path)
                        .await
                }
                Err(error) => Err(error),
            };
            match attempt {
                Err(NodeError::Changed(_)) if tries < 3 => tries += 1,
                done => break done,
            }
        };
        let op = match mode {
            Transfer::Copy => "copy",
            Transfer::Move => "move",
        };
        let path = path.map_or("-", TransferPath::name);
        self.record(op, src, Some(dst), path, result.as_ref(), started);
        result
    }

    /// Copies (or moves) exactly the version `source` describes to `dst`: its bytes are
    /// reserved on the target before anything is read, the export is pinned to that version
    /// (so what was reserved is what arrives), and a move removes that version only.
    async fn transfer(
        &self,
        source: &TensorDesc,
        dst: &TensorKey,
        mode: Transfer,
        existing: IfExists,
        label: Option<TransferPath>,
        path_taken: &mut Option<TransferPath>,
    ) -> Result<TensorDesc, NodeError> {
        let src = &source.key;
        if src == dst {
            return Err(NodeError::SameTensor(src.clone()));
        }
        let from = self.device(src.device)?;
        let target = self.device(dst.device)?;
        let admission = self.admit(
            dst.device,
            &dst.name,
            &source.dtype,
            &source.shape,
            source.bytes,
            existing,
        )?;
        let path = choose_path(self.inner.config.policy, from.kind(), target.kind());
        *path_taken = Some(path);
        let exported = from
            .call(|reply| Command::Export {
                name: src.name.clone(),
                pin: Some(source.version),
                native: path == TransferPath::Native,
                reply,
            })
            .await?;
        // A host copy stays counted on the source device until the target holds the bytes
        // (under its own reservation).
        let mut copy_held = None;
        let payload = match exported {
            Exported::Native(native) => Payload::Native(native),
            Exported::Data(data, held) => {
                copy_held = Some(held);
                // The bytes crossed a channel between workers: held to the same rule as bytes
                // from a socket before the target's backend sees them.
                let meta = ferry_proto::tensor::meta_of(&data)?;
                if meta.byte_len() as u64 != source.bytes {
                    return Err(NodeError::Changed(src.clone()));
                }
                Payload::Data(Arrived::new(data))
            }
        };
        let registered = self
            .register_payload(admission, payload, label.unwrap_or(path))
            .await?;
        drop(copy_held);
        self.recorder().path_taken(path);
        if mode == Transfer::Move {
            // The copy stands either way; a source replaced or removed after its bytes were
            // handed out belongs to whoever did that, and is left to them.
            match self.remove_pinned(src, Some(source.version)).await {
                Ok(_) => {}
                Err(NodeError::Changed(_) | NodeError::NotFound(_)) => {
                    return Err(NodeError::SourceKept {
                        moved: src.clone(),
                        copy: registered.key,
                    });
                }
                Err(other) => return Err(other),
            }
        }
        Ok(registered)
    }

    /// Registers a copy of the version `source` describes as a dedup'd pull; not logged (the
    /// pull it answers is).
    pub(crate) async fn copy_version(
        &self,
        source: &TensorDesc,
        dst: &TensorKey,
        existing: IfExists,
    ) -> Result<TensorDesc, NodeError> {
        let mut path = None;
        self.transfer(
            source,
            dst,
            Transfer::Copy,
            existing,
            Some(TransferPath::Dedup),
            &mut path,
        )
        .await
    }
}
