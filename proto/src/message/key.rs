//! Where a tensor lives on a node ([`TensorKey`]), and which tensor names are accepted.

use serde::{Deserialize, Serialize};

/// The longest tensor name accepted, in bytes.
pub const MAX_NAME_LEN: usize = 1024;

/// Where a tensor lives on a node: a device index and a name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorKey {
    /// Index of the device on its node.
    pub device: u32,
    /// The tensor's name, e.g. `encoder.layer1.weight`.
    pub name: String,
}

impl TensorKey {
    /// A key for `name` on `device`.
    pub fn new(device: u32, name: impl Into<String>) -> Self {
        Self {
            device,
            name: name.into(),
        }
    }

    /// The same name on `device`.
    pub fn on(&self, device: u32) -> Self {
        Self::new(device, self.name.clone())
    }
}

impl std::fmt::Display for TensorKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.device, self.name)
    }
}

/// Why a name is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// Empty.
    #[error("a tensor name cannot be empty")]
    Empty,
    /// Too long.
    #[error("tensor name of {len} bytes exceeds the maximum of {MAX_NAME_LEN}")]
    TooLong {
        /// Its length.
        len: usize,
    },
    /// Holds a control character.
    #[error("tensor name {name:?} holds a control character")]
    ControlCharacter {
        /// The name.
        name: String,
    },
}

/// Checks a tensor name from outside: 1 to [`MAX_NAME_LEN`] bytes, no control characters.
pub fn validate_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > MAX_NAME_LEN {
        return Err(NameError::TooLong { len: name.len() });
    }
    if name.chars().any(char::is_control) {
        return Err(NameError::ControlCharacter {
            name: name.to_string(),
        });
    }
    Ok(())
}
