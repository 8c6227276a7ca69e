//! Pulls spread over several connections (stripes): every kind of tensor bit-exact, a tensor
//! that fits one stripe fetched once, a stripe cut mid-way resumed where it stopped, a flipped
//! byte in a stripe caught by the merged hash, a source that would copy its tensor out for every
//! stripe sending the rest whole, and the capability's bound on what its fetches are charged.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ferry_client::ErrorCode;
use ferry_io::striped::StripedReceive;
use ferry_io::{BufferFrom, HashUse, TensorAssembler};
use ferry_proto::stripes::StripeLen;
use ferry_proto::{DType, TensorData, TensorKey};
use ferry_server::{NodeConfig, PullConfig, ServiceConfig, Striping};
use ferry_testkit::samples;
use ferry_testkit::{
    Fault, TestNode, assert_same, copy_keys, devices, how, proxy, source_code_of,
    source_connection, start,
};

/// Stripes of 64 KiB: a tensor of a few MiB is dozens of them.
const STRIPE: u64 = 64 << 10;

/// A target that spreads a pull over up to four connections, in 64 KiB stripes, and gives a
/// silent source one second and retries twice.
async fn striping_target() -> TestNode {
    let mut config = NodeConfig {
        devices: devices(&["flex"]),
        pulls: PullConfig {
            retries: 2,
            retry_backoff: Duration::from_millis(20),
            striping: Striping::new(4, StripeLen::new(STRIPE).unwrap()),
            ..PullConfig::default()
        },
        ..NodeConfig::light()
    };
    config.pulls.peer_limits.idle_timeout = Duration::from_secs(1);
    start(config, ServiceConfig::default()).await
}

/// A source on `device` that sends 16 KiB chunks (several per stripe) and keeps a broken
/// fetch's capability for half a second.
async fn source(device: &str) -> TestNode {
    let mut service = ServiceConfig::default();
    service.limits.chunk_size = 16 * 1024;
    let mut config = NodeConfig {
        devices: devices(&[device]),
        ..NodeConfig::light()
    };
    config.pulls.peer_limits.idle_timeout = Duration::from_millis(500);
    start(config, service).await
}

/// Puts `tensors` on `a` as "t0", "t1", ... and pulls them all to `b` through `via` in one batch;
/// each answer.
async fn pull_all(
    a: &TestNode,
    b: &TestNode,
    via: &str,
    tensors: &[TensorData],
) -> Vec<Result<ferry_proto::TensorInfo, ferry_client::ClientError>> {
    let mut source = a.client().await;
    let keys: Vec<TensorKey> = (0..tensors.len())
        .map(|i| TensorKey::new(0, format!("t{i}")))
        .collect();
    for (key, data) in keys.iter().zip(tensors) {
        source.put(key, data).await.unwrap();
    }
    let mut target = b.client().await;
    copy_keys(&mut source, &mut target, &keys, &how(via, 0))
        .await
        .unwrap()
}

/// Every answer stored, and what `b` holds under each key is the tensor put, bit for bit.
async fn all_landed(
    b: &TestNode,
    answers: Vec<Result<ferry_proto::TensorInfo, ferry_client::ClientError>>,
    tensors: &[TensorData],
) {
    let mut target = b.client().await;
    for (answer, data) in answers.into_iter().zip(tensors) {
        let info = answer.unwrap();
        assert_eq!(info.path, ferry_proto::TransferPath::Pull);
        assert_same(&target.get(&info.key).await.unwrap(), data, &info.key.name);
    }
}

/// A loopback forwarder to `upstream`, each connection relayed on its own task, that counts the
/// connections it accepted; its address and the count.
async fn counting_proxy(upstream: std::net::SocketAddr) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut down, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                let _ = (down.set_nodelay(true), up.set_nodelay(true));
                let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
            });
        }
    });
    (addr, accepted)
}

