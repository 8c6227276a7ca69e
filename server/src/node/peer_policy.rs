//! Which nodes a node pulls from (and so sends its peer token to): any address a client names,
//! only the peers its operator listed (each by address and, under TLS, by the identity its
//! certificate must carry), or the members of its cluster as etcd lists them.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use ferry_io::{Endpoint, PeerCheck};
use ferry_proto::{NodeId, Token};

/// A node this node may pull from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Its address, exactly as clients name it (`host:port` or `unix:PATH`; no name resolution
    /// takes part in the match).
    pub addr: String,
    /// The identity its TLS certificate must carry (checked before anything is sent to it); any
    /// certificate the CA signed for the address where `None`.
    pub identity: Option<String>,
}

impl Peer {
    /// The peer at `addr`, whoever its certificate names.
    pub fn at(addr: impl Into<String>) -> Self {
        Self {
            addr: addr.into(),
            identity: None,
        }
    }

    /// The peer at `addr` whose certificate names `identity`.
    pub fn named(identity: impl Into<String>, addr: impl Into<String>) -> Self {
        Self {
            addr: addr.into(),
            identity: Some(identity.into()),
        }
    }
}

/// `ADDR`, or `NAME=ADDR` for a peer whose certificate must name `NAME` (an address holds no
/// `=`: neither `host:port` nor `unix:PATH` as ferry writes them).
impl FromStr for Peer {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.split_once('=') {
            Some((name, addr)) if !name.is_empty() && !addr.is_empty() => {
                Ok(Peer::named(name, addr))
            }
            Some(_) => Err(format!("{text:?}: expected NAME=ADDR or ADDR")),
            None if !text.is_empty() => Ok(Peer::at(text)),
            None => Err("an empty peer address".into()),
        }
    }
}

/// Which nodes a node pulls from: a `Pull` naming any other source is refused without
/// connecting, so the node's peer token goes nowhere else.
///
/// What an allowed source is sent, and checked for first (a token, wherever it is granted
/// here, is sent over TCP in clear only: under TLS this node's certificate is its credential,
/// earning it `peer` at every node of the CA, and no token goes):
/// - A listed peer gets the peer token (the operator's choice), and its listed identity is
///   checked.
/// - A member reached over TCP under TLS must show the identity it registered (its node id,
///   which under TLS is its certificate's).
/// - A member over TCP in clear gets no token: etcd's word for an address is not enough to send
///   a credential there.
/// - A member's Unix socket gets no token (no Unix socket ever does: a node serving one takes
///   the kernel's word on who calls), once this very user is seen to serve it (root not
///   counted: a root daemon at a path etcd named is not the member).
/// - Under [`PeerPolicy::Any`] nothing gets the token.
///
/// A policy a later version adds must be matched with a wildcard arm.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerPolicy {
    /// Any address a client names; the peer token, if any, is then never sent (an address a
    /// client chose gets no credential), so only sources that require none can be pulled from.
    Any,
    /// Only these peers.
    Listed(Vec<Peer>),
    /// The members of the node's cluster, as its membership task reads them from etcd, and
    /// these listed peers (on the terms of [`PeerPolicy::Listed`]). A member's address came from
    /// etcd, which others may write: see the policy's rules above for what it is sent.
    Members {
        /// The registered members, kept current by the node's cluster task.
        members: ClusterMembers,
        /// Peers the operator listed besides.
        listed: Vec<Peer>,
    },
}

/// What a pull from an allowed source must check before it sends anything, and may send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerTerms {
    /// Who must answer at the address: a listed identity, a member's registered one under TLS,
    /// or, for a member's Unix socket, this very user (root not counted).
    pub(crate) check: PeerCheck,
    /// The token to present.
    pub(crate) token: Option<Token>,
}

impl PeerPolicy {
    /// Whether a pull may connect to `source`, and on what terms (`None`: refused, nothing
    /// sent), by the rules of [`PeerPolicy`]. `tls` says whether this node's TCP links are TLS;
    /// `peer_token` is its token.
    pub(crate) fn terms(
        &self,
        source: &str,
        tls: bool,
        peer_token: Option<&Token>,
    ) -> Option<PeerTerms> {
        let peer_token = peer_token.cloned();
        let listed = |peers: &[Peer]| {
            peers.iter().find(|p| p.addr == source).map(|p| PeerTerms {
                check: match &p.identity {
                    Some(identity) => PeerCheck::Certificate(NodeId::from(identity.as_str())),
                    None => PeerCheck::Any,
                },
                token: peer_token.clone(),
            })
        };
        match self {
            PeerPolicy::Any => Some(PeerTerms {
                check: PeerCheck::Any,
                token: None,
            }),
            PeerPolicy::Listed(peers) => listed(peers),
            PeerPolicy::Members {
                members,
                listed: peers,
            } => {
                if let Some(terms) = listed(peers) {
                    return Some(terms);
                }
                Some(match Endpoint::parse(source) {
                    // Under TLS the certificate there settles which claim is true: an address
                    // several members claim (one of them, perhaps, an etcd writer's) stays
                    // pullable from whichever of them shows its certificate.
                    Endpoint::Tcp(_) if tls => {
                        let mut claimed = members.identities_at(source);
                        let check = match claimed.len() {
                            0 => return None,
                            1 => PeerCheck::Certificate(NodeId::from(&*claimed.remove(0))),
                            _ => PeerCheck::CertificateAmong(
                                claimed.iter().map(|id| NodeId::from(&**id)).collect(),
                            ),
                        };
                        PeerTerms {
                            check,
                            token: peer_token,
                        }
                    }
                    // The kernel's word on who serves it is the credential there: no token.
                    Endpoint::Unix(_) => {
                        members.identity_at(source)?;
                        PeerTerms {
                            check: PeerCheck::OwnUserSocket,
                            token: None,
                        }
                    }
                    Endpoint::Tcp(_) => {
                        members.identity_at(source)?;
                        PeerTerms {
                            check: PeerCheck::Any,
                            token: None,
                        }
                    }
                })
            }
        }
    }

