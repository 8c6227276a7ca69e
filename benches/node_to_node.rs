//! Node-to-node pull throughput and peak memory of two real `ferry-server` processes.
//!
//! Measured against a raw TCP stream and a memcpy of the same bytes, in the same run.
//!
//! Run with `cargo bench -p ferry-suite --bench node_to_node`. The nodes are the release
//! `ferry-server` binary next to this bench's executable (`target/release/ferry-server`), which
//! `cargo bench -p ferry-suite` does not build (it is another package's binary): build it first
//! with `cargo build --release -p ferry-server-cli`, and rebuild it after changing the server, or
//! this bench measures the old one.
//!
//! Per tensor (f32 1 MiB, 64 MiB, 256 MiB; Q8S 256 MiB), on a fresh pair of nodes A and B with
//! one flex device each:
//! - `ferry`: the tensor is put on A, then `ferry_client::NodeCopy` A -> B is timed: B pulls
//!   it from A under a capability, the bytes never pass through this process. One untimed
//!   warm-up copy opens B's link to A and is checked bit-exact. After every copy the tensor is
//!   deleted on B, so B's content-hash dedup cannot answer the next copy without a transfer
//!   (each copy is asserted to have taken the `pull` path). B registers the tensor under the
//!   content hash A stated and recomputes it in the background; before the delete the bench
//!   waits (untimed) until B has, so that hashing never overlaps the next copy, and prints as
//!   `hash verified` when that was, counted from the copy's start: B's work on a copy ends there.
//!   This is the steady state of a node serving a model: A has sent the tensor before, so it
//!   reuses the chunk checksums it computed then, and B receives into the buffer the previous
//!   copy's tensor freed (the node's default `--recycle`), as raw TCP reuses its buffer;
//! - `ferry A->B, cold`: every first-time cost paid, on another pair of nodes with `--recycle
//!   0`: each run puts the tensor on A under a new name (checksums computed while sending) and B
//!   receives into new memory (the kernel faults in and zeroes every page): a first push (A's
//!   content hash of the put, which a node computes after answering the put, is waited for
//!   before the timing starts: it belongs to the put);
//! - `ferry A->B, cold, pool`: the same first pushes, with B started with a receive pool
//!   (`--pool`, the tensor's size plus 64 MiB) reserved and touched at start: the goal is >= 0.9x
//!   raw TCP at 256 MiB;
//! - `ferry A->B, 1 conn` and `4 conns`: the steady state again, on pairs whose B spreads a
//!   pull over at most that many connections (`--pull-connections`; a default node uses one per
//!   four cores, up to 8, one below 8 cores): a tensor over 16 MiB comes in 16 MiB stripes
//!   fetched side by side, each hashed as it arrives. Where the cores are few these only show
//!   what striping costs; on many cores, what it gains;
//! - `ferry A->B, mTLS`: the steady state again, on a pair of nodes serving mutual TLS
//!   (certificates from `ferry_certs`, the client's too): every byte of the pull crosses a
//!   rustls stream (AES-GCM); the goal is >= 0.6x raw TCP at 256 MiB;
//! - `raw mTLS`: raw TCP under mutual TLS (rustls with ring, TLS 1.3, both ends threads of this
//!   process with rustls's blocking stream, the handshake untimed): what rustls costs one
//!   stream here, a reference for the mTLS row rather than a strict ceiling (the nodes run
//!   their ends in two processes, each with a runtime of its own);
//! - `raw TCP`: the same number of bytes over one loopback TCP connection in this process, in
//!   4 MiB writes, read with `read_exact` into a preallocated buffer whose pages were already
//!   touched: the most a single stream gets out of this kernel, the ceiling for ferry;
//! - `memcpy`: the same bytes copied into that same touched buffer.
//!
//! To show where ferry's time goes, the stages a pull is made of are timed on the same bytes in
//! this process: `raw TCP, fresh dst` and `memcpy, fresh dst` write into a newly allocated
//! buffer each run (its first-touch page faults included, as a receiver's buffer and a source's
//! `into_data` copy pay them), `crc32c` is the per-chunk checksum a put's receiver checks (a
//! pull's target checks none, and the source reuses the checksums of an earlier send), and
//! `blake3` is the content hash the target computes over the whole payload as it arrives
//! (`ferry_proto::tensor::content_hash`), here on one thread: its CPU.
//!
//! CPU (from `/proc/PID/stat`, 10 ms ticks, summed over the runs): `CPU per copy` is what both
//! nodes spent per timed copy, beside raw TCP's own CPU (both ends are threads of this process)
//! and the single-threaded `blake3` and `crc32c` stages. `ceiling` is the ratio a pull would reach
//! if it cost only raw TCP's CPU and `blake3`, spread perfectly over this machine's cores: a limit the machine
//! sets, measured in the same run, so that a missed goal can be told from a slow ferry.
//!
//! Memory (per node, from `/proc/PID/status`): `held` is VmRSS right before a copy (A then
//! holds the source tensor; B holds nothing). VmHWM is reset right before each copy (writing `5`
//! to `/proc/PID/clear_refs`), so VmHWM read after it returns is the peak during that copy
//! alone, and `peak extra = peak - held` is what the copy cost the node: for A whatever it
//! allocates to serve the fetch; for B everything the pull cost including the tensor it ends up
//! holding, so B's can never be below 1x the tensor. The worst run is reported. The goal checked:
//! peak extra <= 1.25 x tensor + 64 MiB per node. Freed large buffers are unmapped, and the kernel
//! folds the current RSS into the high-water mark before it unmaps, so transient peaks are seen.
//!
//! Throughput is payload bytes / wall time, in GB/s (1e9 bytes); each line gives the median and
//! the best run. The ratio is ferry's median over raw TCP's median; the goal is >= 0.8 at
//! 256 MiB. The ratio against raw TCP into a fresh buffer is printed beside it: a receiver that
//! allocates its buffer per tensor pays those page faults too.
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use burn_std::TensorData;
use ferry_client::{Client, TensorKey};

