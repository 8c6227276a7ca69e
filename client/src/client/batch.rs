//! Batches: many uploads or downloads in one pipelined exchange, one answer per tensor (the
//! exchange itself; uploads are asked for through [`Client::put_batch`]'s builder).

use std::collections::VecDeque;

use burn_std::Bytes;
use ferry_io::{ExchangeError, Step};
use ferry_proto::{IfExists, Request, TensorData, TensorInfo, TensorKey, TensorMeta};

use super::put::Upload;
use super::put_ask::PutAsk;
use super::{Client, ClientError, read_tensor_payload, ready, stored, tensor_follows};

/// How many downloads a batch keeps outstanding at once.
const PIPELINE_WINDOW: usize = 64;

/// One tensor's answer in a batch: the node's refusal is that tensor's result; anything else
/// breaks the exchange.
pub(super) fn per_tensor<T>(
    answer: Result<T, ExchangeError>,
) -> Result<Result<T, ClientError>, ClientError> {
    match answer {
        Ok(value) => Ok(Ok(value)),
        Err(ExchangeError::Refused(reply)) => Ok(Err(reply.into())),
        Err(broken) => Err(broken.into()),
    }
}

/// A batch of uploads whose connection failed part way.
pub(super) struct PutBroken {
    /// Why.
    pub(super) cause: ClientError,
    /// The tensors whose payloads were sent (or were being sent when the connection failed)
    /// and whose answers never came: the node may have stored them. Every other unanswered
    /// tensor of the batch was not stored.
    pub(super) in_doubt: Vec<usize>,
}

impl PutBroken {
    /// A failure for `cause`, with the uploads `owed` answers in doubt.
    fn owing(cause: ClientError, owed: &VecDeque<usize>) -> Self {
        Self {
            cause,
            in_doubt: owed.iter().copied().collect(),
        }
    }
}

/// How many uploads whose payloads went out may await their answers at once: the one the node
/// registers and the next, arriving meanwhile.
const OWED_AT_MOST: usize = 2;

