//! The receive pool (`NodeConfig::pool`, `--pool`): every dtype and scheme lands in it bit-exact
//! by put and by pull; every byte drawn comes back after a success, a source that dies, an
//! integrity failure and a client that dies mid-put; a payload it cannot hold goes to fresh
//! memory, counted as a miss; racing clients on a pool too small for them read only what they
//! wrote (seeded: `FERRY_POOL_SEED`).

use ferry_proto::{IfExists, TransferPath};
use ferry_server::PullConfig;
use ferry_testkit::copy_keys;
use std::time::Duration;

use tokio::io::AsyncWriteExt;

use ferry_client::ErrorCode;
use ferry_memory::Pool;
use ferry_proto::{DType, Response, TensorData, TensorKey, frame, tensor};
use ferry_server::{NodeConfig, ReceiveBuffers, ServiceConfig};
use ferry_testkit::samples;
use ferry_testkit::{
    Fault, TestNode, assert_same, devices, eventually, how, on_device, proxy, start, start_with,
};

use crate::hostile::{Raw, put_request};

const MIB: usize = 1 << 20;

/// A node with one flex device that receives into `pool`.
async fn pooled_node(pool: &Pool, pull_retries: u32) -> TestNode {
    let mut config = NodeConfig {
        devices: devices(&["flex"]),
        receive_buffers: ReceiveBuffers::Pool(pool.clone()),
        pulls: PullConfig {
            retries: pull_retries,
            retry_backoff: Duration::from_millis(20),
            ..PullConfig::default()
        },
        ..NodeConfig::light()
    };
    config.pulls.peer_limits.idle_timeout = Duration::from_secs(1);
    start(config, ServiceConfig::default()).await
}

async fn pool_is_whole(pool: &Pool, what: &str) {
    eventually(what, Duration::from_secs(10), || {
        pool.free_bytes() == pool.capacity()
    })
    .await;
}

