//! A model landing on freshly started workers: a model-shaped file put from disk to a node
//! started with default flags 10 s before, then copied whole to a second such node, against a
//! raw TCP copy of the same total bytes in the same run, with both nodes' peak resident memory
//! and CPU.
//!
//! Run with
//! `cargo build --release --workspace --bins && cargo bench -p ferry-suite --bench model_load`
//! (the release `ferry-server` and `ferry` binaries beside this bench's executable).
//!
//! The models: 168 tensors of 8 to 23 MiB (the sizes of a 1B-parameter transformer's layers),
//! 2.3 GiB in all, once as bf16 in a `.safetensors` file and once as Q8S (one f32 scale per
//! tensor) in a `.bpk` file; each file is written, then read once so that it sits in the page
//! cache (a model loaded twice in a row, or from a fast disk). For each model:
//! - `put`: `ferry put FILE A/0`, A a `ferry-server` with one flex device and no other flag,
//!   started 10 s before; timed from spawn to exit of the CLI;
//! - `copy`: `ferry cp A/0 B/0`, B started like A 10 s before, the whole device at once;
//! - `raw TCP`: the model's total bytes over one loopback TCP connection into a buffer touched
//!   before (the ceiling), and into fresh memory (what a process that just started pays: each
//!   run after a pause as long as the nodes' warm-up), best of three each; every command's
//!   ratio to both is printed;
//! - each node's peak resident memory (VmHWM) and the CPU it spent on the command;
//! - the same, for comparison, with nodes that keep the whole model's size ready
//!   (`--pool-ready 2600MiB`), with nodes that keep only the idle amount ready and make none
//!   ready at start for a model (`--pool-ready 256MiB`), and with nodes that make none ready
//!   (`--pool 0`).
//!
//! Goal (issue 30): put and copy each >= 0.7x raw TCP.
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};

use burn_std::quantization::{QuantScheme, QuantStore, QuantValue};
use burn_std::{DType, TensorData};
use support::{MIB, NodeProcess, cli_binary, mib, raw_tcp_once, server_binary, timed};

/// How long a node runs before the command reaches it, as a worker waits for its model.
const WARM_UP: Duration = Duration::from_secs(10);

/// The tensors' sizes in MiB: 24 layers of 7 tensors (attention 4 x 8 MiB, MLP 3 x 22 MiB),
/// 168 tensors, 2.3 GiB.
fn sizes() -> Vec<usize> {
    (0..24)
        .flat_map(|_| [8, 8, 8, 8, 22, 22, 23])
        .map(|m| m * MIB)
        .collect()
}

/// The model as `kind` (`bf16` or `q8s`): its tensors, named as a transformer's.
fn model(kind: &str) -> Vec<(String, TensorData)> {
    sizes()
        .into_iter()
        .enumerate()
        .map(|(i, bytes)| {
            let name = format!("layers.{}.w{}", i / 7, i % 7);
            // Not a constant, so that nothing on the way could get away with less work.
            let value = |b: usize| (b.wrapping_mul(31) ^ i) as u8;
            let data = match kind {
                "bf16" => {
                    let values = (0..bytes).map(value).collect();
                    TensorData::from_bytes_vec(values, [bytes / 2048, 1024], DType::BF16)
                }
                _ => {
                    let scheme = QuantScheme::default()
                        .with_value(QuantValue::Q8S)
                        .with_store(QuantStore::Native);
                    let values: Vec<i8> = (0..bytes).map(|b| value(b) as i8).collect();
                    TensorData::quantized(values, [bytes / 4096, 4096], scheme, &[0.0125], None)
                }
            };
            (name, data)
        })
        .collect()
}

/// Raw TCP of the model's bytes in this run: into touched memory (the ceiling), and into fresh
/// memory (what any receiver that just started pays for memory it never had).
#[derive(Clone, Copy)]
struct RawTcp {
    touched: Duration,
    fresh: Duration,
}

/// One line: a command's rate, its ratios to raw TCP, and each node's memory and CPU.
fn line(what: &str, bytes: usize, took: Duration, raw: RawTcp, nodes: &[(&str, u64, Duration)]) {
    let rate = bytes as f64 / took.as_secs_f64() / 1e9;
    let ratio = raw.touched.as_secs_f64() / took.as_secs_f64();
    let to_fresh = raw.fresh.as_secs_f64() / took.as_secs_f64();
    let nodes: Vec<String> = nodes
        .iter()
        .map(|(who, peak, cpu)| {
            format!("{who}: peak {}, CPU {:.2} s", mib(*peak), cpu.as_secs_f64())
        })
        .collect();
    println!(
        "  {what:<6} {:>6.2} s  {rate:.2} GB/s  {ratio:.2}x raw TCP (goal 0.7x: {}), \
         {to_fresh:.2}x raw TCP into fresh memory  {}",
        took.as_secs_f64(),
        if ratio >= 0.7 { "met" } else { "MISSED" },
        nodes.join("; ")
    );
}