/// How many stripes of `STRIPE` a tensor's hash input makes (none where it fits one).
fn stripes_of(data: &TensorData) -> u64 {
    let meta = ferry_proto::tensor::meta_of(data).unwrap();
    ferry_proto::stripes::StripePlan::new(&meta, StripeLen::new(STRIPE).unwrap())
        .map_or(0, |plan| plan.count() as u64)
}

/// A plain tensor, a quantized one with its scales and a bf16 one, each dozens of stripes, and
/// one that fits a stripe: all land bit-exact, each striped one in a fetch per stripe (its first
/// over the pull's connection, the rest over up to four), the small one in one fetch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tensors_larger_than_a_stripe_come_over_several_connections_bit_exact() {
    let a = source("flex").await;
    let b = striping_target().await;
    let q8s = samples::schemes()
        .into_iter()
        .find(|(name, _)| name.starts_with("Q8S-block"))
        .map(|(_, scheme)| scheme)
        .unwrap();
    let tensors = vec![
        samples::plain(DType::F32, &[700, 900], 1),
        samples::quantized(&q8s, &[1024, 1536], 2),
        samples::plain(DType::BF16, &[333, 2049], 3),
        samples::plain(DType::F32, &[100, 100], 4),
    ];
    let striped: u64 = tensors.iter().map(stripes_of).sum();
    assert!(stripes_of(&tensors[0]) > 30 && stripes_of(&tensors[3]) == 0);
    let before = a.node.stats().await.unwrap().fetches_served;
    let (via, accepted) = counting_proxy(a.addr).await;
    let answers = pull_all(&a, &b, &via, &tensors).await;
    all_landed(&b, answers, &tensors).await;
    let fetches = a.node.stats().await.unwrap().fetches_served - before;
    assert_eq!(
        fetches,
        striped + 1,
        "a fetch per stripe, and one for the small tensor"
    );
    let connections = accepted.load(Ordering::SeqCst);
    assert!(connections >= 2, "{connections} connection(s): no helper");
    let stats = b.client().await.stat().await.unwrap();
    assert_eq!((stats.pulls, stats.pull_retries), (4, 0));
}

/// The pull's own connection cut in the middle of a stripe: that stripe is resumed from its
/// last byte in (over a new connection, or a helper takes it), and the tensor lands bit-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stripe_cut_mid_way_is_resumed_where_it_stopped() {
    let a = source("flex").await;
    let b = striping_target().await;
    let via = proxy(a.addr, Fault::CutOnceAfter(200 << 10))
        .await
        .to_string();
    let tensors = vec![samples::plain(DType::F32, &[1024, 1024], 5)];
    let answers = pull_all(&a, &b, &via, &tensors).await;
    all_landed(&b, answers, &tensors).await;
    let stats = b.client().await.stat().await.unwrap();
    assert!(stats.pull_retries >= 1, "{}", stats.pull_retries);
}

/// One bit flipped in a stripe on the wire (its chunk's checksum left as sent, which a striped
/// receive does not check): the merged hash is not the grant's, the pull fails `Integrity` and
/// nothing is registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flipped_byte_in_a_stripe_fails_the_pull_and_registers_nothing() {
    let a = source("flex").await;
    let b = striping_target().await;
    let via = proxy(a.addr, Fault::FlipAt(50 << 10)).await.to_string();
    let tensors = vec![samples::plain(DType::F32, &[1024, 1024], 6)];
    let answers = pull_all(&a, &b, &via, &tensors).await;
    let error = answers.into_iter().next().unwrap().unwrap_err();
    assert_eq!(error.code(), Some(ErrorCode::Integrity), "{error}");
    assert!(b.client().await.list(None).await.unwrap().is_empty());
    let stats = b.node.stats().await.unwrap();
    assert_eq!(stats.devices[0].bytes_held, 0, "nothing held");
}

