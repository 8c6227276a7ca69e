//! The deployment example as a test: a coordinator (this process) builds a small model from
//! burn-nn layers, quantizes it (Q8S per tensor, then per block), sends it through ferry to a
//! worker that is another OS process embedding a node (`examples/worker.rs`), and sends a
//! batch; the worker applies the model from its node, runs it, and answers with a tensor that
//! must be bit-exact the coordinator's own forward pass. Once by address, once by cluster name
//! through etcd. And a worker killed (SIGKILL) halfway through an apply from it: the module is
//! left exactly as it was.
// Test code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

#[path = "../examples/shared/coordinator.rs"]
mod coordinator;
mod support;
#[path = "../examples/shared/tiny_lm.rs"]
#[allow(dead_code)]
mod tiny_lm;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use burn_core as burn;
use burn_core::module::Module;
use burn_core::tensor::Device;
use burn_nn::{Linear, LinearConfig};
use burn_store::ModuleStore;
use ferry_burn::{FerryStore, StoreError};
use ferry_client::{BlockingClient, ConnectOptions, SharedMemory, Wait};
use ferry_testkit::Etcd;
use support::params;
use tiny_lm::Quantization;

/// The worker example's binary, which `cargo test` builds next to this test's.
fn worker_binary() -> PathBuf {
    let deps = std::env::current_exe().unwrap();
    let profile = deps.parent().unwrap().parent().unwrap();
    let binary = profile.join("examples").join("worker");
    assert!(
        binary.exists(),
        "{}: built by `cargo test` with its default targets (or `cargo build --examples`)",
        binary.display()
    );
    binary
}

/// A worker process, killed when dropped (its standard input closes with it, too).
struct Worker {
    child: Child,
    addr: String,
}

impl Worker {
    fn start(args: &[&str]) -> Worker {
        let mut child = Command::new(worker_binary())
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        let addr = first
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("the worker's first line: {first:?}"))
            .to_string();
        Worker { child, addr }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run_both(connect: impl Fn() -> BlockingClient) {
    for quantization in [Quantization::PerTensor, Quantization::PerBlock] {
        let outputs = coordinator::ship_and_run(connect(), connect(), quantization).unwrap();
        assert_eq!(
            outputs.worker.dtype(),
            outputs.here.dtype(),
            "{quantization:?}"
        );
        assert_eq!(
            outputs.worker.shape(),
            outputs.here.shape(),
            "{quantization:?}"
        );
        assert_eq!(outputs.worker.shape().as_slice(), [4, 16, tiny_lm::VOCAB]);
        assert!(
            outputs.worker.as_bytes() == outputs.here.as_bytes(),
            "{quantization:?}: the worker's output is not bit-exact the coordinator's"
        );
    }
}

#[test]
fn a_quantized_model_shipped_to_a_worker_process_computes_bit_exact_what_the_coordinator_does() {
    let worker = Worker::start(&[]);
    run_both(|| {
        BlockingClient::connect(worker.addr.as_str())
            .blocking()
            .unwrap()
    });
}

/// A worker behind a token survives a batch of the wrong kind (an f32 tensor where it takes
/// token ids): it reports it and serves the next batch, bit-exact.
#[test]
fn a_worker_behind_a_token_reports_a_wrong_batch_and_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "all s3cret-worker-token\n").unwrap();
    let worker = Worker::start(&["--token-file", tokens.to_str().unwrap()]);
    let connect = || {
        BlockingClient::connect(worker.addr.as_str())
            .token("s3cret-worker-token")
            .blocking()
    };
    // Without the token: refused.
    let mut stranger = BlockingClient::connect(worker.addr.as_str()).blocking();
    let refused = match stranger.as_mut() {
        Ok(client) => client.list(None).wait().is_err(),
        Err(_) => true,
    };
    assert!(refused, "a client without the token was served");
    // A batch of floats where the model takes token ids: taken off the node and refused there.
    let mut client = connect().unwrap();
    let wrong = ferry_proto::TensorData::new(vec![0.5f32; 8], [2, 4]);
    client
        .put(&ferry_proto::TensorKey::new(0, "batch"), &wrong)
        .wait()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while client
        .get(&ferry_proto::TensorKey::new(0, "batch"))
        .wait()
        .is_ok()
    {
        assert!(Instant::now() < deadline, "the worker never took the batch");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Still there, and still right.
    run_both(|| connect().unwrap());
}

