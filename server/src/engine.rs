//! The transfer engine's path table: which way a tensor goes between two devices of a node.
//!
//! One table, one place: the log line of every transfer and `stat` report the path taken, and
//! the `round-trip` policy forces the host round trip so both paths stay tested.

use ferry_backend::BackendKind;

/// Which paths a node may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TransferPolicy {
    /// The native path where the table allows it, the round trip elsewhere.
    #[default]
    Auto,
    /// Always the host round trip.
    RoundTrip,
}

impl std::str::FromStr for TransferPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(TransferPolicy::Auto),
            "round-trip" => Ok(TransferPolicy::RoundTrip),
            other => Err(format!(
                "unknown transfer policy {other:?}: expected auto or round-trip"
            )),
        }
    }
}

impl TransferPolicy {
    /// The name used on the command line and in `stat`.
    pub fn name(self) -> &'static str {
        match self {
            TransferPolicy::Auto => "auto",
            TransferPolicy::RoundTrip => "round-trip",
        }
    }
}

pub use ferry_proto::TransferPath;

/// The path a tensor takes from a device of `src` to one of `dst`, whatever its dtype.
///
/// Native only between devices of one backend: a primitive means nothing to another backend.
/// Flex and NdArray implement `float/int/bool_to_device` and `q_to_device` for every dtype they
/// hold (both are single-device backends, so the move keeps the handle), as does wgpu between
/// its devices (cubecl's own copy), so within one backend every dtype goes native. A backend
/// whose `to_device` lacked a dtype would make this a function of the dtype too.
pub fn choose_path(policy: TransferPolicy, src: BackendKind, dst: BackendKind) -> TransferPath {
    match policy {
        TransferPolicy::RoundTrip => TransferPath::RoundTrip,
        TransferPolicy::Auto if src == dst => TransferPath::Native,
        TransferPolicy::Auto => TransferPath::RoundTrip,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table() {
        use BackendKind::*;
        use TransferPath::{Native, RoundTrip as Host};
        use TransferPolicy::{Auto, RoundTrip as Forced};
        let table = [
            (Auto, Flex, Flex, Native),
            (Auto, NdArray, NdArray, Native),
            (Auto, Wgpu, Wgpu, Native),
            (Auto, Flex, NdArray, Host),
            (Auto, NdArray, Flex, Host),
            (Auto, Flex, Wgpu, Host),
            (Auto, Wgpu, NdArray, Host),
            (Forced, Flex, Flex, Host),
            (Forced, Wgpu, Wgpu, Host),
            (Forced, Flex, NdArray, Host),
        ];
        for (policy, src, dst, path) in table {
            assert_eq!(
                choose_path(policy, src, dst),
                path,
                "{policy:?} {src:?} -> {dst:?}"
            );
        }
    }
}