    /// Whether a pull may connect to `source` at all, in clear (an address several members
    /// claim is refused there).
    pub fn allows(&self, source: &str) -> bool {
        self.terms(source, false, None).is_some()
    }

    /// Whether a pull may connect to `source` at all, over TLS where `tls` (an address several
    /// members claim is then allowed, its certificate to name one of them).
    pub(crate) fn allows_over(&self, source: &str, tls: bool) -> bool {
        self.terms(source, tls, None).is_some()
    }

    /// The listed peers that name an identity, which only a TLS link can check.
    pub(crate) fn named(&self) -> impl Iterator<Item = &Peer> {
        let peers = match self {
            PeerPolicy::Any => &[][..],
            PeerPolicy::Listed(peers) | PeerPolicy::Members { listed: peers, .. } => &peers[..],
        };
        peers.iter().filter(|p| p.identity.is_some())
    }

    /// The member list this policy follows, where it follows one.
    pub(crate) fn members(&self) -> Option<&ClusterMembers> {
        match self {
            PeerPolicy::Members { members, .. } => Some(members),
            _ => None,
        }
    }
}

/// The members of a cluster by address: each registered TCP and Unix address with the node id
/// its member registered. Shared between the node's peer policy (reading, per pull) and its
/// cluster task (replacing the whole set on every change). Empty until the task has read etcd,
/// so that a node pulls from no member it has not seen registered; and empty again once the
/// task has been away from etcd longer than a lease (see [`ClusterMembers::hold_until`]), so that
/// a member that left meanwhile is not trusted for ever.
#[derive(Debug, Clone, Default)]
pub struct ClusterMembers {
    now: Arc<RwLock<Snapshot>>,
    /// The node ids the operator admits as members; `None`: whoever registers.
    admitted: Option<Arc<std::collections::BTreeSet<String>>>,
}

/// The member list as last read, and until when it counts.
#[derive(Debug, Default)]
struct Snapshot {
    /// Every node id registered at each address (more than one: claims that disagree).
    by_addr: HashMap<String, Vec<Arc<str>>>,
    /// `None` while the cluster task follows etcd.
    valid_until: Option<Instant>,
}

impl PartialEq for ClusterMembers {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.now, &other.now)
    }
}

impl Eq for ClusterMembers {}

