//! Get: a tensor read out of its device to the host and sent, its description and then its
//! payload.

use ferry_io::{Connection, ConnectionError, Transport};
use ferry_proto::{Response, TensorKey};

use super::{Session, answer};

impl Session<'_> {
    /// Answers a get: [`Response::Tensor`] and the payload, or an error (and no payload).
    pub(super) async fn get<S: Transport>(
        &mut self,
        conn: &mut Connection<S>,
        key: &TensorKey,
    ) -> Result<(), ConnectionError> {
        match self.node.read_host(key).await {
            Ok((desc, meta, bytes)) => {
                conn.write_response(&Response::Tensor {
                    info: desc.to_wire(),
                    meta: meta.to_wire(),
                })
                .await?;
                let route = conn
                    .write_payload_known(&bytes.parts(), 0, bytes.known())
                    .await?;
                self.count_sent(route, bytes.len());
            }
            Err(error) => answer(conn, Err(error)).await?,
        }
        Ok(())
    }
}
