//! Put: a tensor uploaded to a device, checked and its budget claimed before its payload is
//! read, registered once the payload arrived whole; its payload asked for with `Ready`, or
//! following at once (an eager put), read and dropped where the put is refused.

use ferry_io::{Assembled, Connection, ConnectionError, PayloadRoute, RegionUse, Transport};
use ferry_proto::{Response, TensorMeta, WireMeta};

use super::{Session, answer, drop_unasked_payload};
use crate::device::{Arrived, IfExists, KnownHash};
use crate::error::NodeError;
use crate::node::{Direction, Receive};
use crate::service::door::handshake::refuse as fail;
use crate::service::door::refusal_log::RefusalLog;

/// A put refused before its payload (its meta, its device, its budget).
static PUT_REFUSED: RefusalLog = RefusalLog::new("put", "put refused");
/// A put whose payload broke off or failed its checks.
static UPLOAD_FAILED: RefusalLog = RefusalLog::new("put", "upload failed");

/// When a put's payload comes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PayloadComes {
    /// Once the node answered [`Response::Ready`] (`Request::Put`): a refusal is answered
    /// instead, and no payload follows.
    AfterReady,
    /// Right after the request, as chunk frames (`Request::PutEager`): read whether the put is
    /// admitted or not, and dropped where it is not.
    AtOnce,
}

impl Session<'_> {
    /// Answers a put: [`Response::Ready`] once the tensor is admitted (unless its payload comes
    /// at once), then its payload is read, then [`Response::Stored`] once registered; an error
    /// instead where it is refused (and no payload follows, or the one that came is dropped).
    /// A payload that broke off closes the connection.
    pub(super) async fn put<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        device: u32,
        name: Option<String>,
        wire: &WireMeta,
        overwrite: bool,
        comes: PayloadComes,
    ) -> Result<(), ConnectionError> {
        let node = self.node;
        let existing = IfExists::from_overwrite(overwrite);
        let started = std::time::Instant::now();
        let name = name.unwrap_or_else(|| node.fresh_name());
        // Everything about the tensor is checked, and its budget claimed, before one byte of it
        // is read or its buffer allocated.
        let admitted = TensorMeta::try_from(wire)
            .map_err(NodeError::from)
            .and_then(|meta| {
                let bytes = meta.byte_len() as u64;
                let admission =
                    node.admit(device, &name, &meta.dtype(), meta.shape(), bytes, existing)?;
                // Hashed as it arrives only where the device would otherwise hash it before
                // registering, or its model version's commit would wait for the hash; else after
                // the answer (`ferry_io::hash_plan`).
                let purpose = Receive::Put {
                    into_model: admission.writes_a_model(),
                };
                let assembler = node.receiver(device, meta, purpose)?;
                Ok((assembler, admission))
            });
        let (mut assembler, admission) = match admitted {
            Ok(admitted) => admitted,
            Err(error) => {
                node.recorder()
                    .transfer_ended("put", "-", false, started.elapsed());
                PUT_REFUSED.note_in_request(&format!("{device}/{name}: {error}"));
                let unasked = (comes == PayloadComes::AtOnce).then_some(wire.byte_len);
                drop_unasked_payload(conn, unasked).await?;
                return answer(conn, Err(error)).await;
            }
        };
        let read = match comes {
            PayloadComes::AfterReady => {
                conn.write_response(&Response::Ready).await?;
                conn.read_payload_keeping(&mut assembler, RegionUse::Keep)
                    .await
            }
            // Chunk frames only: a region could not have been dropped unread had the put been
            // refused, so none may come.
            PayloadComes::AtOnce => conn
                .read_chunks(&mut assembler)
                .await
                .map(|()| (PayloadRoute::Chunks, None)),
        };
        let region = match read {
            Ok((route, region)) => {
                let bytes = assembler.meta().byte_len() as u64;
                node.recorder().payload(Direction::Received, route, bytes);
                region
            }
            Err(error) => {
                // The rest of the stream cannot be trusted to line up with frames: report and
                // close. Nothing was registered; the buffer and the reservation go first, not
                // after the report (which may wait on the peer).
                drop(assembler);
                drop(admission);
                node.recorder()
                    .transfer_ended("put", "-", false, started.elapsed());
                UPLOAD_FAILED.note_in_request(&format!("{device}/{name}: {error}"));
                return Err(fail(conn, error).await);
            }
        };
        // Off the runtime where it waits: the hashing thread's last chunk is waited for, and
        // sealing a region it was received into reads it once (its checksum) and asks the kernel
        // to seal it. A receiver with neither (a small tensor, hashed in line or not at all)
        // finishes here: a hand-off to a blocking thread and back costs more than that.
        let finished = if assembler.finishes_at_once() {
            assembler.finish().map_err(NodeError::Received)
        } else {
            tokio::task::spawn_blocking(move || assembler.finish())
                .await
                .map_err(|e| NodeError::Backend(format!("finishing a put: {e}")))
                .and_then(|finished| finished.map_err(NodeError::Received))
        };
        let reply = match finished {
            Ok(Assembled {
                data,
                hash,
                sealed,
                checksums,
            }) => {
                let arrived = Arrived {
                    data,
                    hash: hash.map_or(KnownHash::Unknown, KnownHash::Computed),
                    // The region it came in, or the one it was received into
                    // (`--shareable-receives`).
                    region: region.or(sealed),
                    checksums,
                };
                node.register(admission, arrived)
                    .await
                    .map(|desc| Response::Stored(desc.to_wire()))
            }
            Err(error) => Err(error),
        };
        answer(conn, reply).await
    }
}