#[test]
fn the_worker_is_reached_by_its_cluster_name_through_etcd() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let etcd = runtime.block_on(Etcd::start());
    let cluster = etcd.cluster();
    let _worker = Worker::start(&["--cluster", &cluster, "--name", "gpu-worker-1"]);
    // Registered a moment after it listens.
    let deadline = Instant::now() + Duration::from_secs(30);
    let reach = || BlockingClient::reach(&cluster, "gpu-worker-1", ConnectOptions::default());
    while let Err(e) = reach() {
        assert!(Instant::now() < deadline, "not registered within 30 s: {e}");
        std::thread::sleep(Duration::from_millis(50));
    }
    run_both(|| reach().unwrap().0);
}

/// A TCP proxy in front of `upstream` for one connection, which kills the process `pid` (with
/// SIGKILL) once `cut` bytes have come back from it, and closes the connection there.
fn killing_proxy(upstream: &str, pid: u32, cut: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let upstream = upstream.to_string();
    std::thread::spawn(move || {
        let (mut down, _) = listener.accept().unwrap();
        let mut up = TcpStream::connect(&upstream).unwrap();
        let (mut down_reader, mut up_writer) = (down.try_clone().unwrap(), up.try_clone().unwrap());
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut down_reader, &mut up_writer);
        });
        let mut seen = 0;
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match up.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let pass = n.min(cut - seen);
            if down.write_all(&buf[..pass]).is_err() {
                break;
            }
            seen += pass;
            if seen == cut {
                let killed = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status()
                    .unwrap();
                assert!(killed.success(), "kill -KILL {pid}");
                break;
            }
        }
        let _ = down.shutdown(Shutdown::Both);
    });
    addr
}

/// Layers of one size, so that a kill halfway falls between some that arrived and some not.
#[derive(Module, Debug)]
struct Deep {
    layers: Vec<Linear>,
}

impl Deep {
    fn new(device: &Device) -> Self {
        let layers = (0..8).map(|_| LinearConfig::new(64, 64).init(device));
        Self {
            layers: layers.collect(),
        }
    }
}

#[cfg(unix)] // `kill -KILL`
#[test]
fn a_worker_killed_mid_apply_leaves_the_module_exactly_as_it_was() {
    let mut worker = Worker::start(&[]);
    let device = Device::flex();
    let sent = Deep::new(&device);
    let link = BlockingClient::connect(worker.addr.as_str())
        .blocking()
        .unwrap();
    FerryStore::connected(link, 0, "model")
        .collect_from(&sent)
        .unwrap();

    // Fetched through a proxy that kills the worker once half the model's bytes came back.
    let model_bytes: usize = params(&sent).values().map(|d| d.as_bytes().len()).sum();
    let cut = killing_proxy(&worker.addr, worker.child.id(), model_bytes / 2);
    let link = BlockingClient::connect(cut.as_str())
        .shared_memory(SharedMemory::Decline)
        .blocking()
        .unwrap();
    let mut target = Deep::new(&device);
    let before = params(&target);
    let Err(StoreError::NotApplied(result)) =
        FerryStore::connected(link, 0, "model").apply_to(&mut target)
    else {
        panic!("a worker killed halfway refuses the apply");
    };
    assert!(
        !result.applied.is_empty(),
        "the kill came partway ({result})"
    );
    assert!(!result.errors.is_empty(), "{result}");
    let status = worker.child.wait().unwrap();
    assert!(!status.success(), "the worker was killed: {status}");
    // Not one parameter changed, not even those that had arrived whole.
    let after = params(&target);
    assert_eq!(
        after.keys().collect::<Vec<_>>(),
        before.keys().collect::<Vec<_>>()
    );
    for (path, was) in &before {
        assert!(after[path].as_bytes() == was.as_bytes(), "{path} changed");
        assert_eq!(after[path].dtype(), was.dtype(), "{path}");
    }
}
