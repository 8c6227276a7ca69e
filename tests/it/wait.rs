//! Waiting over the wire (`Client::wait_for`, `Request::Wait`): a client that waits for a key
//! hears of its tensor when it arrives, by whichever way, never before and never missed, with the
//! bytes it then reads; a wait times out with nothing; a waiter that hangs up costs the node
//! nothing; a wait longer than one request may ask is refused with its reason.

use std::time::Duration;

use ferry_client::ErrorCode;
use ferry_proto::{DType, TensorData, TensorKey};
use ferry_server::IfExists;
use ferry_testkit::samples;
use ferry_testkit::{assert_same, code_of, start_with};

/// Clients wait over TCP for 24 keys on two devices, then the arrivals race in a seeded random
/// order (puts from other clients, inserts by the node's own program): every waiter is answered
/// with its own tensor's description, and reads exactly its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hears_of_its_tensor_when_it_arrives_and_never_misses_one() {
    use rand::{Rng, SeedableRng, seq::SliceRandom};
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let node = start_with(&["flex", "flex"]).await;
    let dtypes = [DType::F32, DType::BF16, DType::I8, DType::U16];
    let arrivals: Vec<(TensorKey, TensorData)> = (0..24)
        .map(|i| {
            let key = TensorKey::new(i % 2, format!("job-{i}"));
            let data = samples::plain(dtypes[i as usize % 4], &[1 + i as usize % 5, 9], i.into());
            (key, data)
        })
        .collect();
    let mut waiters = Vec::new();
    for (key, data) in &arrivals {
        let mut client = node.client().await;
        let (key, data) = (key.clone(), data.clone());
        waiters.push(tokio::spawn(async move {
            let info = client
                .wait_for(&key, Duration::from_secs(30))
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{key}: never heard of"));
            assert_eq!(info.key, key);
            assert_eq!(info.bytes, data.as_bytes().len() as u64, "{key}");
            assert_same(&client.get(&key).await.unwrap(), &data, "waited for");
        }));
    }
    let mut order: Vec<usize> = (0..arrivals.len()).collect();
    order.shuffle(&mut rng);
    let mut senders = Vec::new();
    for lane in order.chunks(6) {
        let mut client = node.client().await;
        let in_process = node.node.clone();
        let lane: Vec<_> = lane
            .iter()
            .map(|&i| {
                let how = (rng.random_bool(0.25), rng.random_range(0..3u64));
                (arrivals[i].clone(), how)
            })
            .collect();
        senders.push(tokio::spawn(async move {
            for ((key, data), (inserted, pause)) in lane {
                tokio::time::sleep(Duration::from_millis(pause)).await;
                if inserted {
                    in_process
                        .insert(&key, data, IfExists::Refuse)
                        .await
                        .unwrap();
                } else {
                    client.put(&key, &data).await.unwrap();
                }
            }
        }));
    }
    for sender in senders {
        sender.await.unwrap();
    }
    for waiter in waiters {
        waiter.await.unwrap();
    }
    node.shutdown().await;
}

/// A key already there answers at once; one that never gets a tensor answers nothing at the
/// timeout, and the connection takes the next request; a wait past the longest one request may
/// ask is refused as a bad request that says so; a device the node lacks is an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_answers_at_once_times_out_or_is_refused_with_its_reason() {
    let node = start_with(&["flex"]).await;
    let mut client = node.client().await;
    let key = TensorKey::new(0, "there");
    let data = samples::plain(DType::F32, &[4, 4], 3);
    client.put(&key, &data).await.unwrap();
    let started = std::time::Instant::now();
    let info = client.wait_for(&key, Duration::from_secs(60)).await;
    assert_eq!(info.unwrap().unwrap().key, key);
    assert!(started.elapsed() < Duration::from_secs(30), "not at once");

    let started = std::time::Instant::now();
    let missing = TensorKey::new(0, "never");
    let waited = client.wait_for(&missing, Duration::from_millis(300)).await;
    assert_eq!(
        waited.unwrap(),
        None,
        "answered for a key nothing was put under"
    );
    assert!(started.elapsed() >= Duration::from_millis(300));
    // The connection is in step: it takes the next request.
    assert_same(&client.get(&key).await.unwrap(), &data, "after a timeout");

    let error = client
        .wait_for(&TensorKey::new(7, "x"), Duration::from_secs(1))
        .await
        .unwrap_err();
    assert_eq!(code_of::<()>(Err(error)), ErrorCode::BadRequest);
    node.shutdown().await;
}

/// A wait over the longest one request may ask is refused with the reason and the longest, and
/// the connection lives on; asked through the client, a longer wait is split into requests the
/// node takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_past_the_longest_is_refused_by_the_node_and_split_by_the_client() {
    use ferry_proto::message::MAX_WAIT_MS;
    use ferry_proto::{Request, Response, WaitFor};
    let node = start_with(&["flex"]).await;
    let key = TensorKey::new(0, "late");
    let (mut raw, _) = crate::hostile::Raw::hello(&node, None).await;
    let too_long = Request::Wait {
        target: WaitFor::Tensor(key.clone()),
        timeout_ms: MAX_WAIT_MS + 1,
    };
    match raw.ask(&too_long).await {
        Some(Response::Error(reply)) => {
            assert_eq!(reply.code, ErrorCode::BadRequest);
            assert!(
                reply.message.contains("longer than one request"),
                "{}",
                reply.message
            );
        }
        other => panic!("a wait past the longest: {other:?}"),
    }
    // The connection lives on.
    let answer = raw.ask(&Request::Stat).await;
    assert!(matches!(answer, Some(Response::Stats(_))), "{answer:?}");
    // The client splits an hour into requests the node takes, and hears of the tensor.
    let mut waiter = node.client().await;
    let waiting = tokio::spawn({
        let key = key.clone();
        async move { waiter.wait_for(&key, Duration::from_secs(3600)).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let data = samples::plain(DType::BF16, &[3, 5], 8);
    node.client().await.put(&key, &data).await.unwrap();
    let info = waiting.await.unwrap().unwrap().unwrap();
    assert_eq!(info.key, key);
    node.shutdown().await;
}

/// Waiters that hang up before their tensor arrives end their waits: the node stays up, serves
/// the others, and its open connections fall back to those still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_hangs_up_costs_the_node_nothing() {
    let node = start_with(&["flex"]).await;
    for i in 0..8 {
        let mut client = node.client().await;
        let key = TensorKey::new(0, format!("abandoned-{i}"));
        let wait = client.wait_for(&key, Duration::from_secs(600));
        // Dropped mid-wait: the connection closes under the node's waiting session.
        assert!(
            tokio::time::timeout(Duration::from_millis(50), wait)
                .await
                .is_err()
        );
    }
    let mut client = node.client().await;
    let mut connections = u64::MAX;
    for _ in 0..200 {
        connections = client.stat().await.unwrap().connections;
        if connections == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        connections, 1,
        "waiting sessions outlived their connections"
    );
    let key = TensorKey::new(0, "abandoned-0");
    let data = samples::plain(DType::F32, &[2], 1);
    client.put(&key, &data).await.unwrap();
    assert_same(&client.get(&key).await.unwrap(), &data, "after hang-ups");
    node.shutdown().await;
}
