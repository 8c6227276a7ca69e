//! Several lanes of one node-to-node copy: [`NodeCopy::run_in_lanes`] deals the tensors to
//! several pairs of connections ([`Lane`]) and runs them at once, so that a target waiting on one
//! tensor (new memory faulted in, a hash) leaves the link and the nodes' other cores busy.

use ferry_proto::TensorInfo;

use super::deal::{deal, no_answer};
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
        let none_in_step = "not copied: no connection to copy over is in step";
        deal(
            lanes,
            Lane::in_step,
            &self.items,
            |item| &item.src,
            none_in_step,
            |lane, share| {
                let copy = NodeCopy {
                    source_addr: self.source_addr.clone(),
                    items: share.into_iter().cloned().collect(),
                    transfer: self.transfer,
                    if_exists: self.if_exists,
                };
                async move {
                    let answers = copy.run(&mut lane.source, &mut lane.target).await;
                    answers_per_tensor(&copy, answers)
                }
            },
        )
        .await
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
