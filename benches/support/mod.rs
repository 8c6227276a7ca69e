//! What the node benchmarks share: the release `ferry-server` as a child process (with its
//! memory read from `/proc`), timing with medians, and the limits measured beside ferry (memcpy,
//! raw TCP and raw Unix-socket copies).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use burn_std::TensorData;
use burn_std::quantization::{QuantScheme, QuantStore, QuantValue};

pub const MIB: usize = 1 << 20;
/// The raw writers' write size, the same as ferry's default chunk.
pub const WRITE_SIZE: usize = 4 * MIB;

/// `target/release/ferry-server`, beside the `deps/` folder this bench runs from.
pub fn server_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the bench's own path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the bench runs from <target>/<profile>/deps");
    let binary = dir.join(format!("ferry-server{}", std::env::consts::EXE_SUFFIX));
    if !binary.is_file() {
        eprintln!(
            "node_to_node: {} is missing: cargo bench does not build another package's binary.\n\
             Run `cargo build --release -p ferry-server-cli` first, then \
             `cargo bench -p ferry-suite --bench node_to_node`.",
            binary.display()
        );
        std::process::exit(2);
    }
    binary
}

/// A `ferry-server` child process with one flex device on `127.0.0.1:0`; killed when dropped.
pub struct NodeProcess {
    pub child: Child,
    pub addr: String,
    /// `unix:PATH`, where started with `--unix`.
    pub unix: Option<String>,
    // Held so that the node never writes into a closed pipe.
    _stdout: BufReader<ChildStdout>,
    // Held open: a worker (the deployment example) serves until its standard input closes.
    _stdin: ChildStdin,
}

impl NodeProcess {
    /// Starts a node with one flex device on `127.0.0.1:0`, and `extra` arguments.
    pub fn start(binary: &Path, node_id: &str, extra: &[&str]) -> NodeProcess {
        let mut child = Command::new(binary)
            .args(["--listen", "127.0.0.1:0", "--device", "flex"])
            .args(["--node-id", node_id])
            .args(extra)
            // Warnings and errors still show; one info line per transfer would drown the report.
            .env("RUST_LOG", "warn")
            .env_remove("FERRY_TOKEN")
            .env_remove("FERRY_PEER_TOKEN")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()));
        let stdin = child.stdin.take().expect("piped stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut read_address = || {
            let mut line = String::new();
            stdout
                .read_line(&mut line)
                .expect("the node's address line");
            line.trim()
                .strip_prefix("listening on ")
                .unwrap_or_else(|| panic!("expected `listening on ADDR`, got {line:?}"))
                .to_string()
        };
        let addr = read_address();
        let unix = extra.contains(&"--unix").then(read_address);
        NodeProcess {
            child,
            addr,
            unix,
            _stdout: stdout,
            _stdin: stdin,
        }
    }

    /// A `/proc/PID/status` field in bytes (the kernel gives kB).
    pub fn status(&self, field: &str) -> u64 {
        let path = format!("/proc/{}/status", self.child.id());
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        text.lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or_else(|| panic!("no {field} in {path}"))
    }

    pub fn rss(&self) -> u64 {
        self.status("VmRSS")
    }

    pub fn peak(&self) -> u64 {
        self.status("VmHWM")
    }

    /// CPU time (user + system) the node has used so far.
    pub fn cpu(&self) -> Duration {
        cpu_time_of(&format!("/proc/{}/stat", self.child.id()))
    }

    /// Resets VmHWM to the current RSS; false where the kernel does not allow it.
    pub fn reset_peak(&self) -> bool {
        std::fs::write(format!("/proc/{}/clear_refs", self.child.id()), "5").is_ok()
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Median and best of a set of durations, as GB/s for `bytes`.
pub struct Rate {
    pub median: f64,
    pub best: f64,
    pub median_time: Duration,
}

impl Rate {
    pub fn of(bytes: usize, times: &mut [Duration]) -> Rate {
        times.sort();
        let gbps = |t: Duration| bytes as f64 / t.as_secs_f64() / 1e9;
        Rate {
            median: gbps(times[times.len() / 2]),
            best: gbps(times[0]),
            median_time: times[times.len() / 2],
        }
    }

    /// Times `f` `runs` times, after one untimed run.
    pub fn measure(bytes: usize, runs: usize, mut f: impl FnMut() -> Duration) -> Rate {
        let _ = f();
        let mut times: Vec<Duration> = (0..runs).map(|_| f()).collect();
        Rate::of(bytes, &mut times)
    }
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "median {:6.2} GB/s   best {:6.2} GB/s   (median {:7.1} ms)",
            self.median,
            self.best,
            self.median_time.as_secs_f64() * 1e3
        )
    }
}

/// CPU time (user + system, every thread) this process has used so far.
pub fn own_cpu() -> Duration {
    cpu_time_of("/proc/self/stat")
}

