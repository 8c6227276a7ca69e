//! The transfer engine's path table: which way a tensor goes between two devices of a node.
//!
//! One table, one place: the log line of every transfer and `stat` report the path taken, and
//! the `round-trip` policy forces the host round trip so both paths stay tested.

use burn_backend::DType;

use crate::backend::BackendKind;

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

/// The path a tensor of `dtype` takes from a device of `src` to one of `dst`.
///
/// Native only between devices of one backend: a primitive means nothing to another backend.
/// Flex and NdArray implement `float/int/bool_to_device` and `q_to_device` for every dtype they
/// hold (both are single-device backends, so the move keeps the handle), so within one of them
/// every dtype goes native. A backend whose `to_device` lacks a dtype gets an arm here.
pub fn choose_path(
    policy: TransferPolicy,
    src: BackendKind,
    dst: BackendKind,
    _dtype: &DType,
) -> TransferPath {
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
        use TransferPolicy::*;
        let f32 = DType::F32;
        assert_eq!(choose_path(Auto, Flex, Flex, &f32), TransferPath::Native);
        assert_eq!(
            choose_path(Auto, NdArray, NdArray, &f32),
            TransferPath::Native
        );
        assert_eq!(
            choose_path(Auto, Flex, NdArray, &f32),
            TransferPath::RoundTrip
        );
        assert_eq!(
            choose_path(RoundTrip, Flex, Flex, &f32),
            TransferPath::RoundTrip
        );
    }
}
