//! Shareable receives (`ReceiveBuffers::Shareable`, `--shareable-receives`): a tensor that
//! arrives over TCP (a put or a pull) lands in a new shared-memory region, sealed once complete,
//! and goes on to a same-host peer as that very region, with no copy; every dtype and scheme
//! bit-exact; no region outlives its tensors, a put cut halfway included.

use ferry_proto::TransferPath;
use ferry_testkit::copy_keys;
use std::collections::BTreeSet;
use std::time::Duration;

use ferry_client::Client;
use ferry_proto::{DType, TensorData, TensorKey};
use ferry_server::{NodeConfig, ReceiveBuffers, ServiceConfig};
use ferry_testkit::samples;
use ferry_testkit::{
    REGIONS, TestNode, assert_same, devices, eventually, how, on_device, start_unix, start_with,
};

/// A node with one flex device on TCP and a Unix socket, receiving payloads of `min_bytes` and
/// more into regions.
async fn shareable_node(min_bytes: usize) -> TestNode {
    let config = NodeConfig {
        devices: devices(&["flex"]),
        receive_buffers: ReceiveBuffers::Shareable { min_bytes },
        ..NodeConfig::light()
    };
    start_unix(config, ServiceConfig::default()).await
}

async fn plain_unix_node() -> TestNode {
    let config = NodeConfig {
        devices: devices(&["flex"]),
        ..NodeConfig::light()
    };
    start_unix(config, ServiceConfig::default()).await
}

/// The regions this process maps, by inode: one inode per region, however many mappings.
fn region_inodes() -> BTreeSet<u64> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter(|l| l.contains(&format!("memfd:{}", ferry_memory::region::REGION_NAME)))
        .filter_map(|l| l.split_whitespace().nth(4)?.parse().ok())
        .collect()
}

/// Whether any mapping of the region `inode` is shared and writable (`rw-s`): none may be, once
/// the region is sealed.
fn writable_mappings_of(inode: u64) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            fields.get(4) == Some(&inode.to_string().as_str()) && fields.get(1) == Some(&"rw-s")
        })
        .count()
}

