//! What an operator relies on: the Prometheus endpoint (scraped here), the health check, JSON
//! logs with a span per request, and the load generator's bit-exact run.

use std::time::Duration;

use ferry_testkit::{LoggedServer, eventually_blocking, spawn_server};

use crate::ferry_server;
use crate::metrics::{free_port, sample, scrape};
use ferry_client::Client;
use ferry_proto::{DType, TensorKey};
use ferry_testkit::samples;

/// How long a count may take to settle.
const WAIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_endpoint_is_scraped_and_counts_what_happened() {
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let node = spawn_server(
        ferry_server(),
        &[
            "--device",
            "flex",
            "--device",
            "flex",
            "--metrics",
            &metrics,
        ],
        None,
    );
    let mut client = Client::connect(node.addr.as_str()).await.unwrap();
    let data = samples::plain(DType::F32, &[64, 64], 1);
    client.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    client.get(&TensorKey::new(0, "w")).await.unwrap();
    client
        .copy(&TensorKey::new(0, "w"), &TensorKey::new(0, "w").on(1))
        .await
        .unwrap();
    let missing = client.get(&TensorKey::new(0, "nope")).await;
    assert!(missing.is_err());

    // A connection is counted closed once its session has ended, just after the peer hung up
    // (the start-up probe's, say): scraped until only this client's remains.
    let text = tokio::task::spawn_blocking(move || {
        let mut text = String::new();
        // A request's in-flight count drops just after its answer is written: settled too.
        eventually_blocking(
            "only the client's connection open, nothing in flight",
            WAIT,
            || {
                text = scrape(port);
                sample(&text, &["ferry_connections "]) == Some(1.0)
                    && sample(&text, &["ferry_transfers_in_flight "]) == Some(0.0)
            },
        );
        text
    })
    .await
    .unwrap();
    let ok = |op: &str| {
        sample(
            &text,
            &[
                "ferry_transfers_total{",
                &format!("op=\"{op}\""),
                "outcome=\"ok\"",
            ],
        )
    };
    assert_eq!(ok("put"), Some(1.0), "{text}");
    assert_eq!(ok("get"), Some(1.0));
    assert_eq!(ok("copy"), Some(1.0));
    assert_eq!(
        sample(
            &text,
            &["ferry_transfers_total{", "op=\"get\"", "outcome=\"error\""]
        ),
        Some(1.0)
    );
    let bytes = data.as_bytes().len() as f64;
    assert_eq!(
        sample(
            &text,
            &["ferry_bytes_total{", "direction=\"in\"", "route=\"chunks\""]
        ),
        Some(bytes)
    );
    assert_eq!(
        sample(
            &text,
            &[
                "ferry_bytes_total{",
                "direction=\"out\"",
                "route=\"chunks\""
            ]
        ),
        Some(bytes)
    );
    assert_eq!(
        sample(&text, &["ferry_device_tensors{", "device=\"0\""]),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, &["ferry_device_bytes{", "device=\"1\""]),
        Some(bytes)
    );
    assert_eq!(sample(&text, &["ferry_connections "]), Some(1.0));
    assert_eq!(sample(&text, &["ferry_transfers_in_flight "]), Some(0.0));
    assert!(
        sample(
            &text,
            &[
                "ferry_transfer_seconds_bucket{",
                "op=\"put\"",
                "le=\"+Inf\""
            ]
        )
        .is_some_and(|n| n >= 1.0),
        "a latency histogram"
    );
    assert!(text.contains("# HELP ferry_transfers_total"));
    assert!(sample(&text, &["ferry_process_resident_bytes "]).is_some_and(|b| b > 0.0));
}

#[test]
fn json_logs_carry_one_span_per_request() {
    let node = LoggedServer::start(
        ferry_server(),
        &["--device", "flex", "--log-format", "json"],
        &[],
    );
    let addr = node.addr.clone();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let mut client = Client::connect(addr.as_str()).await.unwrap();
        let data = samples::plain(DType::I32, &[8, 8], 2);
        client.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    });
    let stderr = node.stop();
    let done: Vec<serde_json::Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .filter(|v: &serde_json::Value| v["fields"]["message"] == "transfer done")
        .collect();
    assert_eq!(done.len(), 1, "{stderr}");
    let event = &done[0];
    assert_eq!(event["fields"]["op"], "put");
    assert_eq!(event["span"]["name"], "request");
    assert_eq!(event["span"]["op"], "put");
    assert!(
        event["span"]["client"]
            .as_str()
            .unwrap()
            .starts_with("127.0.0.1:")
    );
}

