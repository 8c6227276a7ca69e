//! Wait: answered as soon as what it waits for is there (at once if it is already), or with
//! nothing at its timeout. A peer that hangs up ends the wait, and so does the node's shutdown:
//! no waiter outlives its connection.

use std::time::Duration;

use ferry_io::{Connection, ConnectionError, Transport};
use ferry_proto::message::MAX_WAIT_MS;
use ferry_proto::{Response, WaitFor};

use super::{Session, answer};
use crate::error::NodeError;
use crate::service::door::handshake::refuse as fail;

impl Session<'_> {
    /// Waits for `target`, at most `timeout_ms`: [`Response::Arrived`] for a tensor (or nothing,
    /// at the timeout), [`Response::Model`] for a model version.
    pub(super) async fn wait<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        target: WaitFor,
        timeout_ms: u32,
    ) -> Result<(), ConnectionError> {
        if timeout_ms > MAX_WAIT_MS {
            let too_long = NodeError::WaitTooLong {
                asked_ms: timeout_ms,
                max_ms: MAX_WAIT_MS,
            };
            return answer(conn, Err(too_long)).await;
        }
        let timeout = Duration::from_millis(timeout_ms.into());
        let node = self.node;
        let arrival = async move {
            match target {
                WaitFor::Tensor(key) => node
                    .wait_for(&key)
                    .await
                    .map(|desc| Response::Arrived(Some(desc.to_wire()))),
                WaitFor::Model {
                    device,
                    prefix,
                    newer_than,
                } => node
                    .wait_for_model(device, &prefix, newer_than)
                    .await
                    .map(|manifest| Response::Model(manifest.to_wire())),
            }
        };
        let waited = tokio::select! {
            waited = tokio::time::timeout(timeout, arrival) => waited,
            // Nothing may come before the answer (one request at a time): a close ends the wait
            // and then the session; anything else is the peer breaking the protocol.
            frame = conn.read_frame() => {
                let error = match frame {
                    Ok(None) => return Ok(()),
                    Ok(Some(frame)) => ConnectionError::UnexpectedFrame {
                        expected: "no frame before a wait's answer",
                        got: frame.kind,
                    },
                    Err(error) => error,
                };
                return Err(fail(conn, error).await);
            }
            _ = self.shutdown.recv() => Ok(Err(NodeError::ShuttingDown)),
        };
        let reply = waited.unwrap_or(Ok(Response::Arrived(None)));
        answer(conn, reply).await
    }
}