use support::{
    Copies, MIB, Memory, NodeProcess, Rate, WRITE_SIZE, clients, f32_tensor, memcpy_once, own_cpu,
    pull_once, q8s_256, raw_tcp_once, raw_tls_once, server_binary, verified_since,
};
/// The name the tensor has on both nodes.
const NAME: &str = "bench.w";

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The connections a default node spreads one pull over here (`--pull-connections`' default).
fn default_connections() -> usize {
    ferry_server::Striping::for_this_machine().connections()
}

/// One measured tensor.
struct Case {
    label: &'static str,
    runs: usize,
    make: fn() -> TensorData,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            label: "f32 1 MiB",
            runs: 20,
            make: || f32_tensor(MIB),
        },
        Case {
            label: "f32 64 MiB",
            runs: 5,
            make: || f32_tensor(64 * MIB),
        },
        Case {
            label: "f32 256 MiB",
            runs: 5,
            make: || f32_tensor(256 * MIB),
        },
        Case {
            label: "Q8S 256 MiB",
            runs: 5,
            make: q8s_256,
        },
    ]
}

/// A copy into a new allocation, freed outside the timing.
fn fresh_copy_once(src: &[u8]) -> Duration {
    let started = Instant::now();
    let copy = std::hint::black_box(src).to_vec();
    let elapsed = started.elapsed();
    drop(std::hint::black_box(copy));
    elapsed
}

/// A raw TCP transfer into a buffer allocated (zeroed lazily, untouched) for this run only.
fn raw_tcp_fresh_once(src: &[u8]) -> Duration {
    let mut dst = vec![0u8; src.len()];
    raw_tcp_once(src, &mut dst)
}

fn crc32c_once(src: &[u8]) -> Duration {
    let started = Instant::now();
    // Per 4 MiB chunk, as the frames carry it.
    let crc = src
        .chunks(WRITE_SIZE)
        .fold(0u32, |acc, c| acc ^ crc32c::crc32c(c));
    std::hint::black_box(crc);
    started.elapsed()
}

/// The content hash on one thread: its CPU cost (the node spreads it over the free cores, so
/// `content_hash` itself would show the wall time of that, not the work).
fn blake3_once(data: &TensorData) -> Duration {
    let meta = ferry_proto::tensor::meta_of(data).expect("a valid tensor");
    let started = Instant::now();
    let mut hasher = ferry_proto::tensor::content_hasher(&meta);
    hasher.update(data.as_bytes());
    std::hint::black_box(hasher.finalize());
    started.elapsed()
}

/// What a case measured, for the summary.
struct Outcome {
    label: &'static str,
    ratio: f64,
    cold_ratio: f64,
    pool_ratio: f64,
    tls_ratio: f64,
    /// The most any verifying pull could reach on this machine (see `measure`).
    ceiling: f64,
    memory_holds: bool,
    large: bool,
}

