//! `ContentHash`: the BLAKE3 digest that names a tensor's content (PROTOCOL.md §7.2), written
//! on the wire and for people as 64 lowercase hex digits.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A tensor's content hash: BLAKE3 over its dtype codes, its shape and its bytes (see
/// [`tensor::content_hash`](crate::tensor::content_hash)). Always 32 bytes: a string that is not
/// 64 hex digits never becomes one.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContentHash([u8; 32]);

/// Why a string is not a content hash.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a content hash is 64 hex digits; got {got:?}")]
pub struct ContentHashError {
    /// The string, cut to its first 80 characters.
    pub got: String,
}

impl ContentHash {
    /// The hash whose digest is `digest`.
    pub const fn from_digest(digest: [u8; 32]) -> Self {
        Self(digest)
    }

    /// The digest.
    pub const fn digest(&self) -> &[u8; 32] {
        &self.0
    }
}

impl From<blake3::Hash> for ContentHash {
    fn from(hash: blake3::Hash) -> Self {
        Self(*hash.as_bytes())
    }
}

impl std::fmt::Display for ContentHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for ContentHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ContentHash({self})")
    }
}

impl std::str::FromStr for ContentHash {
    type Err = ContentHashError;

    /// Parses 64 hex digits (either case).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let refuse = || ContentHashError {
            got: text.chars().take(80).collect(),
        };
        let hex = text.as_bytes();
        if hex.len() != 64 {
            return Err(refuse());
        }
        let mut digest = [0u8; 32];
        for (byte, pair) in digest.iter_mut().zip(hex.chunks_exact(2)) {
            let high = (pair[0] as char).to_digit(16).ok_or_else(refuse)?;
            let low = (pair[1] as char).to_digit(16).ok_or_else(refuse)?;
            *byte = (high * 16 + low) as u8;
        }
        Ok(Self(digest))
    }
}

// On the wire it is the string a peer of any minor reads (PROTOCOL.md §7.2), so the newtype
// changes nothing in the bytes.
impl Serialize for ContentHash {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ContentHash {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_hex() {
        let hash = ContentHash::from(blake3::hash(b"ferry"));
        let text = hash.to_string();
        assert_eq!(text, blake3::hash(b"ferry").to_hex().as_str());
        assert_eq!(text.parse::<ContentHash>(), Ok(hash));
        assert_eq!(text.to_uppercase().parse::<ContentHash>(), Ok(hash));
    }

    #[test]
    fn refuses_what_is_not_64_hex_digits() {
        for bad in [
            "",
            "abc",
            &"g".repeat(64),
            &"a".repeat(63),
            &"a".repeat(65),
            &"é".repeat(32),
        ] {
            assert!(bad.parse::<ContentHash>().is_err(), "{bad:?}");
        }
    }
}
