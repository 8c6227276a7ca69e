//! Burn tensors to and from `TensorData`, with the checks Burn itself would panic on.

use std::any::TypeId;

use burn_tensor::kind::Basic;
use burn_tensor::{Bool, Device, Float, Int, Tensor};
use ferry_proto::{DType, TensorData, dtype_name};

use crate::client::ClientError;

/// The host bytes of `tensor` (quantized tensors keep their scheme and scales).
pub fn into_data<const D: usize, K: Basic>(
    tensor: Tensor<D, K>,
) -> Result<TensorData, ClientError> {
    tensor
        .try_into_data()
        .map_err(|e| ClientError::Tensor(format!("reading the tensor failed: {e:?}")))
}

/// Which tensor kind holds `dtype`.
fn kind_of(dtype: &DType) -> (TypeId, &'static str) {
    match dtype {
        DType::Bool(_) => (TypeId::of::<Bool>(), "Bool"),
        d if d.is_int() || d.is_uint() => (TypeId::of::<Int>(), "Int"),
        _ => (TypeId::of::<Float>(), "Float"),
    }
}

/// A tensor of rank `D` and kind `K` on `device` holding exactly `data`: its own dtype, not the
/// device's default (Burn would convert otherwise). Bool tensors take the device's bool store,
/// the one exception Burn makes.
pub fn from_data<const D: usize, K: Basic + 'static>(
    data: TensorData,
    device: &Device,
) -> Result<Tensor<D, K>, ClientError> {
    let dtype = data.dtype();
    let rank = data.shape().num_dims();
    if rank != D {
        return Err(ClientError::Tensor(format!(
            "a tensor of shape {:?} has rank {rank}, not {D}",
            data.shape().as_slice()
        )));
    }
    let (kind, kind_name) = kind_of(&dtype);
    if kind != TypeId::of::<K>() {
        return Err(ClientError::Tensor(format!(
            "{} data makes a {kind_name} tensor",
            dtype_name(&dtype)
        )));
    }
    // Backends fail by panicking (a dtype the device cannot hold): turn that into an error.
    ferry_proto::contained(|| Tensor::<D, K>::from_data(data, (device, dtype))).map_err(|panic| {
        ClientError::Tensor(format!(
            "{device:?} cannot hold {}: {panic}",
            dtype_name(&dtype)
        ))
    })
}