/// Copies that pay every first-time cost: each run puts the tensor on A under a new name (A has
/// never sent it, so its chunk checksums are computed as it goes) and B keeps no freed receive
/// buffer (`--recycle 0`), so its buffer is new memory the kernel faults in and zeroes. What a
/// first push of a model to a fresh worker costs. With `pool`, B receives into a pool of that
/// many bytes, reserved and touched at its start (`--pool`).
async fn cold_copies(binary: &Path, data: &TensorData, runs: usize, pool: Option<usize>) -> Copies {
    let bytes = data.as_bytes().len();
    let a = NodeProcess::start(binary, "bench-cold-a", &["--recycle", "0"]);
    let pool = pool.map_or_else(|| "0".to_string(), |p| p.to_string());
    let b = NodeProcess::start(binary, "bench-cold-b", &["--recycle", "0", "--pool", &pool]);
    let (mut source, mut target) = clients(&a, &b).await;
    let mut memory = (Memory::of(&a), Memory::of(&b));
    let mut times = Vec::with_capacity(runs);
    let mut verified = Vec::with_capacity(runs);
    // One more than measured: the first opens B's link to A.
    for run in 0..=runs {
        let key = TensorKey::new(0, format!("cold{run}"));
        source
            .put(&TensorKey::new(0, &key.name), data)
            .await
            .expect("put on A");
        // A computes a put's content hash after answering it, and a grant waits for it: that
        // belongs to the put, not to the pull measured here.
        verified_since(&mut source, Instant::now()).await;
        a.reset_peak();
        b.reset_peak();
        let (held_a, held_b) = (a.rss(), b.rss());
        let started = Instant::now();
        pull_once(&mut source, &mut target, &key, &a.addr, bytes).await;
        let elapsed = started.elapsed();
        let done = verified_since(&mut target, started).await;
        if run > 0 {
            times.push(elapsed);
            verified.push(done);
            memory.0.saw(held_a, a.peak());
            memory.1.saw(held_b, b.peak());
        }
        target.delete(&key).await.expect("delete on B");
        source.delete(&key).await.expect("delete on A");
    }
    Copies {
        rate: Rate::of(bytes, &mut times),
        verified: Rate::of(bytes, &mut verified),
        source: memory.0,
        target: memory.1,
    }
}

/// Steady-state copies as the plain ones are measured (an untimed warm-up, then each timed copy
/// deleted on B, its hash verified, outside the timing), on a pair whose B pulls over at most
/// `connections` connections per tensor (`--pull-connections`: 1 fetches over one, more stripe a
/// tensor larger than 16 MiB over them).
async fn striped_copies(binary: &Path, data: &TensorData, runs: usize, connections: u16) -> Rate {
    let bytes = data.as_bytes().len();
    let n = connections.to_string();
    let a = NodeProcess::start(binary, "bench-striped-a", &[]);
    let b = NodeProcess::start(binary, "bench-striped-b", &["--pull-connections", &n]);
    let (mut source, mut target) = clients(&a, &b).await;
    let key = TensorKey::new(0, NAME);
    source.put(&key, data).await.expect("put on A");
    let mut times = Vec::with_capacity(runs);
    for run in 0..=runs {
        let started = Instant::now();
        pull_once(&mut source, &mut target, &key, &a.addr, bytes).await;
        let elapsed = started.elapsed();
        if run == 0 {
            let back = target.get(&key).await.expect("get from B");
            assert!(
                back.as_bytes() == data.as_bytes(),
                "bytes after a striped pull"
            );
        } else {
            times.push(elapsed);
        }
        verified_since(&mut target, started).await;
        target.delete(&key).await.expect("delete on B");
    }
    Rate::of(bytes, &mut times)
}

