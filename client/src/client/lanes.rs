//! Several lanes of one node-to-node copy: [`NodeCopy::run_in_lanes`] deals the tensors to
//! several pairs of connections ([`Lane`]) and runs them at once, so that a target waiting on one
//! tensor (new memory faulted in, a hash) leaves the link and the nodes' other cores busy.

use ferry_proto::{TensorInfo, TensorKey};
use futures_util::future::join_all;

use super::{Client, ClientError, InterruptedCopy, NodeCopy};

/// A pair of connections a node-to-node copy runs over: one to the source node, one to the
/// target node.
#[derive(Debug)]
pub struct Lane {
    /// The connection to the source node (grants, releases, a move's deletes).
    pub source: Client,
    /// The connection to the target node (pulls).
    pub target: Client,
}

impl Lane {
    /// Whether both connections still carry calls (a copy that failed on them leaves them out
    /// of step).
    pub fn in_step(&self) -> bool {
        self.source.in_step() && self.target.in_step()
    }
}

impl NodeCopy {
    /// [`run`](Self::run) over `lanes` at once, every one of them between the same source and
    /// target nodes: tensor `i` goes over the `i % n`th of the `n` lanes still in step (so each
    /// gets large and small tensors alike), each lane's share a copy of its own. One answer per
    /// tensor, in the order they were added. A lane whose connection fails keeps the answers it
    /// had and answers each tensor after them with [`ClientError::NoAnswer`]; the other lanes go
    /// on. Where no lane is in step, every tensor is answered so. A source too old for a move
    /// answers every tensor [`ClientError::NodeTooOld`]. Two tensors bound for one target key
    /// should not share a copy over lanes: which lands last is not fixed.
    pub async fn run_in_lanes(&self, lanes: &mut [Lane]) -> Vec<Result<TensorInfo, ClientError>> {
        if self.items.is_empty() {
            return Vec::new();
        }
        let mut usable: Vec<&mut Lane> = lanes.iter_mut().filter(|l| l.in_step()).collect();
        let n = usable.len().min(self.items.len()).max(1);
        usable.truncate(n);
        if usable.is_empty() {
            return self
                .items
                .iter()
                .map(|item| {
                    no_answer(
                        &item.src,
                        "not copied: no connection to copy over is in step",
                    )
                })
                .collect();
        }
        let shares: Vec<NodeCopy> = (0..n)
            .map(|lane| NodeCopy {
                source_addr: self.source_addr.clone(),
                items: self.items.iter().skip(lane).step_by(n).cloned().collect(),
                transfer: self.transfer,
                if_exists: self.if_exists,
            })
            .collect();
        let runs = usable
            .into_iter()
            .zip(&shares)
            .map(|(lane, share)| async move {
                let answers = share.run(&mut lane.source, &mut lane.target).await;
                answers_per_tensor(share, answers).into_iter()
            });
        let mut answers: Vec<_> = join_all(runs).await;
        // Tensor i went to lane i % n, as its (i / n)th; every lane answers each of its own.
        self.items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                answers[i % n]
                    .next()
                    .unwrap_or_else(|| no_answer(&item.src, "no answer: its lane gave none"))
            })
            .collect()
    }
}

/// One answer per tensor of `copy` from what its run returned.
fn answers_per_tensor(
    copy: &NodeCopy,
    run: Result<Vec<Result<TensorInfo, ClientError>>, ClientError>,
) -> Vec<Result<TensorInfo, ClientError>> {
    let (mut answers, reason) = match run {
        Ok(answers) => return answers,
        Err(ClientError::CopyInterrupted(stopped)) => {
            let InterruptedCopy {
                answered, cause, ..
            } = *stopped;
            let reason = format!(
                "no answer, the connection failed ({cause}): it may have arrived all the same"
            );
            (answered, reason)
        }
        // Refused before either node was asked anything: each tensor is told why, typed where
        // the refusal can be told again.
        Err(ClientError::NodeTooOld { what, node, needs }) => {
            let too_old = || ClientError::NodeTooOld { what, node, needs };
            return copy.items.iter().map(|_| Err(too_old())).collect();
        }
        Err(refused) => (Vec::new(), format!("not copied: {refused}")),
    };
    let rest = copy.items.get(answers.len()..).unwrap_or_default();
    answers.extend(rest.iter().map(|item| no_answer(&item.src, &reason)));
    answers
}

/// A tensor a lane gave no answer for, and why.
pub(super) fn no_answer(key: &TensorKey, reason: &str) -> Result<TensorInfo, ClientError> {
    Err(ClientError::NoAnswer {
        key: key.clone(),
        reason: reason.to_string(),
    })
}
