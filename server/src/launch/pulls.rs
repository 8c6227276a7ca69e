//! Which nodes a server pulls from and with what token, decided from what it was given: a pure
//! function, so that `ferry-server` and a program embedding a node draw the same line.

use ferry_proto::Token;

use crate::node::{ClusterMembers, Peer, PeerPolicy};

/// Where a server's peer token comes from.
#[derive(Debug, Clone, Default)]
pub enum PeerToken {
    /// The token clients present ([`ServerBuilder::token`](super::ServerBuilder::token)), if
    /// any: nodes of one deployment usually share it.
    #[default]
    ClientToken,
    /// This token.
    Given(Token),
    /// The first line of this file (neither blank nor a `#` comment).
    File(std::path::PathBuf),
    /// None.
    Nothing,
}

/// What the pull policy is decided from.
#[derive(Debug, Clone)]
pub(crate) struct PullInputs {
    /// Peers the operator listed.
    pub(crate) listed: Vec<Peer>,
    /// The node's peer token, once read.
    pub(crate) peer_token: Option<Token>,
    /// Whether its TCP links are TLS.
    pub(crate) tls: bool,
    /// Whether it joins a cluster, and then which member ids it admits (none: whoever
    /// registers).
    pub(crate) cluster: Option<Vec<String>>,
}

/// The pull policy: a cluster node pulls from its members (and the listed peers); a node with
/// listed peers, a peer token or TLS only from the listed ones (with none listed, from no one,
/// rather than dialling whatever address a client names, where the token would have to go or
/// the certificate's name be taken on trust); any other, an open node whose pulls carry no
/// credential, from any address a client names.
pub(crate) fn pull_policy(inputs: &PullInputs) -> PeerPolicy {
    let listed: Vec<Peer> = inputs
        .listed
        .iter()
        .map(|p| Peer {
            // As a client would name it (a `unix:` path written the one way).
            addr: ferry_io::Endpoint::parse(&p.addr).to_string(),
            identity: p.identity.clone(),
        })
        .collect();
    match &inputs.cluster {
        Some(member_ids) => PeerPolicy::Members {
            members: if member_ids.is_empty() {
                ClusterMembers::new()
            } else {
                ClusterMembers::admitting(member_ids.clone())
            },
            listed,
        },
        None if !listed.is_empty() || inputs.peer_token.is_some() || inputs.tls => {
            PeerPolicy::Listed(listed)
        }
        None => PeerPolicy::Any,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(addr: &str) -> Peer {
        Peer {
            addr: addr.to_string(),
            identity: None,
        }
    }

    /// Listed peers, a peer token?, TLS?, the cluster's admitted ids -> the policy's kind and
    /// how many peers it lists.
    type Case = (
        Vec<Peer>,
        bool,
        bool,
        Option<Vec<String>>,
        &'static str,
        usize,
    );

    /// (listed, token, TLS, cluster) -> the policy's kind and the peers it lists.
    #[test]
    fn a_node_pulls_from_any_address_only_with_no_credential_to_lose() {
        let cases: Vec<Case> = vec![
            (vec![], false, false, None, "any", 0),
            (vec![], true, false, None, "listed", 0),
            (vec![], false, true, None, "listed", 0),
            (
                vec![peer("127.0.0.1:7071")],
                false,
                false,
                None,
                "listed",
                1,
            ),
            (vec![peer("unix:/tmp/a")], true, true, None, "listed", 1),
            (vec![], false, false, Some(vec![]), "members", 0),
            (
                vec![peer("h:1")],
                true,
                true,
                Some(vec!["n1".into()]),
                "members",
                1,
            ),
        ];
        for (listed, token, tls, cluster, kind, count) in cases {
            let inputs = PullInputs {
                listed,
                peer_token: token.then(|| Token::from("t")),
                tls,
                cluster,
            };
            let got = match pull_policy(&inputs) {
                PeerPolicy::Any => ("any", 0),
                PeerPolicy::Listed(l) => ("listed", l.len()),
                PeerPolicy::Members { listed, .. } => ("members", listed.len()),
            };
            assert_eq!(got, (kind, count), "{inputs:?}");
        }
    }
}
