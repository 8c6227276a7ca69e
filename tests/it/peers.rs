//! Node-to-node transfers between two real nodes on loopback: every dtype, a 64-tensor batch,
//! dedup, moves, capability misuse, and faults injected by a proxy (a source that dies or
//! drops, a flipped byte, a target that goes away).

use ferry_proto::{ContentHash, IfExists, NodeId, Transfer, TransferPath};
use ferry_server::{NodeLimits, PullConfig};
use ferry_testkit::copy_keys;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::AsyncWriteExt;

use ferry_client::{Client, ErrorCode, IssuedCapability};
use ferry_io::RegionUse;
use ferry_proto::{DType, TensorData, TensorKey};
use ferry_server::{NodeConfig, Peer, PeerPolicy, ServiceConfig};
use ferry_testkit::samples;
use ferry_testkit::{
    Fault, TestNode, assert_same, code_of, copy_one, devices, hashes_verified, how, on_device,
    proxy, source_code_of, source_connection, start, start_with,
};

async fn pair() -> (TestNode, TestNode) {
    (
        start_with(&["flex", "flex"]).await,
        start_with(&["flex", "ndarray"]).await,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dtype_goes_node_to_node_bit_exact_in_one_batch() {
    let (a, b) = pair().await;
    let mut source = a.client().await;
    let mut target = b.client().await;
    let matrix = samples::full_matrix();
    let tensors: Vec<(String, TensorData)> = matrix
        .iter()
        .map(|s| (s.name.clone(), s.data.clone()))
        .collect();
    for answer in source.put_batch(&on_device(0, &tensors)).await.unwrap() {
        answer.unwrap();
    }
    let keys: Vec<TensorKey> = matrix.iter().map(|s| TensorKey::new(0, &s.name)).collect();
    let addr = a.addr.to_string();
    let answers = copy_keys(&mut source, &mut target, &keys, &how(&addr, 0))
        .await
        .unwrap();
    for (sample, answer) in matrix.iter().zip(answers) {
        let info = answer.unwrap_or_else(|e| panic!("{}: {e}", sample.name));
        assert_eq!(info.path, TransferPath::Pull, "{}", sample.name);
        let back = target.get(&info.key).await.unwrap();
        assert_same(&back, &sample.data, &sample.name);
    }
    let stats = target.stat().await.unwrap();
    assert_eq!(stats.pulls, matrix.len() as u64);
    assert_eq!(stats.transfers_failed, 0);
    let served = source.stat().await.unwrap().fetches_served;
    assert_eq!(served, matrix.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_64_tensor_batch_then_the_same_again_costs_no_transfer() {
    let (a, b) = pair().await;
    let mut source = a.client().await;
    let mut target = b.client().await;
    let tensors: Vec<(String, TensorData)> = (0..64)
        .map(|i| {
            let data = samples::quantized(&samples::schemes()[i % 5].1, &[8, 64], i as u64);
            (format!("layer{i}.w"), data)
        })
        .collect();
    source.put_batch(&on_device(0, &tensors)).await.unwrap();
    let keys: Vec<TensorKey> = tensors.iter().map(|(n, _)| TensorKey::new(0, n)).collect();
    let addr = a.addr.to_string();
    for answer in copy_keys(&mut source, &mut target, &keys, &how(&addr, 1))
        .await
        .unwrap()
    {
        // Device 1 is NdArray, which holds these Q8F per-tensor schemes.
        answer.unwrap();
    }
    let before = target.stat().await.unwrap();
    let pulled = before.pulls;
    assert!(pulled > 0);
    // Pushing the same model again to device 0 pulls nothing new for what device 1 holds.
    let answers = copy_keys(&mut source, &mut target, &keys, &how(&addr, 0))
        .await
        .unwrap();
    let mut dedup = 0;
    for ((name, data), answer) in tensors.iter().zip(answers) {
        let info = answer.unwrap();
        if info.path == TransferPath::Dedup {
            dedup += 1;
        }
        assert_same(&target.get(&info.key).await.unwrap(), data, name);
    }
    let after = target.stat().await.unwrap();
    assert_eq!(after.dedup_hits, dedup);
    assert_eq!(
        dedup, pulled,
        "every tensor already on device 1 was deduplicated"
    );
    assert_eq!(after.pulls - before.pulls, 64 - pulled);
    let served = source.stat().await.unwrap().fetches_served;
    assert_eq!(served, 64, "the source sent each tensor exactly once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_to_node_move_deletes_the_source_after_the_target_registered() {
    let (a, b) = pair().await;
    let mut source = a.client().await;
    let mut target = b.client().await;
    let data = samples::plain(DType::U32, &[3, 5, 7], 2);
    source.put(&TensorKey::new(0, "ids"), &data).await.unwrap();
    let addr = a.addr.to_string();
    let mut moving = how(&addr, 0);
    moving.transfer = Transfer::Move;
    moving.dst_name = Some("ids.moved".to_string());
    let answers = copy_keys(
        &mut source,
        &mut target,
        &[TensorKey::new(0, "ids")],
        &moving,
    )
    .await
    .unwrap();
    let info = answers.into_iter().next().unwrap().unwrap();
    assert_same(&target.get(&info.key).await.unwrap(), &data, "moved");
    assert_eq!(
        code_of(source.get(&TensorKey::new(0, "ids")).await),
        ErrorCode::NotFound
    );
    // A move the target refuses (NdArray and F16) keeps the source.
    let half = samples::plain(DType::F16, &[4], 1);
    source.put(&TensorKey::new(0, "half"), &half).await.unwrap();
    let mut refused = how(&addr, 1);
    refused.transfer = Transfer::Move;
    let answers = copy_keys(
        &mut source,
        &mut target,
        &[TensorKey::new(0, "half")],
        &refused,
    )
    .await
    .unwrap();
    let Err(error) = &answers[0] else {
        panic!("expected a refusal");
    };
    assert_eq!(error.code(), Some(ErrorCode::UnsupportedDType));
    assert_same(
        &source.get(&TensorKey::new(0, "half")).await.unwrap(),
        &half,
        "kept",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_are_single_use_bound_expiring_and_unforgeable() {
    let a = start(
        NodeConfig {
            devices: devices(&["flex"]),
            limits: NodeLimits {
                capability_ttl: Duration::from_millis(300),
                ..NodeLimits::default()
            },
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await;
    let b = start_with(&["flex"]).await;
    let c = start_with(&["flex"]).await;
    let mut source = a.client().await;
    let mut target = b.client().await;
    let data = samples::plain(DType::F32, &[64, 33], 1);
    source.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let key = TensorKey::new(0, "w");
    let addr = a.addr.to_string();
    let b_id = target.identify().await.unwrap();

    // Used once, then refused. The target gives back what it pulled each time, so that dedup
    // (which needs no capability) cannot answer instead.
    let grant = source.grant(&key, &b_id).await.unwrap();
    let pulled = target
        .pull(&addr, &grant, &TensorKey::new(0, "w1"), IfExists::Refuse)
        .await
        .unwrap();
    assert_same(&target.get(&pulled.key).await.unwrap(), &data, "pulled");
    target.delete(&pulled.key).await.unwrap();
    let reused = target
        .pull(&addr, &grant, &TensorKey::new(0, "w2"), IfExists::Refuse)
        .await;
    assert_eq!(code_of(reused), ErrorCode::CapabilityRefused);

    // Forged.
    let mut forged = grant.clone();
    forged.token = "f".repeat(32).into();
    let refused = target
        .pull(&addr, &forged, &TensorKey::new(0, "w3"), IfExists::Refuse)
        .await;
    assert_eq!(code_of(refused), ErrorCode::CapabilityRefused);

    // Bound to node C, presented by node B.
    let c_id = c.client().await.identify().await.unwrap();
    let for_c = source.grant(&key, &c_id).await.unwrap();
    let refused = target
        .pull(&addr, &for_c, &TensorKey::new(0, "w4"), IfExists::Refuse)
        .await;
    assert_eq!(code_of(refused), ErrorCode::CapabilityRefused);

    // Expired.
    let late = source.grant(&key, &b_id).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let refused = target
        .pull(&addr, &late, &TensorKey::new(0, "w5"), IfExists::Refuse)
        .await;
    assert_eq!(code_of(refused), ErrorCode::CapabilityRefused);

    // Granted for one version; the tensor is replaced before the pull: refused, never mixed.
    let early = source.grant(&key, &b_id).await.unwrap();
    let newer = samples::plain(DType::F32, &[64, 33], 2);
    source
        .put(&TensorKey::new(0, "w"), &newer)
        .if_exists(IfExists::Replace)
        .await
        .unwrap();
    let refused = target
        .pull(&addr, &early, &TensorKey::new(0, "w6"), IfExists::Refuse)
        .await;
    assert_eq!(code_of(refused), ErrorCode::CapabilityRefused);

    let names: Vec<String> = target
        .list(None)
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.key.name)
        .collect();
    assert!(
        names.is_empty(),
        "no refused pull registered anything: {names:?}"
    );
}

/// A source serving through a proxy with small chunks, and a target that gives a silent source
/// one second and retries twice.
async fn faulty_pair(fault: Fault) -> (TestNode, TestNode, String, TensorData) {
    let mut service = ServiceConfig::default();
    service.limits.chunk_size = 64 * 1024;
    // The source keeps a broken fetch's capability for a resume for half a second.
    let mut resume_window = service.limits;
    resume_window.idle_timeout = Duration::from_millis(500);
    let a = start(
        NodeConfig {
            devices: devices(&["flex"]),
            pulls: PullConfig {
                peer_limits: resume_window,
                ..PullConfig::default()
            },
            ..NodeConfig::light()
        },
        service,
    )
    .await;
    let mut target_config = NodeConfig {
        devices: devices(&["flex"]),
        pulls: PullConfig {
            retries: 2,
            retry_backoff: Duration::from_millis(20),
            ..PullConfig::default()
        },
        ..NodeConfig::light()
    };
    target_config.pulls.peer_limits.idle_timeout = Duration::from_secs(1);
    let b = start(target_config, ServiceConfig::default()).await;
    // 4 MiB in 64 KiB chunks: the fault lands mid-stream.
    let data = samples::plain(DType::F32, &[1024, 1024], 3);
    a.client()
        .await
        .put(&TensorKey::new(0, "big"), &data)
        .await
        .unwrap();
    let via = proxy(a.addr, fault).await.to_string();
    (a, b, via, data)
}

async fn pull_big(
    b: &TestNode,
    a: &TestNode,
    via: &str,
) -> Result<ferry_proto::TensorInfo, ferry_client::ClientError> {
    let mut source = a.client().await;
    let mut target = b.client().await;
    let answers = copy_keys(
        &mut source,
        &mut target,
        &[TensorKey::new(0, "big")],
        &how(via, 0),
    )
    .await
    .unwrap();
    answers.into_iter().next().unwrap()
}

async fn nothing_registered_and_source_intact(a: &TestNode, b: &TestNode, data: &TensorData) {
    let mut target = b.client().await;
    assert!(
        target.list(None).await.unwrap().is_empty(),
        "nothing half-registered"
    );
    let mut source = a.client().await;
    let kept = source.get(&TensorKey::new(0, "big")).await.unwrap();
    assert_same(&kept, data, "source intact");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_dies_mid_stream_fails_the_pull_cleanly() {
    let (a, b, via, data) = faulty_pair(Fault::DieAfter(1 << 20)).await;
    let result = pull_big(&b, &a, &via).await;
    let Err(error) = result else {
        panic!("expected a failure");
    };
    assert_eq!(error.code(), Some(ErrorCode::PeerFailed), "{error}");
    assert!(error.to_string().contains("retries"), "{error}");
    nothing_registered_and_source_intact(&a, &b, &data).await;
    assert_eq!(b.client().await.stat().await.unwrap().pull_retries, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_drop_is_retried_and_resumes_from_the_last_verified_chunk() {
    let (a, b, via, data) = faulty_pair(Fault::CutOnceAfter(1 << 20)).await;
    let info = pull_big(&b, &a, &via).await.unwrap();
    let mut target = b.client().await;
    assert_same(&target.get(&info.key).await.unwrap(), &data, "resumed");
    let stats = target.stat().await.unwrap();
    assert_eq!(stats.pull_retries, 1);
    assert_eq!(stats.pulls, 1);
}

/// A capability on `a`'s "big" bound to `b`, with the connection that was granted it (its
/// capabilities end with it: keep it), `b`'s node id, and a client of `b` to pull with.
async fn big_granted_to(a: &TestNode, b: &TestNode) -> (IssuedCapability, Client, NodeId, Client) {
    let mut source = a.client().await;
    let b_id = b.client().await.identify().await.unwrap();
    let grant = source
        .grant(&TensorKey::new(0, "big"), &b_id)
        .await
        .unwrap();
    (grant, source, b_id, b.client().await)
}

/// Noise on a link in clear (one bit flipped, the chunk's checksum left as the source sent it):
/// the pull's receiver reads each byte once, for the whole payload's hash, not for the chunk
/// checksums too, and that hash catches it: `Integrity`, nothing registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_fails_the_pull_and_registers_nothing() {
    let (a, b, via, data) = faulty_pair(Fault::FlipAt(3 << 19)).await;
    let Err(error) = pull_big(&b, &a, &via).await else {
        panic!("expected a failure");
    };
    assert_eq!(error.code(), Some(ErrorCode::Integrity), "{error}");
    nothing_registered_and_source_intact(&a, &b, &data).await;
}

/// A pull whose bytes do not hash to the grant does not use the capability up: the target
/// releases it only once the hash matched, so the same capability fetches again (over the
/// proxy's next connection, untouched) and lands bit-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_that_fails_its_hash_leaves_the_capability_for_another_fetch() {
    let (a, b, via, data) = faulty_pair(Fault::FlipAt(3 << 19)).await;
    let (grant, _source, _, mut target) = big_granted_to(&a, &b).await;
    let dst = grant.info.key.on(0);
    let failed = target.pull(&via, &grant, &dst, IfExists::Refuse).await;
    assert_eq!(code_of(failed), ErrorCode::Integrity);
    assert!(
        target.list(None).await.unwrap().is_empty(),
        "nothing registered"
    );
    let info = target
        .pull(&via, &grant, &dst, IfExists::Refuse)
        .await
        .expect("the capability was not used up by bytes that were not the ones granted");
    assert_same(
        &target.get(&info.key).await.unwrap(),
        &data,
        "fetched again",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_goes_away_mid_stream_costs_the_source_nothing() {
    // The source sees its reader vanish mid-stream (the proxy cuts both ways and stays down):
    // the source keeps its tensor, and the capability lapses after the resume window.
    let (a, b, via, data) = faulty_pair(Fault::DieAfter(1 << 20)).await;
    let (grant, _source, b_id, mut target) = big_granted_to(&a, &b).await;
    assert!(
        target
            .pull(&via, &grant, &grant.info.key.on(0), IfExists::Refuse)
            .await
            .is_err()
    );
    nothing_registered_and_source_intact(&a, &b, &data).await;
    // Past the resume window the capability is gone, and the source serves others as before.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let mut direct = source_connection(&a).await;
    let lapsed = direct.fetch(&grant.token, &b_id, 0).await.map(|f| f.meta);
    assert_eq!(source_code_of(lapsed), ErrorCode::CapabilityRefused);
    let mut other = Client::connect(a.addr).await.unwrap();
    assert_same(
        &other.get(&TensorKey::new(0, "big")).await.unwrap(),
        &data,
        "source serves on",
    );
}

/// Waits until `node` has recomputed every stated content hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pulled_tensor_answers_to_the_stated_hash_once_the_target_recomputed_it() {
    let (a, b) = pair().await;
    let mut source = a.client().await;
    let mut target = b.client().await;
    // Large enough that the target's verifier is still hashing when the second copy asks.
    let data = samples::plain(DType::F32, &[2048, 2048], 9);
    source.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let addr = a.addr.to_string();
    let key = TensorKey::new(0, "w");
    let first = copy_keys(
        &mut source,
        &mut target,
        std::slice::from_ref(&key),
        &how(&addr, 0),
    )
    .await
    .unwrap();
    assert_eq!(first[0].as_ref().unwrap().path, TransferPath::Pull);
    // At once, under another name: dedup waits for the verification instead of pulling again.
    let mut again = how(&addr, 0);
    again.dst_name = Some("w.again".to_string());
    let second = copy_keys(&mut source, &mut target, std::slice::from_ref(&key), &again)
        .await
        .unwrap();
    assert_eq!(second[0].as_ref().unwrap().path, TransferPath::Dedup);
    let stats = hashes_verified(&mut target).await;
    assert_eq!(
        (stats.pulls, stats.dedup_hits, stats.hash_mismatches),
        (1, 1, 0)
    );
    let on_source = a.node.describe(&key).await.unwrap();
    for name in ["w", "w.again"] {
        let held = b.node.describe(&TensorKey::new(0, name)).await.unwrap();
        assert!(held.content_hash.is_verified(), "{name}");
        assert_eq!(held.content_hash, on_source.content_hash, "{name}");
        assert_same(&target.get(&held.key).await.unwrap(), &data, name);
    }
}

/// Asks `target` to pull `key` from `source` (at `source_addr`, as the target reaches it) and
/// register it under `dst`, relaying `hash` as the content hash granted, as a client that lies
/// about it would.
async fn pull_claiming(
    source: &mut Client,
    source_addr: &str,
    target: &mut Client,
    key: &TensorKey,
    dst: &TensorKey,
    hash: ContentHash,
) -> Result<ferry_proto::TensorInfo, ferry_client::ClientError> {
    let audience = target.identify().await.unwrap();
    let mut grant = source.grant(key, &audience).await.unwrap();
    grant.content_hash = hash;
    target
        .pull(source_addr, &grant, dst, IfExists::Refuse)
        .await
}

/// A pull from a node of the same host through shared memory is the one route on which a node
/// registers a tensor under a hash it did not compute: the one the client relayed from the
/// grant, recomputed from the registered bytes afterwards. A client that relays a false one
/// gets the tensor registered, but the node counts the lie, replaces it with the computed hash,
/// and never dedups on it, whether asked before or after it recomputed; the computed hash
/// answers. Flex verifies after registering, NdArray (which cannot lend its bytes) before: the
/// same outcome on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_false_hash_relayed_through_shared_memory_is_replaced_by_the_computed_one_and_never_answers_dedup()
 {
    use ferry_server::HashState;
    let _serial = ferry_testkit::REGIONS.lock().await;
    let unix_node = async |specs: &[&str]| {
        let config = NodeConfig {
            devices: devices(specs),
            ..NodeConfig::light()
        };
        ferry_testkit::start_unix(config, ServiceConfig::default()).await
    };
    let a = unix_node(&["flex"]).await;
    let b = unix_node(&["flex", "ndarray"]).await;
    // A source over TCP, whose payloads the target hashes as they arrive: a pull from it under a
    // hash its bytes do not have fails `Integrity`, unless the target dedups on that hash.
    let c = start_with(&["flex"]).await;
    let (a_unix, c_addr) = (a.unix.clone().unwrap(), c.addr.to_string());
    let mut on_a = Client::connect(a_unix.as_str()).await.unwrap();
    let mut on_b = Client::connect(b.unix.clone().unwrap().as_str())
        .await
        .unwrap();
    let mut on_c = c.client().await;
    let decoy = TensorKey::new(0, "decoy");
    on_c.put(&decoy, &samples::plain(DType::F32, &[4, 4], 70))
        .await
        .unwrap();
    let lie = ContentHash::from_digest([0; 32]);
    for device in [0u32, 1] {
        // 512 KiB: past the size from which payloads go through shared memory.
        let data = samples::plain(DType::F32, &[512, 256], 3 + u64::from(device));
        let truth = hash_of(&data);
        let src = TensorKey::new(0, format!("w{device}"));
        on_a.put(&src, &data).await.unwrap();
        let dst = TensorKey::new(device, "w");
        let pulled = pull_claiming(&mut on_a, &a_unix, &mut on_b, &src, &dst, lie)
            .await
            .unwrap();
        assert_eq!(pulled.path, TransferPath::Pull);
        let stats = on_b.stat().await.unwrap();
        assert_eq!(
            stats.shm_payloads_received,
            1 + u64::from(device),
            "the pull came through shared memory"
        );
        // The lie answers no dedup, asked at once and again once the node recomputed.
        for when in ["at once", "once recomputed"] {
            if when != "at once" {
                let stats = hashes_verified(&mut on_b).await;
                assert_eq!(
                    stats.hash_mismatches,
                    1 + u64::from(device),
                    "the lie counted"
                );
            }
            let decoy_dst = TensorKey::new(device, format!("decoy-{device}-{when}"));
            let refused =
                pull_claiming(&mut on_c, &c_addr, &mut on_b, &decoy, &decoy_dst, lie).await;
            assert_eq!(code_of(refused), ErrorCode::Integrity, "{when}");
            assert_eq!(
                code_of(on_b.get(&decoy_dst).await),
                ErrorCode::NotFound,
                "{when}: nothing registered"
            );
        }
        let held = b.node.describe(&dst).await.unwrap();
        assert_eq!(held.content_hash, HashState::Verified(truth));
        assert_same(&on_b.get(&dst).await.unwrap(), &data, "pulled");
        // The computed hash answers: the same bytes pulled from C are copied from B's own.
        let same = TensorKey::new(0, format!("same{device}"));
        on_c.put(&same, &data).await.unwrap();
        let again = TensorKey::new(device, "w.again");
        let deduped = pull_claiming(&mut on_c, &c_addr, &mut on_b, &same, &again, truth)
            .await
            .unwrap();
        assert_eq!(deduped.path, TransferPath::Dedup);
        assert_same(&on_b.get(&again).await.unwrap(), &data, "deduped");
    }
    let stats = hashes_verified(&mut on_b).await;
    assert_eq!(
        (stats.pulls, stats.dedup_hits, stats.hash_mismatches),
        (2, 2, 2)
    );
}

/// The content hash of `data` as nodes state it.
fn hash_of(data: &TensorData) -> ContentHash {
    let meta = ferry_proto::tensor::meta_of(data).unwrap();
    ferry_proto::tensor::content_hash(&meta, data.as_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_racing_dedup_pulls_never_gets_the_other_value() {
    // The target holds a candidate for dedup whose value a writer flips between the pulled
    // tensor's bytes and other bytes: a dedup must copy the version it found, or pull.
    let a = start_with(&["flex"]).await;
    let b = start_with(&["flex"]).await;
    let wanted = samples::plain(DType::F32, &[4, 4], 1);
    let other = samples::plain(DType::F32, &[4, 4], 2);
    a.client()
        .await
        .put(&TensorKey::new(0, "w"), &wanted)
        .await
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (stop, mut client) = (stop.clone(), b.client().await);
        let (wanted, other) = (wanted.clone(), other.clone());
        tokio::spawn(async move {
            let mut writes = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let value = if writes.is_multiple_of(2) {
                    &wanted
                } else {
                    &other
                };
                client
                    .put(&TensorKey::new(0, "cand"), value)
                    .if_exists(IfExists::Replace)
                    .await
                    .unwrap();
                writes += 1;
            }
            writes
        })
    };
    let mut source = a.client().await;
    let mut target = b.client().await;
    let addr = a.addr.to_string();
    let mut again = how(&addr, 0);
    again.dst_name = Some("out".to_string());
    again.if_exists = IfExists::Replace;
    let key = TensorKey::new(0, "w");
    let started = std::time::Instant::now();
    let (mut pulls, mut dedups) = (0u64, 0u64);
    while started.elapsed() < Duration::from_secs(10) {
        let answer = copy_keys(&mut source, &mut target, std::slice::from_ref(&key), &again)
            .await
            .unwrap()
            .remove(0)
            .unwrap();
        match answer.path {
            TransferPath::Dedup => dedups += 1,
            _ => pulls += 1,
        }
        let got = target.get(&TensorKey::new(0, "out")).await.unwrap();
        assert_same(&got, &wanted, "a pull answered Stored");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let writes = writer.await.unwrap();
    eprintln!("{dedups} dedups and {pulls} pulls against {writes} racing writes");
    assert!(dedups > 0, "the race was never run: no dedup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_false_stated_hash_over_tcp_fails_the_pull_and_registers_nothing() {
    let a = start_with(&["flex"]).await;
    let b = start_with(&["flex", "ndarray"]).await;
    let c = start_with(&["flex"]).await;
    let mut source = a.client().await;
    let mut target = b.client().await;
    let data = samples::plain(DType::F32, &[64, 64], 3);
    let unrelated = samples::plain(DType::F32, &[4], 4);
    source.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    // The third node holds unrelated bytes under their true hash: a lie that reached it would
    // make it dedup them.
    c.client()
        .await
        .put(&TensorKey::new(0, "u"), &unrelated)
        .await
        .unwrap();
    let b_id = target.identify().await.unwrap();
    for device in [0u32, 1] {
        let mut grant = source.grant(&TensorKey::new(0, "w"), &b_id).await.unwrap();
        grant.content_hash = hash_of(&unrelated);
        let refused = target
            .pull(
                &a.addr.to_string(),
                &grant,
                &TensorKey::new(device, "w"),
                IfExists::Refuse,
            )
            .await;
        assert_eq!(code_of(refused), ErrorCode::Integrity, "device {device}");
    }
    assert!(
        target.list(None).await.unwrap().is_empty(),
        "nothing registered"
    );
    // An honest copy from the target onwards has nothing to carry a lie with; the source's own
    // copy to the third node holds the source's bytes.
    let mut third = c.client().await;
    let addr = a.addr.to_string();
    let answers = copy_keys(
        &mut source,
        &mut third,
        &[TensorKey::new(0, "w")],
        &how(&addr, 0),
    )
    .await
    .unwrap();
    assert_eq!(answers[0].as_ref().unwrap().path, TransferPath::Pull);
    assert_same(
        &third.get(&TensorKey::new(0, "w")).await.unwrap(),
        &data,
        "third node",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_states_only_a_verified_hash_after_a_false_statement_through_shared_memory() {
    // Through a sealed region the target registers under the stated hash and verifies it
    // afterwards: a grant of that tensor waits for the verification, and states the truth.
    let config = || NodeConfig {
        devices: devices(&["flex"]),
        ..NodeConfig::light()
    };
    let _serial = ferry_testkit::REGIONS.lock().await;
    let a = ferry_testkit::start_unix(config(), ServiceConfig::default()).await;
    let b = ferry_testkit::start_unix(config(), ServiceConfig::default()).await;
    let c = start_with(&["flex"]).await;
    let a_unix = a.unix.clone().unwrap();
    let mut source = Client::connect(a_unix.as_str()).await.unwrap();
    let mut target = Client::connect(b.unix.clone().unwrap().as_str())
        .await
        .unwrap();
    // 8 MiB: large enough to travel as a kept region.
    let data = samples::plain(DType::F32, &[2048, 1024], 6);
    let unrelated = samples::plain(DType::F32, &[8], 7);
    source.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    c.client()
        .await
        .put(&TensorKey::new(0, "u"), &unrelated)
        .await
        .unwrap();
    let b_id = target.identify().await.unwrap();
    let mut grant = source.grant(&TensorKey::new(0, "w"), &b_id).await.unwrap();
    grant.content_hash = hash_of(&unrelated);
    let stored = target
        .pull(&a_unix, &grant, &TensorKey::new(0, "w"), IfExists::Refuse)
        .await
        .unwrap();
    assert_eq!(stored.path, TransferPath::Pull);
    // Granted onwards at once: the grant waits for the verification and states the truth.
    let mut from_b = b.client().await;
    let mut third = c.client().await;
    let c_id = third.identify().await.unwrap();
    let onwards = from_b.grant(&TensorKey::new(0, "w"), &c_id).await.unwrap();
    assert_eq!(onwards.content_hash, hash_of(&data));
    let stored = third
        .pull(
            &b.addr.to_string(),
            &onwards,
            &TensorKey::new(0, "w"),
            IfExists::Refuse,
        )
        .await
        .unwrap();
    assert_eq!(
        stored.path,
        TransferPath::Pull,
        "no dedup on the unrelated tensor"
    );
    assert_same(&third.get(&stored.key).await.unwrap(), &data, "third node");
    assert_eq!(from_b.stat().await.unwrap().hash_mismatches, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_rewrites_chunks_and_their_checksums_fails_the_pull() {
    let (a, b, via, data) = faulty_pair(Fault::FlipAndReframe).await;
    let result = pull_big(&b, &a, &via).await;
    let Err(error) = result else {
        panic!("a pull of altered bytes answered Stored");
    };
    assert_eq!(error.code(), Some(ErrorCode::Integrity), "{error}");
    nothing_registered_and_source_intact(&a, &b, &data).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_racing_an_overwrite_keeps_the_newer_version() {
    let a = start_with(&["flex"]).await;
    let b = start_with(&["flex"]).await;
    let addr = a.addr.to_string();
    let key = TensorKey::new(0, "k");
    let value = |i: u64| TensorData::new(vec![i as i64; 1 << 16], [1 << 16]);
    let id_of = |data: &TensorData| data.as_slice::<i64>().unwrap()[0] as u64;

    // The steps of a move, one at a time: copied, then overwritten, then the conditional delete.
    let mut source = a.client().await;
    let mut target = b.client().await;
    source
        .put(&TensorKey::new(0, "k"), &value(1))
        .await
        .unwrap();
    let b_id = target.identify().await.unwrap();
    let grant = source.grant(&key, &b_id).await.unwrap();
    target
        .pull(&addr, &grant, &grant.info.key.on(0), IfExists::Replace)
        .await
        .unwrap();
    source
        .put(&TensorKey::new(0, "k"), &value(2))
        .if_exists(IfExists::Replace)
        .await
        .unwrap();
    let refused = source.delete_if(&key, &grant.content_hash).await;
    assert_eq!(code_of(refused), ErrorCode::Changed);
    assert_eq!(
        id_of(&source.get(&key).await.unwrap()),
        2,
        "the newer version stays"
    );

    // Racing: a writer overwrites the source while moves run; after each round the last
    // acknowledged write is at the source, or it was moved (and is then at the target).
    let mut move_how = how(&addr, 0);
    move_how.transfer = Transfer::Move;
    move_how.if_exists = IfExists::Replace;
    let (mut changed, mut moved) = (0u32, 0u32);
    let mut next = 10u64;
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        let mut writer = a.client().await;
        let first = next;
        let writes = tokio::spawn(async move {
            let mut last = None;
            for i in first..first + 4 {
                writer
                    .put(&TensorKey::new(0, "k"), &value(i))
                    .if_exists(IfExists::Replace)
                    .await
                    .unwrap();
                last = Some(i);
                tokio::task::yield_now().await;
            }
            last.unwrap()
        });
        let answers = copy_keys(
            &mut source,
            &mut target,
            std::slice::from_ref(&key),
            &move_how,
        )
        .await
        .unwrap();
        match answers.into_iter().next().unwrap() {
            Ok(_) => moved += 1,
            Err(ferry_client::ClientError::SourceChanged { .. }) => changed += 1,
            Err(e) if e.code() == Some(ErrorCode::NotFound) => {}
            Err(e) if e.code() == Some(ErrorCode::CapabilityRefused) => {}
            Err(e) => panic!("move failed: {e}"),
        }
        let last = writes.await.unwrap();
        next += 4;
        match source.get(&key).await {
            Ok(held) => assert_eq!(id_of(&held), last, "the source holds the last write"),
            Err(e) => {
                assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
                let there = target.get(&key).await.unwrap();
                assert_eq!(id_of(&there), last, "the last write was moved, not lost");
            }
        }
    }
    eprintln!("{moved} moves, {changed} refused deletes of a changed source");
    assert!(moved + changed > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capability_serves_a_bounded_number_of_fetches_and_only_its_fetcher_releases_it() {
    let a = start_with(&["flex"]).await;
    let b = start_with(&["flex"]).await;
    let mut source = a.client().await;
    let data = samples::plain(DType::F32, &[256, 256], 8);
    source.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let key = TensorKey::new(0, "w");
    let b_id = b.client().await.identify().await.unwrap();
    let grant = source.grant(&key, &b_id).await.unwrap();

    // Fetched whole once (as node B would); fetching it whole again is served too, until the
    // fetcher releases it: its only chunk may have been lost in flight.
    let mut fetcher = source_connection(&a).await;
    let fetch = fetcher.fetch(&grant.token, &b_id, 0).await.unwrap();
    let mut assembler = ferry_io::TensorAssembler::new(
        fetch.meta.clone(),
        u64::MAX,
        ferry_io::BufferFrom::Fresh,
        ferry_io::HashUse::Skip,
    )
    .unwrap();
    fetch.payload(&mut assembler, RegionUse::Map).await.unwrap();
    assert_same(&assembler.finish().unwrap().data, &data, "fetched");
    let mut other = source_connection(&a).await;
    let fetch = other.fetch(&grant.token, &b_id, 0).await.unwrap();
    let mut again = ferry_io::TensorAssembler::new(
        fetch.meta.clone(),
        u64::MAX,
        ferry_io::BufferFrom::Fresh,
        ferry_io::HashUse::Skip,
    )
    .unwrap();
    fetch.payload(&mut again, RegionUse::Map).await.unwrap();
    assert_same(&again.finish().unwrap().data, &data, "fetched whole again");

    // A resume (a later offset) by the audience is served.
    let fetch = other.fetch(&grant.token, &b_id, 1024).await.unwrap();
    let mut tail = ferry_io::TensorAssembler::new(
        fetch.meta.clone(),
        u64::MAX,
        ferry_io::BufferFrom::Fresh,
        ferry_io::HashUse::Skip,
    )
    .unwrap();
    tail.accept(0, &data.as_bytes()[..1024]).unwrap();
    fetch.payload(&mut tail, RegionUse::Map).await.unwrap();
    assert_same(&tail.finish().unwrap().data, &data, "resumed");

    // But not again and again: 16 fetches in all (3 so far), then refused.
    for _ in 3..16 {
        let fetch = other.fetch(&grant.token, &b_id, 0).await.unwrap();
        let mut whole = ferry_io::TensorAssembler::new(
            fetch.meta.clone(),
            u64::MAX,
            ferry_io::BufferFrom::Fresh,
            ferry_io::HashUse::Skip,
        )
        .unwrap();
        fetch.payload(&mut whole, RegionUse::Map).await.unwrap();
    }
    let too_often = other.fetch(&grant.token, &b_id, 0).await.map(|f| f.meta);
    assert_eq!(
        source_code_of(too_often),
        ErrorCode::CapabilityRefused,
        "a 17th fetch"
    );
    let grant = source.grant(&key, &b_id).await.unwrap();
    let fetch = other.fetch(&grant.token, &b_id, 0).await.unwrap();
    let mut fresh = ferry_io::TensorAssembler::new(
        fetch.meta.clone(),
        u64::MAX,
        ferry_io::BufferFrom::Fresh,
        ferry_io::HashUse::Skip,
    )
    .unwrap();
    fetch.payload(&mut fresh, RegionUse::Map).await.unwrap();

    // Released only by a connection that fetched under it: not by a third party that knows the
    // token and the audience, nor by the client it was granted to once a fetch began.
    let mut third = source_connection(&a).await;
    assert_eq!(
        source_code_of(third.release(&grant.token, &b_id).await),
        ErrorCode::CapabilityRefused
    );
    assert_eq!(
        code_of(source.release(&grant).await),
        ErrorCode::CapabilityRefused
    );
    other.release(&grant.token, &b_id).await.unwrap();
    let used = third.fetch(&grant.token, &b_id, 1024).await.map(|f| f.meta);
    assert_eq!(
        source_code_of(used),
        ErrorCode::CapabilityRefused,
        "used up"
    );

    // Before any fetch, the client it was granted to may hand it back; nobody else.
    let unused = source.grant(&key, &b_id).await.unwrap();
    assert_eq!(
        source_code_of(third.release(&unused.token, &b_id).await),
        ErrorCode::CapabilityRefused
    );
    source.release(&unused).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outstanding_grants_are_capped_per_client_and_revoked_with_its_connection() {
    let a = start(
        NodeConfig {
            devices: devices(&["flex"]),
            limits: NodeLimits {
                max_grants_per_client: 8,
                ..NodeLimits::default()
            },
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await;
    let b = start_with(&["flex"]).await;
    let data = samples::plain(DType::F32, &[4], 1);
    let mut greedy = a.client().await;
    greedy.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let key = TensorKey::new(0, "w");
    let b_id = b.client().await.identify().await.unwrap();
    for _ in 0..8 {
        greedy.grant(&key, &b_id).await.unwrap();
    }
    let over = greedy.grant(&key, &b_id).await;
    let Err(error) = over else {
        panic!("a ninth grant was issued");
    };
    assert_eq!(error.code(), Some(ErrorCode::LimitExceeded));
    assert!(error.to_string().contains("8 outstanding"), "{error}");
    let held = greedy.grant(&key, &b_id).await;
    assert_eq!(code_of(held), ErrorCode::LimitExceeded);

    // Another client copies as usual meanwhile.
    let mut source = a.client().await;
    let mut target = b.client().await;
    let addr = a.addr.to_string();
    let answers = copy_keys(
        &mut source,
        &mut target,
        std::slice::from_ref(&key),
        &how(&addr, 0),
    )
    .await
    .unwrap();
    assert!(answers[0].is_ok());

    // A client's unused capabilities go with its connection.
    let mut fresh = a.client().await;
    let grant = fresh.grant(&key, &b_id).await.unwrap();
    let before = a.node.stats().await.unwrap().connections;
    drop(fresh);
    for _ in 0..200 {
        if a.node.stats().await.unwrap().connections < before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut fetcher = source_connection(&a).await;
    let revoked = fetcher.fetch(&grant.token, &b_id, 0).await.map(|f| f.meta);
    assert_eq!(source_code_of(revoked), ErrorCode::CapabilityRefused);
    drop(greedy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capability_serves_a_bounded_number_of_fetches_and_ends_with_its_client() {
    let a = start_with(&["flex"]).await;
    let data = samples::plain(DType::F32, &[64, 64], 9);
    let key = TensorKey::new(0, "w");
    let mut granter = a.client().await;
    granter.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let audience = &NodeId::new("node-b");

    // Resumes of a served capability are bounded: 16 fetches in all, then refused.
    let grant = granter.grant(&key, audience).await.unwrap();
    let mut fetcher = source_connection(&a).await;
    let mut served = 0;
    loop {
        let offset = if served == 0 { 0 } else { 4 };
        match fetcher.fetch(&grant.token, audience, offset).await {
            Ok(fetch) => {
                let mut assembler = ferry_io::TensorAssembler::new(
                    fetch.meta.clone(),
                    u64::MAX,
                    ferry_io::BufferFrom::Fresh,
                    ferry_io::HashUse::Skip,
                )
                .unwrap();
                if offset > 0 {
                    assembler.accept(0, &data.as_bytes()[..4]).unwrap();
                }
                fetch.payload(&mut assembler, RegionUse::Map).await.unwrap();
                assert_same(&assembler.finish().unwrap().data, &data, "fetched");
                served += 1;
            }
            Err(e) => {
                assert_eq!(e.code(), Some(ErrorCode::CapabilityRefused), "{e}");
                break;
            }
        }
        assert!(served <= 16, "a capability served more than 16 fetches");
    }
    assert_eq!(served, 16);

    // A capability ends with the connection that asked for it, fetched or not.
    let grant = granter.grant(&key, audience).await.unwrap();
    let fetch = fetcher.fetch(&grant.token, audience, 0).await.unwrap();
    let mut assembler = ferry_io::TensorAssembler::new(
        fetch.meta.clone(),
        u64::MAX,
        ferry_io::BufferFrom::Fresh,
        ferry_io::HashUse::Skip,
    )
    .unwrap();
    fetch.payload(&mut assembler, RegionUse::Map).await.unwrap();
    let before = a.node.stats().await.unwrap().connections;
    drop(granter);
    for _ in 0..200 {
        if a.node.stats().await.unwrap().connections < before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let resumed = fetcher
        .fetch(&grant.token, audience, 4)
        .await
        .map(|f| f.meta);
    assert_eq!(source_code_of(resumed), ErrorCode::CapabilityRefused);
}

/// A listener that counts the connections it gets and answers each with `banner` (another
/// service on a port a client names).
async fn decoy(banner: &'static [u8]) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            let _ = socket.write_all(banner).await;
        }
    });
    (addr, connections)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_pulls_only_from_its_listed_peers() {
    let a = start_with(&["flex"]).await;
    let (elsewhere, connections) = decoy(b"").await;
    let b = start(
        NodeConfig {
            devices: devices(&["flex"]),
            pulls: PullConfig {
                peer_token: Some("the-peer-token".into()),
                peers: PeerPolicy::Listed(vec![Peer::at(a.addr.to_string())]),
                ..PullConfig::default()
            },
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await;
    let data = samples::plain(DType::F32, &[32, 32], 4);
    let key = TensorKey::new(0, "w");
    let (mut source, mut target) = (a.client().await, b.client().await);
    source.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    // Named by a client as the source: refused before any connection, so the peer token never
    // leaves for it.
    let elsewhere = elsewhere.to_string();
    let refused = copy_one(&mut source, &mut target, &key, &how(&elsewhere, 0))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::BadRequest), "{refused}");
    assert!(
        refused.to_string().contains("not an allowed peer"),
        "{refused}"
    );
    assert_eq!(
        connections.load(Ordering::SeqCst),
        0,
        "nothing connected there"
    );
    // The listed peer serves as before.
    let a_addr = a.addr.to_string();
    copy_one(&mut source, &mut target, &key, &how(&a_addr, 0))
        .await
        .unwrap();
    assert_same(&target.get(&key).await.unwrap(), &data, "w");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_pull_tells_the_client_nothing_about_what_answered_there() {
    let (a, b) = pair().await;
    let data = samples::plain(DType::F32, &[8, 8], 5);
    let key = TensorKey::new(0, "w");
    let (mut source, mut target) = (a.client().await, b.client().await);
    source.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    // Another service's banner: the client learns nothing of what it said.
    let (service, _) = decoy(b"SSH-2.0-OpenSSH_9.6 secret-build\r\n").await;
    let service = service.to_string();
    // The client hears the same few words whatever is there, and none of its details.
    let told_nothing =
        async |source: &mut Client, target: &mut Client, at: &str, details: &[&str]| {
            let error = copy_one(source, target, &key, &how(at, 0))
                .await
                .unwrap_err();
            assert_eq!(error.code(), Some(ErrorCode::PeerFailed), "{error}");
            let message = error.to_string();
            assert!(
                message.contains("peer unreachable or not a ferry node"),
                "{message}"
            );
            for detail in details {
                assert!(!message.contains(detail), "{message}");
            }
        };
    told_nothing(&mut source, &mut target, &service, &["SSH", "secret-build"]).await;
    // A closed port and a missing socket file read alike, and like the banner.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    };
    for nowhere in [closed.as_str(), "unix:/nonexistent/ferry.sock"] {
        let details = ["refused", "No such file", "os error"];
        told_nothing(&mut source, &mut target, nowhere, &details).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_with_read_and_write_scopes_copies_and_moves_between_nodes() {
    use ferry_server::parse_token_file;
    let service = || ServiceConfig {
        credentials: parse_token_file("read,write client-token\npeer node-token\n").unwrap(),
        ..ServiceConfig::default()
    };
    let a = start(
        NodeConfig {
            devices: devices(&["flex"]),
            ..NodeConfig::light()
        },
        service(),
    )
    .await;
    let b = start(
        NodeConfig {
            devices: devices(&["flex"]),
            pulls: PullConfig {
                peer_token: Some("node-token".into()),
                peers: PeerPolicy::Listed(vec![Peer::at(a.addr.to_string())]),
                ..PullConfig::default()
            },
            ..NodeConfig::light()
        },
        service(),
    )
    .await;
    let connect = async |node: &TestNode| {
        Client::connect(node.addr.to_string().as_str())
            .token("client-token")
            .await
            .unwrap()
    };
    let (mut source, mut target) = (connect(&a).await, connect(&b).await);
    let data = samples::plain(DType::F32, &[64, 64], 6);
    source.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let a_addr = a.addr.to_string();
    // A pull: the target fetches and releases with its peer credential.
    let key = TensorKey::new(0, "w");
    let pulled = copy_one(&mut source, &mut target, &key, &how(&a_addr, 0))
        .await
        .unwrap();
    assert_eq!(pulled.path, TransferPath::Pull);
    // A dedup: the client hands the unneeded capability back itself, with its read scope; and a
    // move then deletes the source.
    let mut moving = how(&a_addr, 0);
    moving.dst_name = Some("again".to_string());
    moving.transfer = Transfer::Move;
    hashes_verified(&mut target).await;
    let deduped = copy_one(&mut source, &mut target, &key, &moving)
        .await
        .unwrap();
    assert_eq!(deduped.path, TransferPath::Dedup);
    assert_same(
        &target.get(&TensorKey::new(0, "again")).await.unwrap(),
        &data,
        "again",
    );
    assert!(
        source.list(None).await.unwrap().is_empty(),
        "the move deleted the source"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_token_goes_only_to_listed_peers_never_to_an_address_a_client_chose() {
    let service = || ServiceConfig {
        credentials: vec![ferry_server::Credential::full("shared").unwrap()],
        ..ServiceConfig::default()
    };
    let a = start(
        NodeConfig {
            devices: devices(&["flex"]),
            ..NodeConfig::light()
        },
        service(),
    )
    .await;
    // The same peer token, but any source allowed: the token stays home, so a source that
    // requires it refuses the pull.
    let open = start(
        NodeConfig {
            devices: devices(&["flex"]),
            pulls: PullConfig {
                peer_token: Some("shared".into()),
                peers: PeerPolicy::Any,
                ..PullConfig::default()
            },
            ..NodeConfig::light()
        },
        service(),
    )
    .await;
    let connect = async |node: &TestNode| {
        Client::connect(node.addr.to_string().as_str())
            .token("shared")
            .await
            .unwrap()
    };
    let (mut source, mut target) = (connect(&a).await, connect(&open).await);
    let data = samples::plain(DType::F32, &[16, 16], 8);
    source.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let key = TensorKey::new(0, "w");
    let a_addr = a.addr.to_string();
    let refused = copy_one(&mut source, &mut target, &key, &how(&a_addr, 0))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::PeerFailed), "{refused}");
    assert!(refused.to_string().contains("AuthRefused"), "{refused}");
    assert!(target.list(None).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_is_answered_before_its_hash_where_the_device_lends_its_bytes() {
    use ferry_server::HashState;
    // Flex lends its registered bytes, so the hash is computed after the answer; NdArray cannot,
    // so its chunks are hashed as they arrive, and the tensor is registered with the hash.
    // Either way a grant right after the put waits for it and states the truth.
    let a = start_with(&["flex", "ndarray"]).await;
    let b = start_with(&["flex"]).await;
    let mut client = a.client().await;
    let b_id = b.client().await.identify().await.unwrap();
    for device in [0u32, 1] {
        let data = samples::plain(DType::F32, &[2048, 2048], 40 + u64::from(device));
        let meta = ferry_proto::tensor::meta_of(&data).unwrap();
        let truth = ferry_proto::tensor::content_hash(&meta, data.as_bytes());
        client
            .put(&TensorKey::new(device, "w"), &data)
            .await
            .unwrap();
        let key = TensorKey::new(device, "w");
        let at_answer = a.node.describe(&key).await.unwrap().content_hash;
        match (device, &at_answer) {
            (0, HashState::Computing) => {}
            (_, HashState::Verified(hash)) => assert_eq!(*hash, truth),
            other => panic!("unexpected hash state at the answer: {other:?}"),
        }
        let grant = client.grant(&key, &b_id).await.unwrap();
        assert_eq!(
            grant.content_hash, truth,
            "device {device}: granted the computed hash"
        );
        let held = a.node.describe(&key).await.unwrap();
        assert_eq!(held.content_hash, HashState::Verified(truth));
        // And it answers dedup: the same bytes pulled from B are copied from A's own tensor.
        let mut on_b = b.client().await;
        let same = TensorKey::new(0, format!("same{device}"));
        on_b.put(&same, &data).await.unwrap();
        let mut again = how(&b.addr.to_string(), device);
        again.dst_name = Some("w.again".to_string());
        let deduped = copy_one(&mut on_b, &mut client, &same, &again)
            .await
            .unwrap();
        assert_eq!(deduped.path, TransferPath::Dedup, "device {device}");
        assert_same(&client.get(&deduped.key).await.unwrap(), &data, "deduped");
    }
    let stats = hashes_verified(&mut client).await;
    assert_eq!((stats.hashes_pending, stats.hash_mismatches), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_whose_only_chunk_is_lost_after_it_was_sent_resumes_from_the_start() {
    // One chunk (the default 4 MiB chunk holds the whole 1 MiB): the source has sent every byte
    // when the cut lands, so the target's resume asks for offset 0 of a capability served in
    // full. It must be served again, not refused.
    let a = start_with(&["flex"]).await;
    let mut config = NodeConfig {
        devices: devices(&["flex"]),
        pulls: PullConfig {
            retries: 2,
            retry_backoff: Duration::from_millis(20),
            ..PullConfig::default()
        },
        ..NodeConfig::light()
    };
    config.pulls.peer_limits.idle_timeout = Duration::from_secs(1);
    let b = start(config, ServiceConfig::default()).await;
    let data = samples::plain(DType::F32, &[256, 1024], 8);
    a.client()
        .await
        .put(&TensorKey::new(0, "big"), &data)
        .await
        .unwrap();
    let via = proxy(a.addr, Fault::CutOnceAfter(256 * 1024))
        .await
        .to_string();
    let info = pull_big(&b, &a, &via).await.unwrap();
    let mut target = b.client().await;
    assert_same(
        &target.get(&info.key).await.unwrap(),
        &data,
        "resumed from 0",
    );
    assert_eq!(target.stat().await.unwrap().pull_retries, 1);
}
