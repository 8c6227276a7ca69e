//! Batches: many uploads or downloads in one pipelined exchange, one answer per tensor.

use burn_std::Bytes;
use ferry_proto::{Request, Response, TensorData, TensorInfo, TensorKey, TensorMeta};

use super::{Client, ClientError, unexpected};

/// How many downloads a batch keeps outstanding at once.
const PIPELINE_WINDOW: usize = 64;

impl Client {
    /// Uploads many tensors to `device` in one pipelined exchange (a whole model's weights): the
    /// next upload starts while the node registers the previous one. One answer per tensor, in
    /// order; a refused tensor does not stop the others. `Err` only when the connection fails.
    pub async fn put_batch(
        &mut self,
        device: u32,
        tensors: &[(String, TensorData)],
        overwrite: bool,
    ) -> Result<Vec<Result<TensorInfo, ClientError>>, ClientError> {
        self.begin()?;
        let result = async {
            let mut results: Vec<Option<Result<TensorInfo, ClientError>>> =
                (0..tensors.len()).map(|_| None).collect();
            // The upload whose `Stored` (or error) the node still owes.
            let mut owed: Option<usize> = None;
            for (i, (name, data)) in tensors.iter().enumerate() {
                let meta = match ferry_proto::tensor::meta_of(data) {
                    Ok(meta) => meta,
                    Err(e) => {
                        results[i] = Some(Err(e.into()));
                        continue;
                    }
                };
                self.conn
                    .write_request(&Request::Put {
                        device,
                        name: Some(name.clone()),
                        meta: meta.to_wire(),
                        overwrite,
                    })
                    .await?;
                if let Some(prev) = owed.take() {
                    results[prev] = Some(self.read_stored().await?);
                }
                match self.conn.read_response().await? {
                    Response::Ready => {
                        self.conn.write_payload(data.as_bytes()).await?;
                        owed = Some(i);
                    }
                    Response::Error(reply) => results[i] = Some(Err(reply.into())),
                    other => return Err(unexpected(other)),
                }
            }
            if let Some(prev) = owed {
                results[prev] = Some(self.read_stored().await?);
            }
            Ok(results
                .into_iter()
                .map(|r| r.unwrap_or_else(|| Err(ClientError::Unexpected("no answer".into()))))
                .collect())
        }
        .await;
        self.end(result)
    }

    /// Downloads many tensors in one pipelined exchange: every request is sent before the first
    /// answer is read. One answer per key, in order.
    pub async fn get_batch(
        &mut self,
        keys: &[TensorKey],
    ) -> Result<Vec<Result<TensorData, ClientError>>, ClientError> {
        self.get_batch_into(keys, |_, _| None).await
    }

    /// [`get_batch`](Self::get_batch), receiving each tensor into memory the caller gives:
    /// `buffer_for(i, meta)` is asked, once the node's description of the `i`-th tensor is
    /// checked, for a buffer of exactly `meta.byte_len()` bytes (a range of the file being
    /// written, so that the bytes land in it with no copy); `None`, or a buffer of another
    /// length, and the tensor goes to new memory. Every byte of a given buffer is overwritten
    /// before its tensor is returned; a tensor that fails leaves its buffer partly written.
    pub async fn get_batch_into(
        &mut self,
        keys: &[TensorKey],
        mut buffer_for: impl FnMut(usize, &TensorMeta) -> Option<Bytes>,
    ) -> Result<Vec<Result<TensorData, ClientError>>, ClientError> {
        self.begin()?;
        let result = async {
            let mut results = Vec::with_capacity(keys.len());
            // Requests go out in windows so that a huge batch never has more than this many
            // answers outstanding.
            for window in keys.chunks(PIPELINE_WINDOW) {
                for key in window {
                    self.conn
                        .write_request(&Request::Get { key: key.clone() })
                        .await?;
                }
                for _ in window {
                    let index = results.len();
                    let answer = self.read_tensor(|meta| buffer_for(index, meta)).await?;
                    results.push(answer);
                }
            }
            Ok(results)
        }
        .await;
        self.end(result)
    }

    /// A node's answer to a download: the tensor, or an error.
    async fn read_tensor(
        &mut self,
        buffer_for: impl FnOnce(&TensorMeta) -> Option<Bytes>,
    ) -> Result<Result<TensorData, ClientError>, ClientError> {
        let wire = match self.conn.read_response().await? {
            Response::Tensor { meta, .. } => meta,
            Response::Error(reply) => return Ok(Err(reply.into())),
            other => return Err(unexpected(other)),
        };
        Ok(Ok(self.read_tensor_payload(&wire, buffer_for).await?))
    }
}
