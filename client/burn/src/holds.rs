//! What a device of this process holds bit-exact: the node's measured [`HoldsTable`] of the
//! device's backend, found from a Burn `Device`.

use std::sync::Arc;

use burn_dispatch::DispatchDevice;
use burn_tensor::Device;
use ferry_server::{BackendKind, HoldsTable};

/// The backend of `device`, where ferry measures what that backend holds.
pub(crate) fn backend_of(device: &Device) -> Option<BackendKind> {
    // Only the backends this build of burn-dispatch was compiled with are variants; for the
    // rest (autodiff, capture, remote, a GPU runtime) the callers ask the backend's own
    // `supports_dtype` instead.
    #[allow(unreachable_patterns)]
    match device.as_dispatch() {
        DispatchDevice::Flex(_) => Some(BackendKind::Flex),
        #[cfg(feature = "ndarray")]
        DispatchDevice::NdArray(_) => Some(BackendKind::NdArray),
        _ => None,
    }
}

/// What `device` holds, as measured by ferry (once per backend and process); `None` for a
/// device whose backend ferry does not measure here.
pub(crate) fn holds_of(device: &Device) -> Option<Arc<HoldsTable>> {
    backend_of(device).and_then(BackendKind::measured_holds)
}
