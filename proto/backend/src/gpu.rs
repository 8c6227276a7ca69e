//! GPU devices: which one a `--device` spec names (`wgpu:0`, `vulkan:cpu`, `gl:default`), and
//! opening it on burn-cubecl's wgpu runtime without a panic, with the adapter it landed on.
//!
//! burn-wgpu and burn-cuda are one backend type (`burn_cubecl::CubeBackend`) over a device enum
//! (`cubecl::Device`): a CUDA device would be one more [`GpuRuntime`] variant and one more arm in
//! `open` (built with the `wgpu` feature), behind a `cuda` feature. It is not compiled here
//! because burn-cuda's build (`cubecl-cuda` -> `cubecl-llvm`) downloads LLVM, which these
//! machines cannot reach.

use std::fmt;
use std::str::FromStr;

/// The graphics API a wgpu device is reached through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GraphicsApi {
    /// Whichever the runtime picks (Vulkan where it has an adapter).
    Auto,
    /// Vulkan.
    Vulkan,
    /// OpenGL (EGL).
    Gl,
}

/// Which of the machine's adapters, by wgpu's own kinds (each counted from 0 among its kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Adapter {
    /// The best the API offers (a high-power GPU first).
    Default,
    /// The n-th discrete GPU (`wgpu:0`, as Burn's `DiscreteGpu(0)`).
    Discrete(usize),
    /// The n-th integrated GPU.
    Integrated(usize),
    /// The n-th virtual GPU.
    Virtual(usize),
    /// A software rasterizer (llvmpipe, lavapipe).
    Software,
    /// The n-th adapter the driver does not classify (some OpenGL drivers).
    Other(usize),
}

/// A GPU device as a `--device` spec names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GpuSpec {
    /// The graphics API.
    pub api: GraphicsApi,
    /// The adapter.
    pub adapter: Adapter,
}

/// The runtimes a GPU device can be on (see the module's note on CUDA).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GpuRuntime {
    /// burn-wgpu: Vulkan, OpenGL (Metal and DirectX elsewhere).
    Wgpu,
}

impl GpuSpec {
    /// The spec's API prefix (`wgpu`, `vulkan`, `gl`).
    fn prefix(&self) -> &'static str {
        match self.api {
            GraphicsApi::Auto => "wgpu",
            GraphicsApi::Vulkan => "vulkan",
            GraphicsApi::Gl => "gl",
        }
    }

    /// Parses `API[:ADAPTER]` where API is `wgpu`, `vulkan` or `gl`; `None` for another prefix.
    pub fn parse(s: &str) -> Option<Result<GpuSpec, String>> {
        let (prefix, rest) = s.split_once(':').unwrap_or((s, "default"));
        let api = match prefix {
            "wgpu" => GraphicsApi::Auto,
            "vulkan" => GraphicsApi::Vulkan,
            "gl" => GraphicsApi::Gl,
            _ => return None,
        };
        let index = |n: &str| {
            n.parse::<usize>()
                .ok()
                .filter(|&n| n <= MAX_ADAPTER_INDEX)
                .ok_or_else(|| format!("device {s:?}: {n:?} is not an adapter index"))
        };
        let adapter = match rest.split_once(':') {
            None => match rest {
                "default" => Ok(Adapter::Default),
                "cpu" => Ok(Adapter::Software),
                n => index(n).map(Adapter::Discrete),
            },
            Some(("igpu", n)) => index(n).map(Adapter::Integrated),
            Some(("vgpu", n)) => index(n).map(Adapter::Virtual),
            Some(("other", n)) => index(n).map(Adapter::Other),
            Some(_) => Err(format!(
                "device {s:?}: expected {prefix}:N (discrete GPU N), {prefix}:igpu:N, \
                 {prefix}:vgpu:N, {prefix}:other:N, {prefix}:cpu or {prefix}:default"
            )),
        };
        Some(adapter.map(|adapter| GpuSpec { api, adapter }))
    }
}

/// The largest adapter index a spec may name (cubecl keeps 13 bits of it).
const MAX_ADAPTER_INDEX: usize = (1 << 13) - 1;

impl fmt::Display for GpuSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let prefix = self.prefix();
        match self.adapter {
            Adapter::Default => write!(f, "{prefix}:default"),
            Adapter::Discrete(n) => write!(f, "{prefix}:{n}"),
            Adapter::Integrated(n) => write!(f, "{prefix}:igpu:{n}"),
            Adapter::Virtual(n) => write!(f, "{prefix}:vgpu:{n}"),
            Adapter::Software => write!(f, "{prefix}:cpu"),
            Adapter::Other(n) => write!(f, "{prefix}:other:{n}"),
        }
    }
}