/// A source whose device cannot lend its tensor's bytes (NdArray: every read is a copy) answers
/// the first stripe with the whole payload instead: one fetch, bit-exact. Each such answer is
/// charged as a whole fetch, so a capability serves 16 of them however little each asks for.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_source_that_would_copy_for_every_stripe_sends_the_tensor_whole() {
    let a = source("ndarray").await;
    let b = striping_target().await;
    let tensors = vec![samples::plain(DType::F32, &[1024, 512], 7)];
    let answers = pull_all(&a, &b, &a.addr.to_string(), &tensors).await;
    all_landed(&b, answers, &tensors).await;
    assert_eq!(a.node.stats().await.unwrap().fetches_served, 1);

    let mut granter = a.client().await;
    let b_id = ferry_proto::NodeId::new("node-b");
    let grant = granter
        .grant(&TensorKey::new(0, "t0"), &b_id)
        .await
        .unwrap();
    let mut conn = source_connection(&a).await;
    for served in 0..=16 {
        // Nothing asked for but the first byte's place: the whole payload comes.
        let fetch = conn.fetch_range(&grant.token, &b_id, 0..1).await;
        if served == 16 {
            let refused = fetch.map(|f| f.range);
            assert_eq!(source_code_of(refused), ErrorCode::CapabilityRefused);
            break;
        }
        let fetch = fetch.unwrap();
        assert_eq!(fetch.range, 0..tensors[0].as_bytes().len() as u64);
        let mut whole = TensorAssembler::new(
            fetch.meta.clone(),
            u64::MAX,
            BufferFrom::Fresh,
            HashUse::Skip,
        )
        .unwrap();
        fetch
            .payload(&mut whole, ferry_io::RegionUse::Map)
            .await
            .unwrap();
        assert_same(&whole.finish().unwrap().data, &tensors[0], "whole");
    }
}

