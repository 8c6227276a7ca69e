//! Waiting for a tensor: the node answers when it arrives (or at the timeout), so a worker that
//! waits for its job's input neither polls nor sleeps.

use std::time::Duration;

use ferry_proto::message::MAX_WAIT_MS;
use ferry_proto::{Request, Response, TensorInfo, TensorKey, WaitFor};

use super::{Client, ClientError};

impl Client {
    /// The tensor under `key`, as soon as one is registered there (at once if one is): `None`
    /// where `timeout` passed first. The node answers on arrival; a wait longer than one request
    /// may ask (15 minutes) is asked again for the rest, so nothing here polls. Needs a node of
    /// protocol minor 9 or later.
    pub async fn wait_for(
        &mut self,
        key: &TensorKey,
        timeout: Duration,
    ) -> Result<Option<TensorInfo>, ClientError> {
        let target = WaitFor::Tensor(key.clone());
        self.wait_until(target, timeout, |answer| match answer {
            Response::Arrived(arrived) => Some(arrived),
            _ => None,
        })
        .await
    }

    /// Asks the node to answer when `target` is there, within `timeout`, in requests of at most
    /// [`MAX_WAIT_MS`] each: what `arrived` reads from the answer (`None`: a timeout).
    pub(super) async fn wait_until<T>(
        &mut self,
        target: WaitFor,
        timeout: Duration,
        arrived: impl Fn(Response) -> Option<Option<T>>,
    ) -> Result<Option<T>, ClientError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            // Rounded up: the node waits at least what is left, never a millisecond less.
            let left_ms = left.as_nanos().div_ceil(1_000_000);
            let timeout_ms = u32::try_from(left_ms).unwrap_or(u32::MAX).min(MAX_WAIT_MS);
            let request = Request::Wait {
                target: target.clone(),
                timeout_ms,
            };
            let answer = self.exchange.call(&request, &arrived).await?;
            // Asked again only for the rest of a wait longer than one request may be.
            if answer.is_some() || u128::from(timeout_ms) >= left_ms {
                return Ok(answer);
            }
        }
    }
}
