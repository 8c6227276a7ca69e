//! A model through `FerryStore::collect_from` into a worker that embeds a node built with the
//! defaults (`client/burn/examples/worker.rs`: `Server::builder()`, one Flex device) and into a
//! `ferry-server` with one Flex device and no other flag, both started the same time before, in
//! one run, against raw TCP landing into warm memory of the model's size, measured in the same
//! run. The goal: the worker's rate at least 0.9x the binary's.
//!
//! The models: 84 linear layers (168 tensors), bf16 2560 x 2560 (1.10 GB), and Q8S per tensor
//! 3584 x 3584 (1.08 GB of values, f32 biases).
//!
//! Run with `cargo build --release -p ferry-server-cli && cargo build --release -p ferry-burn
//! --examples`, then `cargo bench -p ferry-suite --bench embedded_worker`.
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use burn_core as burn;
use burn_core::module::{Module, ModuleMapper, Param, Quantizer};
use burn_core::tensor::quantization::{Calibration, QuantScheme, QuantStore, QuantValue};
use burn_core::tensor::{Device, FloatDType, Tensor};
use burn_nn::{Linear, LinearConfig};
use burn_store::{ModuleSnapshot, ModuleStore};
use ferry_burn::FerryStore;
use ferry_client::BlockingClient;
use support::{NodeProcess, mib, own_status, raw_tcp_once, server_binary};

/// Layers of one size, as a model's blocks are.
#[derive(Module, Debug)]
struct Stack {
    layers: Vec<Linear>,
}

/// Casts every float parameter to bf16.
struct ToBf16;

impl ModuleMapper for ToBf16 {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|t| t.cast(FloatDType::BF16))
    }
}

/// How long a node runs before the model is sent: as a worker waits for its model.
const STARTED_BEFORE: Duration = Duration::from_secs(10);
/// Rounds, each a fresh process of each kind, in alternating order.
const ROUNDS: usize = 5;

/// `target/release/examples/worker`, which `cargo build --release -p ferry-burn --examples`
/// makes.
fn worker_binary() -> PathBuf {
    let server = server_binary();
    let binary = server.with_file_name("examples").join("worker");
    if !binary.is_file() {
        eprintln!(
            "embedded_worker: {} is missing: run `cargo build --release -p ferry-burn --examples` \
             first",
            binary.display()
        );
        std::process::exit(2);
    }
    binary
}

fn gbps(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / took.as_secs_f64() / 1e9
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let server = server_binary();
    let worker = worker_binary();
    let device = Device::flex();
    let layers = |n: usize| Stack {
        layers: (0..84)
            .map(|_| LinearConfig::new(n, n).init(&device))
            .collect(),
    };
    let bf16 = layers(2560).map(&mut ToBf16);
    let q8s = QuantScheme::default()
        .with_value(QuantValue::Q8S)
        .with_store(QuantStore::Native);
    let q8s_model = layers(3584).quantize_weights(&mut Quantizer::new(Calibration::MinMax, q8s));

    for (label, model) in [("bf16", &bf16), ("Q8S", &q8s_model)] {
        let snapshots = model.collect(None, None, false);
        let bytes: u64 = snapshots.iter().map(|t| t.byte_len() as u64).sum();
        let tensors = snapshots.len();
        drop(snapshots);
        let src = vec![1u8; bytes as usize];
        let mut dst = vec![0u8; bytes as usize];
        let raw = (0..3).map(|_| raw_tcp_once(&src, &mut dst)).min().unwrap();
        drop((src, dst));
        println!(
            "{label} model: {tensors} tensors, {}; raw TCP into warm memory {:.2} GB/s",
            mib(bytes),
            gbps(bytes, raw)
        );
        let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        for round in 0..ROUNDS {
            let mut order = [
                (0, "ferry-server", &server),
                (1, "embedded worker", &worker),
            ];
            if round % 2 == 1 {
                order.reverse();
            }
            for (slot, who, binary) in order {
                let node = NodeProcess::start(binary, "embedded-worker-bench", &[]);
                std::thread::sleep(STARTED_BEFORE);
                let client = BlockingClient::connect(node.addr.as_str())
                    .blocking()
                    .unwrap();
                let mut store = FerryStore::connected(client, 0, "m");
                let _ = std::fs::write("/proc/self/clear_refs", "5");
                let before = own_status("VmRSS");
                let started = Instant::now();
                store.collect_from(model).unwrap();
                let took = started.elapsed();
                let rate = gbps(bytes, took);
                rates[slot].push(rate);
                println!(
                    "  round {round}, {who}: {:.0} ms, {rate:.2} GB/s = {:.2}x raw TCP; node peak \
                     resident {}, sender +{} at peak",
                    took.as_secs_f64() * 1e3,
                    raw.as_secs_f64() / took.as_secs_f64(),
                    mib(node.peak()),
                    mib(own_status("VmHWM").saturating_sub(before)),
                );
            }
        }
        let (binary_rate, worker_rate) = (median(&mut rates[0]), median(&mut rates[1]));
        println!(
            "  {label} medians: ferry-server {binary_rate:.2} GB/s ({:.2}x raw TCP), embedded \
             worker {worker_rate:.2} GB/s ({:.2}x raw TCP); worker / binary {:.2} (goal >= 0.9)",
            binary_rate / gbps(bytes, raw),
            worker_rate / gbps(bytes, raw),
            worker_rate / binary_rate
        );
    }
}
