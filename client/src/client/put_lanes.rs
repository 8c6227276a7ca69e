//! A batch of uploads over several connections to one node at once:
//! [`Client::put_batch_in_lanes`] deals the tensors to the connections and runs a
//! [`put_batch`](Client::put_batch) on each, so that while the node registers one tensor (or
//! faults in new memory for it) another is already arriving.

use ferry_proto::{IfExists, TensorData, TensorInfo, TensorKey};

use super::batch::PutBroken;
use super::deal::{deal, no_answer};
use super::{Client, ClientError};

impl Client {
    /// [`put_batch`](Self::put_batch) over `lanes` at once, every one a connection to the same
    /// node: tensor `i` goes over the `i % n`th of the `n` connections still in step (so each
    /// gets large and small tensors alike), each connection's share a batch of its own. One
    /// answer per tensor, in order. A connection that fails keeps the answers it had and
    /// answers each tensor it had no answer for with [`ClientError::NoAnswer`], whose reason
    /// says whether it may have been stored all the same (the one whose payload was sent, or
    /// being sent, when the connection failed) or was not; the other connections go on. Where
    /// no connection is in step, every tensor is answered so. That every connection reaches one
    /// node is the caller's to check ([`identify`](Self::identify)): an address behind a
    /// balancer may reach several. Two tensors with one key should not share a batch over
    /// lanes: which lands last is not fixed.
    pub async fn put_batch_in_lanes<'a>(
        lanes: impl IntoIterator<Item = &'a mut Client>,
        tensors: &[(TensorKey, TensorData)],
        if_exists: IfExists,
    ) -> Vec<Result<TensorInfo, ClientError>> {
        let none_in_step = "not put: no connection to put over is in step";
        // References: a tensor's bytes are sent from where they lie, never copied.
        deal(
            lanes,
            Client::in_step,
            tensors,
            |(key, _)| key,
            none_in_step,
            |client, share| async move {
                let mut answers = (0..share.len()).map(|_| None).collect::<Vec<_>>();
                let outcome = client.put_batch_into(&share, if_exists, &mut answers).await;
                answers_per_tensor(&share, answers, outcome.err())
            },
        )
        .await
    }
}

/// One answer per tensor of a connection's share: the node's where it gave one, else why not,
/// after a failure saying whether the tensor may have been stored all the same.
fn answers_per_tensor(
    share: &[&(TensorKey, TensorData)],
    answers: Vec<Option<Result<TensorInfo, ClientError>>>,
    broken: Option<PutBroken>,
) -> Vec<Result<TensorInfo, ClientError>> {
    answers
        .into_iter()
        .zip(share)
        .enumerate()
        .map(|(at, (answer, (key, _)))| {
            answer.unwrap_or_else(|| {
                let reason = match &broken {
                    Some(PutBroken { cause, in_doubt }) if *in_doubt == Some(at) => format!(
                        "no answer, the connection failed ({cause}) while or after its payload \
                         went out: it may have been stored all the same"
                    ),
                    Some(PutBroken { cause, .. }) => format!(
                        "not put: the connection failed ({cause}) before its payload went out"
                    ),
                    None => "no answer".to_string(),
                };
                no_answer(key, &reason)
            })
        })
        .collect()
}