/// Steady-state copies between two nodes that serve mutual TLS, as the plain ones are measured:
/// an untimed warm-up (checked bit-exact) opens B's TLS link to A, then each timed copy is
/// deleted on B (and its hash verified) outside the timing.
async fn tls_copies(binary: &Path, data: &TensorData, runs: usize) -> Rate {
    let bytes = data.as_bytes().len();
    let pki = ferry_testkit::TestPki::new();
    let start = |name: &str, extra: &[&str]| {
        pki.node(name);
        let files = pki.files(name);
        let path = |p: &Path| p.to_str().expect("a UTF-8 path").to_string();
        let (cert, key, ca) = (path(&files.cert), path(&files.key), path(&files.ca));
        let mut args = vec!["--tls-cert", &cert, "--tls-key", &key, "--tls-ca", &ca];
        args.extend_from_slice(extra);
        NodeProcess::start(binary, name, &args)
    };
    let a = start("bench-tls-a", &[]);
    // A TLS node pulls only from the peers it lists, each checked to be who its name says.
    let b = start(
        "bench-tls-b",
        &["--peer", &format!("bench-tls-a={}", a.addr)],
    );
    let tls = pki.client("bench");
    let connect = async |node: &NodeProcess| {
        Client::connect(node.addr.as_str())
            .tls(tls.clone())
            .await
            .expect("connect to a node over TLS")
    };
    let (mut source, mut target) = (connect(&a).await, connect(&b).await);
    source
        .put(&TensorKey::new(0, NAME), data)
        .await
        .expect("put on A");
    let key = TensorKey::new(0, NAME);
    pull_once(&mut source, &mut target, &key, &a.addr, bytes).await;
    let back = target.get(&key).await.expect("get from B");
    assert!(
        back.as_bytes() == data.as_bytes(),
        "bytes after the TLS pull"
    );
    drop(back);
    verified_since(&mut target, Instant::now()).await;
    target.delete(&key).await.expect("delete on B");
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let started = Instant::now();
        pull_once(&mut source, &mut target, &key, &a.addr, bytes).await;
        times.push(started.elapsed());
        verified_since(&mut target, started).await;
        target.delete(&key).await.expect("delete on B");
    }
    Rate::of(bytes, &mut times)
}

/// rustls configurations for a raw mutual-TLS stream between two certified ends, as ferry's
/// nodes use (its provider: ring, AES-128-GCM first; TLS 1.3; a client certificate required).
fn raw_tls_configs() -> (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>) {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let pki = ferry_testkit::TestPki::new();
    pki.node("raw-server");
    pki.client("raw-client");
    let load = |name: &str| {
        let files = pki.files(name);
        let chain = CertificateDer::pem_file_iter(&files.cert)
            .expect("a certificate file")
            .collect::<Result<Vec<_>, _>>()
            .expect("certificates");
        let key = PrivateKeyDer::from_pem_file(&files.key).expect("a key");
        (chain, key, files.ca)
    };
    let (server_chain, server_key, ca) = load("raw-server");
    let (client_chain, client_key, _) = load("raw-client");
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&ca).expect("the CA") {
        roots.add(cert.expect("a CA certificate")).expect("a root");
    }
    let roots = Arc::new(roots);
    let provider = ferry_io::tls::provider();
    let versions = &[&rustls::version::TLS13];
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots.clone(),
        provider.clone(),
    )
    .build()
    .expect("a client verifier");
    let server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(versions)
        .expect("TLS 1.3")
        .with_client_cert_verifier(verifier)
        .with_single_cert(server_chain, server_key)
        .expect("a server config");
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .expect("TLS 1.3")
        .with_root_certificates(roots)
        .with_client_auth_cert(client_chain, client_key)
        .expect("a client config");
    (Arc::new(server), Arc::new(client))
}

