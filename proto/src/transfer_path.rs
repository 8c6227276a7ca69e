//! `TransferPath`: how a tensor reached the device that holds it, as a `TensorInfo` reports it.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// How a tensor reached the device that holds it. On the wire it is its [`name`](Self::name), a
/// string (PROTOCOL.md §5.2), so a path added later reads as an error here rather than as another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TransferPath {
    /// Uploaded from outside the node (a put or an in-process insert).
    Put,
    /// Handed over as a backend primitive and moved with `*_to_device` / `q_to_device`.
    Native,
    /// `into_data` on the source, validated bytes over a channel, `from_data` on the target.
    RoundTrip,
    /// Streamed from another node with a capability.
    Pull,
    /// A pull skipped: the node already held the same bytes, so it copied its own.
    Dedup,
}

/// Every path, in the order of the wire's documentation.
const ALL: [TransferPath; 5] = [
    TransferPath::Put,
    TransferPath::Native,
    TransferPath::RoundTrip,
    TransferPath::Pull,
    TransferPath::Dedup,
];

/// A path name that this build does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown transfer path {0:?}: expected put, native, round-trip, pull or dedup")]
pub struct UnknownPath(pub String);

impl TransferPath {
    /// The name on the wire, in logs and in listings.
    pub fn name(self) -> &'static str {
        match self {
            TransferPath::Put => "put",
            TransferPath::Native => "native",
            TransferPath::RoundTrip => "round-trip",
            TransferPath::Pull => "pull",
            TransferPath::Dedup => "dedup",
        }
    }
}

impl std::fmt::Display for TransferPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for TransferPath {
    type Err = UnknownPath;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        ALL.into_iter()
            .find(|path| path.name() == name)
            .ok_or_else(|| UnknownPath(name.chars().take(80).collect()))
    }
}

impl Serialize for TransferPath {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for TransferPath {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}
