//! The deployment example as a test: a coordinator (this process) builds a small model from
//! burn-nn layers, quantizes it (Q8S per tensor, then per block), sends it through ferry to a
//! worker that is another OS process embedding a node (`examples/worker.rs`), and sends a
//! batch; the worker applies the model from its node, runs it, and answers with a tensor that
//! must be bit-exact the coordinator's own forward pass. Once by address, once by cluster name
//! through etcd.
// Test code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

#[path = "../examples/shared/coordinator.rs"]
mod coordinator;
#[path = "../examples/shared/tiny_lm.rs"]
#[allow(dead_code)]
mod tiny_lm;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::client::{BlockingClient, ConnectOptions};
use ferry::testing::Etcd;
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
