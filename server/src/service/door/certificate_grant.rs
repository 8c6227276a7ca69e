//! Scopes a node grants to certificate identities under TLS: the credential that never travels.
//! A certificate is proved in the TLS handshake, never sent as a secret, so a node that was sent
//! nothing cannot replay anything elsewhere (a bearer token can be, by any node it reaches).
//!
//! Under TLS a node authorizes by identity alone: the scopes granted to the certificate's name,
//! and `peer` for every node certificate of the cluster's CA (capabilities are bound to node
//! ids besides). Tokens are taken over TCP in clear only.

use std::fmt;

use ferry_io::credential::CredentialError;
use ferry_io::tls::{Identity, MAX_IDENTITY_LEN, Role};

use super::credential::{Scope, Scopes};

/// Scopes granted to the certificates that name `identity` (their common name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertificateGrant {
    identity: String,
    scopes: Scopes,
}

/// Why a grant could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CertificateGrantError {
    /// Not `NAME=SCOPES` with a name a certificate can carry.
    #[error(
        "a grant is NAME=SCOPES, NAME a certificate's common name (printable ASCII, no spaces) \
         and SCOPES comma-separated, or all: {0:?}"
    )]
    Form(String),
    /// A bad scope list.
    #[error("the grant to {identity}: {error}")]
    Scopes {
        /// Whom it grants to.
        identity: String,
        /// What is wrong with its scopes.
        error: CredentialError,
    },
}

impl CertificateGrant {
    /// `scopes` for the certificates named `identity`.
    pub fn new(
        identity: impl Into<String>,
        scopes: Scopes,
    ) -> Result<CertificateGrant, CertificateGrantError> {
        let identity = identity.into();
        // A name no certificate can carry (as `Identity` reads one) would silently grant nothing.
        if identity.is_empty()
            || identity.len() > MAX_IDENTITY_LEN
            || !identity.chars().all(|c| c.is_ascii_graphic())
        {
            return Err(CertificateGrantError::Form(format!("{identity}={scopes}")));
        }
        if scopes == Scopes::of(&[]) {
            return Err(CertificateGrantError::Scopes {
                identity,
                error: CredentialError::NoScopes,
            });
        }
        Ok(CertificateGrant { identity, scopes })
    }

    /// Whom it grants to.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// What it grants.
    pub fn scopes(&self) -> Scopes {
        self.scopes
    }
}

impl std::str::FromStr for CertificateGrant {
    type Err = CertificateGrantError;

    /// `NAME=SCOPES`: `reader=read`, `pipeline=read,write`, `admin=all`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (identity, scopes) = text
            .split_once('=')
            .ok_or_else(|| CertificateGrantError::Form(text.to_string()))?;
        let scopes = if scopes == "all" {
            Scopes::ALL
        } else {
            let parsed: Result<Vec<Scope>, _> = scopes.split(',').map(str::parse).collect();
            Scopes::of(&parsed.map_err(|error| CertificateGrantError::Scopes {
                identity: identity.to_string(),
                error,
            })?)
        };
        CertificateGrant::new(identity, scopes)
    }
}

impl fmt::Display for CertificateGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.identity, self.scopes)
    }
}

/// What a certified peer may do on a node that grants `grants`. A node that grants nothing lets
/// every certificate of its CA do everything; otherwise the scopes granted to the peer's name,
/// and `peer` where its certificate is a node's (one with the server-authentication usage).
/// `None`: nothing, refused.
pub fn scopes_of(identity: &Identity, grants: &[CertificateGrant]) -> Option<Scopes> {
    granted_to(identity.as_str(), identity.role(), grants)
}

/// [`scopes_of`] an identity by its name and role (only `ferry-io` makes an [`Identity`], from a
/// verified certificate).
fn granted_to(name: &str, role: Role, grants: &[CertificateGrant]) -> Option<Scopes> {
    if grants.is_empty() {
        return Some(Scopes::ALL);
    }
    let granted = grants
        .iter()
        .filter(|grant| grant.identity == name)
        .fold(Scopes::of(&[]), |all, grant| all.with(grant.scopes));
    // `peer` to a node's certificate; a client's (`Role` is non-exhaustive: any other too) gets
    // what its name was granted alone.
    let scopes = match role {
        Role::Node => granted.with(Scopes::of(&[Scope::Peer])),
        _ => granted,
    };
    (scopes != Scopes::of(&[])).then_some(scopes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_read_as_written_and_refuse_what_is_not_one() {
        let grant: CertificateGrant = "pipeline=read,write".parse().unwrap();
        assert_eq!(grant.identity(), "pipeline");
        assert_eq!(grant.scopes(), Scopes::of(&[Scope::Read, Scope::Write]));
        assert_eq!(grant.to_string(), "pipeline=read,write");
        assert_eq!(
            "admin=all".parse::<CertificateGrant>().unwrap().scopes(),
            Scopes::ALL
        );
        for bad in [
            "reader",
            "=read",
            "reader=",
            "ops =all",
            "reader=sudo",
            "reader=read,,write",
        ] {
            assert!(bad.parse::<CertificateGrant>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_certificate_earns_what_its_name_was_granted_and_a_node_peer() {
        let grants = vec![
            "reader=read".parse::<CertificateGrant>().unwrap(),
            "reader=peer".parse::<CertificateGrant>().unwrap(),
            "writer=read,write".parse::<CertificateGrant>().unwrap(),
        ];
        let client =
            |name: &str, grants: &[CertificateGrant]| granted_to(name, Role::Client, grants);
        let node = |name: &str, grants: &[CertificateGrant]| granted_to(name, Role::Node, grants);
        assert_eq!(
            client("reader", &grants),
            Some(Scopes::of(&[Scope::Read, Scope::Peer]))
        );
        assert_eq!(client("stranger", &grants), None);
        assert_eq!(node("node-b", &grants), Some(Scopes::of(&[Scope::Peer])));
        assert_eq!(
            node("writer", &grants),
            Some(Scopes::ALL),
            "a grant by name, whatever the role"
        );
        // Nothing granted: every certificate of the CA may do everything.
        assert_eq!(client("anyone", &[]), Some(Scopes::ALL));
    }
}