impl ClusterMembers {
    /// An empty list, which takes whoever registers.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty list, which takes only members whose node id is among `ids` (the operator's
    /// list): a record of any other id, whoever wrote it, is not listed, and cannot make a
    /// member's address look claimed twice either.
    pub fn admitting(ids: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            now: Arc::default(),
            admitted: Some(Arc::new(ids.into_iter().map(Into::into).collect())),
        }
    }

    /// Whether a member of node id `id` may be listed.
    fn admits(&self, id: &str) -> bool {
        self.admitted.as_ref().is_none_or(|ids| ids.contains(id))
    }

    /// Replaces the list: `(address, node id)` for every address of every member. An address
    /// two members claim under different node ids keeps both claims: in clear pulls from it are
    /// refused (which one is there, only a certificate could tell), under TLS the certificate
    /// there must name one of them.
    pub fn replace(&self, members: impl IntoIterator<Item = (String, String)>) {
        let mut by_addr: HashMap<String, Vec<Arc<str>>> = HashMap::new();
        for (addr, id) in members.into_iter().filter(|(_, id)| self.admits(id)) {
            let addr = Endpoint::parse(&addr).to_string();
            let claims = by_addr.entry(addr).or_default();
            if !claims.iter().any(|claimed| **claimed == *id) {
                claims.push(Arc::from(id));
            }
        }
        for (addr, claims) in &by_addr {
            if claims.len() > 1 {
                tracing::warn!(addr = %addr, claims = claims.len(), "cluster members claim one address under different node ids: in clear pulls from it are refused, under TLS its certificate must name one of them");
            }
        }
        *self.now.write().unwrap_or_else(|e| e.into_inner()) = Snapshot {
            by_addr,
            valid_until: None,
        };
    }

    /// The cluster task lost etcd: the list it read stays good until `until` (one lease's time
    /// to live after etcd last answered: the longest a member that left meanwhile would have
    /// stayed listed), then counts as empty until the task reads it again. A first deadline
    /// stands through later failures.
    pub fn hold_until(&self, until: Instant) {
        let mut now = self.now.write().unwrap_or_else(|e| e.into_inner());
        if now.valid_until.is_none() {
            now.valid_until = Some(until);
        }
    }

    /// The node id registered at `addr`, if one member registered it (none where several
    /// claims disagree).
    pub fn identity_at(&self, addr: &str) -> Option<Arc<str>> {
        match self.identities_at(addr).as_slice() {
            [one] => Some(one.clone()),
            _ => None,
        }
    }

    /// Every node id registered at `addr`.
    pub fn identities_at(&self, addr: &str) -> Vec<Arc<str>> {
        let now = self.now.read().unwrap_or_else(|e| e.into_inner());
        if now.valid_until.is_some_and(|until| Instant::now() > until) {
            return Vec::new();
        }
        now.by_addr.get(addr).cloned().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_get_the_token_only_where_their_identity_can_be_checked() {
        let members = ClusterMembers::new();
        members.replace([
            ("10.0.0.1:7070".to_string(), "node-a".to_string()),
            ("unix:/run/a.sock".to_string(), "node-a".to_string()),
            ("10.0.0.9:7070".to_string(), "node-x".to_string()),
            ("10.0.0.9:7070".to_string(), "node-y".to_string()),
        ]);
        let policy = PeerPolicy::Members {
            members,
            listed: vec![Peer::named("gpu-b", "10.0.0.2:7070")],
        };
        let secret = Token::new("secret");
        let token = Some(&secret);
        let sent = Some(secret.clone());
        let tls = policy.terms("10.0.0.1:7070", true, token).unwrap();
        assert_eq!(
            (tls.check, tls.token),
            (PeerCheck::Certificate(NodeId::new("node-a")), sent.clone())
        );
        let clear = policy.terms("10.0.0.1:7070", false, token).unwrap();
        assert_eq!((clear.check, clear.token), (PeerCheck::Any, None));
        let unix = policy.terms("unix:/run/a.sock", false, token).unwrap();
        assert_eq!(
            (unix.check, unix.token),
            (PeerCheck::OwnUserSocket, None),
            "a member's socket: this user's own, and no token"
        );
        let listed = policy.terms("10.0.0.2:7070", true, token).unwrap();
        assert_eq!(
            (listed.check, listed.token),
            (PeerCheck::Certificate(NodeId::new("gpu-b")), sent)
        );
        assert!(
            policy.terms("10.0.0.3:7070", true, token).is_none(),
            "not a member"
        );
        // Claimed twice: in clear refused, under TLS the certificate there names one of them.
        assert!(policy.terms("10.0.0.9:7070", false, token).is_none());
        assert!(!policy.allows("10.0.0.9:7070"));
        let both = policy.terms("10.0.0.9:7070", true, token).unwrap();
        assert_eq!(
            both.check,
            PeerCheck::CertificateAmong(vec![NodeId::new("node-x"), NodeId::new("node-y")])
        );
        assert!(policy.allows_over("10.0.0.9:7070", true));
        // Away from etcd longer than the grace, the list counts as empty.
        let PeerPolicy::Members { members, .. } = &policy else {
            unreachable!()
        };
        members.hold_until(Instant::now());
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(
            policy.terms("10.0.0.1:7070", true, token).is_none(),
            "stale"
        );
        assert!(
            policy.terms("10.0.0.2:7070", true, token).is_some(),
            "listed stays"
        );
        members.replace([("10.0.0.1:7070".to_string(), "node-a".to_string())]);
        assert!(policy.allows("10.0.0.1:7070"), "read again");
        assert!(
            !PeerPolicy::Members {
                members: ClusterMembers::new(),
                listed: vec![]
            }
            .allows("10.0.0.1:7070")
        );
    }

    #[test]
    fn peers_parse_with_and_without_a_name() {
        assert_eq!("10.0.0.1:7070".parse(), Ok(Peer::at("10.0.0.1:7070")));
        assert_eq!(
            "gpu-a=10.0.0.1:7070".parse(),
            Ok(Peer::named("gpu-a", "10.0.0.1:7070"))
        );
        assert_eq!("unix:/run/a.sock".parse(), Ok(Peer::at("unix:/run/a.sock")));
        for bad in ["", "=10.0.0.1:7070", "gpu-a="] {
            assert!(bad.parse::<Peer>().is_err(), "{bad:?}");
        }
    }
}
