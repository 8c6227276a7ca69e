//! Same-host transfers: Unix sockets and shared-memory regions. Every dtype and scheme through
//! both, two node processes copying a batch through shared memory, and the fault paths (a
//! sender gone after creating a region, a receiver gone before reading one), each ending with a
//! count of the regions left in every process involved: none.

use std::time::Duration;

use ferry_testkit::{
    REGIONS, ServerProcess, assert_same, eventually, on_device, spawn_server, start_unix,
};

use crate::ferry_server;
use ferry_client::{Client, ConnectionLimits, SharedMemory};
use ferry_io::connection::{DEFAULT_REGION_MIN, PayloadRoute};
use ferry_io::transport::Endpoint;
use ferry_io::{Connection, Stream, Transport};
use ferry_memory::region::{OutgoingRegion, count_regions, regions_in_flight};
use ferry_proto::{
    FEATURE_SHM, FEATURES, Hello, NodeStats, PROTOCOL_MINOR, PROTOCOL_VERSION, Request, Response,
    TensorData, TensorKey, TransferPath,
};
use ferry_server::{NodeConfig, ServiceConfig};
use ferry_testkit::copy_keys;
use ferry_testkit::samples;

/// Limits that send every non-empty payload through shared memory where it is agreed.
fn every_payload_shared() -> ConnectionLimits {
    ConnectionLimits {
        region_min: 1,
        ..ConnectionLimits::default()
    }
}

/// A connection to open with [`every_payload_shared`], offering shared memory or not.
fn config(connect: ferry_client::Connect, shared: bool) -> ferry_client::Connect {
    let shared_memory = if shared {
        SharedMemory::Offer
    } else {
        SharedMemory::Decline
    };
    connect
        .limits(every_payload_shared())
        .shared_memory(shared_memory)
}

fn matrix() -> Vec<(String, TensorData)> {
    samples::full_matrix()
        .into_iter()
        .map(|s| (s.name, s.data))
        .collect()
}

/// Regions (open descriptors, mappings) left in this process.
fn regions_here() -> (usize, usize) {
    count_regions(std::process::id()).expect("/proc is readable")
}

