//! Node-to-node pulls: the target connects to the source with a capability and streams the
//! tensor straight into one preallocated buffer, resuming after a transient drop; a tensor
//! larger than a stripe may come over several connections at once (`striped`).
//!
//! - `request`: what a client asks a node to pull ([`PullRequest`]).
//! - `pull`: one pull carried out (`Pull`): checks, attempts, resume, stripes, hash, release.
//! - `plan`: the pull's decisions as pure functions: what to ask for, retry or give up.
//! - `striped`: the hand-off once the source answered a first stripe, and the other stripes
//!   over several connections.
//! - `receive`: the receiver kept across attempts, and its hash.
//! - `link`: the connections to a source ([`PeerLink`]), reused or dialled.
//! - `failure`: how attempts fail, and what a client and the log learn of it.
//! - `dedup`: a pull skipped for bytes this node already holds.

mod dedup;
mod failure;
mod link;
mod plan;
mod pull;
mod receive;
mod request;
mod striped;

pub(crate) use link::PeerLink;
pub(crate) use request::PullRequest;

use crate::device::TensorDesc;
use crate::error::NodeError;
use crate::node::Node;

impl Node {
    /// Pulls a tensor from another node and registers it; answered only once it is registered.
    /// Nothing is registered unless every byte arrived and the whole hashes to the grant.
    pub(crate) async fn pull(
        &self,
        link: &mut PeerLink,
        req: &PullRequest,
    ) -> Result<TensorDesc, NodeError> {
        pull::Pull::new(self, link, req).run().await
    }
}
