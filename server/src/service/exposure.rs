//! Who may reach what a node listens on: beyond loopback only under TLS with grants, or with a
//! token, unless the program says the network is trusted ([`Exposure::Insecure`]). One rule for
//! the service ([`Service::bind`](crate::Service::bind)) and the metrics endpoint, so that an
//! embedded node keeps the same door as `ferry-server`.

use std::net::SocketAddr;

/// Whether a node may listen beyond loopback without the protections that keep strangers out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Exposure {
    /// Beyond loopback, the service needs TLS and a credential (grants under TLS, a token in
    /// clear would travel readable), the metrics endpoint (clear HTTP, no credential) is refused,
    /// and the node pulls only from listed peers or cluster members. `ferry-server`'s default.
    #[default]
    Guarded,
    /// The network is trusted (`ferry-server --insecure`): anything goes, with a warning.
    Insecure,
}

/// What a listener beyond loopback lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Missing {
    /// Neither TLS nor a credential: anyone who reaches it reads, overwrites and deletes.
    TlsAndCredential,
    /// TLS without grants: every certificate of the CA may overwrite and delete.
    Credential,
    /// A token in clear: whoever sits on the path reads the tensors and the token.
    Tls,
    /// Clear HTTP with no credential: the metrics endpoint.
    Everything,
    /// A node that pulls from any address a client names: a client could make it dial any
    /// host its network reaches.
    PeerList,
}

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Missing::TlsAndCredential => "no TLS and no credential",
            Missing::Credential => "no credential",
            Missing::Tls => "no TLS",
            Missing::Everything => "clear HTTP and no credential",
            Missing::PeerList => "pulls from any address a client names",
        })
    }
}

/// A listener refused by [`Exposure::Guarded`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "refusing to {what} on {addr} with {missing}: whoever reaches it or sits on the path could \
     {harm}. {remedy}, listen on loopback, or declare the network trusted (Exposure::Insecure; \
     ferry-server --insecure)"
)]
pub struct ExposureError {
    /// What was to listen.
    pub what: &'static str,
    /// Where.
    pub addr: SocketAddr,
    /// What it lacks.
    pub missing: Missing,
    /// What a stranger could do.
    harm: &'static str,
    /// What would close the door.
    remedy: &'static str,
}

/// What a node's listener has, for [`service_door`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Protections {
    /// Its TCP links are mutual TLS.
    pub(crate) tls: bool,
    /// Clients show a credential: a token (in clear), or a certificate granted scopes (TLS).
    pub(crate) credential: bool,
    /// The node pulls only from listed peers or cluster members.
    pub(crate) listed_peers: bool,
}

/// Whether the service may listen on `addr` with `protections`; `Ok(Some(missing))` where it
/// may only because the exposure is [`Exposure::Insecure`] (worth a warning).
pub(crate) fn service_door(
    addr: SocketAddr,
    protections: Protections,
    exposure: Exposure,
) -> Result<Option<Missing>, ExposureError> {
    if is_loopback(addr) {
        return Ok(None);
    }
    let missing = match (protections.tls, protections.credential) {
        (false, false) => Some(Missing::TlsAndCredential),
        (true, false) => Some(Missing::Credential),
        (false, true) => Some(Missing::Tls),
        (true, true) if !protections.listed_peers => Some(Missing::PeerList),
        (true, true) => None,
    };
    let Some(missing) = missing else {
        return Ok(None);
    };
    match exposure {
        Exposure::Insecure => Ok(Some(missing)),
        Exposure::Guarded => Err(ExposureError {
            what: "listen",
            addr,
            missing,
            harm: match missing {
                Missing::PeerList => "make the node connect to any host its network reaches",
                Missing::Tls => "read the tensors and the tokens",
                _ => "read, overwrite and delete every tensor",
            },
            remedy: match missing {
                Missing::Credential => "Grant certificate names their scopes (--grant NAME=SCOPES)",
                Missing::PeerList => "List the peers it pulls from (--peer, PullConfig::peers)",
                _ => {
                    "Give the node TLS (`ferry certs` makes the files; --tls-cert/--tls-key/--tls-ca) \
                     and grants"
                }
            },
        }),
    }
}

