//! Fetch and FetchRange: another node fetching, under a capability this node granted, a
//! tensor's payload from an offset, or the part of it a stripe of its content hash's input
//! covers.

use ferry_io::{Connection, ConnectionError, PayloadRoute, Transport};
use ferry_proto::{CapabilityToken, NodeId, Response};

use super::{Session, answer};
use crate::error::{NodeError, Refusal};
use crate::node::FetchWants;
use crate::service::door::refusal_log::RefusalLog;

/// A fetch refused (its capability, the identity it speaks for).
static FETCH_REFUSED: RefusalLog = RefusalLog::new("fetch", "fetch refused");

impl Session<'_> {
    /// Answers a `Fetch`: the payload from `offset` to its end.
    pub(super) async fn fetch<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        capability: &CapabilityToken,
        node_id: &NodeId,
        offset: u64,
    ) -> Result<(), ConnectionError> {
        let wants = FetchWants::From(offset);
        self.serve_fetch(conn, capability, node_id, wants).await
    }

    /// Answers a `FetchRange`: the part of the payload in `from..to` of the content hash's
    /// input (a stripe).
    pub(super) async fn fetch_range<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        capability: &CapabilityToken,
        node_id: &NodeId,
        from: u64,
        to: u64,
    ) -> Result<(), ConnectionError> {
        let wants = FetchWants::Input(from..to);
        self.serve_fetch(conn, capability, node_id, wants).await
    }

    /// Serves a node-to-node fetch under a capability: from an offset to the end (`Fetch`), or
    /// the part of the payload in a range of the content hash's input (`FetchRange`, a stripe),
    /// which is sent from where it starts to the payload's end instead where the bytes are a
    /// copy read out of the device for this fetch (a copy per stripe would cost more than the
    /// stripes gain).
    async fn serve_fetch<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        capability: &CapabilityToken,
        node_id: &NodeId,
        wants: FetchWants,
    ) -> Result<(), ConnectionError> {
        let mut lease = match self
            .speaks_for(node_id)
            .and_then(|node_id| self.node.begin_fetch(capability, node_id, self.id, &wants))
        {
            Ok(lease) => lease,
            Err(error) => {
                FETCH_REFUSED.note_in_request(&format!("for {}: {error}", node_id.as_str()));
                return answer(conn, Err(error)).await;
            }
        };
        let read = self
            .node
            .read_host_pinned(lease.key(), Some(lease.version()))
            .await;
        let (desc, meta, bytes) = match read {
            Ok(read) => read,
            // The version granted is gone for good: so is the capability.
            Err(NodeError::Changed(key) | NodeError::NotFound(key)) => {
                self.node.revoke(capability);
                let error = NodeError::CapabilityRefused(Refusal::VersionGone(key));
                return answer(conn, Err(error)).await;
            }
            Err(error) => return answer(conn, Err(error)).await,
        };
        let len = bytes.len();
        match wants {
            FetchWants::From(offset) => {
                let Ok(start) = usize::try_from(offset).map(|o| o.min(len)) else {
                    let error = NodeError::OffsetOutOfRange {
                        offset,
                        bytes: len as u64,
                    };
                    return answer(conn, Err(error)).await;
                };
                conn.write_response(&Response::Tensor {
                    info: desc.to_wire(),
                    meta: meta.to_wire(),
                })
                .await?;
                // A failed write drops the lease (the capability waits briefly for a resume) and
                // the host copy read for it.
                let route = conn
                    .write_payload_known(&bytes.parts(), start, bytes.known())
                    .await?;
                self.count_sent(route, len - start);
            }
            FetchWants::Input(input) => {
                let prefix = ferry_proto::tensor::content_hash_prefix(&meta).len() as u64;
                let part = ferry_proto::stripes::payload_part(prefix, len as u64, input);
                // Within the payload, so within a `usize`.
                let start = part.start as usize;
                let end = if bytes.lent() {
                    part.end as usize
                } else {
                    // The whole rest, charged as a whole payload: it cost a copy of it.
                    if let Err(error) = lease.charge_whole() {
                        return answer(conn, Err(error)).await;
                    }
                    len
                };
                conn.write_response(&Response::TensorPart {
                    info: desc.to_wire(),
                    meta: meta.to_wire(),
                    start: start as u64,
                    end: end as u64,
                })
                .await?;
                conn.write_payload_part(&bytes.parts(), start..end, bytes.known())
                    .await?;
                self.count_sent(PayloadRoute::Chunks, end - start);
            }
        }
        self.node.recorder().fetch_served();
        drop(lease);
        Ok(())
    }
}
