//! What the store and move tests share: a module's parameters read back, and their comparison;
//! a tensor of any dtype made on one device and moved to another.
// Test code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used, dead_code)]

use std::collections::BTreeMap;

use burn_core::tensor::TensorData;
use burn_store::{ModuleSnapshot, bridge};
use burn_tensor::{Bool, DType, Device, Float, Int, Tensor};
use ferry_burn::{MoveError, TryToDevice};

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

/// `data` made on `from` (read back there: what the tensor is), and the tensor moved to `to`,
/// read back there.
pub fn moved(
    data: TensorData,
    from: &Device,
    to: &Device,
) -> (TensorData, Result<TensorData, MoveError>) {
    let dtype = data.dtype();
    macro_rules! go {
        ($rank:literal, $kind:ty) => {{
            let tensor = Tensor::<$rank, $kind>::from_data(data, (from, dtype));
            let source = tensor.clone().into_data();
            (source, tensor.try_to_device(to).map(Tensor::into_data))
        }};
    }
    match (data.shape().len(), dtype) {
        (1, DType::Bool(_)) => go!(1, Bool),
        (2, DType::Bool(_)) => go!(2, Bool),
        (3, DType::Bool(_)) => go!(3, Bool),
        (1, d) if d.is_int() || d.is_uint() => go!(1, Int),
        (2, d) if d.is_int() || d.is_uint() => go!(2, Int),
        (3, d) if d.is_int() || d.is_uint() => go!(3, Int),
        (1, _) => go!(1, Float),
        (2, _) => go!(2, Float),
        (3, _) => go!(3, Float),
        (rank, _) => unreachable!("rank {rank} is filtered out"),
    }
}
