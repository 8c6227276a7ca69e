//! What the store tests share: a module's parameters read back, and their comparison.
// Test code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used, dead_code)]

use std::collections::BTreeMap;

use burn_core::tensor::TensorData;
use burn_store::{ModuleSnapshot, bridge};

/// Every parameter's data, by path.
pub fn params<M: ModuleSnapshot>(module: &M) -> BTreeMap<String, TensorData> {
    module
        .collect(None, None, false)
        .iter()
        .map(|t| (t.name.clone(), bridge::to_data(t).unwrap()))
        .collect()
}

/// Same paths, and for each the same dtype, shape and bytes (scales included).
pub fn assert_same_params(
    actual: &BTreeMap<String, TensorData>,
    expected: &BTreeMap<String, TensorData>,
) {
    assert_eq!(
        actual.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>(),
        "the same parameters"
    );
    for (path, want) in expected {
        let got = &actual[path];
        assert_eq!(got.dtype(), want.dtype(), "{path}: dtype");
        assert_eq!(got.shape(), want.shape(), "{path}: shape");
        assert!(got.as_bytes() == want.as_bytes(), "{path}: bytes differ");
    }
}