impl Client {
    /// Uploads many tensors in one pipelined exchange (a whole model's weights): the next upload
    /// starts while the node registers the previous one. One answer per tensor, in order; a
    /// refused tensor does not stop the others. `Err` only when the connection fails. What a
    /// [`PutBatch`](super::PutBatch) runs ([`Client::put_batch`]).
    pub(super) async fn put_batch_over_one<T: Upload>(
        &mut self,
        tensors: &[(TensorKey, T)],
        if_exists: IfExists,
    ) -> Result<Vec<Result<TensorInfo, ClientError>>, ClientError> {
        let mut results: Vec<Option<Result<TensorInfo, ClientError>>> =
            (0..tensors.len()).map(|_| None).collect();
        let tensors: Vec<&(TensorKey, T)> = tensors.iter().collect();
        self.put_batch_into(&tensors, if_exists, &mut results)
            .await
            .map_err(|broken| broken.cause)?;
        Ok(results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(ClientError::Unexpected("no answer".into()))))
            .collect())
    }

    /// [`put_batch_over_one`](Self::put_batch_over_one), each answer written to `results` (one
    /// slot per tensor) as it comes: where the connection fails, the answers before the failure are kept, the
    /// slots still `None` are the tensors the node did not answer for, and [`PutBroken`] says
    /// which of them may have been stored all the same.
    ///
    /// A small payload goes right after its request ([`PutAsk::Eager`]), while the node still
    /// registers the tensor before it; a larger one after the node's `Ready`, which comes once
    /// every answer owed before it was read. At most [`OWED_AT_MOST`] uploads await their
    /// answers at once.
    pub(super) async fn put_batch_into<T: Upload>(
        &mut self,
        tensors: &[&(TensorKey, T)],
        if_exists: IfExists,
        results: &mut [Option<Result<TensorInfo, ClientError>>],
    ) -> Result<(), PutBroken> {
        debug_assert_eq!(tensors.len(), results.len());
        // The uploads whose payloads went out (or are going out) and whose `Stored` (or refusal)
        // the node still owes, in order: the tensors a failure leaves in doubt.
        let mut owed: VecDeque<usize> = VecDeque::with_capacity(OWED_AT_MOST);
        let mut step = self
            .exchange
            .begin()
            .map_err(|e| PutBroken::owing(e.into(), &owed))?;
        for (i, (key, data)) in tensors.iter().enumerate() {
            let (meta, parts) = match data.checked() {
                Ok(checked) => checked,
                Err(e) => {
                    results[i] = Some(Err(e));
                    continue;
                }
            };
            let len = meta.byte_len();
            let ask =
                PutAsk::for_payload(step.node_minor(), len as u64, step.whole_payload_route(len));
            let request = ask.request(
                key.device,
                Some(key.name.clone()),
                &meta,
                if_exists.overwrite(),
            );
            step.send(&request)
                .await
                .map_err(|e| PutBroken::owing(e.into(), &owed))?;
            // Owed from its payload's first byte on: one whose last byte left may be stored.
            match ask {
                PutAsk::Eager => {
                    owed.push_back(i);
                    step.send_payload_chunks(&parts)
                        .await
                        .map_err(|e| PutBroken::owing(e.into(), &owed))?;
                    while owed.len() >= OWED_AT_MOST {
                        take_stored(&mut step, &mut owed, results).await?;
                    }
                }
                PutAsk::AfterReady => {
                    while !owed.is_empty() {
                        take_stored(&mut step, &mut owed, results).await?;
                    }
                    match per_tensor(step.answer(ready).await)
                        .map_err(|e| PutBroken::owing(e, &owed))?
                    {
                        Ok(()) => {
                            owed.push_back(i);
                            step.send_payload_parts(&parts)
                                .await
                                .map_err(|e| PutBroken::owing(e.into(), &owed))?;
                        }
                        Err(refused) => results[i] = Some(Err(refused)),
                    }
                }
            }
        }
        while !owed.is_empty() {
            take_stored(&mut step, &mut owed, results).await?;
        }
        step.finish();
        Ok(())
    }

    /// Downloads many tensors in one pipelined exchange: requests go out a window ahead of the
    /// answers. One answer per key, in order.
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
        buffer_for: impl FnMut(usize, &TensorMeta) -> Option<Bytes>,
    ) -> Result<Vec<Result<TensorData, ClientError>>, ClientError> {
        let mut results = Vec::with_capacity(keys.len());
        self.get_each_into(keys, buffer_for, |_, answer| results.push(answer))
            .await?;
        Ok(results)
    }

    /// [`get_batch`](Self::get_batch), each answer handed to `each(i, answer)` as it arrives,
    /// in order, rather than all at the end: the caller uses the first tensor while the others
    /// are on their way. `each` runs between reads of the connection: it should not wait long.
    pub async fn get_each(
        &mut self,
        keys: &[TensorKey],
        each: impl FnMut(usize, Result<TensorData, ClientError>),
    ) -> Result<(), ClientError> {
        self.get_each_into(keys, |_, _| None, each).await
    }

    /// [`get_each`](Self::get_each) into buffers `buffer_for` gives (see
    /// [`get_batch_into`](Self::get_batch_into)).
    async fn get_each_into(
        &mut self,
        keys: &[TensorKey],
        mut buffer_for: impl FnMut(usize, &TensorMeta) -> Option<Bytes>,
        mut each: impl FnMut(usize, Result<TensorData, ClientError>),
    ) -> Result<(), ClientError> {
        let max = self.max_tensor_bytes;
        let mut step = self.exchange.begin()?;
        let mut index = 0;
        // Requests go out in windows so that a huge batch never has more than this many answers
        // outstanding.
        for window in keys.chunks(PIPELINE_WINDOW) {
            for key in window {
                step.send(&Request::Get { key: key.clone() }).await?;
            }
            for _ in window {
                let answer = read_tensor(&mut step, max, |meta| buffer_for(index, meta)).await?;
                each(index, answer);
                index += 1;
            }
        }
        step.finish();
        Ok(())
    }
}

/// Reads the answer the node owes first of `owed` (a `Stored`, or that tensor's refusal) into
/// its slot of `results`.
async fn take_stored(
    step: &mut Step<'_>,
    owed: &mut VecDeque<usize>,
    results: &mut [Option<Result<TensorInfo, ClientError>>],
) -> Result<(), PutBroken> {
    let Some(&first) = owed.front() else {
        return Ok(());
    };
    match per_tensor(step.answer(stored).await) {
        Ok(answer) => {
            results[first] = Some(answer);
            owed.pop_front();
            Ok(())
        }
        Err(cause) => Err(PutBroken::owing(cause, owed)),
    }
}

/// A node's answer to one download of a batch: the tensor, or its refusal.
async fn read_tensor(
    step: &mut Step<'_>,
    max: u64,
    buffer_for: impl FnOnce(&TensorMeta) -> Option<Bytes>,
) -> Result<Result<TensorData, ClientError>, ClientError> {
    match per_tensor(step.answer(tensor_follows).await)? {
        Ok((_, wire)) => Ok(Ok(read_tensor_payload(step, max, &wire, buffer_for).await?)),
        Err(refused) => Ok(Err(refused)),
    }
}