/// With no flag, a node makes receive memory ready before any tensor arrives (a quarter of its
/// pool, for a model, in the background at the lowest CPU priority), sized to its device budget,
/// and a tensor that arrives draws from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_default_node_makes_receive_memory_ready_before_the_tensor_arrives() {
    const MIB: u64 = 1 << 20;
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let node = LoggedServer::start(
        ferry_server(),
        &[
            "--device",
            "flex",
            "--memory-limit",
            "2GiB",
            "--metrics",
            &metrics,
        ],
        &[],
    );
    // Made ready at the lowest CPU priority: the other tests running beside this one may leave
    // little CPU to it. Its idle amount at least: the rest of its start amount (512 MiB, a
    // quarter of the pool, in the log below) is made only while the machine has half its
    // memory free, which the nodes of other tests may take.
    tokio::task::spawn_blocking(move || {
        eventually_blocking("256 MiB ready", 6 * WAIT, || {
            sample(&scrape(port), &["ferry_pool_ready_bytes "])
                .is_some_and(|ready| ready >= (256 * MIB) as f64)
        });
    })
    .await
    .unwrap();
    // Its threads: one touching in idle time, one giving back (named so by the pool; their
    // policies are checked by the pool's own tests).
    let threads: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", node.pid()))
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .map(|comm| comm.trim_end().to_string())
        .collect();
    for pool_thread in ["ferry-pool-idle", "ferry-pool-back"] {
        assert!(
            threads.iter().any(|name| name == pool_thread),
            "{threads:?}"
        );
    }
    let mut client = Client::connect(node.addr.as_str()).await.unwrap();
    let stats = client.stat().await.unwrap();
    assert_eq!(stats.pool_bytes, 2048 * MIB, "up to the device budget");
    assert!(stats.resident_bytes >= 256 * MIB, "ready means touched");
    let data = samples::plain(DType::F32, &[4096, 1024], 3);
    client.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let stats = client.stat().await.unwrap();
    assert_eq!(
        stats.pool_free_bytes,
        2048 * MIB - 16 * MIB,
        "drawn from the pool"
    );
    assert_eq!(stats.pool_misses, 0);
    assert_eq!(
        client
            .get(&TensorKey::new(0, "w"))
            .await
            .unwrap()
            .as_bytes(),
        data.as_bytes()
    );
    let log = node.stop();
    assert!(log.contains("elastic receive pool reserved"), "{log}");
    assert!(log.contains("ready_at_start=536870912"), "{log}");
}

/// A node told how much to keep ready keeps that from the start: no larger start amount for a
/// model (which devices get one: `a_start_amount_is_for_nodes_with_a_flex_device`).
#[test]
fn a_node_given_pool_ready_makes_no_start_amount() {
    let told = LoggedServer::start(
        ferry_server(),
        &[
            "--device",
            "flex",
            "--memory-limit",
            "2GiB",
            "--pool-ready",
            "64MiB",
        ],
        &[],
    );
    let log = told.stop();
    assert!(log.contains("ready_at_start=67108864"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_pool_is_reserved_at_start_and_shown_in_stat_and_metrics() {
    const MIB: u64 = 1 << 20;
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let node = LoggedServer::start(
        ferry_server(),
        &["--device", "flex", "--pool", "8MiB", "--metrics", &metrics],
        &[],
    );
    let mut client = Client::connect(node.addr.as_str()).await.unwrap();
    let stats = client.stat().await.unwrap();
    assert_eq!(
        (stats.pool_bytes, stats.pool_free_bytes),
        (8 * MIB, 8 * MIB)
    );
    assert!(
        stats.resident_bytes >= 8 * MIB,
        "the pool is touched at start"
    );
    // 2 MiB draws from it; 16 MiB cannot, and goes to fresh memory as a miss.
    let data = samples::plain(DType::F32, &[512, 1024], 1);
    client.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let larger = samples::plain(DType::F32, &[4096, 1024], 2);
    client
        .put(&TensorKey::new(0, "larger"), &larger)
        .await
        .unwrap();
    let back = client.get(&TensorKey::new(0, "larger")).await.unwrap();
    assert_eq!(back.as_bytes(), larger.as_bytes());
    let stats = client.stat().await.unwrap();
    assert_eq!(stats.pool_free_bytes, 6 * MIB);
    assert_eq!(stats.pool_misses, 1);
    let text = tokio::task::spawn_blocking(move || {
        let mut text = String::new();
        eventually_blocking("the pool gauges sampled", WAIT, || {
            text = scrape(port);
            sample(&text, &["ferry_pool_free_bytes "]) == Some((6 * MIB) as f64)
        });
        text
    })
    .await
    .unwrap();
    assert_eq!(
        sample(&text, &["ferry_pool_bytes "]),
        Some((8 * MIB) as f64)
    );
    assert_eq!(sample(&text, &["ferry_pool_misses_total "]), Some(1.0));
    let log = node.stop();
    assert!(
        log.contains("receive pool reserved and touched") && log.contains("bytes=8388608"),
        "{log}"
    );
    assert!(
        log.contains("the receive pool cannot hold this payload") && log.contains("bytes=16777216"),
        "the miss is logged with its size: {log}"
    );
}