/// Whether the metrics endpoint (clear HTTP, no credential) may listen on `addr`; as
/// [`service_door`].
pub(crate) fn metrics_door(
    addr: SocketAddr,
    exposure: Exposure,
) -> Result<Option<Missing>, ExposureError> {
    if is_loopback(addr) {
        return Ok(None);
    }
    match exposure {
        Exposure::Insecure => Ok(Some(Missing::Everything)),
        Exposure::Guarded => Err(ExposureError {
            what: "serve metrics",
            addr,
            missing: Missing::Everything,
            harm: "read the node's traffic, memory and refusals",
            remedy: "Scrape them through a tunnel",
        }),
    }
}

/// Loopback, also as an IPv4-mapped IPv6 address.
fn is_loopback(addr: SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: Protections = Protections {
        tls: false,
        credential: false,
        listed_peers: false,
    };

    /// (address, TLS, credential, listed peers, exposure) -> refused, allowed, or allowed with
    /// what it lacks.
    #[test]
    fn the_service_listens_beyond_loopback_only_behind_tls_and_a_credential() {
        use Exposure::{Guarded, Insecure};
        let all = Protections {
            tls: true,
            credential: true,
            listed_peers: true,
        };
        let token = Protections {
            credential: true,
            listed_peers: true,
            ..NONE
        };
        let tls_only = Protections {
            tls: true,
            listed_peers: true,
            ..NONE
        };
        let any_peer = Protections {
            listed_peers: false,
            ..all
        };
        type Case = (
            &'static str,
            Protections,
            Exposure,
            Result<Option<Missing>, Missing>,
        );
        let cases: &[Case] = &[
            ("127.0.0.1:7070", NONE, Guarded, Ok(None)),
            ("127.8.9.10:7070", NONE, Guarded, Ok(None)),
            ("[::1]:7070", NONE, Guarded, Ok(None)),
            ("[::ffff:127.0.0.1]:7070", NONE, Guarded, Ok(None)),
            (
                "0.0.0.0:7070",
                NONE,
                Guarded,
                Err(Missing::TlsAndCredential),
            ),
            ("[::]:7070", NONE, Guarded, Err(Missing::TlsAndCredential)),
            (
                "10.1.2.3:7070",
                NONE,
                Guarded,
                Err(Missing::TlsAndCredential),
            ),
            ("10.1.2.3:7070", token, Guarded, Err(Missing::Tls)),
            ("10.1.2.3:7070", tls_only, Guarded, Err(Missing::Credential)),
            ("10.1.2.3:7070", any_peer, Guarded, Err(Missing::PeerList)),
            ("10.1.2.3:7070", all, Guarded, Ok(None)),
            (
                "0.0.0.0:7070",
                NONE,
                Insecure,
                Ok(Some(Missing::TlsAndCredential)),
            ),
            ("0.0.0.0:7070", token, Insecure, Ok(Some(Missing::Tls))),
            ("0.0.0.0:7070", all, Insecure, Ok(None)),
        ];
        for (addr, protections, exposure, expected) in cases {
            let got =
                service_door(addr.parse().unwrap(), *protections, *exposure).map_err(|e| e.missing);
            assert_eq!(got, *expected, "{addr} {protections:?} {exposure:?}");
        }
    }

    #[test]
    fn metrics_go_beyond_loopback_only_on_a_trusted_network() {
        let at = |a: &str, e| metrics_door(a.parse().unwrap(), e).map_err(|e| e.missing);
        assert_eq!(at("127.0.0.1:9090", Exposure::Guarded), Ok(None));
        assert_eq!(
            at("0.0.0.0:9090", Exposure::Guarded),
            Err(Missing::Everything)
        );
        assert_eq!(
            at("0.0.0.0:9090", Exposure::Insecure),
            Ok(Some(Missing::Everything))
        );
    }

    #[test]
    fn the_refusal_says_where_what_is_missing_and_what_to_do() {
        let error = service_door("0.0.0.0:7070".parse().unwrap(), NONE, Exposure::Guarded)
            .unwrap_err()
            .to_string();
        for needle in [
            "0.0.0.0:7070",
            "no TLS and no credential",
            "--insecure",
            "ferry certs",
        ] {
            assert!(error.contains(needle), "{needle}: {error}");
        }
    }
}