fn main() {
    // `cargo test --benches` builds (and may run) bench targets: a run here writes 4.6 GiB.
    if !std::env::args().any(|a| a == "--bench") {
        println!("model_load: not run outside `cargo bench`");
        return;
    }
    let server = server_binary();
    let cli = cli_binary();
    let dir = tempfile::tempdir().unwrap();
    for (kind, extension) in [("bf16", "safetensors"), ("q8s", "bpk")] {
        let file = dir.path().join(format!("model.{extension}"));
        let tensors = model(kind);
        let bytes: usize = tensors.iter().map(|(_, t)| t.as_bytes().len()).sum();
        ferry_files::write_tensors(&file, &tensors).unwrap();
        drop(tensors);
        // Into the page cache: the put measures the node, not the disk.
        let on_disk = std::io::copy(
            &mut std::fs::File::open(&file).unwrap(),
            &mut std::io::sink(),
        )
        .unwrap();

        // The ceiling, in this run: the same bytes over loopback TCP.
        let src = vec![7u8; bytes];
        let mut touched = vec![0u8; bytes];
        raw_tcp_once(&src, &mut touched);
        let raw = (0..3)
            .map(|_| raw_tcp_once(&src, &mut touched))
            .min()
            .unwrap();
        drop(touched);
        // Best of three as well, each into memory never touched before, after as long a pause
        // as the nodes get: memory freed a moment before is cheap to touch again, and on a VM
        // whose freed memory goes back to its host (measured here: within 5 s), memory a
        // process gets after a pause costs what a freshly started node pays.
        let fresh = (0..3)
            .map(|_| {
                std::thread::sleep(WARM_UP);
                raw_tcp_once(&src, &mut vec![0u8; bytes])
            })
            .min()
            .unwrap();
        let raw = RawTcp {
            touched: raw,
            fresh,
        };
        drop(src);
        println!(
            "model_load: {kind}, {} tensors, {} of tensor bytes ({} on disk); raw TCP {:.2} GB/s \
             into touched memory, {:.2} GB/s into fresh memory",
            sizes().len(),
            mib(bytes as u64),
            mib(on_disk as u64),
            bytes as f64 / raw.touched.as_secs_f64() / 1e9,
            bytes as f64 / raw.fresh.as_secs_f64() / 1e9,
        );

        // A pair of nodes at a time, each pair run 10 s before its commands: no receive pool
        // (`--pool 0`: every tensor into new memory), for comparison; only the idle amount kept
        // ready, none made ready at start for a model (`--pool-ready 256MiB`); default flags;
        // and the whole model's size kept ready (`--pool-ready 2600MiB`).
        let setups: [(&str, &[&str]); 4] = [
            ("--pool 0", &["--pool", "0"]),
            ("--pool-ready 256MiB", &["--pool-ready", "256MiB"]),
            ("default", &[]),
            ("--pool-ready 2600MiB", &["--pool-ready", "2600MiB"]),
        ];
        for (label, extra) in setups {
            let started = Instant::now();
            let a = NodeProcess::start(&server, &format!("{kind}-a"), extra);
            let b = NodeProcess::start(&server, &format!("{kind}-b"), extra);
            std::thread::sleep(WARM_UP.saturating_sub(started.elapsed()));
            println!(
                "  {label}: resident after {} s idle: A {}, B {}",
                WARM_UP.as_secs(),
                mib(a.rss()),
                mib(b.rss())
            );
            let a_cpu = a.cpu();
            let put = timed(
                &cli,
                &["put", file.to_str().unwrap(), &format!("{}/0", a.addr)],
            );
            line("put", bytes, put, raw, &[("A", a.peak(), a.cpu() - a_cpu)]);
            let (a_cpu, b_cpu) = (a.cpu(), b.cpu());
            let copy = timed(
                &cli,
                &["cp", &format!("{}/0", a.addr), &format!("{}/0", b.addr)],
            );
            line(
                "copy",
                bytes,
                copy,
                raw,
                &[
                    ("A", a.peak(), a.cpu() - a_cpu),
                    ("B", b.peak(), b.cpu() - b_cpu),
                ],
            );
        }
        std::fs::remove_file(&file).unwrap();
    }
}
