//! Checks of what a node answered (bit-exact tensors, error codes) and batches of named tensors.

use ferry_client::{ClientError, ErrorCode};
use ferry_io::ExchangeError;
use ferry_proto::{TensorData, TensorKey};

/// Bit-exact: the same bytes, the same dtype (scheme and scales included), the same shape.
pub fn assert_same(actual: &TensorData, expected: &TensorData, what: &str) {
    assert_eq!(actual.dtype(), expected.dtype(), "{what}: dtype");
    assert_eq!(actual.shape(), expected.shape(), "{what}: shape");
    assert!(
        actual.as_bytes() == expected.as_bytes(),
        "{what}: bytes differ ({} vs {} bytes)",
        actual.as_bytes().len(),
        expected.as_bytes().len()
    );
}

/// The node's error code of a failed call.
pub fn code_of<T: std::fmt::Debug>(result: Result<T, ClientError>) -> ErrorCode {
    match result {
        Err(ClientError::Node { code, .. }) => code,
        other => panic!("expected an error reply from the node, got {other:?}"),
    }
}

/// [`code_of`] for an exchange a node makes with its source.
pub fn source_code_of<T: std::fmt::Debug>(result: Result<T, ExchangeError>) -> ErrorCode {
    match result {
        Err(ExchangeError::Refused(reply)) => reply.code,
        other => panic!("expected an error reply from the source, got {other:?}"),
    }
}

/// Named tensors as a batch for `device` ([`Client::put_batch`](ferry_client::Client::put_batch)).
pub fn on_device(device: u32, tensors: &[(String, TensorData)]) -> Vec<(TensorKey, TensorData)> {
    tensors
        .iter()
        .map(|(name, data)| (TensorKey::new(device, name.clone()), data.clone()))
        .collect()
}