async fn no_region_left(what: &str) {
    let pid = std::process::id();
    eventually(what, Duration::from_secs(10), || {
        ferry_memory::region::count_regions(pid).unwrap() == (0, 0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_put_over_tcp_goes_on_to_a_same_host_node_as_the_same_region() {
    let _serial = REGIONS.lock().await;
    let a = shareable_node(ferry_io::connection::KEEP_REGION_MIN).await;
    let b = plain_unix_node().await;
    let before = region_inodes();
    // 8 MiB over TCP, in chunks: received into a region, sealed, kept.
    let data = samples::plain(DType::F32, &[2048, 1024], 11);
    a.client()
        .await
        .put(&TensorKey::new(0, "w"), &data)
        .await
        .unwrap();
    let mut a_stats = a.client().await.stat().await.unwrap();
    assert_eq!(a_stats.regions_kept, 1, "the put's region is kept");
    let after_put: BTreeSet<u64> = region_inodes().difference(&before).copied().collect();
    assert_eq!(after_put.len(), 1, "one region holds the tensor");
    let inode = *after_put.first().unwrap();
    assert_eq!(
        writable_mappings_of(inode),
        0,
        "sealed: no shared writable mapping left"
    );

    // Node to node over the Unix sockets: B pulls A's region itself.
    let (a_unix, b_unix) = (a.unix.clone().unwrap(), b.unix.clone().unwrap());
    let mut source = Client::connect(a_unix.as_str()).await.unwrap();
    let mut target = Client::connect(b_unix.as_str()).await.unwrap();
    let key = TensorKey::new(0, "w");
    let answers = copy_keys(
        &mut source,
        &mut target,
        std::slice::from_ref(&key),
        &how(&a_unix, 0),
    )
    .await
    .unwrap();
    assert_eq!(answers[0].as_ref().unwrap().path, TransferPath::Pull);
    let after_copy: BTreeSet<u64> = region_inodes().difference(&before).copied().collect();
    assert_eq!(
        after_copy, after_put,
        "B maps A's region: no new region, no copy"
    );
    assert_same(&target.get(&key).await.unwrap(), &data, "on B");
    assert_same(&source.get(&key).await.unwrap(), &data, "on A");
    a_stats = a.client().await.stat().await.unwrap();
    assert_eq!(a_stats.shm_payloads_sent, 2, "the fetch and the get");

    target.delete(&key).await.unwrap();
    source.delete(&key).await.unwrap();
    drop((source, target));
    no_region_left("the region goes with its last tensor").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dtype_received_into_a_region_by_put_or_pull_is_bit_exact_on_and_past_it() {
    let _serial = REGIONS.lock().await;
    // Every payload into a region (the sample matrix is small): the route is what is tested.
    let a = shareable_node(1).await;
    let b = plain_unix_node().await;
    let c = start_with(&["flex"]).await;
    let matrix = samples::full_matrix();
    let tensors: Vec<(String, TensorData)> = matrix
        .iter()
        .map(|s| (s.name.clone(), s.data.clone()))
        .collect();
    let keys: Vec<TensorKey> = tensors.iter().map(|(n, _)| TensorKey::new(0, n)).collect();
    let (a_unix, b_unix) = (a.unix.clone().unwrap(), b.unix.clone().unwrap());
    let mut on_a = a.client().await;
    let mut on_b = Client::connect(b_unix.as_str()).await.unwrap();
    let mut a_by_unix = Client::connect(a_unix.as_str()).await.unwrap();
    for route in ["put", "pull"] {
        if route == "put" {
            for answer in on_a.put_batch(&on_device(0, &tensors)).await.unwrap() {
                answer.unwrap();
            }
        } else {
            // Pulled over TCP from a node that holds them in its heap.
            let mut on_c = c.client().await;
            on_c.put_batch(&on_device(0, &tensors)).await.unwrap();
            let c_addr = c.addr.to_string();
            for answer in copy_keys(&mut on_c, &mut on_a, &keys, &how(&c_addr, 0))
                .await
                .unwrap()
            {
                assert_eq!(answer.unwrap().path, TransferPath::Pull);
            }
        }
        let kept = on_a.stat().await.unwrap().regions_kept;
        assert!(kept > 0, "{route}: tensors kept in their regions");
        // On to B through shared memory, and back out of both.
        for answer in copy_keys(&mut a_by_unix, &mut on_b, &keys, &how(&a_unix, 0))
            .await
            .unwrap()
        {
            answer.unwrap();
        }
        for (name, data) in &tensors {
            let key = TensorKey::new(0, name);
            assert_same(
                &on_a.get(&key).await.unwrap(),
                data,
                &format!("{route}: {name} on A"),
            );
            assert_same(
                &on_b.get(&key).await.unwrap(),
                data,
                &format!("{route}: {name} on B"),
            );
        }
        for key in &keys {
            on_a.delete(key).await.unwrap();
            on_b.delete(key).await.unwrap();
        }
        assert_eq!(on_a.stat().await.unwrap().regions_kept, 0, "{route}");
    }
    drop((on_a, on_b, a_by_unix));
    no_region_left("no region outlives its tensors").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_cut_halfway_into_a_shareable_node_leaves_no_region() {
    use crate::hostile::{Raw, put_request};
    use ferry_proto::{Response, frame, tensor};
    use tokio::io::AsyncWriteExt;
    const MIB: usize = 1 << 20;
    let _serial = REGIONS.lock().await;
    let a = shareable_node(ferry_io::connection::KEEP_REGION_MIN).await;
    let data = samples::plain(DType::F32, &[2048, 1024], 12);
    let (mut raw, _) = Raw::hello(&a, None).await;
    let meta = tensor::meta_of(&data).unwrap().to_wire();
    raw.send(&put_request(0, "cut", meta)).await;
    assert_eq!(raw.response().await, Some(Response::Ready));
    let bytes = data.as_bytes();
    for offset in (0..2 * MIB).step_by(MIB) {
        let chunk = frame::encode_chunk(offset as u64, &bytes[offset..offset + MIB]);
        raw.stream.write_all(&chunk).await.unwrap();
    }
    let pid = std::process::id();
    eventually(
        "the put receives into a region",
        Duration::from_secs(10),
        || ferry_memory::region::count_regions(pid).unwrap().0 > 0,
    )
    .await;
    drop(raw);
    no_region_left("a cut put leaves no region").await;
    let mut client = a.client().await;
    assert!(
        client.list(None).await.unwrap().is_empty(),
        "nothing registered"
    );
    assert_eq!(client.stat().await.unwrap().regions_kept, 0);
}