/// A capability's time to live bounds when a first fetch may begin; once fetched, it lives
/// while fetches follow one another (a striped pull's next stripe may begin after the time to
/// live) and lapses one idle timeout of the source after the last one ended. Once the client it
/// was granted to is gone, no fetch begins, even beside one under way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fetched_capability_lapses_from_its_last_fetch_and_none_begins_once_its_client_left() {
    let mut config = NodeConfig {
        devices: devices(&["flex"]),
        limits: ferry_server::NodeLimits {
            capability_ttl: Duration::from_millis(500),
            ..Default::default()
        },
        ..NodeConfig::light()
    };
    config.pulls.peer_limits.idle_timeout = Duration::from_millis(1500);
    let a = start(config, ServiceConfig::default()).await;
    let data = samples::plain(DType::F32, &[256, 256], 9);
    let key = TensorKey::new(0, "w");
    let mut granter = a.client().await;
    granter.put(&key, &data).await.unwrap();
    let b_id = ferry_proto::NodeId::new("node-b");
    let (meta, _) = ferry_proto::tensor::into_parts(data.clone()).unwrap();
    let len = StripeLen::new(STRIPE).unwrap();
    let mut conn = source_connection(&a).await;
    let stripe_fetch = async |conn: &mut ferry_io::Exchange,
                              token: &ferry_proto::CapabilityToken,
                              index: usize| {
        let fresh = TensorAssembler::new(meta.clone(), u64::MAX, BufferFrom::Fresh, HashUse::Check)
            .unwrap();
        let (_striped, mut stripes) = StripedReceive::new(fresh, len).unwrap();
        let stripe = &mut stripes[index];
        let input = STRIPE * index as u64..STRIPE * (index as u64 + 1);
        let fetch = conn.fetch_range(token, &b_id, input).await?;
        fetch.stripe(stripe).await
    };

    // Never fetched: gone after its time to live.
    let unused = granter.grant(&key, &b_id).await.unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let late = stripe_fetch(&mut conn, &unused.token, 0).await;
    assert_eq!(source_code_of(late), ErrorCode::CapabilityRefused);

    // Fetched at once: its next stripes come past the time to live, each within the window.
    let grant = granter.grant(&key, &b_id).await.unwrap();
    let first = std::time::Instant::now();
    for index in 0..4 {
        stripe_fetch(&mut conn, &grant.token, index).await.unwrap();
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    // The fetches spanned more than the window: it runs from the last one.
    assert!(first.elapsed() > Duration::from_millis(2000));
    // Past the window after the last fetch: lapsed.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let lapsed = stripe_fetch(&mut conn, &grant.token, 4).await;
    assert_eq!(source_code_of(lapsed), ErrorCode::CapabilityRefused);

    // The client it was granted to gone while a fetch is under way (its payload not read: 8 MiB
    // the source is still writing): no fetch begins after, though one is under way.
    let big = samples::plain(DType::F32, &[2048, 1024], 10);
    let big_key = TensorKey::new(0, "big");
    granter.put(&big_key, &big).await.unwrap();
    let grant = granter.grant(&big_key, &b_id).await.unwrap();
    let mut stalled = source_connection(&a).await;
    let under_way = stalled
        .fetch_range(&grant.token, &b_id, 0..(8 << 20))
        .await
        .unwrap();
    let before = a.node.stats().await.unwrap().connections;
    drop(granter);
    for _ in 0..200 {
        if a.node.stats().await.unwrap().connections < before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let after = conn.fetch_range(&grant.token, &b_id, 0..STRIPE).await;
    assert_eq!(
        source_code_of(after.map(|f| f.range)),
        ErrorCode::CapabilityRefused
    );
    drop(under_way);
}

/// Stripes fetched by hand over two connections at once (as a striping node's do) merge into
/// the tensor; a range asked of a part that is not the one answered is refused by the fetcher;
/// and a capability serves 16 times its payload in stripes, then refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stripes_fetched_side_by_side_merge_and_a_capability_bounds_them() {
    let a = source("flex").await;
    let data = samples::plain(DType::F32, &[512, 512], 8);
    let key = TensorKey::new(0, "w");
    let mut granter = a.client().await;
    granter.put(&key, &data).await.unwrap();
    let b_id = ferry_proto::NodeId::new("node-b");
    let grant = granter.grant(&key, &b_id).await.unwrap();
    let (meta, _) = ferry_proto::tensor::into_parts(data.clone()).unwrap();
    let assembler =
        TensorAssembler::new(meta.clone(), u64::MAX, BufferFrom::Fresh, HashUse::Check).unwrap();
    let len = StripeLen::new(STRIPE).unwrap();
    let (striped, stripes) = StripedReceive::new(assembler, len).unwrap();
    let prefix = ferry_proto::tensor::content_hash_prefix(&meta).len() as u64;
    let count = stripes.len();
    let (evens, odds): (Vec<_>, Vec<_>) = stripes.into_iter().partition(|s| s.index() % 2 == 0);
    let fetch_all = |mut stripes: Vec<ferry_io::striped::StripeReceiver>| {
        let (token, b_id, a) = (grant.token.clone(), b_id.clone(), &a);
        async move {
            let mut conn = source_connection(a).await;
            for stripe in &mut stripes {
                let range = stripe.payload_range();
                let input = range.start + prefix..range.end + prefix;
                let fetch = conn.fetch_range(&token, &b_id, input).await.unwrap();
                assert_eq!(fetch.range, range);
                fetch.stripe(stripe).await.unwrap();
            }
            stripes
        }
    };
    let (mut done, odd) = tokio::join!(fetch_all(evens), fetch_all(odds));
    done.extend(odd);
    let mut whole = striped.join(done).unwrap();
    assert_eq!(whole.settle_hash().unwrap(), grant.content_hash);
    assert_same(&whole.finish().unwrap().data, &data, "merged");

    // 1 MiB of payload, charged a stripe at a time: 16 MiB in all, so 256 stripes of 64 KiB
    // (count of them fetched above), then refused.
    let mut conn = source_connection(&a).await;
    let mut served = count;
    loop {
        match conn.fetch_range(&grant.token, &b_id, 0..STRIPE).await {
            Ok(fetch) => {
                let (asm, mut stripes) = StripedReceive::new(
                    TensorAssembler::new(meta.clone(), u64::MAX, BufferFrom::Fresh, HashUse::Check)
                        .unwrap(),
                    len,
                )
                .unwrap();
                fetch.stripe(&mut stripes[0]).await.unwrap();
                drop(asm);
                served += 1;
            }
            Err(error) => {
                assert_eq!(
                    source_code_of::<()>(Err(error)),
                    ErrorCode::CapabilityRefused
                );
                break;
            }
        }
        assert!(
            served <= 16 * 16,
            "served {served} stripes of 64 KiB of a 1 MiB tensor"
        );
    }
    assert_eq!(served, 16 * 16);
}

