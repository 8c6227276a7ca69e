//! A whole model through `FerryStore` over TCP to a `ferry-server` process, against a raw TCP copy
//! of the same bytes in the same run: `collect_from` (read off the device, sent, held by the node)
//! with three windows of host copies and over two lanes, to a node just started and then five
//! times more replacing the version before, then once to a node started 10 s before (whose
//! pool made its start amount ready meanwhile), and `apply_to` (fetched and applied), with
//! this process's resident size before and its peak (VmHWM) during each (growth only: memory freed
//! earlier but kept by the allocator is reused without growing it). burn-store's own
//! `BurnpackStore` into memory is timed too, as Burn's own way to serialize the same model.
//!
//! The model: 64 linear layers of 1024 x 1024 f32 (256 MiB), and the same with its weights
//! quantized Q8S per tensor (64 MiB of values).
//!
//! Run with `cargo build --release --workspace --bins`, then
//! `cargo bench -p ferry-suite --bench model_store`.
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};

use burn_core as burn;
use burn_core::module::{Module, Quantizer};
use burn_core::tensor::Device;
use burn_core::tensor::quantization::{Calibration, QuantScheme, QuantStore, QuantValue};
use burn_nn::{Linear, LinearConfig};
use burn_store::{BurnpackStore, ModuleSnapshot, ModuleStore};
use ferry_burn::FerryStore;
use ferry_client::{BlockingClient, IfExists, Wait};
use support::{NodeProcess, mib, own_status, raw_tcp_once, server_binary};

/// Layers of one size, as a model's blocks are.
#[derive(Module, Debug)]
struct Stack {
    layers: Vec<Linear>,
}

/// Runs `work`, returning its time and this process's peak resident size over it (VmHWM,
/// reset to the resident size first), minus the resident size before.
fn measured<T>(work: impl FnOnce() -> T) -> (T, Duration, u64) {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let before = own_status("VmRSS");
    let started = Instant::now();
    let out = work();
    let took = started.elapsed();
    (out, took, own_status("VmHWM").saturating_sub(before))
}

fn gbps(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / took.as_secs_f64() / 1e9
}

