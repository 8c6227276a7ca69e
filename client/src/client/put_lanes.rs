//! A batch of uploads over several connections to one node at once (what
//! [`PutBatch::lanes`](super::PutBatch::lanes) asks for): the tensors are dealt to the
//! connections and each runs a pipelined batch of its own, so that while the node registers one
//! tensor (or faults in new memory for it) another is already arriving.

use std::sync::Arc;

use ferry_proto::{IfExists, TensorData, TensorInfo, TensorKey};
use tokio::task::JoinSet;

use super::batch::PutBroken;
use super::deal::{deal, in_dealt_order, no_answer};
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

impl Client {
    /// [`put_batch`](Client::put_batch) over `lanes` (connections to one node, that node the
    /// caller's to check as for [`PutBatch::lanes`](super::PutBatch::lanes), whose rules the
    /// answers follow), each lane's share sent by a task of its own on the current runtime:
    /// on a runtime with several threads the lanes copy into their sockets and checksum their
    /// chunks on as many cores, where [`PutBatch::lanes`](super::PutBatch::lanes) sends for
    /// every lane from one task, and so from one core at a time. The tensors are shared, not
    /// copied. The lanes come back in the order given (a lane whose task the runtime cancelled
    /// as it shut down does not), with one answer per tensor, in order. Dropped
    /// before it is done, it stops the lanes' tasks, and their connections close.
    ///
    /// # Panics
    /// Outside a Tokio runtime; and where a lane's task panicked, with its panic.
    pub async fn put_batch_spread(
        lanes: Vec<Client>,
        tensors: Arc<[(TensorKey, TensorData)]>,
        if_exists: IfExists,
    ) -> (Vec<Client>, Vec<Result<TensorInfo, ClientError>>) {
        let total = lanes.len();
        let mut back: Vec<Option<Client>> = Vec::with_capacity(total);
        // The lanes in step, with where each goes back; the others wait in their places.
        let mut usable = Vec::new();
        for (at, client) in lanes.into_iter().enumerate() {
            if client.in_step() && usable.len() < tensors.len() {
                usable.push((at, client));
                back.push(None);
            } else {
                back.push(Some(client));
            }
        }
        let n = usable.len();
        if n == 0 {
            let reason = "not put: no connection to put over is in step";
            let answers = tensors
                .iter()
                .map(|(key, _)| no_answer(key, reason))
                .collect();
            return (back.into_iter().flatten().collect(), answers);
        }
        // A JoinSet aborts its tasks when dropped: a put cancelled here stops sending.
        let mut tasks = JoinSet::new();
        // Which lane each task runs, for a task that ends without handing its lane back.
        let mut lane_of = std::collections::HashMap::new();
        for (lane, (at, mut client)) in usable.into_iter().enumerate() {
            let tensors = tensors.clone();
            let task = tasks.spawn(async move {
                let share: Vec<&(TensorKey, TensorData)> =
                    tensors.iter().skip(lane).step_by(n).collect();
                let mut answers = (0..share.len()).map(|_| None).collect::<Vec<_>>();
                let outcome = client.put_batch_into(&share, if_exists, &mut answers).await;
                let answers = answers_per_tensor(&share, answers, outcome.err());
                (lane, at, client, answers)
            });
            lane_of.insert(task.id(), lane);
        }
        let mut answers: Vec<Vec<Result<TensorInfo, ClientError>>> =
            (0..n).map(|_| Vec::new()).collect();
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok((lane, at, client, given)) => {
                    back[at] = Some(client);
                    answers[lane] = given;
                }
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                // Cancelled: the runtime is shutting down. Its connection is gone, and each of
                // its tensors is answered that no answer came.
                Err(e) => {
                    if let Some(&lane) = lane_of.get(&e.id()) {
                        let reason = "no answer: the runtime shut down while its lane was \
                                      sending; it may have been stored all the same";
                        answers[lane] = tensors
                            .iter()
                            .skip(lane)
                            .step_by(n)
                            .map(|(key, _)| no_answer(key, reason))
                            .collect();
                    }
                }
            }
        }
        let answers = in_dealt_order(&tensors, answers, |(key, _)| key);
        (back.into_iter().flatten().collect(), answers)
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
                    Some(PutBroken { cause, in_doubt }) if in_doubt.contains(&at) => format!(
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