/// Striped pulls racing a writer that overwrites the source tensor with other values (and
/// sometimes deletes it), for a few seconds with random sizes: every stripe is a fetch of its
/// own, and the capability pins the version granted, so each pull either lands one version
/// whole, bit for bit, or fails with nothing registered (the version was replaced before all
/// its stripes were fetched); never stripes of two versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn striped_pulls_racing_overwrites_land_one_version_whole_or_nothing() {
    use rand::{Rng, SeedableRng};
    let a = source("flex").await;
    let b = striping_target().await;
    let seed: u64 = rand::random();
    eprintln!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    // Versions of several sizes (each dozens of stripes), every one told apart by its bytes.
    let versions: Vec<TensorData> = (0..6)
        .map(|i| {
            samples::plain(
                DType::F32,
                &[256 + 64 * rng.random_range(0..8), 1024],
                100 + i,
            )
        })
        .collect();
    let key = TensorKey::new(0, "w");
    a.client().await.put(&key, &versions[0]).await.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (stop, versions) = (stop.clone(), versions.clone());
        let mut client = a.client().await;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 1);
        tokio::spawn(async move {
            let mut writes = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if rng.random_ratio(1, 8) {
                    let _ = client.delete(&key).await;
                } else {
                    let value = &versions[rng.random_range(0..versions.len())];
                    client
                        .put(&key, value)
                        .if_exists(ferry_proto::IfExists::Replace)
                        .await
                        .unwrap();
                }
                writes += 1;
                tokio::time::sleep(Duration::from_millis(rng.random_range(5..40))).await;
            }
            writes
        })
    };
    let mut source = a.client().await;
    let mut target = b.client().await;
    let addr = a.addr.to_string();
    let mut again = how(&addr, 0);
    again.if_exists = ferry_proto::IfExists::Replace;
    let started = std::time::Instant::now();
    let (mut landed, mut failed) = (0u32, 0u32);
    while started.elapsed() < Duration::from_secs(4) {
        let key = TensorKey::new(0, "w");
        let answer =
            match copy_keys(&mut source, &mut target, std::slice::from_ref(&key), &again).await {
                Ok(mut answers) => answers.remove(0),
                // The grant itself found nothing to grant (deleted meanwhile).
                Err(_) => continue,
            };
        match answer {
            Ok(info) => {
                landed += 1;
                let got = target.get(&info.key).await.unwrap();
                let whole = versions.iter().any(|v| {
                    v.as_bytes() == got.as_bytes()
                        && v.shape() == got.shape()
                        && v.dtype() == got.dtype()
                });
                assert!(
                    whole,
                    "seed {seed}: a pull answered Stored holds no version whole"
                );
                target.delete(&info.key).await.unwrap();
            }
            Err(error) => {
                failed += 1;
                let code = error.code();
                assert!(
                    matches!(
                        code,
                        Some(
                            ErrorCode::CapabilityRefused | ErrorCode::NotFound | ErrorCode::Changed
                        )
                    ),
                    "seed {seed}: {error}"
                );
                assert!(target.list(None).await.unwrap().is_empty(), "seed {seed}");
            }
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let writes = writer.await.unwrap();
    eprintln!("{landed} pulls landed, {failed} failed, against {writes} racing writes");
    assert!(
        landed > 0 && writes > 0,
        "seed {seed}: the race was never run"
    );
}