impl FromStr for GpuSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        GpuSpec::parse(s).unwrap_or_else(|| Err(format!("{s:?} is not a GPU device")))
    }
}

/// The Burn backend a GPU device is hosted on: burn-cubecl's, one type over every cubecl runtime
/// (burn-wgpu's `Wgpu` without fusion).
#[cfg(feature = "wgpu")]
pub type Backend = burn_wgpu::Wgpu;

#[cfg(feature = "wgpu")]
/// An opened GPU device: the Burn device to use, and what it landed on.
#[derive(Debug, Clone)]
pub struct OpenedGpu {
    /// The device, as burn-cubecl's backend takes it.
    pub device: burn_cubecl::CubeDevice,
    /// The adapter, for a person: its name, driver and graphics API.
    pub adapter: String,
    /// The most bytes the runtime allocates in one buffer on it (cubecl's page size: the
    /// adapter's `max_buffer_size` and storage binding size, the smaller). A larger tensor
    /// cannot live there: cubecl accepts it and fails at the first read.
    pub largest_buffer: u64,
}

/// Why a GPU device did not open.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// No adapter matches, the driver refused a device, or its setup failed.
    #[error("cannot open GPU device {spec}: {reason}")]
    Unavailable {
        /// The device asked for.
        spec: GpuSpec,
        /// What the runtime or driver said.
        reason: String,
    },
    /// The driver panicked while the device was being opened (contained).
    #[error("cannot open GPU device {spec}: the driver panicked: {message}")]
    Panicked {
        /// The device asked for.
        spec: GpuSpec,
        /// The panic's message.
        message: String,
    },
}

#[cfg(feature = "wgpu")]
/// Opens the device `spec` names: finds the adapter, creates the device and registers it with
/// the runtime, or says why not. A spec opened before in this process is the same device again
/// (the runtime keeps one registration per adapter selector); a failure is not remembered, so a
/// device that was busy can be opened by a later try.
pub fn open(spec: GpuSpec) -> Result<OpenedGpu, GpuError> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static OPENED: OnceLock<Mutex<HashMap<GpuSpec, OpenedGpu>>> = OnceLock::new();
    let opened = OPENED.get_or_init(Default::default);
    let mut opened = opened.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(gpu) = opened.get(&spec) {
        return Ok(gpu.clone());
    }
    let gpu = open_once(spec)?;
    opened.insert(spec, gpu.clone());
    Ok(gpu)
}

#[cfg(feature = "wgpu")]
fn open_once(spec: GpuSpec) -> Result<OpenedGpu, GpuError> {
    use burn_cubecl::cubecl::device::WgpuDeviceKind;
    use burn_wgpu::graphics::{AutoGraphicsApi, OpenGl, Vulkan};
    use burn_wgpu::{RuntimeOptions, WgpuBackend, WgpuDevice, WgpuInitError, try_init_setup};
    let kind = match spec.adapter {
        Adapter::Default => WgpuDeviceKind::DefaultDevice,
        Adapter::Discrete(n) => WgpuDeviceKind::DiscreteGpu(n),
        Adapter::Integrated(n) => WgpuDeviceKind::IntegratedGpu(n),
        Adapter::Virtual(n) => WgpuDeviceKind::VirtualGpu(n),
        Adapter::Software => WgpuDeviceKind::Cpu,
        Adapter::Other(n) => WgpuDeviceKind::Other(n),
    };
    let backend = match spec.api {
        GraphicsApi::Auto => WgpuBackend::Auto,
        GraphicsApi::Vulkan => WgpuBackend::Vulkan,
        GraphicsApi::Gl => WgpuBackend::Gl,
    };
    let device = WgpuDevice::new(kind).on(backend);
    let selector = device.clone();
    // The driver may panic rather than fail (a loader that is missing pieces): contained too.
    let setup = ferry_proto::contained(move || {
        let options = RuntimeOptions::try_default()?;
        match spec.api {
            GraphicsApi::Auto => try_init_setup::<AutoGraphicsApi>(&selector, options),
            GraphicsApi::Vulkan => try_init_setup::<Vulkan>(&selector, options),
            GraphicsApi::Gl => try_init_setup::<OpenGl>(&selector, options),
        }
    })
    .map_err(|panic| GpuError::Panicked {
        spec,
        message: panic.message,
    })?;
    let adapter = match setup {
        Ok(setup) => {
            let info = setup.adapter.get_info();
            format!(
                "{} ({:?}, {:?}, driver {} {})",
                info.name, info.backend, info.device_type, info.driver, info.driver_info
            )
        }
        // The application embedding this node opened the same device first (Burn registers a
        // device on first use): it is there to use, on whatever adapter it landed.
        Err(WgpuInitError::Registration { .. }) => {
            "an adapter the embedding application opened first".to_string()
        }
        Err(e) => {
            return Err(GpuError::Unavailable {
                spec,
                reason: e.to_string(),
            });
        }
    };
    let device: burn_cubecl::CubeDevice = device.into();
    let client_of = device.clone();
    let largest_buffer =
        ferry_proto::contained(move || client_of.client().properties().memory.max_page_size)
            .map_err(|panic| GpuError::Panicked {
                spec,
                message: panic.message,
            })?;
    Ok(OpenedGpu {
        device,
        adapter,
        largest_buffer,
    })
}