/// Deletes every tensor `client`'s node holds.
async fn delete_all(client: &mut ferry_client::Client) {
    for info in client.list(None).await.unwrap() {
        client.delete(&info.key).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dtype_and_scheme_lands_in_the_pool_bit_exact_by_pull_and_by_put() {
    // Every payload draws (the sample matrix is small): the route is what is tested here.
    let pool = Pool::reserve_with(64 * MIB, 0).unwrap();
    let a = start_with(&["flex"]).await;
    let b = pooled_node(&pool, 3).await;
    let (mut source, mut target) = (a.client().await, b.client().await);
    let matrix = samples::full_matrix();
    let tensors: Vec<(String, TensorData)> = matrix
        .iter()
        .map(|s| (s.name.clone(), s.data.clone()))
        .collect();
    let bytes: usize = tensors.iter().map(|(_, d)| d.as_bytes().len()).sum();
    for answer in source.put_batch(&on_device(0, &tensors)).await.unwrap() {
        answer.unwrap();
    }
    let keys: Vec<TensorKey> = tensors.iter().map(|(n, _)| TensorKey::new(0, n)).collect();
    let addr = a.addr.to_string();
    for answer in copy_keys(&mut source, &mut target, &keys, &how(&addr, 0))
        .await
        .unwrap()
    {
        assert_eq!(answer.unwrap().path, TransferPath::Pull);
    }
    for (name, data) in &tensors {
        let back = target.get(&TensorKey::new(0, name)).await.unwrap();
        assert_same(&back, data, &format!("{name} pulled into the pool"));
    }
    // Every tensor the device kept as it arrived lives in the pool (Flex keeps most dtypes'
    // buffers as they are; the few it converts give theirs back at once).
    let drawn = pool.capacity() - pool.free_bytes();
    assert!(drawn >= bytes / 2, "{drawn} bytes drawn for {bytes}");
    delete_all(&mut target).await;
    pool_is_whole(&pool, "deleted pulled tensors give their buffers back").await;

    for (name, data) in &tensors {
        target.put(&TensorKey::new(0, name), data).await.unwrap();
    }
    for (name, data) in &tensors {
        let back = target.get(&TensorKey::new(0, name)).await.unwrap();
        assert_same(&back, data, &format!("{name} put into the pool"));
    }
    let stats = target.stat().await.unwrap();
    assert_eq!(stats.pool_bytes, pool.capacity() as u64);
    assert_eq!(stats.pool_free_bytes, pool.free_bytes() as u64);
    assert_eq!(stats.pool_misses, 0, "everything fit");
    delete_all(&mut target).await;
    pool_is_whole(&pool, "deleted put tensors give their buffers back").await;
}

/// The source of a 32 MiB f32 tensor, and the tensor.
async fn source_of_32_mib() -> (TestNode, TensorData) {
    let mut service = ServiceConfig::default();
    service.limits.chunk_size = 256 * 1024;
    let a = start(
        NodeConfig {
            devices: devices(&["flex"]),
            ..NodeConfig::light()
        },
        service,
    )
    .await;
    let data = samples::plain(DType::F32, &[8 * 1024, 1024], 5);
    a.client()
        .await
        .put(&TensorKey::new(0, "big"), &data)
        .await
        .unwrap();
    (a, data)
}

async fn pull_via(b: &TestNode, a: &TestNode, via: &str) -> Result<(), Option<ErrorCode>> {
    let (mut source, mut target) = (a.client().await, b.client().await);
    let answer = copy_keys(
        &mut source,
        &mut target,
        &[TensorKey::new(0, "big")],
        &how(via, 0),
    )
    .await
    .unwrap()
    .remove(0);
    answer.map(drop).map_err(|e| e.code())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_byte_drawn_comes_back_after_success_and_after_each_failure() {
    let pool = Pool::reserve(64 * MIB).unwrap();
    let (a, data) = source_of_32_mib().await;
    let b = pooled_node(&pool, 0).await;
    let mut target = b.client().await;

    // A source that dies mid-stream.
    let via = proxy(a.addr, Fault::DieAfter(4 * MIB)).await.to_string();
    assert_eq!(
        pull_via(&b, &a, &via).await,
        Err(Some(ErrorCode::PeerFailed))
    );
    pool_is_whole(&pool, "after a source died mid-pull").await;

    // Bytes altered on the way, every chunk checksum recomputed: only the content hash tells.
    let via = proxy(a.addr, Fault::FlipAndReframe).await.to_string();
    assert_eq!(
        pull_via(&b, &a, &via).await,
        Err(Some(ErrorCode::Integrity))
    );
    pool_is_whole(&pool, "after an integrity failure").await;
    assert!(
        target.list(None).await.unwrap().is_empty(),
        "nothing registered"
    );

    // A client that dies after a quarter of its put.
    let (mut raw, _) = Raw::hello(&b, None).await;
    let meta = tensor::meta_of(&data).unwrap().to_wire();
    raw.send(&put_request(0, "cut", meta)).await;
    assert_eq!(raw.response().await, Some(Response::Ready));
    let bytes = data.as_bytes();
    for offset in (0..bytes.len() / 4).step_by(MIB) {
        let chunk = frame::encode_chunk(offset as u64, &bytes[offset..offset + MIB]);
        raw.stream.write_all(&chunk).await.unwrap();
    }
    eventually(
        "the cut put draws its buffer",
        Duration::from_secs(10),
        || pool.free_bytes() < pool.capacity(),
    )
    .await;
    drop(raw);
    pool_is_whole(&pool, "after a client died mid-put").await;
    assert!(
        target.list(None).await.unwrap().is_empty(),
        "nothing registered"
    );

    // Success: the tensor holds its buffer until deleted, then gives it back.
    pull_via(&b, &a, &a.addr.to_string()).await.unwrap();
    assert!(pool.capacity() - pool.free_bytes() >= bytes.len());
    let key = TensorKey::new(0, "big");
    assert_same(&target.get(&key).await.unwrap(), &data, "pulled");
    target.delete(&key).await.unwrap();
    pool_is_whole(&pool, "after a delete").await;
    assert_eq!(target.stat().await.unwrap().pool_misses, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_the_pool_cannot_hold_goes_to_fresh_memory_as_a_miss() {
    let pool = Pool::reserve(4 * MIB).unwrap();
    let b = pooled_node(&pool, 0).await;
    let mut client = b.client().await;
    let data = samples::plain(DType::F32, &[2 * 1024, 1024], 9);
    assert!(data.as_bytes().len() > pool.capacity());
    client
        .put(&TensorKey::new(0, "larger"), &data)
        .await
        .unwrap();
    let key = TensorKey::new(0, "larger");
    assert_same(&client.get(&key).await.unwrap(), &data, "in fresh memory");
    let stats = client.stat().await.unwrap();
    assert_eq!(stats.pool_misses, 1);
    assert_eq!(
        stats.pool_free_bytes, stats.pool_bytes,
        "the pool was not drawn"
    );
    // One that fits still draws from it.
    let small = samples::plain(DType::F32, &[512, 1024], 10);
    client
        .put(&TensorKey::new(0, "fits"), &small)
        .await
        .unwrap();
    assert!(pool.free_bytes() < pool.capacity());
    assert_eq!(client.stat().await.unwrap().pool_misses, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_clients_on_a_pool_smaller_than_their_tensors_read_only_what_they_wrote() {
    use rand::{Rng, SeedableRng};
    // A pool that holds about three of the tensors in flight at once: draws, misses, gives back
    // and reuse race each other. Every get must hold what its key's last put wrote, and every
    // byte must come back once the tensors are gone.
    // Seeded, and printed: FERRY_POOL_SEED=N replays a run.
    let seed: u64 = std::env::var("FERRY_POOL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("pool race seed {seed} (FERRY_POOL_SEED={seed} replays it)");
    let pool = Pool::reserve(8 * MIB).unwrap();
    let node = pooled_node(&pool, 0).await;
    let clients = (0..6u64).map(|c| {
        let addr = node.addr;
        tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ c);
            let mut client = ferry_client::Client::connect(addr).await.unwrap();
            // Each client has its own keys, so that what a get must hold is known exactly.
            let mut held: Vec<Option<TensorData>> = vec![None; 3];
            for step in 0..40u64 {
                let k = rng.random_range(0..held.len());
                let key = TensorKey::new(0, format!("c{c}-k{k}"));
                match rng.random_range(0..3) {
                    0 => {
                        let rows = rng.random_range(256..1024);
                        let data =
                            samples::plain(DType::F32, &[rows, 1024], seed ^ (c << 32) ^ step);
                        client
                            .put(&TensorKey::new(0, &key.name), &data)
                            .if_exists(IfExists::Replace)
                            .await
                            .unwrap();
                        held[k] = Some(data);
                    }
                    1 => match (&held[k], client.get(&key).await) {
                        (Some(data), Ok(back)) => assert_same(&back, data, &key.to_string()),
                        (None, Err(e)) => assert_eq!(e.code(), Some(ErrorCode::NotFound)),
                        (expected, got) => panic!("{key}: expected {expected:?}, got {got:?}"),
                    },
                    _ => {
                        let deleted = client.delete(&key).await;
                        assert_eq!(deleted.is_ok(), held[k].take().is_some(), "{key}");
                    }
                }
            }
            for (k, data) in held.iter().enumerate() {
                if data.is_some() {
                    client
                        .delete(&TensorKey::new(0, format!("c{c}-k{k}")))
                        .await
                        .unwrap();
                }
            }
        })
    });
    for client in clients.collect::<Vec<_>>() {
        client.await.unwrap();
    }
    let stats = node.client().await.stat().await.unwrap();
    eprintln!(
        "pool misses {} of 8 MiB; {} transfers",
        stats.pool_misses, stats.transfers_done
    );
    assert!(
        stats.pool_misses > 0,
        "the pool was too small for some puts"
    );
    pool_is_whole(&pool, "every byte back after the race").await;
}

/// A node's elastic pool keeps no more ready than its device's budget has room for: a tensor
/// that fills most of the budget leaves ready only what could still be received; once it is
/// deleted, its buffer is ready again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_keeps_no_more_ready_than_the_device_budget_has_room_for() {
    const LIMIT: usize = 64 * MIB;
    let readiness = ferry_memory::pool::Readiness {
        idle: 48 * MIB,
        ahead: 8 * MIB,
        idle_after: Duration::from_secs(600),
        touching: ferry_memory::pool::Touching::AlongsideOthers,
        at_start: ferry_memory::pool::AtStart::IDLE,
    };
    // Room for the pool to make its idle amount ready again beside the tensor, but for the bound.
    let pool = Pool::elastic(2 * LIMIT, readiness).unwrap();
    let node = start(
        NodeConfig {
            devices: devices(&["flex"]),
            receive_buffers: ReceiveBuffers::Pool(pool.clone()),
            limits: ferry_server::NodeLimits {
                memory_limit: Some(LIMIT as u64),
                ..ferry_server::NodeLimits::default()
            },
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await;
    eventually("ready at start", Duration::from_secs(10), || {
        pool.ready_bytes() == 48 * MIB
    })
    .await;
    let mut client = node.client().await;
    let key = TensorKey::new(0, "big");
    let data = samples::plain(DType::F32, &[40 * MIB / 4], 50);
    client.put(&key, &data).await.unwrap();
    // The budget's room, up to a whole granule of the pool.
    let room = (LIMIT - 40 * MIB - ferry_server::TENSOR_OVERHEAD as usize)
        .next_multiple_of(ferry_memory::pool::GRANULE);
    eventually("ready within the room", Duration::from_secs(10), || {
        pool.ready_bytes() <= room
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(pool.ready_bytes() <= room, "kept within the room");
    assert_eq!(
        pool.free_bytes() + 40 * MIB,
        pool.capacity(),
        "drawn from the pool"
    );
    assert_same(&client.get(&key).await.unwrap(), &data, "the tensor");
    client.delete(&key).await.unwrap();
    eventually("ready again", Duration::from_secs(10), || {
        pool.ready_bytes() >= 48 * MIB
    })
    .await;
    node.shutdown().await;
}

/// A node's first tensor ends its pool's start amount even when it draws nothing from the pool
/// (a tensor under the pool's minimum): what is left goes back after the idle wait, and the
/// tensor is held bit-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_tensor_too_small_for_the_pool_ends_its_start_amount() {
    let readiness = ferry_memory::pool::Readiness {
        idle: 8 * MIB,
        ahead: 8 * MIB,
        idle_after: Duration::from_millis(300),
        touching: ferry_memory::pool::Touching::AlongsideOthers,
        at_start: ferry_memory::pool::AtStart {
            bytes: 48 * MIB,
            kept_for: Duration::from_secs(600),
            spare: ferry_memory::pool::SpareCheck::Unchecked,
        },
    };
    let pool = Pool::elastic(128 * MIB, readiness).unwrap();
    let node = start(
        NodeConfig {
            devices: devices(&["flex"]),
            receive_buffers: ReceiveBuffers::Pool(pool.clone()),
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await;
    eventually("the start amount ready", Duration::from_secs(10), || {
        pool.ready_bytes() == 48 * MIB
    })
    .await;
    let mut client = node.client().await;
    let key = TensorKey::new(0, "small");
    let data = samples::plain(DType::F32, &[1024], 51);
    client.put(&key, &data).await.unwrap();
    // Within the idle wait (300 ms) of the arrival, not at some later timeout of the pool's.
    eventually("back to the idle amount", Duration::from_secs(3), || {
        pool.ready_bytes() == 8 * MIB
    })
    .await;
    assert_eq!(pool.free_bytes(), pool.capacity(), "nothing drawn");
    assert_same(&client.get(&key).await.unwrap(), &data, "the tensor");
    node.shutdown().await;
}