/// Puts, gets back and compares every sample over one connection; returns how many payloads
/// were not empty (those are the ones that can travel as regions).
async fn round_trip_matrix(client: &mut Client) -> u64 {
    let tensors = matrix();
    for answer in client.put_batch(&on_device(0, &tensors)).await.unwrap() {
        answer.unwrap();
    }
    let keys: Vec<TensorKey> = tensors.iter().map(|(n, _)| TensorKey::new(0, n)).collect();
    let back = client.get_batch(&keys).await.unwrap();
    for ((name, data), got) in tensors.iter().zip(back) {
        assert_same(&got.unwrap(), data, name);
    }
    // And once more through a device copy, so adopted regions feed Burn's own paths too.
    for key in &keys {
        let info = client.copy(key, &key.on(1)).await.unwrap();
        let (name, data) = &tensors[keys.iter().position(|k| k == key).unwrap()];
        assert_same(&client.get(&info.key).await.unwrap(), data, name);
        client.delete(&info.key).await.unwrap();
        client.delete(key).await.unwrap();
    }
    tensors
        .iter()
        .filter(|(_, d)| !d.as_bytes().is_empty())
        .count() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dtype_and_scheme_goes_through_shared_memory_bit_exact_and_leaves_no_region() {
    let _serial = REGIONS.lock().await;
    let node = start_unix(
        NodeConfig::light(),
        ServiceConfig {
            limits: every_payload_shared(),
            ..ServiceConfig::default()
        },
    )
    .await;
    let unix = node.unix.clone().unwrap();
    let mut client = config(Client::connect(unix.as_str()), true).await.unwrap();
    assert!(
        client.shared_memory(),
        "a Unix socket to a node that offers it"
    );
    let shared = round_trip_matrix(&mut client).await;
    let stats = client.stat().await.unwrap();
    assert_eq!(
        stats.shm_payloads_received, shared,
        "every put came as a region"
    );
    // Each non-empty tensor was read twice (the original and its device copy).
    assert_eq!(stats.shm_payloads_sent, 2 * shared);
    assert_eq!(stats.transfers_failed, 0);
    assert_eq!(stats.regions_in_flight, 0);
    assert_eq!(
        stats.unix_socket.as_deref(),
        Some(unix.as_str()),
        "stat names the socket"
    );
    assert!(stats.shared_memory);
    drop(client);
    node.shutdown().await;
    assert_eq!(regions_here(), (0, 0), "every region went with its tensor");
    assert_eq!(regions_in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dtype_and_scheme_goes_over_a_unix_socket_without_shared_memory() {
    let _serial = REGIONS.lock().await;
    let node = start_unix(
        NodeConfig::light(),
        ServiceConfig {
            limits: every_payload_shared(),
            ..ServiceConfig::default()
        },
    )
    .await;
    let unix = node.unix.clone().unwrap();
    let mut client = config(Client::connect(unix.as_str()), false).await.unwrap();
    assert!(!client.shared_memory(), "the client turned it off");
    round_trip_matrix(&mut client).await;
    let stats = client.stat().await.unwrap();
    assert_eq!(stats.shm_payloads_received + stats.shm_payloads_sent, 0);
    assert_eq!(stats.transfers_failed, 0);
    drop(client);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_shared_memory_is_still_reached_over_its_unix_socket() {
    let _serial = REGIONS.lock().await;
    let node = start_unix(
        NodeConfig {
            shared_memory: ferry_io::SharedMemory::Decline,
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await;
    let mut client = config(Client::connect(node.unix.clone().unwrap().as_str()), true)
        .await
        .unwrap();
    assert!(!client.shared_memory(), "the node turned it off");
    let data = samples::plain(ferry_proto::DType::F32, &[256, 1024], 3);
    client.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    assert_same(
        &client.get(&TensorKey::new(0, "w")).await.unwrap(),
        &data,
        "w",
    );
    let stats = client.stat().await.unwrap();
    assert!(!stats.shared_memory);
    assert_eq!(stats.shm_payloads_received + stats.shm_payloads_sent, 0);
    drop(client);
    node.shutdown().await;
}

fn unix_server(dir: &tempfile::TempDir, name: &str, extra: &[&str]) -> ServerProcess {
    let path = dir.path().join(name);
    let path = path.to_str().unwrap();
    let mut args = vec!["--device", "flex", "--device", "ndarray", "--unix", path];
    args.extend_from_slice(extra);
    spawn_server(ferry_server(), &args, None)
}

/// Regions left in a node process: open descriptors and mappings.
/// Asks the node for its stats until `check` holds (5 s at most).
async fn stat_until(client: &mut Client, what: &str, check: impl Fn(&NodeStats) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let stats = client.stat().await.unwrap();
        if check(&stats) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within 5 s: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn regions_in(server: &ServerProcess) -> (usize, usize) {
    count_regions(server.pid()).expect("the node's /proc is readable")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_node_processes_copy_a_batch_through_shared_memory() {
    let _serial = REGIONS.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let a = unix_server(&dir, "a.sock", &["--shm-min", "1"]);
    let b = unix_server(&dir, "b.sock", &["--shm-min", "1"]);
    let a_unix = a.unix.clone().unwrap();
    let mut source = config(Client::connect(a_unix.as_str()), true)
        .await
        .unwrap();
    let mut target = config(Client::connect(b.unix.clone().unwrap().as_str()), true)
        .await
        .unwrap();
    let tensors: Vec<(String, TensorData)> = (0..48)
        .map(|i| {
            let data = if i % 2 == 0 {
                samples::quantized(&samples::schemes()[i % 7].1, &[16, 64], i as u64)
            } else {
                let dtype = samples::plain_dtypes()[i % samples::plain_dtypes().len()];
                samples::plain(dtype, &[32, 48], i as u64)
            };
            (format!("layer{i}.w"), data)
        })
        .collect();
    for answer in source.put_batch(&on_device(0, &tensors)).await.unwrap() {
        answer.unwrap();
    }
    let keys: Vec<TensorKey> = tensors.iter().map(|(n, _)| TensorKey::new(0, n)).collect();
    let how = ferry_testkit::how(&a_unix, 0);
    let answers = copy_keys(&mut source, &mut target, &keys, &how)
        .await
        .unwrap();
    for ((name, data), answer) in tensors.iter().zip(answers) {
        let info = answer.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(info.path, TransferPath::Pull, "{name}");
        assert_same(&target.get(&info.key).await.unwrap(), data, name);
    }
    let count = tensors.len() as u64;
    let b_stats = target.stat().await.unwrap();
    assert_eq!(b_stats.pulls, count);
    // Received: the pulls; sent: the gets just made.
    assert_eq!(b_stats.shm_payloads_received, count);
    assert_eq!(b_stats.shm_payloads_sent, count);
    let a_stats = source.stat().await.unwrap();
    assert_eq!(a_stats.fetches_served, count);
    assert_eq!(a_stats.shm_payloads_sent, count, "each pull took a region");
    assert_eq!(a_stats.regions_in_flight + b_stats.regions_in_flight, 0);
    // Nothing but the tensors' own storage is left; with the tensors gone, nothing at all.
    assert_eq!(regions_in(&a).0, 0, "no region descriptor left open in A");
    assert_eq!(regions_in(&b).0, 0, "no region descriptor left open in B");
    for key in &keys {
        source.delete(key).await.unwrap();
        target.delete(key).await.unwrap();
    }
    assert_eq!(regions_in(&a), (0, 0));
    assert_eq!(regions_in(&b), (0, 0));
}

/// A hand-driven connection that has agreed on shared memory with the node at `unix`.
async fn raw_shared_connection(unix: &str) -> Connection<Stream> {
    let stream = Endpoint::parse(unix).connect(None).await.unwrap();
    let mut conn = Connection::new(stream, ConnectionLimits::default());
    let mut features: Vec<String> = FEATURES.iter().map(|f| f.to_string()).collect();
    features.push(FEATURE_SHM.to_string());
    conn.write_request(&Request::Hello(Hello {
        major: PROTOCOL_VERSION,
        minor: PROTOCOL_MINOR,
        features,
        token: None,
        agent: "ferry-test".into(),
    }))
    .await
    .unwrap();
    match conn.read_response().await.unwrap() {
        Response::Welcome(w) => assert!(w.features.iter().any(|f| f == FEATURE_SHM)),
        other => panic!("expected Welcome, got {other:?}"),
    }
    conn.set_shared_memory(true);
    assert!(conn.shared_memory());
    conn
}

/// Starts a put of `data` under `name` and waits for the node's `Ready`.
async fn begin_put(conn: &mut Connection<Stream>, name: &str, data: &TensorData) {
    let meta = ferry_proto::tensor::meta_of(data).unwrap();
    conn.write_request(&Request::Put {
        device: 0,
        name: Some(name.into()),
        meta: meta.to_wire(),
        overwrite: false,
    })
    .await
    .unwrap();
    assert_eq!(conn.read_response().await.unwrap(), Response::Ready);
}

/// The node still serves a normal client bit-exact and holds nothing it should not.
async fn node_is_clean(node: &ServerProcess) {
    let mut client = Client::connect(node.unix.clone().unwrap().as_str())
        .await
        .unwrap();
    assert!(
        client.list(None).await.unwrap().is_empty(),
        "nothing half-registered"
    );
    let data = samples::plain(ferry_proto::DType::F32, &[512, 512], 9);
    client
        .put(&TensorKey::new(0, "after"), &data)
        .await
        .unwrap();
    assert_same(
        &client.get(&TensorKey::new(0, "after")).await.unwrap(),
        &data,
        "after",
    );
    client.delete(&TensorKey::new(0, "after")).await.unwrap();
    let stats = client.stat().await.unwrap();
    assert_eq!(stats.regions_in_flight, 0);
    drop(client);
    // A deleted tensor's mapping goes once its background hash (the put's, computed after the
    // answer at a lower priority) notices the deletion: at the latest, one hashed piece later.
    eventually(
        "no region left in the node",
        Duration::from_secs(10),
        || regions_in(node) == (0, 0),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_gone_after_creating_a_region_leaves_nothing_behind() {
    let _serial = REGIONS.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let node = unix_server(&dir, "n.sock", &[]);
    let unix = node.unix.clone().unwrap();
    let data = samples::plain(ferry_proto::DType::F32, &[1024, 1024], 1);

    // Gone after creating the region, before sending it.
    let mut conn = raw_shared_connection(&unix).await;
    begin_put(&mut conn, "w", &data).await;
    let region = OutgoingRegion::create(data.as_bytes()).unwrap();
    assert_eq!(regions_in_flight(), 1);
    drop(conn);
    drop(region);
    assert_eq!(regions_in_flight(), 0);

    // Gone right after sending a whole, valid region, before the node's answer: the upload is
    // complete, so the node registers it (whole and exact), as it would a chunked one.
    let mut conn = raw_shared_connection(&unix).await;
    begin_put(&mut conn, "w", &data).await;
    assert_eq!(
        conn.write_payload(data.as_bytes()).await.unwrap(),
        PayloadRoute::Region
    );
    drop(conn);
    let mut client = Client::connect(unix.as_str()).await.unwrap();
    let key = TensorKey::new(0, "w");
    // The node registers it once it has read the region: poll for it.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let stored = loop {
        match client.get(&key).await {
            Ok(back) => break back,
            Err(e) => assert!(std::time::Instant::now() < deadline, "not registered: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_same(&stored, &data, "w");
    // It came back mapped from a region: let that go before this process's regions are counted.
    drop(stored);
    client.delete(&key).await.unwrap();
    drop(client);

    // A region whose declared checksum is not its bytes' is adopted for the bytes it holds: the
    // seals, not the sender's checksum, are what make them safe to map, and the node hashes
    // what it registers. Nothing reads the region to adopt it.
    let mut conn = raw_shared_connection(&unix).await;
    begin_put(&mut conn, "w", &data).await;
    let region = OutgoingRegion::create(data.as_bytes()).unwrap();
    let mut lying = region.descriptor();
    lying.crc32c ^= 1;
    let fd = region.into_fd().unwrap();
    send_region(&mut conn, fd, lying).await;
    let answer = conn.read_response().await.unwrap();
    assert!(matches!(&answer, Response::Stored(_)), "{answer:?}");
    drop(conn);
    let mut client = Client::connect(unix.as_str()).await.unwrap();
    let stored = client.get(&key).await.unwrap();
    assert_same(&stored, &data, "w");
    drop(stored);
    client.delete(&key).await.unwrap();
    drop(client);

    // A region frame that comes without its descriptor.
    let mut conn = raw_shared_connection(&unix).await;
    begin_put(&mut conn, "w", &data).await;
    let descriptor = OutgoingRegion::create(data.as_bytes())
        .unwrap()
        .descriptor();
    conn.write_frame(&descriptor.frame()).await.unwrap();
    let answer = conn.read_response().await.unwrap();
    assert!(
        matches!(&answer, Response::Error(e) if e.message.contains("without its file descriptor")),
        "{answer:?}"
    );
    drop(conn);

    // The node drops what the refused connections sent once it sees them close.
    eventually(
        "the node let go of every region",
        Duration::from_secs(5),
        || regions_in(&node) == (0, 0),
    )
    .await;
    node_is_clean(&node).await;
    assert_eq!(regions_here(), (0, 0), "and none left in the sender");
}

/// Sends a region frame declaring `descriptor` with `fd`, bypassing the connection's own checks.
async fn send_region(
    conn: &mut Connection<Stream>,
    fd: std::os::fd::OwnedFd,
    descriptor: ferry_proto::RegionDescriptor,
) {
    conn.get_mut().attach_fd(fd).unwrap();
    conn.write_frame(&descriptor.frame()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_gone_before_reading_a_region_leaves_nothing_behind() {
    let _serial = REGIONS.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let node = unix_server(&dir, "n.sock", &[]);
    let unix = node.unix.clone().unwrap();
    let data = samples::plain(ferry_proto::DType::F32, &[1024, 1024], 2);
    assert!(data.as_bytes().len() >= DEFAULT_REGION_MIN);
    let mut client = Client::connect(unix.as_str()).await.unwrap();
    client.put(&TensorKey::new(0, "w"), &data).await.unwrap();

    // Ask for it, take the answer, and go before reading the region the node then sends.
    let mut conn = raw_shared_connection(&unix).await;
    conn.write_request(&Request::Get {
        key: TensorKey::new(0, "w"),
    })
    .await
    .unwrap();
    assert!(matches!(
        conn.read_response().await.unwrap(),
        Response::Tensor { .. }
    ));
    // The region and its descriptor are in this side's socket buffer, unread, once sent.
    stat_until(&mut client, "the region sent", |s| s.shm_payloads_sent == 1).await;
    drop(conn);
    stat_until(&mut client, "no region in flight", |s| {
        s.regions_in_flight == 0
    })
    .await;
    // What is left is the stored tensor's own: its mapping, and (at 4 MiB, large enough to be
    // passed on without a copy) the region's descriptor it keeps for that.
    assert!(data.as_bytes().len() >= ferry_io::connection::KEEP_REGION_MIN);
    assert_eq!(regions_in(&node), (1, 1));
    client.delete(&TensorKey::new(0, "w")).await.unwrap();
    drop(client);
    node_is_clean(&node).await;
    assert_eq!(
        regions_here(),
        (0, 0),
        "the unread descriptor went with the socket"
    );
}

/// Copies `keys` from the node `from` is connected to (reached at `source_addr`) to device 0 of
/// the one `to` is, each by a pull (not a dedup).
async fn pull_all(from: &mut Client, to: &mut Client, source_addr: &str, keys: &[TensorKey]) {
    for answer in copy_keys(from, to, keys, &ferry_testkit::how(source_addr, 0))
        .await
        .unwrap()
    {
        assert_eq!(answer.unwrap().path, TransferPath::Pull);
    }
}

/// The shared-memory files (by inode) the process `pid` holds descriptors of.
fn region_inodes(pid: u32) -> Vec<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut inodes = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        let path = entry.unwrap().path();
        let is_region = std::fs::read_link(&path)
            .is_ok_and(|t| t.to_string_lossy().contains("memfd:ferry-region"));
        if is_region && let Ok(meta) = std::fs::metadata(&path) {
            inodes.push(meta.ino());
        }
    }
    inodes.sort_unstable();
    inodes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_that_arrived_in_shared_memory_is_passed_on_in_the_same_region() {
    let _serial = REGIONS.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let a = unix_server(&dir, "a.sock", &[]);
    let b = unix_server(&dir, "b.sock", &[]);
    let c = unix_server(&dir, "c.sock", &[]);
    let a_unix = a.unix.clone().unwrap();
    let b_unix = b.unix.clone().unwrap();
    let connect = async |unix: &str| Client::connect(unix).await.unwrap();
    let mut on_a = connect(&a_unix).await;
    let mut on_b = connect(&b_unix).await;
    let mut on_c = connect(c.unix.as_deref().unwrap()).await;
    // Plain, and quantized with one scale per tensor and per block (Flex keeps those in place).
    let schemes = samples::schemes();
    let scheme = |name: &str| &schemes.iter().find(|(n, _)| n == name).unwrap().1;
    let tensors: Vec<(String, TensorData)> = vec![
        (
            "w".into(),
            samples::plain(ferry_proto::DType::F32, &[1536, 1024], 5),
        ),
        (
            "q".into(),
            samples::quantized(scheme("Q8S-tensor-F32"), &[2048, 2560], 6),
        ),
        (
            "qb".into(),
            samples::quantized(scheme("Q8S-block32-F16"), &[2048, 2560], 7),
        ),
    ];
    // First a region that is only mapped, not kept (under KEEP_REGION_MIN): it must not upset
    // the kept count (it once wrapped it below zero, and no region was kept after).
    let small = samples::plain(ferry_proto::DType::F32, &[512, 512], 4);
    on_a.put(&TensorKey::new(0, "small"), &small).await.unwrap();
    for (name, data) in &tensors {
        assert!(data.as_bytes().len() >= ferry_io::connection::KEEP_REGION_MIN);
        on_a.put(&TensorKey::new(0, name), data).await.unwrap();
    }
    let kept = region_inodes(a.pid());
    assert_eq!(kept.len(), 3, "A keeps the regions the puts came in");
    assert_eq!(on_a.stat().await.unwrap().regions_kept, 3);
    let keys: Vec<TensorKey> = tensors.iter().map(|(n, _)| TensorKey::new(0, n)).collect();
    pull_all(&mut on_a, &mut on_b, &a_unix, &keys).await;
    // And on again, B -> C: every node maps the regions the client filled.
    pull_all(&mut on_b, &mut on_c, &b_unix, &keys).await;
    assert_eq!(
        region_inodes(b.pid()),
        kept,
        "B holds A's regions, not copies"
    );
    assert_eq!(region_inodes(c.pid()), kept, "C holds them too");
    for client in [&mut on_a, &mut on_b, &mut on_c] {
        for ((name, data), key) in tensors.iter().zip(&keys) {
            assert_same(&client.get(key).await.unwrap(), data, name);
        }
    }
    // The NdArray device copies what it is given: nothing to keep a region for.
    let (name, data) = &tensors[0];
    on_a.put(&TensorKey::new(1, name), data).await.unwrap();
    assert_same(
        &on_a.get(&TensorKey::new(1, name)).await.unwrap(),
        data,
        name,
    );
    // The get's own region: A closes its descriptor once `sendmsg` handed it over, which may be
    // a moment after this client has the tensor.
    eventually(
        "A holds only the kept regions",
        Duration::from_secs(5),
        || region_inodes(a.pid()) == kept,
    )
    .await;
    let a_stats = on_a.stat().await.unwrap();
    assert_eq!(a_stats.shm_payloads_received, 5);
    assert_eq!(
        a_stats.shm_payloads_sent, 7,
        "three pulls and four gets, all regions"
    );
    assert_eq!(a_stats.regions_in_flight, 0);
    for (client, node) in [(&mut on_a, &a), (&mut on_b, &b), (&mut on_c, &c)] {
        for info in client.list(None).await.unwrap() {
            client.delete(&info.key).await.unwrap();
        }
        assert_eq!(
            regions_in(node),
            (0, 0),
            "nothing left once the tensors are gone"
        );
        assert_eq!(client.stat().await.unwrap().regions_kept, 0);
    }
}

/// A region is adopted without reading it (seals, size and owner are checked; pages are mapped
/// as they are first touched), so the target's tensor must stay whole after its sender is gone:
/// here the source is killed as soon as the pull is answered, before the target has read or
/// hashed a byte of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_mapped_lazily_stays_whole_after_its_sender_is_killed() {
    let _serial = REGIONS.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let a = unix_server(&dir, "a.sock", &[]);
    let b = unix_server(&dir, "b.sock", &[]);
    let a_unix = a.unix.clone().unwrap();
    let mut on_a = Client::connect(a_unix.as_str()).await.unwrap();
    let mut on_b = Client::connect(b.unix.as_deref().unwrap()).await.unwrap();
    let schemes = samples::schemes();
    let scheme = |name: &str| &schemes.iter().find(|(n, _)| n == name).unwrap().1;
    let tensors: Vec<(String, TensorData)> = vec![
        (
            "w".into(),
            samples::plain(ferry_proto::DType::F32, &[2048, 1024], 11),
        ),
        (
            "q".into(),
            samples::quantized(scheme("Q8S-block32-F16"), &[2048, 2560], 12),
        ),
    ];
    for (name, data) in &tensors {
        on_a.put(&TensorKey::new(0, name), data).await.unwrap();
    }
    let keys: Vec<TensorKey> = tensors.iter().map(|(n, _)| TensorKey::new(0, n)).collect();
    pull_all(&mut on_a, &mut on_b, &a_unix, &keys).await;
    drop(on_a);
    drop(a);
    for ((name, data), key) in tensors.iter().zip(&keys) {
        assert_same(&on_b.get(key).await.unwrap(), data, name);
    }
    let stats = ferry_testkit::hashes_verified(&mut on_b).await;
    assert_eq!(
        stats.hash_mismatches, 0,
        "the hashes A stated hold for the bytes B maps"
    );
    assert_eq!(stats.shm_payloads_received, 2);
    for key in &keys {
        on_b.delete(key).await.unwrap();
    }
    assert_eq!(
        regions_in(&b),
        (0, 0),
        "nothing left once the tensors are gone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_does_not_read_is_sent_no_new_regions() {
    use ferry_io::connection::UNREAD_REGION_BYTES;
    let _serial = REGIONS.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let node = unix_server(&dir, "n.sock", &[]);
    let unix = node.unix.clone().unwrap();
    // Put over TCP: the tensor lies in the node's heap, so every region would be a new copy.
    let data = samples::plain(ferry_proto::DType::F32, &[2048, 1024], 8);
    let size = data.as_bytes().len();
    let mut client = Client::connect(node.addr.as_str()).await.unwrap();
    client.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    // Sixteen gets pipelined by a peer that reads nothing for a while.
    const GETS: usize = 16;
    let mut conn = raw_shared_connection(&unix).await;
    for _ in 0..GETS {
        let key = TensorKey::new(0, "w");
        conn.write_request(&Request::Get { key }).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Meanwhile the node made new regions up to the unread budget, then sent chunks, which
    // wait on the socket until the peer reads.
    let bounded = (UNREAD_REGION_BYTES / size) as u64;
    assert!(bounded < GETS as u64);
    assert_eq!(client.stat().await.unwrap().shm_payloads_sent, bounded);
    let mut routes = Vec::new();
    for _ in 0..GETS {
        let Response::Tensor { meta, .. } = conn.read_response().await.unwrap() else {
            panic!("expected a tensor");
        };
        let meta = ferry_proto::TensorMeta::try_from(&meta).unwrap();
        let mut assembler = ferry_io::TensorAssembler::new(
            meta,
            1 << 30,
            ferry_io::BufferFrom::Fresh,
            ferry_io::HashUse::Skip,
        )
        .unwrap();
        routes.push(conn.read_payload(&mut assembler).await.unwrap());
        assert_same(&assembler.finish().unwrap().data, &data, "w");
    }
    let bounded = bounded as usize;
    assert!(routes[..bounded].iter().all(|r| *r == PayloadRoute::Region));
    assert_eq!(routes[bounded], PayloadRoute::Chunks, "{routes:?}");
    let regions = routes
        .iter()
        .filter(|r| **r == PayloadRoute::Region)
        .count() as u64;
    // The node counts a region once its send returned, which can be just after the peer read
    // it: waited for, not raced.
    stat_until(&mut client, "every region counted", |s| {
        s.shm_payloads_sent == regions
    })
    .await;
    drop(conn);
    client.delete(&TensorKey::new(0, "w")).await.unwrap();
    node_is_clean(&node).await;
}
