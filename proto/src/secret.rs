//! Secrets on the wire (a node's shared token, a capability) and the node ids they are bound to:
//! newtypes, so that a secret is never printed and never passed where a name was meant.

use serde::{Deserialize, Serialize};

/// A node's shared token, as a client presents it in `Hello`. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Token(String);

/// A single-use capability a source node issued (`Response::Capability`): whoever holds it may
/// pull one tensor, once, as the node it is bound to. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CapabilityToken(String);

/// A node's id: what a capability is bound to, what a cluster member registers, and what its
/// certificate names under TLS.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(String);

macro_rules! string_newtype {
    ($name:ident) => {
        impl $name {
            /// Wraps `text`.
            pub fn new(text: impl Into<String>) -> Self {
                Self(text.into())
            }

            /// The text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl From<&str> for $name {
            fn from(text: &str) -> Self {
                Self(text.to_string())
            }
        }

        impl From<String> for $name {
            fn from(text: String) -> Self {
                Self(text)
            }
        }
    };
}

string_newtype!(Token);
string_newtype!(CapabilityToken);
string_newtype!(NodeId);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl std::fmt::Debug for CapabilityToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CapabilityToken(<redacted>)")
    }
}

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl PartialEq<str> for NodeId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for NodeId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_show_in_debug() {
        let token = Token::new("hunter2");
        let capability = CapabilityToken::new("cap-secret");
        assert!(!format!("{token:?}").contains("hunter2"));
        assert!(!format!("{capability:?}").contains("cap-secret"));
        assert!(!format!("{:?}", Some(&capability)).contains("cap-secret"));
    }
}
