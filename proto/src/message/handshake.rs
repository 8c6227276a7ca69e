//! The handshake that opens every connection: the opener's [`Hello`] and the node's [`Welcome`].

use serde::{Deserialize, Serialize};

use crate::secret::Token;

/// The first message on every connection, from the side that opened it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The protocol major version the peer speaks.
    pub major: u8,
    /// The protocol minor version the peer speaks.
    pub minor: u16,
    /// Optional features the peer speaks (see `PROTOCOL.md`).
    pub features: Vec<String>,
    /// The shared token, where the node requires one.
    pub token: Option<Token>,
    /// Free text naming the peer's software, for logs.
    pub agent: String,
}

/// The node's answer to a [`Hello`] it accepts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// The protocol major version the node speaks.
    pub major: u8,
    /// The protocol minor version the node speaks.
    pub minor: u16,
    /// The features both sides speak.
    pub features: Vec<String>,
    /// Free text naming the node's software, for logs.
    pub agent: String,
    /// The largest frame body the node accepts.
    pub max_body: u64,
    /// The payload bytes per chunk the node sends and prefers to receive.
    pub chunk_size: u64,
}
