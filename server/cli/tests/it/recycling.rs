//! The process-wide pool of recycled receive buffers (hence node processes): a recycled buffer
//! never shows the tensor it held before, through pulls, a resumed pull and a put.

use std::time::Duration;

use ferry_client::Client;
use ferry_proto::{DType, TensorData, TensorKey, TransferPath};
use ferry_testkit::samples;
use ferry_testkit::{Fault, assert_same, copy_keys, hashes_verified, how, proxy, spawn_server};

use crate::ferry_server;

/// A node whose large receives go to new or recycled memory: no receive pool (`--pool 0`; a
/// pool's buffers are tested in `tests/it/pool.rs`).
fn server() -> ferry_testkit::ServerProcess {
    spawn_server(ferry_server(), &["--device", "flex", "--pool", "0"], None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recycled_receive_buffer_never_shows_the_tensor_it_held_before() {
    // Two node processes with the default recycling (process-wide, hence processes).
    let a = server();
    let b = server();
    let mut source = Client::connect(a.addr.as_str()).await.unwrap();
    let mut target = Client::connect(b.addr.as_str()).await.unwrap();
    // 20 MiB each, over the 16 MiB from which buffers are recycled; each its own bytes.
    let versions: Vec<TensorData> = (0..3)
        .map(|seed| samples::plain(DType::F32, &[1280, 4096], 40 + seed))
        .collect();
    let bytes = versions[0].as_bytes().len() as u64;
    let name = |i: usize| format!("v{i}");
    for (i, data) in versions.iter().enumerate().take(2) {
        source.put(&TensorKey::new(0, name(i)), data).await.unwrap();
        let key = TensorKey::new(0, name(i));
        let keys = std::slice::from_ref(&key);
        let answers = copy_keys(&mut source, &mut target, keys, &how(&a.addr, 0))
            .await
            .unwrap();
        assert_eq!(answers[0].as_ref().unwrap().path, TransferPath::Pull);
        // The second pull lands in the buffer the first one's tensor left.
        if i == 1 {
            assert!(target.stat().await.unwrap().recycled_bytes < bytes, "taken");
        }
        assert_same(&target.get(&key).await.unwrap(), data, &name(i));
        hashes_verified(&mut target).await;
        target.delete(&key).await.unwrap();
        assert!(
            target.stat().await.unwrap().recycled_bytes >= bytes,
            "kept for reuse"
        );
    }
    // A pull cut mid-stream resumes into the recycled buffer: the bytes before the cut are the
    // new tensor's, those after it are received again, none of the old tensor's shows.
    let via = proxy(
        a.addr.parse().unwrap(),
        Fault::CutOnceAfter(bytes as usize / 2),
    )
    .await
    .to_string();
    let key = TensorKey::new(0, "cut");
    source
        .put(&TensorKey::new(0, &key.name), &versions[2])
        .await
        .unwrap();
    let keys = std::slice::from_ref(&key);
    let answers = copy_keys(&mut source, &mut target, keys, &how(&via, 0))
        .await
        .unwrap();
    answers[0].as_ref().unwrap();
    assert_eq!(
        target.stat().await.unwrap().pull_retries,
        1,
        "the cut was resumed"
    );
    assert_same(&target.get(&key).await.unwrap(), &versions[2], "resumed");
    hashes_verified(&mut target).await;
    target.delete(&key).await.unwrap();
    // A put takes a recycled buffer the same way.
    target
        .put(&TensorKey::new(0, "put"), &versions[2])
        .await
        .unwrap();
    assert!(
        target.stat().await.unwrap().recycled_bytes < bytes,
        "taken again"
    );
    let key = TensorKey::new(0, "put");
    assert_same(&target.get(&key).await.unwrap(), &versions[2], "put");
    target.delete(&key).await.unwrap();
    // Unused, it goes back to the system within a few seconds.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left = target.stat().await.unwrap().recycled_bytes;
        if left == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "recycled buffers not freed once idle: {left} bytes left"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