async fn measure(binary: &Path, case: &Case, peaks_resettable: &mut bool) -> Outcome {
    let data = (case.make)();
    let bytes = data.as_bytes().len();
    let runs = case.runs;
    println!(
        "{} ({bytes} payload bytes, {}), {runs} runs",
        case.label,
        ferry_proto::dtype_name(&data.dtype())
    );

    // The baselines and stages first, while no node exists to compete for the two cores.
    let src = data.as_bytes();
    let mut dst = vec![1u8; bytes];
    let cpu_before = own_cpu();
    let tcp = Rate::measure(bytes, runs, || raw_tcp_once(src, &mut dst));
    // Both ends of the stream run in this process; `measure` makes one untimed run more.
    let tcp_cpu = (own_cpu() - cpu_before) / (runs as u32 + 1);
    assert!(dst == src, "raw TCP delivered other bytes");
    let (tls_server, tls_client) = raw_tls_configs();
    let raw_tls = Rate::measure(bytes, runs, || {
        raw_tls_once(src, &mut dst, &tls_server, &tls_client)
    });
    assert!(dst == src, "raw TLS delivered other bytes");
    let memcpy = Rate::measure(bytes, runs, || memcpy_once(src, &mut dst));
    drop(dst);
    let stages = [
        (
            "raw TCP, fresh dst",
            Rate::measure(bytes, runs, || raw_tcp_fresh_once(src)),
        ),
        (
            "memcpy, fresh dst",
            Rate::measure(bytes, runs, || fresh_copy_once(src)),
        ),
        ("crc32c", Rate::measure(bytes, runs, || crc32c_once(src))),
        ("blake3", Rate::measure(bytes, runs, || blake3_once(&data))),
    ];

    // A fresh pair of nodes per case, so that one case's memory never shows in another's.
    let a = NodeProcess::start(binary, "bench-a", &[]);
    let b = NodeProcess::start(binary, "bench-b", &[]);
    let (mut mem_a, mut mem_b) = (Memory::of(&a), Memory::of(&b));
    let (mut source, mut target) = clients(&a, &b).await;
    source
        .put(&TensorKey::new(0, NAME), &data)
        .await
        .expect("put on A");
    let key = TensorKey::new(0, NAME);
    let copy = async |source: &mut Client, target: &mut Client| {
        pull_once(source, target, &key, &a.addr, bytes).await;
    };

    // Warm-up: opens B's connection to A; the result is checked bit-exact once.
    copy(&mut source, &mut target).await;
    let back = target.get(&key).await.expect("get from B");
    assert_eq!(back.dtype(), data.dtype(), "dtype after the pull");
    assert_eq!(back.shape(), data.shape(), "shape after the pull");
    assert!(back.as_bytes() == data.as_bytes(), "bytes after the pull");
    drop(back);
    verified_since(&mut target, Instant::now()).await;
    target.delete(&key).await.expect("delete on B");

    let mut times = Vec::with_capacity(runs);
    let mut verified = Vec::with_capacity(runs);
    let (cpu_a, cpu_b) = (a.cpu(), b.cpu());
    for _ in 0..runs {
        let reset = a.reset_peak() & b.reset_peak();
        *peaks_resettable &= reset;
        let (held_a, held_b) = (a.rss(), b.rss());
        let started = Instant::now();
        copy(&mut source, &mut target).await;
        times.push(started.elapsed());
        verified.push(verified_since(&mut target, started).await);
        mem_a.saw(held_a, a.peak());
        mem_b.saw(held_b, b.peak());
        target.delete(&key).await.expect("delete on B");
    }
    let copy_cpu_a = (a.cpu() - cpu_a) / runs as u32;
    let copy_cpu_b = (b.cpu() - cpu_b) / runs as u32;
    drop((source, target, a, b));
    let cold = cold_copies(binary, &data, runs, None).await;
    let pooled = cold_copies(binary, &data, runs, Some(bytes + 64 * MIB)).await;
    let tls = tls_copies(binary, &data, runs).await;
    let one_connection = striped_copies(binary, &data, runs, 1).await;
    let four_connections = striped_copies(binary, &data, runs, 4).await;
    drop(data);
    let ferry = Rate::of(bytes, &mut times);
    let ratio = ferry.median / tcp.median;
    println!("  ferry A->B          {ferry}");
    println!("    hash verified     {}", Rate::of(bytes, &mut verified));
    println!("  ferry A->B, cold    {}", cold.rate);
    println!("    hash verified     {}", cold.verified);
    println!("  ferry A->B, cold, pool {}", pooled.rate);
    println!("    hash verified     {}", pooled.verified);
    println!("  ferry A->B, mTLS    {tls}");
    println!("  ferry A->B, 1 conn  {one_connection}");
    println!("  ferry A->B, 4 conns {four_connections}");
    println!("  raw TCP             {tcp}");
    println!("  raw mTLS            {raw_tls}");
    println!("  memcpy              {memcpy}");
    for (name, rate) in &stages {
        println!("  {name:<19} {rate}");
    }
    println!(
        "  ferry/raw TCP       {ratio:.2} (medians; {:.2} against raw TCP into a fresh buffer)",
        ferry.median / stages[0].1.median
    );
    println!(
        "  ferry/raw TCP, cold {:.2} (medians; {:.2} against raw TCP into a fresh buffer)",
        cold.rate.median / tcp.median,
        cold.rate.median / stages[0].1.median
    );
    println!(
        "  ferry/raw TCP, cold, pool {:.2} (medians; {:.2} of the warm copy)",
        pooled.rate.median / tcp.median,
        pooled.rate.median / ferry.median
    );
    println!(
        "  ferry/raw TCP, mTLS {:.2} (medians; {:.2} of plain ferry, {:.2} of raw mTLS; raw mTLS/raw TCP {:.2})",
        tls.median / tcp.median,
        tls.median / ferry.median,
        tls.median / raw_tls.median,
        raw_tls.median / tcp.median
    );
    println!(
        "  ferry/raw TCP, 1 connection {:.2}, 4 connections {:.2} (medians; default here: {} per pull)",
        one_connection.median / tcp.median,
        four_connections.median / tcp.median,
        default_connections()
    );
    // What a pull cannot avoid: the stream's own CPU (a send and a receive copy) and the
    // receiver's BLAKE3 over every byte (it checks no chunk checksum; the source reuses its
    // own). Spread perfectly over this machine's cores, that work bounds the wall time from
    // below, so it bounds the ratio from above.
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (blake3, crc) = (stages[3].1.median_time, stages[2].1.median_time);
    let floor = (tcp_cpu + blake3).as_secs_f64() / cores() as f64;
    let ceiling = tcp.median_time.as_secs_f64() / floor.max(tcp.median_time.as_secs_f64());
    println!(
        "  CPU per copy        ferry {:.0} ms (A {:.0}, B {:.0}); raw TCP {:.0} ms; blake3 {:.0} ms; crc32c {:.0} ms",
        ms(copy_cpu_a + copy_cpu_b),
        ms(copy_cpu_a),
        ms(copy_cpu_b),
        ms(tcp_cpu),
        ms(blake3),
        ms(crc)
    );
    println!(
        "  ceiling, {} cores    {ceiling:.2} (raw TCP's CPU + blake3 over {} cores: >= {:.0} ms)",
        cores(),
        cores(),
        floor * 1e3
    );
    let (line_a, holds_a) = mem_a.report("node A (src)", bytes);
    let (line_b, holds_b) = mem_b.report("node B (dst)", bytes);
    let (cold_a, cold_holds_a) = cold.source.report("node A (src), cold", bytes);
    let (cold_b, cold_holds_b) = cold.target.report("node B (dst), cold", bytes);
    let (pool_b, pool_holds_b) = pooled.target.report("node B (dst), cold, pool", bytes);
    println!("{line_a}\n{line_b}\n{cold_a}\n{cold_b}\n{pool_b}");
    Outcome {
        label: case.label,
        ratio,
        cold_ratio: cold.rate.median / tcp.median,
        pool_ratio: pooled.rate.median / tcp.median,
        tls_ratio: tls.median / tcp.median,
        ceiling,
        memory_holds: holds_a && holds_b && cold_holds_a && cold_holds_b && pool_holds_b,
        large: bytes >= 256 * MIB,
    }
}

