//! A quantized model pulled node to node across two network namespaces with delay and loss.
//!
//! Ignored by default: it needs root, `ip` and `tc`, and it runs the `ferry-server` binary, which
//! `cargo test -p ferry-cli` does not build (`cargo build -p ferry-server-cli` does). Run with
//! `cargo build -p ferry-server-cli && cargo test -p ferry-cli --test it netns:: -- --ignored
//! --nocapture`.
//! `tests/netns-pull.sh` sets up the namespaces, the lossy link and the nodes and runs the CLI;
//! this test writes the model and checks what came back, bit for bit.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry_files::{read_tensors, write_tensors};
use ferry_proto::{DType, TensorData};
use ferry_testkit::samples;

/// What the script is allowed in all (its own deadline), and the margin past it after which
/// this test kills it.
const SCRIPT_LIMIT_S: u64 = 120;
const KILL_MARGIN: Duration = Duration::from_secs(30);

/// A small model: quantized weights in several schemes (per-tensor, per-block, two-level, 8 and
/// 4 bits, float values) and an f32 norm, about 1 MiB, so that the lossy link (10 ms round
/// trip, 0.5% loss each way) carries it in seconds.
fn model() -> Vec<(String, TensorData)> {
    let wanted = [
        "Q8S-tensor-F32",
        "Q8S-block32-F32",
        "Q4S-block32-F16",
        "Q8F-tensor-BF16",
        "E2M1-block16-UE4M3+tensor-F32",
    ];
    let schemes = samples::schemes();
    let mut tensors: Vec<(String, TensorData)> = wanted
        .iter()
        .enumerate()
        .map(|(i, label)| {
            let (_, scheme) = schemes
                .iter()
                .find(|(l, _)| l == label)
                .unwrap_or_else(|| panic!("samples::schemes() has no {label}"));
            let data = samples::quantized(scheme, &[256, 512], i as u64);
            (format!("layers.{i}.w"), data)
        })
        .collect();
    tensors.push((
        "norm.gamma".to_string(),
        samples::plain(DType::F32, &[256, 512], 7),
    ));
    tensors
}

/// Runs the script to completion, or kills it once it overran its own deadline.
fn run_script(args: &[&Path]) -> (bool, String, String) {
    // The script lives with the workspace's other scripts, two levels up from this package.
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/netns-pull.sh");
    let mut child = Command::new("bash")
        .arg(&script)
        .args(args)
        .env("FERRY_NETNS_TIMEOUT", SCRIPT_LIMIT_S.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("bash runs the script");
    // Drained on their own threads, so that a chatty script never blocks on a full pipe.
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = drain(Box::new(child.stdout.take().expect("stdout")));
    let stderr = drain(Box::new(child.stderr.take().expect("stderr")));
    let deadline = Instant::now() + Duration::from_secs(SCRIPT_LIMIT_S) + KILL_MARGIN;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the script") {
            break status;
        }
        if Instant::now() > deadline {
            // SIGKILL skips the script's trap; its namespaces would outlive it, so say so.
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the script overran its own deadline and was killed; check `ip netns list` for \
                 leftover ferry-a-*/ferry-b-* namespaces"
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = stdout.join().expect("stdout reader");
    let stderr = stderr.join().expect("stderr reader");
    (status.success(), stdout, stderr)
}

#[test]
#[ignore = "needs root, ip and tc: creates network namespaces"]
fn a_quantized_model_crosses_a_lossy_link_node_to_node_bit_exact() {
    let server = ferry_server_next_to(crate::ferry_cli());
    let cli = crate::ferry_cli().to_path_buf();
    let dir = tempfile::tempdir().expect("temp dir");
    let sent = dir.path().join("model.bpk");
    let back = dir.path().join("back.bpk");
    let model = model();
    write_tensors(&sent, &model).expect("write the model");

    let (ok, stdout, stderr) = run_script(&[&server, &cli, &sent, &back]);
    print!("{stdout}");
    eprint!("{stderr}");
    if let Some(reason) = stdout.lines().find(|l| l.starts_with("skipping:")) {
        println!("netns test {reason}");
        return;
    }
    assert!(ok, "tests/netns-pull.sh failed");

    // `ferry get` of a whole device writes the tensors in the node's order; compare by name.
    let mut expected = model;
    let mut received = read_tensors(&back).expect("read what came back");
    expected.sort_by(|a, b| a.0.cmp(&b.0));
    received.sort_by(|a, b| a.0.cmp(&b.0));
    let names = |t: &[(String, TensorData)]| t.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&received), names(&expected), "tensor names");
    for ((name, got), (_, want)) in received.iter().zip(&expected) {
        assert_eq!(got.dtype(), want.dtype(), "{name}: dtype");
        assert_eq!(got.shape(), want.shape(), "{name}: shape");
        assert!(got.as_bytes() == want.as_bytes(), "{name}: bytes differ");
    }
    println!("{} tensors came back bit-exact", received.len());
}

/// The `ferry-server` binary, which this test runs inside a network namespace of its own, so
/// that it must be a process; another package's binary, found where cargo builds it beside
/// `ferry` (`cargo build -p ferry-server-cli` first).
fn ferry_server_next_to(ferry: &Path) -> std::path::PathBuf {
    let path = ferry.with_file_name(format!("ferry-server{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "{} is missing: run `cargo build -p ferry-server-cli` first",
        path.display()
    );
    path
}
