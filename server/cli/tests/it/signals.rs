//! The real `ferry-server` binary: its `listening on` line, a flex and an ndarray device, a
//! token from the environment, and a clean exit on SIGTERM.

use std::process::Command;
use std::time::{Duration, Instant};

use ferry_testkit::{assert_same, code_of, spawn_server};

use crate::ferry_server;
use ferry_client::{Client, ErrorCode};
use ferry_proto::{DType, TensorKey, TransferPath};
use ferry_testkit::samples;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_and_stops_cleanly_on_sigterm() {
    let mut server = spawn_server(
        ferry_server(),
        &["--device", "flex", "--device", "ndarray"],
        Some("tok"),
    );
    assert_eq!(
        code_of(Client::connect(server.addr.as_str()).await),
        ErrorCode::AuthRefused
    );
    let mut client = Client::connect(server.addr.as_str())
        .token("tok")
        .await
        .unwrap();
    let stats = client.stat().await.unwrap();
    let backends: Vec<&str> = stats.devices.iter().map(|d| d.backend.as_str()).collect();
    assert_eq!(backends, ["flex", "ndarray"]);

    let data = samples::quantized(&samples::schemes()[1].1, &[8, 64], 3);
    client.put(&TensorKey::new(0, "q"), &data).await.unwrap();
    let copied = client
        .copy(&TensorKey::new(0, "q"), &TensorKey::new(0, "q").on(1))
        .await
        .unwrap();
    assert_eq!(copied.path, TransferPath::RoundTrip);
    assert_same(
        &client.get(&copied.key).await.unwrap(),
        &data,
        "via ndarray",
    );
    let half = samples::plain(DType::F16, &[2, 2], 1);
    client.put(&TensorKey::new(0, "h"), &half).await.unwrap();
    let refused = client
        .copy(&TensorKey::new(0, "h"), &TensorKey::new(0, "h").on(1))
        .await;
    assert_eq!(code_of(refused), ErrorCode::UnsupportedDType);
    drop(client);

    let status = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            assert!(status.success(), "exit status {status}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "ferry-server did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_bad_device_spec_is_a_clear_error() {
    let output = Command::new(ferry_server())
        .args(["--listen", "127.0.0.1:0", "--device", "tpu"])
        .output()
        .expect("ferry-server runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("unknown device \"tpu\""), "{stderr}");
}