#[cfg(feature = "wgpu")]
/// Whether a tensor of this runtime (`None` for another backend's) was allocated and written:
/// cubecl keeps a failed allocation or write on the buffer and reports it at the first read,
/// so this is that read's check without the read.
///
/// `None` for any other type: [`Backend`] must stay burn-cubecl's own tensor (no `fusion`
/// feature, which would wrap it), or this check would silently pass; the test
/// `a_buffer_the_adapter_could_not_allocate_is_caught_before_any_read` fails if it does.
pub fn confirm_written(tensor: &dyn std::any::Any) -> Option<Result<(), String>> {
    let tensor = tensor.downcast_ref::<burn_cubecl::tensor::CubeTensor>()?;
    let checked = burn_backend::read_sync(tensor.client.sync_buffers([&tensor.handle]));
    // cubecl's message is a chain over many lines ("Caused by:", then a backtrace after
    // "Asked at:"): the causes alone, on one line, say what failed.
    Some(checked.map_err(|e| {
        let text = e.to_string();
        let causes: Vec<&str> = text
            .lines()
            .map(str::trim)
            .take_while(|l| !l.starts_with("Asked at"))
            .filter(|l| !l.is_empty() && *l != "Caused by:" && !l.contains("backtrace"))
            .take(8)
            .collect();
        causes.join(": ")
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_print_back() {
        for s in [
            "wgpu:default",
            "wgpu:0",
            "vulkan:cpu",
            "gl:cpu",
            "gl:other:1",
            "vulkan:igpu:2",
            "wgpu:vgpu:0",
        ] {
            let spec: GpuSpec = s.parse().unwrap();
            assert_eq!(spec.to_string(), s);
        }
        assert_eq!(
            "wgpu".parse::<GpuSpec>().unwrap(),
            GpuSpec {
                api: GraphicsApi::Auto,
                adapter: Adapter::Default
            }
        );
        for bad in ["wgpu:x", "gl:igpu", "vulkan:cpu:1", "wgpu:99999", "wgpu:-1"] {
            assert!(bad.parse::<GpuSpec>().is_err(), "{bad}");
        }
        assert!(GpuSpec::parse("flex").is_none());
    }
    /// cubecl accepts a tensor over the adapter's largest buffer and fails only when it is
    /// read: `confirm_written` is that failure before anything is acknowledged.
    #[cfg(feature = "wgpu")]
    #[test]
    fn a_buffer_the_adapter_could_not_allocate_is_caught_before_any_read() {
        use crate::backend::Primitive;
        use burn_backend::TensorData;
        let gpu = open("gl:cpu".parse().unwrap()).unwrap();
        let fits = TensorData::new(vec![1.5f32; 1024], [1024]);
        let fits = Primitive::<Backend>::from_data(fits, &gpu.device).unwrap();
        fits.confirm_written().unwrap();
        let elements = usize::try_from(gpu.largest_buffer / 4 + 1).unwrap();
        let over = TensorData::new(vec![1.5f32; elements], [elements]);
        let over = Primitive::<Backend>::from_data(over, &gpu.device).unwrap();
        let caught = over.confirm_written().unwrap_err().to_string();
        assert!(caught.contains("did not take"), "{caught}");
        assert!(
            caught.contains("can't allocate buffer"),
            "says why: {caught}"
        );
        assert!(!caught.contains('\n'), "one line: {caught}");
    }
}