fn main() {
    let binary = server_binary();
    let device = Device::flex();
    let f32_model = Stack {
        layers: (0..64)
            .map(|_| LinearConfig::new(1024, 1024).init(&device))
            .collect(),
    };
    let q8s = QuantScheme::default()
        .with_value(QuantValue::Q8S)
        .with_store(QuantStore::Native);
    let q8s_model = f32_model
        .clone()
        .quantize_weights(&mut Quantizer::new(Calibration::MinMax, q8s));

    for (label, model) in [("f32", &f32_model), ("Q8S", &q8s_model)] {
        let bytes: u64 = model
            .collect(None, None, false)
            .iter()
            .map(|t| t.byte_len() as u64)
            .sum();
        let tensors = model.num_params();
        let src = vec![1u8; bytes as usize];
        let mut dst = vec![0u8; bytes as usize];
        let raw = (0..3).map(|_| raw_tcp_once(&src, &mut dst)).min().unwrap();
        // Into new memory each time, as a node that just started receives.
        let fresh = (0..3)
            .map(|_| raw_tcp_once(&src, &mut vec![0u8; bytes as usize]))
            .min()
            .unwrap();
        drop((src, dst));
        println!(
            "{label} model, {} in {} layers ({tensors} values): raw TCP {:.2} GB/s, into fresh \
             memory {:.2} GB/s",
            mib(bytes),
            model.layers.len(),
            gbps(bytes, raw),
            gbps(bytes, fresh)
        );

        let (_, took, peak) = measured(|| {
            let mut pack = BurnpackStore::from_bytes(None);
            pack.collect_from(model).unwrap();
            pack
        });
        println!(
            "  BurnpackStore into memory: {:.0} ms ({:.2} GB/s), peak +{}",
            took.as_secs_f64() * 1e3,
            gbps(bytes, took),
            mib(peak)
        );

        // Windows of host copies (each lane's), over one connection and over two lanes.
        for (window, lanes) in [(8 << 20, 1), (32 << 20, 1), (256 << 20, 1), (32 << 20, 2)] {
            // A fresh node each time: what a model meets on a worker that just started.
            let node = NodeProcess::start(&binary, "model-store-bench", &[]);
            let connect = || {
                BlockingClient::connect(node.addr.as_str())
                    .blocking()
                    .unwrap()
            };
            let mut store = FerryStore::connected(connect(), 0, "m")
                .window(window)
                .with_lanes((1..lanes).map(|_| connect()).collect())
                .unwrap();
            let ((), took, peak) = measured(|| store.collect_from(model).unwrap());
            println!(
                "  collect_from, window {}, {lanes} lane(s): {:.0} ms, {:.2} GB/s = {:.2}x raw \
                 TCP ({:.2}x into fresh memory); resident here +{} at peak, node resident {} \
                 (peak {})",
                mib(window),
                took.as_secs_f64() * 1e3,
                gbps(bytes, took),
                raw.as_secs_f64() / took.as_secs_f64(),
                fresh.as_secs_f64() / took.as_secs_f64(),
                mib(peak),
                mib(node.rss()),
                mib(node.peak()),
            );
            // The same collect five times more, each replacing the version before: into
            // memory the node had before, as a worker that already holds a model receives.
            let mut replacing = FerryStore::connected(connect(), 0, "m")
                .window(window)
                .if_exists(IfExists::Replace)
                .with_lanes((1..lanes).map(|_| connect()).collect())
                .unwrap();
            let mut again: Vec<Duration> = (0..5)
                .map(|_| measured(|| replacing.collect_from(model).unwrap()).1)
                .collect();
            again.sort();
            println!(
                "  collect_from again, replacing, median of 5: {:.0} ms = {:.2}x raw TCP",
                again[2].as_secs_f64() * 1e3,
                raw.as_secs_f64() / again[2].as_secs_f64(),
            );
            let mut target = Stack {
                layers: (0..64)
                    .map(|_| LinearConfig::new(1024, 1024).init(&device))
                    .collect(),
            };
            let (result, took, peak) = measured(|| store.apply_to(&mut target).unwrap());
            assert_eq!(result.applied.len(), 128);
            // The same apply again, five times: its spread on a machine shared with the node.
            let mut again: Vec<Duration> = (0..5)
                .map(|_| measured(|| store.apply_to(&mut target).unwrap()).1)
                .collect();
            again.sort();
            println!(
                "  apply_to: {:.0} ms, {:.2} GB/s = {:.2}x raw TCP; resident here +{} at peak \
                 (the model's new {} included, in memory freed before where there was some); \
                 again, median of 5: {:.0} ms = {:.2}x",
                took.as_secs_f64() * 1e3,
                gbps(bytes, took),
                raw.as_secs_f64() / took.as_secs_f64(),
                mib(peak),
                mib(bytes),
                again[2].as_secs_f64() * 1e3,
                raw.as_secs_f64() / again[2].as_secs_f64(),
            );
        }

        // A worker started a while before its model is sent, as a deployment starts its
        // workers and then ships them the model: a node started 10 s before, with the default
        // window over one connection, the first time.
        let node = NodeProcess::start(&binary, "model-store-bench", &[]);
        std::thread::sleep(Duration::from_secs(10));
        let client = BlockingClient::connect(node.addr.as_str())
            .blocking()
            .unwrap();
        let ready = node.rss();
        let mut store = FerryStore::connected(client, 0, "m");
        let ((), took, peak) = measured(|| store.collect_from(model).unwrap());
        let mut client = BlockingClient::connect(node.addr.as_str())
            .blocking()
            .unwrap();
        let misses = client.stat().wait().unwrap().pool_misses;
        println!(
            "  collect_from to a node started 10 s before (resident {} before it, its pool's \
             ready memory; {misses} receive(s) the pool missed), default window, 1 lane: {:.0} \
             ms, {:.2} GB/s = {:.2}x raw TCP; resident here +{} at peak, node peak {}",
            mib(ready),
            took.as_secs_f64() * 1e3,
            gbps(bytes, took),
            raw.as_secs_f64() / took.as_secs_f64(),
            mib(peak),
            mib(node.peak()),
        );
    }
}
