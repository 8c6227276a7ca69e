//! Starting a device's worker: opening the device, measuring what it holds bit-exact, and the
//! thread and handle of the worker.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use burn_backend::Backend;
use ferry_backend::{BackendKind, DeviceSpec};
use tokio::sync::mpsc;

use super::Worker;
use crate::device::verify::spawn_verifier;
use crate::device::{Budget, DeviceHandle, DeviceLimits};

/// How many commands may wait for one worker before senders wait too.
const QUEUE_DEPTH: usize = 256;

/// Starts the worker thread for one device.
pub(crate) fn spawn(
    index: u32,
    spec: DeviceSpec,
    limits: DeviceLimits,
) -> std::io::Result<(DeviceHandle, std::thread::JoinHandle<()>)> {
    let cpu = |kind: BackendKind| {
        let label = format!("{kind}:Cpu");
        let holds = kind
            .measured_holds()
            .ok_or_else(|| std::io::Error::other(format!("{kind} is not a CPU backend")))?;
        Ok::<_, std::io::Error>((label, holds))
    };
    match spec {
        DeviceSpec::Flex => {
            let (label, holds) = cpu(BackendKind::Flex)?;
            let at = Opened::new(index, spec, label, holds, None);
            spawn_on::<burn_flex::Flex>(at, Default::default(), limits)
        }
        // Deprecated upstream in favour of Flex, but still what many deployments run, and the
        // second CPU backend that keeps the cross-backend paths honest.
        #[allow(deprecated)]
        DeviceSpec::NdArray => {
            let (label, holds) = cpu(BackendKind::NdArray)?;
            let at = Opened::new(index, spec, label, holds, None);
            spawn_on::<burn_ndarray::NdArray>(at, Default::default(), limits)
        }
        DeviceSpec::Wgpu(gpu) => spawn_gpu(index, spec, gpu, limits),
    }
}

/// Opens a GPU device, measures what it holds (once per adapter in a process) and starts its
/// worker.
#[cfg(feature = "wgpu")]
fn spawn_gpu(
    index: u32,
    spec: DeviceSpec,
    gpu: crate::gpu::GpuSpec,
    limits: DeviceLimits,
) -> std::io::Result<(DeviceHandle, std::thread::JoinHandle<()>)> {
    let opened = crate::gpu::open(gpu).map_err(std::io::Error::other)?;
    let device = opened.device.clone();
    let holds = crate::holds::HoldsTable::cached(&format!("wgpu {}", opened.adapter), || {
        crate::holds::HoldsTable::measure::<crate::gpu::Backend>(&device)
    });
    let label = format!("{gpu} on {}", opened.adapter);
    let at = Opened::new(index, spec, label, holds, Some(opened.largest_buffer));
    spawn_on::<crate::gpu::Backend>(at, opened.device, limits)
}

#[cfg(not(feature = "wgpu"))]
fn spawn_gpu(
    _index: u32,
    _spec: DeviceSpec,
    gpu: crate::gpu::GpuSpec,
    _limits: DeviceLimits,
) -> std::io::Result<(DeviceHandle, std::thread::JoinHandle<()>)> {
    Err(std::io::Error::other(format!(
        "device {gpu}: this build of ferry-server has no GPU runtime: build it with its `wgpu` \
         feature (`cargo build --release --bin ferry-server --features ferry-server-cli/wgpu`)"
    )))
}

/// A device about to get its worker: where it sits, what it is, and what it measured.
struct Opened {
    index: u32,
    kind: BackendKind,
    label: String,
    holds: Arc<crate::holds::HoldsTable>,
    /// The most bytes one tensor may take on it (a GPU adapter's largest buffer); none for host
    /// memory, which the budget bounds.
    largest_tensor: Option<u64>,
}

impl Opened {
    fn new(
        index: u32,
        spec: DeviceSpec,
        label: String,
        holds: Arc<crate::holds::HoldsTable>,
        largest_tensor: Option<u64>,
    ) -> Opened {
        let (probed, exact) = holds.counts();
        tracing::info!(
            device = index,
            spec = %spec,
            label,
            probed,
            exact,
            probe_ms = holds.took().as_millis() as u64,
            largest_tensor,
            "device measured what it holds bit-exact"
        );
        Opened {
            index,
            kind: spec.kind(),
            label,
            holds,
            largest_tensor,
        }
    }
}

fn spawn_on<B: Backend>(
    at: Opened,
    device: B::Device,
    limits: DeviceLimits,
) -> std::io::Result<(DeviceHandle, std::thread::JoinHandle<()>)> {
    let Opened {
        index,
        kind,
        label,
        holds,
        largest_tensor,
    } = at;
    let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
    let hash_mismatches = Arc::new(AtomicU64::new(0));
    let changes = Arc::new(AtomicU64::new(0));
    let verifier = spawn_verifier(index, tx.downgrade())?;
    let budget = Arc::new(Budget::new(index, limits));
    let worker = Worker::<B> {
        index,
        kind,
        device,
        tensors: BTreeMap::new(),
        by_hash: HashMap::new(),
        verifier,
        next_version: 0,
        hash_mismatches: hash_mismatches.clone(),
        changes: changes.clone(),
        budget: budget.clone(),
        held_bytes: 0,
    };
    let thread = std::thread::Builder::new()
        .name(format!("ferry-device-{index}"))
        .spawn(move || worker.run(rx))?;
    let handle = DeviceHandle {
        index,
        kind,
        backend: std::any::TypeId::of::<B>(),
        label,
        tx,
        budget,
        hash_mismatches,
        changes,
        holds,
        largest_tensor,
    };
    Ok((handle, thread))
}
