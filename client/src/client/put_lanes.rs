//! A batch of uploads over several connections to one node at once (what
//! [`PutBatch::lanes`](super::PutBatch::lanes) asks for): the tensors are dealt to the
//! connections and each runs a pipelined batch of its own, so that while the node registers one
//! tensor (or faults in new memory for it) another is already arriving.

use ferry_proto::{IfExists, TensorData, TensorInfo, TensorKey};

use super::batch::PutBroken;
use super::deal::{deal, no_answer};
use super::{Client, ClientError};

/// The batch over `lanes` at once, every one a connection to the same node: tensor `i` goes over
/// the `i % n`th of the `n` connections still in step, each connection's share a batch of its
/// own. One answer per tensor, in order; a connection that fails keeps the answers it had and the
/// others go on (the rules are [`PutBatch::lanes`](super::PutBatch::lanes)'s).
pub(super) async fn put_batch_in_lanes(
    lanes: Vec<&mut Client>,
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
