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
    /// Waits for `target`, at most `timeout_ms`: [`Response::Arrived`].
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
        let WaitFor::Tensor(key) = target;
        let timeout = Duration::from_millis(timeout_ms.into());
        let waited = tokio::select! {
            waited = tokio::time::timeout(timeout, self.node.wait_for(&key)) => waited,
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
        let reply = match waited {
            Ok(Ok(desc)) => Ok(Response::Arrived(Some(desc.to_wire()))),
            Ok(Err(error)) => Err(error),
            Err(_elapsed) => Ok(Response::Arrived(None)),
        };
        answer(conn, reply).await
    }
}
