//! Credentials a node accepts, each with its scopes: what its holder may do once welcomed. Kept
//! as digests (BLAKE3 of the token), so that a token is compared in constant time over a fixed
//! length and the node's memory holds no token in clear.
//!
//! What can be wrong with one, [`CredentialError`], is `ferry-io`'s: a client reads its token
//! file with `ferry_io::credential::token_from_file` and reports it alike.

use std::fmt;

pub use ferry_io::credential::CredentialError;

/// One thing a credential may allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scope {
    /// Read tensors and the node's state: get, list, stat, identify, grant a capability.
    Read,
    /// Change what the node holds: put, copy, move, delete, pull.
    Write,
    /// Serve another node: fetch with a capability, and release it.
    Peer,
}

impl Scope {
    /// Every scope, in order.
    pub const ALL: [Scope; 3] = [Scope::Read, Scope::Write, Scope::Peer];

    /// The scope's name, as a token file and messages spell it.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Write => "write",
            Scope::Peer => "peer",
        }
    }

    fn bit(self) -> u8 {
        match self {
            Scope::Read => 1,
            Scope::Write => 2,
            Scope::Peer => 4,
        }
    }
}

impl std::str::FromStr for Scope {
    type Err = CredentialError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Scope::ALL
            .into_iter()
            .find(|scope| scope.name() == s)
            .ok_or(CredentialError::UnknownScope)
    }
}

/// A set of scopes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scopes(u8);

impl Scopes {
    /// Every scope: what a node without credentials, or a credential given as `--token`, allows.
    pub const ALL: Scopes = Scopes(7);

    /// Exactly `scopes`.
    pub fn of(scopes: &[Scope]) -> Scopes {
        Scopes(scopes.iter().fold(0, |bits, s| bits | s.bit()))
    }

    /// Whether `scope` is among them.
    pub fn allows(self, scope: Scope) -> bool {
        self.0 & scope.bit() != 0
    }

    /// These and `other`'s.
    pub fn with(self, other: Scopes) -> Scopes {
        Scopes(self.0 | other.0)
    }
}

impl fmt::Display for Scopes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = Scope::ALL
            .into_iter()
            .filter(|s| self.allows(*s))
            .map(Scope::name)
            .collect();
        f.write_str(&names.join(","))
    }
}

/// A token a node accepts, as its digest, with what it allows.
#[derive(Clone, PartialEq, Eq)]
pub struct Credential {
    digest: blake3::Hash,
    scopes: Scopes,
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the digest: it is as good as the token to anyone who can replay it offline.
        f.debug_struct("Credential")
            .field("scopes", &self.scopes)
            .finish_non_exhaustive()
    }
}

impl Credential {
    /// A credential for `token` allowing `scopes`.
    pub fn new(token: &str, scopes: Scopes) -> Result<Credential, CredentialError> {
        if token.is_empty() {
            return Err(CredentialError::Empty);
        }
        if scopes.0 == 0 {
            return Err(CredentialError::NoScopes);
        }
        Ok(Credential {
            digest: blake3::hash(token.as_bytes()),
            scopes,
        })
    }

    /// A credential for `token` allowing everything.
    pub fn full(token: &str) -> Result<Credential, CredentialError> {
        Credential::new(token, Scopes::ALL)
    }

    /// What it allows.
    pub fn scopes(&self) -> Scopes {
        self.scopes
    }
}

/// The scopes `given` (a `Hello`'s token, if any) earns among `accepted`: all of them where the
/// node accepts no credentials; `None` where it requires one and `given` matches none. Every
/// credential is compared (in constant time, over digests), whichever matches.
pub fn scopes_for(accepted: &[Credential], given: Option<&str>) -> Option<Scopes> {
    if accepted.is_empty() {
        return Some(Scopes::ALL);
    }
    matching(accepted, given)
        .and_then(|index| accepted.get(index))
        .map(Credential::scopes)
}

/// Which of `accepted` `given` (a `Hello`'s token, if any) is: its place in the list, which
/// tells one credential's holders from another's without keeping the token. Every credential
/// is compared (in constant time, over digests), whichever matches.
pub fn matching(accepted: &[Credential], given: Option<&str>) -> Option<usize> {
    let digest = blake3::hash(given.unwrap_or("").as_bytes());
    let mut found = None;
    for (index, credential) in accepted.iter().enumerate() {
        // `blake3::Hash` compares in constant time.
        if credential.digest == digest && given.is_some() {
            found = Some(index);
        }
    }
    found
}

