//! What a client asks a target node to pull, and the check of the source address it names.

use ferry_proto::{CapabilityToken, ContentHash, TensorKey, Untrusted};

use crate::device::IfExists;
use crate::error::NodeError;

/// What a client asks a target node to pull.
#[derive(Debug, Clone)]
pub(crate) struct PullRequest {
    /// The source node's address, as this node reaches it.
    pub(crate) source: String,
    /// The capability the source issued for this node.
    pub(crate) capability: CapabilityToken,
    /// The tensor on the source.
    pub(crate) src: TensorKey,
    /// The target device.
    pub(crate) dst_device: u32,
    /// The target name; the source's name when absent.
    pub(crate) dst_name: Option<String>,
    /// What becomes of a tensor already registered under the target name.
    pub(crate) existing: IfExists,
    /// The content hash the source granted the tensor under: what the bytes that arrive must
    /// hash to, and what a tensor this node already holds may stand in for. Required.
    pub(crate) content_hash: Option<ContentHash>,
}

/// The longest source address a pull accepts.
const MAX_SOURCE_LEN: usize = 1024;

/// A source address fit to connect to and to log: not empty, bounded, no control characters.
pub(super) fn check_source(source: &str) -> Result<(), NodeError> {
    if source.is_empty() || source.len() > MAX_SOURCE_LEN || source.chars().any(char::is_control) {
        return Err(NodeError::InvalidSource(Untrusted(source).to_string()));
    }
    Ok(())
}
