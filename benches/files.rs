//! Files at wire speed: `ferry put` of a 256 MiB `.safetensors` file that sits in the page
//! cache, and `ferry get` of that tensor into a new file, against a raw TCP copy of the same
//! bytes in the same run.
//!
//! Run with `cargo build --release --workspace --bins && cargo bench -p ferry-suite --bench files`
//! (the release `ferry-server` and `ferry` binaries beside this bench's executable).
//!
//! One release node with one flex device and a receive pool sized for the tensor (`--pool`,
//! `--recycle 0`), as the goal asks. Every run is the whole command line, timed from spawn to
//! exit (process start, connection and the node's answer included):
//! - `put`: `ferry put FILE NODE/0 --prefix runN.`; the CLI maps the file and sends each tensor
//!   from the page cache; the node receives into its pool, checks the chunk checksums and the
//!   content hash, and registers it. The tensor is deleted (untimed) after each run, so that the
//!   next one draws from the pool again;
//! - `get`: `ferry get NODE/0/NAME OUT.safetensors` into a file that does not exist yet; the CLI
//!   lays the file out from the listing and receives the payload straight into the file's
//!   mapping. The file is removed (untimed) after each run;
//! - `ferry health`: the same process start and connection with no payload: the fixed cost
//!   inside every run above;
//! - `raw TCP`: the same bytes over one loopback TCP connection into a touched buffer (the
//!   ceiling), and `raw TCP, fresh dst` into new memory each run.
//!
//! Goal: put and get each >= 0.8x raw TCP (medians).
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use ferry_client::{Client, TensorKey};
use support::{MIB, NodeProcess, Rate, cli_binary, f32_tensor, raw_tcp_once, server_binary, timed};

const RUNS: usize = 5;

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("files: not run outside `cargo bench`");
        return;
    }
    let (server, cli) = (server_binary(), cli_binary());
    let bytes = 256 * MIB;
    let data = f32_tensor(bytes);
    let pool = (bytes + 64 * MIB).to_string();
    let node = NodeProcess::start(&server, "bench-files", &["--pool", &pool, "--recycle", "0"]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    let file_arg = file.to_str().unwrap().to_string();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut client = runtime
        .block_on(Client::connect(node.addr.as_str()).open())
        .unwrap();
    runtime
        .block_on(client.put(&TensorKey::new(0, "w"), &data).into_future())
        .unwrap();
    // The file, written by `ferry get` itself and read back once: in the page cache.
    let seed = format!("{}/0/w", node.addr);
    timed(&cli, &["get", &seed, "-o", &file_arg]);
    assert!(std::fs::metadata(&file).unwrap().len() as usize > bytes);
    drop(std::fs::read(&file).unwrap());
    // The pool holds one such tensor: `w` goes while the puts run, and comes back for the gets.
    let w = TensorKey::new(0, "w");
    runtime.block_on(client.delete(&w)).unwrap();

    let mut puts = Vec::with_capacity(RUNS);
    let target = format!("{}/0", node.addr);
    for run in 0..=RUNS {
        let prefix = format!("run{run}.");
        let elapsed = timed(&cli, &["put", &file_arg, &target, "--prefix", &prefix]);
        let key = TensorKey::new(0, format!("{prefix}w"));
        let back = runtime.block_on(client.get(&key)).unwrap();
        assert!(back.as_bytes() == data.as_bytes(), "bytes after the put");
        drop(back);
        runtime.block_on(client.delete(&key)).unwrap();
        // The first run opens everything once; it is not counted.
        if run > 0 {
            puts.push(elapsed);
        }
    }
    runtime
        .block_on(client.put(&TensorKey::new(0, "w"), &data).into_future())
        .unwrap();
    let mut gets = Vec::with_capacity(RUNS);
    for run in 0..=RUNS {
        let out = dir.path().join(format!("out{run}.safetensors"));
        let out_arg = out.to_str().unwrap();
        let elapsed = timed(&cli, &["get", &seed, "-o", out_arg]);
        if run == 0 {
            assert!(std::fs::read(&out).unwrap() == std::fs::read(&file).unwrap());
        } else {
            gets.push(elapsed);
        }
        std::fs::remove_file(&out).unwrap();
    }
    let mut health: Vec<Duration> = (0..RUNS)
        .map(|_| timed(&cli, &["health", &node.addr]))
        .collect();
    let stats = runtime.block_on(client.stat()).unwrap();
    let src = data.as_bytes();
    let mut dst = vec![1u8; bytes];
    let tcp = Rate::measure(bytes, RUNS, || raw_tcp_once(src, &mut dst));
    let tcp_fresh = Rate::measure(bytes, RUNS, || {
        let mut fresh = vec![0u8; bytes];
        raw_tcp_once(src, &mut fresh)
    });
    let put = Rate::of(bytes, &mut puts);
    let get = Rate::of(bytes, &mut gets);
    health.sort();
    println!("files: 256 MiB f32 .safetensors, node with --pool {pool}");
    println!("  ferry put FILE      {put}");
    println!("  ferry get -o FILE   {get}");
    println!("  raw TCP             {tcp}");
    println!("  raw TCP, fresh dst  {tcp_fresh}");
    println!(
        "  ferry health        {:.1} ms (median): process start and connection, in every run above",
        health[RUNS / 2].as_secs_f64() * 1e3
    );
    println!(
        "  node: pool {} MiB, {} misses; peak resident {} MiB",
        stats.pool_bytes / MIB as u64,
        stats.pool_misses,
        stats.peak_resident_bytes / MIB as u64
    );
    let verdict = |r: f64| if r >= 0.8 { ">=" } else { "< (MISSED)" };
    let (put_ratio, get_ratio) = (put.median / tcp.median, get.median / tcp.median);
    println!("goals:");
    println!(
        "  put  {put_ratio:.2} {} 0.8 raw TCP ({:.2} of raw TCP into fresh memory)",
        verdict(put_ratio),
        put.median / tcp_fresh.median
    );
    println!(
        "  get  {get_ratio:.2} {} 0.8 raw TCP ({:.2} of raw TCP into fresh memory)",
        verdict(get_ratio),
        get.median / tcp_fresh.median
    );
}
