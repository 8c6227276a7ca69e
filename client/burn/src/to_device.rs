//! [`TryToDevice`]: a tensor moved to any device of this process, or an error that names the
//! dtype and the device; never a panic.

use burn_tensor::kind::Basic;
use burn_tensor::{DType, Device, Tensor};
use ferry_proto::{contained, dtype_name};

use crate::holds::check_holds;

/// Why a tensor was not moved. The tensor is gone either way (it was taken by value): keep a
/// clone (a handle, not the bytes) where it is still needed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MoveError {
    /// The target device does not hold the dtype (at this shape) bit-exact, as ferry measured
    /// it; decided before anything was read or written.
    #[error("{device} cannot hold a {dtype} tensor of shape {shape:?}: {why}")]
    NotHeld {
        /// The tensor's dtype, readable.
        dtype: String,
        /// Its shape.
        shape: Vec<usize>,
        /// The target device.
        device: String,
        /// What the measurement says.
        why: String,
    },
    /// The source backend failed to read the tensor back, or the target backend to build it
    /// (a failure its measured table did not foresee, such as running out of memory).
    #[error("moving a {dtype} tensor to {device}: {message}")]
    Backend {
        /// The tensor's dtype, readable.
        dtype: String,
        /// The target device.
        device: String,
        /// What the backend said.
        message: String,
    },
}

/// A tensor moved to another device of this process without a panic: Burn's own `to_device`
/// where both devices are of one backend, else the host round trip (`into_data` on the
/// source, `from_data` on the target), either way only once the target's measured table says
/// it holds the dtype at that shape.
pub trait TryToDevice: Sized {
    /// `self` on `device`, bit-exact (dtype, shape and bytes, scales included).
    fn try_to_device(self, device: &Device) -> Result<Self, MoveError>;
}

impl<const D: usize, K: Basic + 'static> TryToDevice for Tensor<D, K> {
    fn try_to_device(self, device: &Device) -> Result<Self, MoveError> {
        let from = self.device();
        if stays(&from, device) {
            return Ok(self);
        }
        let autodiff_alike = from.is_autodiff() == device.is_autodiff();
        let dtype = self.dtype();
        let shape = self.shape().to_vec();
        check_held(device, &dtype, &shape)?;
        let failed = |message: String| MoveError::Backend {
            dtype: dtype_name(&dtype),
            device: format!("{device:?}"),
            message,
        };
        let same_backend = std::mem::discriminant(from.as_dispatch())
            == std::mem::discriminant(device.as_dispatch())
            && autodiff_alike;
        if same_backend {
            // The backend's native move (on a CPU backend, the same buffer).
            return contained(|| self.to_device(device)).map_err(|p| failed(p.message));
        }
        let data = contained(|| self.try_into_data())
            .map_err(|p| failed(format!("reading it back panicked: {}", p.message)))?
            .map_err(|e| failed(format!("reading it back: {e:?}")))?;
        contained(|| Tensor::<D, K>::from_data(data, (device, dtype)))
            .map_err(|p| failed(format!("building it panicked: {}", p.message)))
    }
}

/// Whether a tensor on `from` is already where a move to `to` would put it. Devices compare
/// equal whatever their autodiff: a move onto or off an autodiff device is a move (through the
/// data, which builds the target's kind of tensor).
pub(crate) fn stays(from: &Device, to: &Device) -> bool {
    from == to && from.is_autodiff() == to.is_autodiff()
}

/// Whether `device` holds `dtype` at `shape` ([`check_holds`]), as a [`MoveError`].
pub(crate) fn check_held(device: &Device, dtype: &DType, shape: &[usize]) -> Result<(), MoveError> {
    check_holds(device, dtype, shape).map_err(|why| MoveError::NotHeld {
        dtype: dtype_name(dtype),
        shape: shape.to_vec(),
        device: format!("{device:?}"),
        why,
    })
}