fn main() {
    // `cargo test --benches` runs this without `--bench`: a 1 GiB-scale measurement has no place
    // in a test run.
    if !std::env::args().any(|a| a == "--bench") {
        println!("node_to_node: not run outside `cargo bench`");
        return;
    }
    let binary = server_binary();
    let built = std::fs::metadata(&binary)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| SystemTime::now().duration_since(t).ok())
        .map_or("?".to_string(), |age| {
            format!("{:.0} min", age.as_secs_f64() / 60.0)
        });
    println!(
        "node_to_node: nodes run {} (built {built} ago); {} cores",
        binary.display(),
        cores()
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let mut peaks_resettable = true;
    let outcomes: Vec<Outcome> = cases()
        .iter()
        .map(|case| runtime.block_on(measure(&binary, case, &mut peaks_resettable)))
        .collect();
    if !peaks_resettable {
        println!(
            "note: VmHWM could not be reset here, so the peaks above are since each node started \
             (the put on A included)"
        );
    }
    println!("goals:");
    for o in &outcomes {
        let verdict = |r: f64, goal: f64| if r >= goal { ">=" } else { "< (MISSED)" };
        let ratio = if o.large {
            format!(
                "ratio {:.2} {} 0.8, cold {:.2}, cold with a pool {:.2} {} 0.9, mTLS {:.2} {} 0.6 \
                 (ceiling here {:.2})",
                o.ratio,
                verdict(o.ratio, 0.8),
                o.cold_ratio,
                o.pool_ratio,
                verdict(o.pool_ratio, 0.9),
                o.tls_ratio,
                verdict(o.tls_ratio, 0.6),
                o.ceiling
            )
        } else {
            format!(
                "ratio {:.2}, cold {:.2}, cold with a pool {:.2}, mTLS {:.2} (no goal below 256 MiB)",
                o.ratio, o.cold_ratio, o.pool_ratio, o.tls_ratio
            )
        };
        let memory = if o.memory_holds {
            "memory holds on both nodes"
        } else {
            "memory MISSED"
        };
        println!("  {:<12} {ratio}; {memory}", o.label);
    }
}