/// utime + stime of `/proc/PID/stat`, in the kernel's clock ticks (USER_HZ, 100 on Linux: a
/// 10 ms resolution, so callers sum over several runs).
fn cpu_time_of(path: &str) -> Duration {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    // The command name (field 2) may hold spaces; the fields after it are plain numbers.
    let after_name = &text[text.rfind(')').expect("a comm field") + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Fields 14 and 15 of the whole line are utime and stime: 12 and 13 after the name.
    let ticks: u64 =
        fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    Duration::from_millis(ticks * 10)
}

/// One single-stream TCP transfer of `src` over loopback into `dst`, timed from the moment both
/// ends are connected until the reader holds the last byte.
pub fn raw_tcp_once(src: &[u8], dst: &mut [u8]) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let ready = Barrier::new(2);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut stream = TcpStream::connect(addr).expect("connect");
            // ferry's connections set it too.
            stream.set_nodelay(true).expect("nodelay");
            ready.wait();
            for piece in src.chunks(WRITE_SIZE) {
                stream.write_all(piece).expect("write");
            }
        });
        let (mut stream, _) = listener.accept().expect("accept");
        ready.wait();
        let started = Instant::now();
        stream.read_exact(dst).expect("read");
        started.elapsed()
    })
}

/// [`raw_tcp_once`] under mutual TLS: rustls (ring, TLS 1.3) on both ends of one loopback
/// stream, the handshake done before the timing starts. What encryption alone costs a stream
/// on this machine, with no ferry in it.
pub fn raw_tls_once(
    src: &[u8],
    dst: &mut [u8],
    server: &std::sync::Arc<rustls::ServerConfig>,
    client: &std::sync::Arc<rustls::ClientConfig>,
) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let ready = Barrier::new(2);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let socket = TcpStream::connect(addr).expect("connect");
            socket.set_nodelay(true).expect("nodelay");
            let name = rustls_pki_types::ServerName::try_from("127.0.0.1").expect("a name");
            let session =
                rustls::ClientConnection::new(client.clone(), name).expect("a TLS client");
            let mut stream = rustls::StreamOwned::new(session, socket);
            // The handshake, outside the timing.
            while stream.conn.is_handshaking() {
                stream
                    .conn
                    .complete_io(&mut stream.sock)
                    .expect("client handshake");
            }
            ready.wait();
            for piece in src.chunks(WRITE_SIZE) {
                stream.write_all(piece).expect("write");
            }
            stream.flush().expect("flush");
            // Closing now, with the server's session tickets unread, would reset the stream
            // under the reader: wait for the reader to close first.
            let mut rest = Vec::new();
            let _ = stream.read_to_end(&mut rest);
        });
        let (socket, _) = listener.accept().expect("accept");
        let session = rustls::ServerConnection::new(server.clone()).expect("a TLS server");
        let mut stream = rustls::StreamOwned::new(session, socket);
        while stream.conn.is_handshaking() {
            stream
                .conn
                .complete_io(&mut stream.sock)
                .expect("server handshake");
        }
        ready.wait();
        let started = Instant::now();
        stream.read_exact(dst).expect("read");
        let elapsed = started.elapsed();
        stream.conn.send_close_notify();
        let _ = stream.flush();
        elapsed
    })
}

pub fn memcpy_once(src: &[u8], dst: &mut [u8]) -> Duration {
    let started = Instant::now();
    dst.copy_from_slice(std::hint::black_box(src));
    std::hint::black_box(&mut *dst);
    started.elapsed()
}

/// What one node's memory did over the timed copies.
#[derive(Default)]
pub struct Memory {
    pub start: u64,
    pub held: u64,
    pub peak: u64,
    pub extra: u64,
}

impl Memory {
    /// Watching `node`, whose resident memory now is the start.
    pub fn of(node: &NodeProcess) -> Memory {
        Memory {
            start: node.rss(),
            ..Memory::default()
        }
    }

    pub fn saw(&mut self, held: u64, peak: u64) {
        self.held = self.held.max(held);
        self.peak = self.peak.max(peak);
        self.extra = self.extra.max(peak.saturating_sub(held));
    }

    /// One report line, and whether the memory goal holds.
    pub fn report(&self, who: &str, tensor: usize) -> (String, bool) {
        let budget = tensor as f64 * 1.25 + 64.0 * MIB as f64;
        let holds = (self.extra as f64) <= budget;
        let line = format!(
            "  {who:<19} VmRSS at start {}, before copy {}; VmHWM during copy {}; \
             peak extra {} = {:.2}x tensor (goal <= 1.25x + 64 MiB = {}: {})",
            mib(self.start),
            mib(self.held),
            mib(self.peak),
            mib(self.extra),
            self.extra as f64 / tensor as f64,
            mib(budget as u64),
            if holds { "holds" } else { "MISSED" }
        );
        (line, holds)
    }
}

pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / MIB as f64)
}

/// One single-stream Unix-socket transfer of `src` into `dst`, timed like [`raw_tcp_once`].
pub fn raw_unix_once(src: &[u8], dst: &mut [u8]) -> Duration {
    use std::os::unix::net::{UnixListener, UnixStream};
    let dir = std::env::temp_dir().join(format!("ferry-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let path = dir.join("raw.sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).expect("bind");
    let ready = Barrier::new(2);
    let elapsed = std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut stream = UnixStream::connect(&path).expect("connect");
            ready.wait();
            for piece in src.chunks(WRITE_SIZE) {
                stream.write_all(piece).expect("write");
            }
        });
        let (mut stream, _) = listener.accept().expect("accept");
        ready.wait();
        let started = Instant::now();
        stream.read_exact(dst).expect("read");
        started.elapsed()
    });
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_dir(&dir);
    elapsed
}

