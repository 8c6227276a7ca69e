//! What a device of this process holds bit-exact: the [`HoldsTable`] ferry measured on the
//! device's backend (Flex, NdArray) or on the device itself (a wgpu device), found from a Burn
//! `Device`; and the one check every move and apply makes with it before a byte moves.

use std::sync::Arc;

use burn_dispatch::DispatchDevice;
use burn_tensor::{DType, Device};
use ferry_backend::{BackendKind, HoldsTable};

/// What `device` holds, as measured by ferry (once per backend, or per GPU device, and
/// process); `None` for a device ferry does not measure here (a remote or capture device).
pub(crate) fn holds_of(device: &Device) -> Option<Arc<HoldsTable>> {
    // Only the backends this build of burn-dispatch was compiled with are variants.
    #[allow(unreachable_patterns)]
    match device.as_dispatch() {
        DispatchDevice::Flex(_) => BackendKind::Flex.measured_holds(),
        #[cfg(feature = "ndarray")]
        DispatchDevice::NdArray(_) => BackendKind::NdArray.measured_holds(),
        // A GPU's table depends on its adapter: measured on the device itself, as the node
        // measures the devices it opens. (Burn's own `supports_dtype` is no answer there: for a
        // natively stored sub-byte scheme cubecl panics instead of saying no.)
        #[cfg(feature = "wgpu")]
        DispatchDevice::Cube(cube) => {
            let cube = cube.clone();
            Some(HoldsTable::cached(
                &format!("program's cubecl device {cube:?}"),
                move || HoldsTable::measure::<ferry_backend::gpu::Backend>(&cube),
            ))
        }
        _ => None,
    }
}

/// Whether `device` holds `dtype` at `shape` bit-exact: by ferry's measured table, or, for a
/// device ferry does not measure, by the backend's own answer (a panic there is a no). `Err`
/// says why not, for a person.
pub(crate) fn check_holds(device: &Device, dtype: &DType, shape: &[usize]) -> Result<(), String> {
    match holds_of(device) {
        Some(holds) => holds.check(dtype, shape),
        None => match ferry_proto::contained(|| device.supports_dtype(*dtype)) {
            Ok(true) => Ok(()),
            Ok(false) => Err("the backend does not support it".into()),
            Err(panic) => Err(format!(
                "the backend does not support it (asking it panicked: {})",
                panic.message
            )),
        },
    }
}
