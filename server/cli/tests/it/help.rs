//! `ferry-server --help`: every flag is documented.

use std::process::Command;

#[test]
fn help_names_every_flag() {
    let output = Command::new(env!("CARGO_BIN_EXE_ferry-server"))
        .arg("--help")
        .output()
        .expect("ferry-server runs");
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    for flag in [
        "--listen",
        "--device",
        "--token",
        "--max-connections",
        "--max-tensor-bytes",
        "--memory-limit",
        "--transfer",
        "--idle-timeout",
        "--hello-timeout",
        "--shutdown-grace",
        "--chunk-size",
        "--node-id",
        "--peer-token",
        "--capability-ttl",
        "--pull-retries",
        "--pool",
        "--shareable-receives",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help:\n{help}");
    }
}

#[test]
fn a_chunk_size_past_the_frame_limit_is_refused() {
    let output = Command::new(env!("CARGO_BIN_EXE_ferry-server"))
        .args(["--listen", "127.0.0.1:0", "--chunk-size", "64MiB"])
        .output()
        .expect("ferry-server runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--chunk-size"), "{stderr}");
}

#[test]
fn a_pool_and_shareable_receives_are_one_choice() {
    let output = Command::new(env!("CARGO_BIN_EXE_ferry-server"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--pool",
            "8MiB",
            "--shareable-receives",
        ])
        .output()
        .expect("ferry-server runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--shareable-receives") && stderr.contains("--pool"),
        "{stderr}"
    );
}

#[test]
fn a_gpu_device_that_cannot_open_stops_the_node_at_start_naming_it() {
    let output = Command::new(env!("CARGO_BIN_EXE_ferry-server"))
        .args(["--listen", "127.0.0.1:0", "--device", "flex"])
        .args(["--device", "vulkan:57"])
        .output()
        .expect("ferry-server runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("device 1") && stderr.contains("vulkan:57"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        !String::from_utf8_lossy(&output.stdout).contains("listening on"),
        "it never served"
    );
    // A spec that names nothing, and CUDA, are refused as arguments.
    for (spec, says) in [("wgpu:x", "adapter index"), ("cuda:0", "CUDA")] {
        let output = Command::new(env!("CARGO_BIN_EXE_ferry-server"))
            .args(["--listen", "127.0.0.1:0", "--device", spec])
            .output()
            .expect("ferry-server runs");
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(says), "{spec}: {stderr}");
    }
}
