//! A batch of uploads over several connections to one node at once:
//! [`Client::put_batch_in_lanes`] deals the tensors to the connections and runs a
//! [`put_batch`](Client::put_batch) on each, so that while the node registers one tensor (or
//! faults in new memory for it) another is already arriving.

use futures_util::future::join_all;

use ferry_proto::{IfExists, TensorData, TensorInfo, TensorKey};

use super::batch::PutBroken;
use super::lanes::no_answer;
use super::{Client, ClientError};

impl Client {
    /// [`put_batch`](Self::put_batch) over `lanes` at once, every one a connection to the same
    /// node: tensor `i` goes over the `i % n`th of the `n` connections still in step (so each
    /// gets large and small tensors alike), each connection's share a batch of its own. One
    /// answer per tensor, in order. A connection that fails keeps the answers it had and answers
    /// each tensor it had no answer for with [`ClientError::NoAnswer`], whose reason says
    /// whether it may have been stored all the same (the one whose payload was sent, or being
    /// sent, when the connection failed) or was not; the other connections go on. Where no connection is in step, every
    /// tensor is answered so. That every connection reaches one node is the caller's to check
    /// ([`identify`](Self::identify)): an address behind a balancer may reach several. Two
    /// tensors with one key should not share a batch over lanes: which lands last is not fixed.
    pub async fn put_batch_in_lanes<'a>(
        lanes: impl IntoIterator<Item = &'a mut Client>,
        tensors: &[(TensorKey, TensorData)],
        if_exists: IfExists,
    ) -> Vec<Result<TensorInfo, ClientError>> {
        if tensors.is_empty() {
            return Vec::new();
        }
        let mut usable: Vec<&mut Client> = lanes.into_iter().filter(|c| c.in_step()).collect();
        let n = usable.len().min(tensors.len());
        usable.truncate(n);
        if n == 0 {
            return tensors
                .iter()
                .map(|(key, _)| no_answer(key, "not put: no connection to put over is in step"))
                .collect();
        }
        // References: a tensor's bytes are sent from where they lie, never copied.
        let shares: Vec<Vec<&(TensorKey, TensorData)>> = (0..n)
            .map(|lane| tensors.iter().skip(lane).step_by(n).collect())
            .collect();
        let runs = usable
            .into_iter()
            .zip(&shares)
            .map(|(client, share)| async move {
                let mut answers: Vec<Option<Result<TensorInfo, ClientError>>> =
                    (0..share.len()).map(|_| None).collect();
                let (unsure, sure) = match client
                    .put_batch_into(share, if_exists, &mut answers)
                    .await
                {
                    Ok(()) => (None, "no answer".to_string()),
                    Err(PutBroken { cause, in_doubt }) => {
                        let unsure = in_doubt.map(|at| {
                            (
                                at,
                                format!(
                                    "no answer, the connection failed ({cause}) while or \
                                     after its payload went out: it may have been stored all \
                                     the same"
                                ),
                            )
                        });
                        let sure = format!(
                            "not put: the connection failed ({cause}) before its payload went out"
                        );
                        (unsure, sure)
                    }
                };
                answers
                    .into_iter()
                    .zip(share)
                    .enumerate()
                    .map(|(at, (answer, (key, _)))| {
                        answer.unwrap_or_else(|| match &unsure {
                            Some((doubt, reason)) if *doubt == at => no_answer(key, reason),
                            _ => no_answer(key, &sure),
                        })
                    })
                    .collect::<Vec<_>>()
                    .into_iter()
            });
        let mut answers: Vec<_> = join_all(runs).await;
        // Tensor i went to lane i % n, as its (i / n)th; every lane answers each of its own.
        tensors
            .iter()
            .enumerate()
            .map(|(i, (key, _))| {
                answers[i % n]
                    .next()
                    .unwrap_or_else(|| no_answer(key, "no answer: its lane gave none"))
            })
            .collect()
    }
}
