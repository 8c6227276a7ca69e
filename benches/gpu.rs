//! Put and get of 256 MiB (f32 and Q8S) to a GPU device, against Burn's own `from_data` and
//! `into_data` on the same adapter in the same run. An adapter whose largest buffer is smaller
//! (Mesa's software adapters: 128 MiB) is measured at the most whole MiB it takes.
//!
//! Run with `cargo build --release --workspace --bins && cargo bench -p ferry-suite --bench gpu`;
//! `FERRY_GPU=SPEC` names the device (default `vulkan:cpu`, Mesa's lavapipe; on a machine with a
//! GPU, `wgpu:0` or `vulkan:0`). `tests/gpu.sh` runs it with the rest of the GPU checks.
//!
//! One release node hosts the device (device 1, beside a flex device 0). Each timed run:
//! - `ferry put`: `Client::put` of the tensor to device 1 over loopback TCP, to the node's
//!   answer (the node received the payload, checked it, and `from_data` registered it);
//! - `ferry get`: `Client::get` of it back (`into_data` on the device, sent from that buffer);
//! - `burn from_data`: `from_data` on the same device in this process, then `sync` (the bytes
//!   are on the device);
//! - `burn into_data`: `into_data` of that tensor (read back to host memory).
//!
//! Goal: ferry's put and get each <= 1.1x Burn's own call (medians), with the node's peak extra
//! memory printed (VmHWM over the held memory before each run).
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};

use burn_backend::Backend;
use burn_std::TensorData;
use ferry_client::{Client, TensorKey};
use ferry_server::Primitive;
use ferry_server::gpu::GpuSpec;
use support::{
    MIB, Memory, NodeProcess, Rate, f32_tensor, q8s_tensor, raw_tcp_once, server_binary,
};

const RUNS: usize = 5;
const GOAL: f64 = 1.1;

type Gpu = ferry_server::gpu::Backend;

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("gpu: not run outside `cargo bench`");
        return;
    }
    let spec = std::env::var("FERRY_GPU").unwrap_or_else(|_| "vulkan:cpu".into());
    let gpu: GpuSpec = spec.parse().expect("FERRY_GPU names a GPU device");
    let opened = ferry_server::gpu::open(gpu).expect("the GPU device opens in this process");
    println!("{spec}: {}", opened.adapter);
    let binary = server_binary();
    let node = NodeProcess::start(&binary, "bench-gpu", &["--device", &spec]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut client = runtime
        .block_on(Client::connect(node.addr.as_str()).open())
        .expect("connect");
    // 256 MiB where the adapter takes a buffer that large; else the most whole MiB below its
    // largest buffer that leaves room for the Q8S scale (Mesa's software adapters: 128 MiB, so
    // 127). ferry refuses a larger tensor; Burn's own calls would fail at the read.
    let largest = usize::try_from(opened.largest_buffer).unwrap_or(usize::MAX);
    let mib = (largest.saturating_sub(4096) / MIB).min(256);
    assert!(mib > 0, "the adapter's largest buffer is {largest} bytes");
    println!("largest buffer {largest} bytes: measuring {mib} MiB tensors");
    let cases: [(String, Box<dyn Fn() -> TensorData>); 2] = [
        (
            format!("f32 {mib} MiB"),
            Box::new(move || f32_tensor(mib * MIB)),
        ),
        (
            format!("Q8S {mib} MiB"),
            Box::new(move || q8s_tensor(mib * MIB)),
        ),
    ];
    let mut goals = Vec::new();
    for (label, make) in cases {
        let data = make();
        let bytes = data.as_bytes().len();
        println!("{label} ({bytes} payload bytes), {RUNS} runs");

        // Burn's own calls on the same adapter, in this process.
        let mut from = Vec::new();
        let mut into = Vec::new();
        for _ in 0..=RUNS {
            let input = data.clone();
            let started = Instant::now();
            let tensor = Primitive::<Gpu>::from_data(input, &opened.device).unwrap();
            Gpu::sync(&opened.device).unwrap();
            from.push(started.elapsed());
            let started = Instant::now();
            let back = tensor.to_data().unwrap();
            into.push(started.elapsed());
            assert!(back.as_bytes() == data.as_bytes(), "Burn's own round trip");
        }
        // The first run of each warms the device's memory pools; it is not counted.
        let burn_from = Rate::of(bytes, &mut from[1..]);
        let burn_into = Rate::of(bytes, &mut into[1..]);
        // The wire alone: the same bytes over one loopback TCP stream into fresh memory. A put
        // cannot call `from_data` before the last byte arrives (Burn takes a whole buffer), nor
        // send before `into_data` returns, so wire + Burn's call is the floor for either.
        let mut tcp: Vec<Duration> = (0..RUNS)
            .map(|_| {
                let mut into = vec![0u8; bytes];
                raw_tcp_once(data.as_bytes(), &mut into)
            })
            .collect();
        let tcp = Rate::of(bytes, &mut tcp);

        let mut put = Vec::new();
        let mut get = Vec::new();
        let mut memory = Memory::of(&node);
        let key = TensorKey::new(1, "bench.w");
        for run in 0..=RUNS {
            node.reset_peak();
            let held = node.rss();
            let started = Instant::now();
            runtime
                .block_on(
                    client
                        .put(&TensorKey::new(1, "bench.w"), &data)
                        .into_future(),
                )
                .expect("put to the GPU device");
            let put_took = started.elapsed();
            let started = Instant::now();
            let back = runtime.block_on(client.get(&key)).expect("get");
            let get_took = started.elapsed();
            assert!(
                back.as_bytes() == data.as_bytes(),
                "bytes after put and get"
            );
            assert_eq!(back.dtype(), data.dtype());
            drop(back);
            runtime.block_on(client.delete(&key)).unwrap();
            memory.saw(held, node.peak());
            if run > 0 {
                put.push(put_took);
                get.push(get_took);
            }
        }
        let put = Rate::of(bytes, &mut put);
        let get = Rate::of(bytes, &mut get);
        let ratio = |ferry: &Rate, burn: &Rate| ratio_of(ferry.median_time, burn.median_time);
        println!("  {:<16} {burn_from}", "burn from_data");
        println!("  {:<16} {burn_into}", "burn into_data");
        println!("  {:<16} {tcp}", "raw tcp");
        let floor = |burn: &Rate| burn.median_time + tcp.median_time;
        let (put_x, get_x) = (ratio(&put, &burn_from), ratio(&get, &burn_into));
        println!(
            "  {:<16} {put}   {put_x:.2}x burn's from_data time, {:.2}x raw tcp + from_data",
            "ferry put",
            ratio_of(put.median_time, floor(&burn_from))
        );
        println!(
            "  {:<16} {get}   {get_x:.2}x burn's into_data time, {:.2}x into_data + raw tcp",
            "ferry get",
            ratio_of(get.median_time, floor(&burn_into))
        );
        println!("{}", memory.report("node", bytes).0);
        goals.push((label.clone(), "put", put_x));
        goals.push((label, "get", get_x));
    }
    println!("goals (time as a multiple of Burn's own call, <= {GOAL}):");
    for (label, op, x) in goals {
        let verdict = if x <= GOAL { "<=" } else { "> (MISSED)" };
        println!("  {label:<12} {op}  {x:.2}x {verdict} {GOAL}");
    }
}

fn ratio_of(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}