/// Reads a token file: one credential per line, `SCOPES TOKEN` (scopes comma-separated, or
/// `all`) or a bare `TOKEN` (every scope); blank lines and lines starting with `#` are skipped.
pub fn parse_token_file(text: &str) -> Result<Vec<Credential>, CredentialError> {
    let mut credentials: Vec<(usize, Credential)> = Vec::new();
    for (index, line) in text.lines().map(str::trim).enumerate() {
        let number = index + 1;
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let in_line = |error| CredentialError::Line {
            line: number,
            error: Box::new(error),
        };
        let credential = match line.split_once(char::is_whitespace) {
            // A scope name alone is a line whose token is missing, not a token.
            None if line == "all" || line.split(',').all(|s| s.parse::<Scope>().is_ok()) => {
                return Err(in_line(CredentialError::Empty));
            }
            None => Credential::full(line).map_err(in_line)?,
            Some((scopes, token)) => {
                let scopes = if scopes == "all" {
                    Scopes::ALL
                } else {
                    let parsed: Result<Vec<Scope>, _> = scopes.split(',').map(str::parse).collect();
                    Scopes::of(&parsed.map_err(in_line)?)
                };
                Credential::new(token.trim(), scopes).map_err(in_line)?
            }
        };
        if let Some((first, _)) = credentials
            .iter()
            .find(|(_, c)| c.digest == credential.digest)
        {
            return Err(CredentialError::Duplicate {
                line: number,
                first: *first,
            });
        }
        credentials.push((number, credential));
    }
    Ok(credentials.into_iter().map(|(_, c)| c).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_earns_the_scopes_of_its_credential_and_nothing_else() {
        let accepted = parse_token_file(
            "# readers\nread reader-token\nread,write writer-token\npeer peer-token\nall admin\nroot-token\n",
        )
        .unwrap();
        let earned = |t: Option<&str>| scopes_for(&accepted, t);
        assert_eq!(
            earned(Some("reader-token")),
            Some(Scopes::of(&[Scope::Read]))
        );
        assert_eq!(
            earned(Some("writer-token")),
            Some(Scopes::of(&[Scope::Read, Scope::Write]))
        );
        assert_eq!(earned(Some("peer-token")), Some(Scopes::of(&[Scope::Peer])));
        assert_eq!(earned(Some("admin")), Some(Scopes::ALL));
        assert_eq!(earned(Some("root-token")), Some(Scopes::ALL));
        assert_eq!(earned(Some("reader-toke")), None);
        assert_eq!(earned(Some("")), None);
        assert_eq!(earned(None), None);
        assert_eq!(
            scopes_for(&[], None),
            Some(Scopes::ALL),
            "no credentials: open"
        );
        assert_eq!(
            Scopes::of(&[Scope::Read, Scope::Peer]).to_string(),
            "read,peer"
        );
    }

    #[test]
    fn a_token_is_matched_to_its_place_among_the_credentials() {
        let accepted = parse_token_file("read reader-token\nall admin\n").unwrap();
        for (given, expected) in [
            (Some("reader-token"), Some(0)),
            (Some("admin"), Some(1)),
            (Some("admin "), None),
            (Some(""), None),
            (None, None),
        ] {
            assert_eq!(matching(&accepted, given), expected, "{given:?}");
        }
        assert_eq!(
            matching(&[], Some("any")),
            None,
            "no credentials: none matches"
        );
    }

    #[test]
    fn bad_token_files_are_refused() {
        let line = |line, error| CredentialError::Line {
            line,
            error: Box::new(error),
        };
        assert_eq!(
            parse_token_file("read "),
            Err(line(1, CredentialError::Empty))
        );
        assert_eq!(
            parse_token_file("\nwrite,peer"),
            Err(line(2, CredentialError::Empty))
        );
        assert_eq!(
            parse_token_file("read t\n# the same, wider\nall t"),
            Err(CredentialError::Duplicate { line: 3, first: 1 })
        );
        // Written the wrong way round: the token is not echoed back.
        let reversed = parse_token_file("s3cret-token read").unwrap_err();
        assert_eq!(reversed, line(1, CredentialError::UnknownScope));
        assert!(!reversed.to_string().contains("s3cret"), "{reversed}");
        assert_eq!(
            Credential::new("t", Scopes::of(&[])),
            Err(CredentialError::NoScopes)
        );
    }
}
