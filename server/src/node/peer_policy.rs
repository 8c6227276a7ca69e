//! Which nodes a node pulls from (and so sends its peer token to): any address a client names,
//! or only the peers its operator listed, each by address and, under TLS, by the identity its
//! certificate must carry.

use std::str::FromStr;

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerPolicy {
    /// Any address a client names; the peer token, if any, is then never sent (an address a
    /// client chose gets no credential), so only sources that require none can be pulled from.
    Any,
    /// Only these peers.
    Listed(Vec<Peer>),
}

impl PeerPolicy {
    /// Whether a pull may connect to `source`.
    pub fn allows(&self, source: &str) -> bool {
        match self {
            PeerPolicy::Any => true,
            PeerPolicy::Listed(peers) => peers.iter().any(|p| p.addr == source),
        }
    }

    /// The identity the certificate of the source at `source` must carry, where its listing
    /// names one.
    pub fn identity_of(&self, source: &str) -> Option<&str> {
        match self {
            PeerPolicy::Any => None,
            PeerPolicy::Listed(peers) => peers
                .iter()
                .find(|p| p.addr == source)
                .and_then(|p| p.identity.as_deref()),
        }
    }

    /// The token to present to a source this policy allowed: the peer token only to a listed
    /// peer (an operator's choice), never to an address a client named.
    pub fn token_for<'a>(&self, peer_token: Option<&'a str>) -> Option<&'a str> {
        match self {
            PeerPolicy::Any => None,
            PeerPolicy::Listed(_) => peer_token,
        }
    }

    /// The listed peers that name an identity, which only a TLS link can check.
    pub(crate) fn named(&self) -> impl Iterator<Item = &Peer> {
        let peers = match self {
            PeerPolicy::Any => &[][..],
            PeerPolicy::Listed(peers) => &peers[..],
        };
        peers.iter().filter(|p| p.identity.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