pub fn f32_tensor(bytes: usize) -> TensorData {
    let numel = bytes / 4;
    // Not a constant, so that nothing on the way could get away with less work than real data.
    let values: Vec<f32> = (0..numel)
        .map(|i| (i % 65_521) as f32 * 0.25 - 1e4)
        .collect();
    TensorData::new(values, [numel / 1024, 1024])
}

/// 256 MiB of Q8S values with one per-tensor f32 scale (see [`q8s_tensor`]).
pub fn q8s_256() -> TensorData {
    q8s_tensor(256 * MIB)
}

/// `bytes` (a multiple of 4096) of Q8S values with one per-tensor f32 scale, built from i8
/// values directly rather than by quantizing through a backend (which would take longer than
/// the measurement).
pub fn q8s_tensor(bytes: usize) -> TensorData {
    let shape = [bytes / 4096, 4096];
    let values: Vec<i8> = (0..shape[0] * shape[1]).map(|i| (i % 255) as i8).collect();
    let scheme = QuantScheme::default()
        .with_value(QuantValue::Q8S)
        .with_store(QuantStore::Native);
    TensorData::quantized(values, shape, scheme, &[0.0125], None)
}

/// A copy that takes longer than this is a hang, not a measurement.
pub const COPY_TIMEOUT: Duration = Duration::from_secs(300);

/// One node-to-node copy of the tensor under `key` from `source`'s node to `target`'s, as
/// `ferry_client::NodeCopy` does it (the target registered it when this returns), checked
/// to have been a real pull of `bytes` payload bytes rather than a dedup.
pub async fn pull_once(
    source: &mut ferry_client::Client,
    target: &mut ferry_client::Client,
    key: &ferry_client::TensorKey,
    source_addr: &str,
    bytes: usize,
) {
    let copy = ferry_client::NodeCopy::new(source_addr).tensor(key.clone(), key.on(0));
    let answers = tokio::time::timeout(COPY_TIMEOUT, copy.run(source, target))
        .await
        .expect("the copy finished in time")
        .expect("the copy's connections held");
    let info = answers
        .into_iter()
        .next()
        .expect("one answer")
        .expect("the copy succeeded");
    assert_eq!(
        info.path,
        ferry_client::TransferPath::Pull,
        "the copy was a real pull, not dedup"
    );
    assert_eq!(info.bytes, bytes as u64);
}

/// Waits until `target` has recomputed every content hash a source stated (a pulled tensor is
/// registered under the source's hash and verified in the background), and returns how long
/// after `started` that was. The benches wait for it outside the timing, so that one copy's
/// background hashing never runs into the next copy, and print it: the node's work on a copy
/// ends there, not at the acknowledgement.
pub async fn verified_since(target: &mut ferry_client::Client, started: Instant) -> Duration {
    loop {
        let stats = target.stat().await.expect("stat the target");
        if stats.hashes_pending == 0 {
            assert_eq!(stats.hash_mismatches, 0, "a stated hash did not hold");
            return started.elapsed();
        }
        assert!(
            started.elapsed() < COPY_TIMEOUT,
            "hash verification stalled"
        );
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
}

/// What timed copies between two nodes measured: the copies, when the target had verified the
/// content hash (from each copy's start), and both nodes' memory.
pub struct Copies {
    pub rate: Rate,
    pub verified: Rate,
    pub source: Memory,
    pub target: Memory,
}

/// A client of each node, by its TCP address: the source's and the target's.
pub async fn clients(
    a: &NodeProcess,
    b: &NodeProcess,
) -> (ferry_client::Client, ferry_client::Client) {
    let connect = async |node: &NodeProcess| {
        ferry_client::Client::connect(node.addr.as_str())
            .await
            .expect("connect to a node")
    };
    (connect(a).await, connect(b).await)
}

/// This process's `/proc/self/status` field (`VmRSS`, `VmHWM`...), in bytes.
pub fn own_status(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"))
}

/// `target/release/ferry`, beside `ferry-server`.
pub fn cli_binary() -> PathBuf {
    let binary = server_binary().with_file_name(format!("ferry{}", std::env::consts::EXE_SUFFIX));
    if !binary.is_file() {
        eprintln!(
            "{} is missing: run `cargo build --release --workspace --bins` first",
            binary.display()
        );
        std::process::exit(2);
    }
    binary
}

/// Runs the CLI with `args` and returns its wall time; panics, with its output, if it fails.
pub fn timed(cli: &Path, args: &[&str]) -> Duration {
    let started = Instant::now();
    let output = Command::new(cli)
        .args(args)
        .env_remove("FERRY_TOKEN")
        .output()
        .expect("the CLI runs");
    let elapsed = started.elapsed();
    assert!(
        output.status.success(),
        "ferry {args:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    elapsed
}
