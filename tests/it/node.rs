//! A real node on loopback: every dtype and quantization scheme through put, copy (each path
//! forced), move and get, bit-exact; Flex to NdArray and back; 16 concurrent clients.

use ferry_client::ErrorCode;
use ferry_proto::{DType, TensorKey, dtype_name};
use ferry_proto::{Transfer, TransferPath};
use ferry_server::{BackendKind, IfExists, NodeConfig, ServiceConfig, TransferPolicy};
use ferry_testkit::samples;
use ferry_testkit::{assert_same, code_of, devices, start, start_with};

async fn copy_matrix(policy: TransferPolicy, expected_path: TransferPath) {
    let node = start(
        NodeConfig {
            devices: devices(&["flex", "flex"]),
            policy,
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await;
    let mut client = node.client().await;
    let matrix = samples::full_matrix();
    for sample in &matrix {
        let src = TensorKey::new(0, &sample.name);
        let put = client
            .put(&TensorKey::new(0, &sample.name), &sample.data)
            .await;
        let put = put.unwrap_or_else(|e| panic!("{}: put: {e}", sample.name));
        assert_eq!(
            put.bytes as usize,
            sample.data.as_bytes().len(),
            "{}",
            sample.name
        );
        let copied = client
            .copy(&src, &src.on(1))
            .await
            .unwrap_or_else(|e| panic!("{}: copy: {e}", sample.name));
        assert_eq!(copied.path, expected_path, "{}", sample.name);
        assert_eq!(copied.key, TensorKey::new(1, &sample.name));
        let back = client.get(&copied.key).await.expect("get copy");
        assert_same(&back, &sample.data, &sample.name);
        // The source is untouched by a copy.
        let source = client.get(&src).await.expect("get source");
        assert_same(&source, &sample.data, &sample.name);
    }
    let stats = client.stat().await.unwrap();
    let count = matrix.len() as u64;
    match policy {
        TransferPolicy::Auto => assert_eq!(stats.native_transfers, count),
        TransferPolicy::RoundTrip => assert_eq!(stats.round_trip_transfers, count),
        other => panic!("no expectation for the policy {other:?}"),
    }
    assert_eq!(stats.transfers_failed, 0);
    assert_eq!(stats.devices[1].tensors, count);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dtype_copies_bit_exact_on_the_native_path() {
    copy_matrix(TransferPolicy::Auto, TransferPath::Native).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dtype_copies_bit_exact_on_the_forced_round_trip() {
    copy_matrix(TransferPolicy::RoundTrip, TransferPath::RoundTrip).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_deletes_the_source_only_once_the_target_holds_it() {
    let node = start_with(&["flex", "flex", "ndarray"]).await;
    let mut client = node.client().await;
    let data = samples::quantized(&samples::schemes()[1].1, &[8, 64], 7);
    let src = TensorKey::new(0, "w");
    client.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let moved = client
        .move_to(&src, &TensorKey::new(1, "w2"))
        .await
        .unwrap();
    assert_eq!(moved.key, TensorKey::new(1, "w2"));
    assert_same(&client.get(&moved.key).await.unwrap(), &data, "moved");
    assert_eq!(code_of(client.get(&src).await), ErrorCode::NotFound);

    // A move the target refuses (NdArray cannot hold F16) leaves the source where it was.
    let half = samples::plain(DType::F16, &[4, 4], 1);
    let src = TensorKey::new(0, "half");
    client.put(&TensorKey::new(0, "half"), &half).await.unwrap();
    let refused = client.move_to(&src, &src.on(2)).await;
    assert_eq!(code_of(refused), ErrorCode::UnsupportedDType);
    assert_same(&client.get(&src).await.unwrap(), &half, "source kept");
    let listing = client.list(Some(2)).await.unwrap();
    assert!(
        listing.is_empty(),
        "nothing registered on the target: {listing:?}"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flex_to_ndarray_round_trips_what_ndarray_holds_and_refuses_the_rest_clearly() {
    let node = start_with(&["flex", "ndarray"]).await;
    let mut client = node.client().await;
    let mut held = 0;
    let mut refused = 0;
    for sample in samples::full_matrix() {
        let dtype = sample.data.dtype();
        let shape = sample.data.shape().as_slice().to_vec();
        let src = TensorKey::new(0, &sample.name);
        client
            .put(&TensorKey::new(0, &sample.name), &sample.data)
            .await
            .unwrap();
        let result = client.copy(&src, &src.on(1)).await;
        if BackendKind::NdArray
            .measured_holds()
            .unwrap()
            .check(&dtype, &shape)
            .is_ok()
        {
            let info = result.unwrap_or_else(|e| panic!("{}: {e}", sample.name));
            assert_eq!(info.path, TransferPath::RoundTrip, "{}", sample.name);
            let back = client.get(&info.key).await.unwrap();
            assert_same(&back, &sample.data, &sample.name);
            // And back again, NdArray to Flex.
            let home = client
                .copy(&info.key, &TensorKey::new(0, "returned"))
                .await
                .unwrap();
            let returned = client.get(&home.key).await.unwrap();
            assert_same(&returned, &sample.data, &format!("{} back", sample.name));
            client.delete(&home.key).await.unwrap();
            held += 1;
        } else {
            let Err(ferry_client::ClientError::Node { code, message }) = result else {
                panic!("{}: expected a refusal, got {result:?}", sample.name);
            };
            assert_eq!(code, ErrorCode::UnsupportedDType, "{}", sample.name);
            assert!(message.contains(&dtype_name(&dtype)), "{message}");
            assert!(message.contains("ndarray"), "{message}");
            refused += 1;
        }
    }
    // The matrix exercises both sides of the table.
    assert!(held > 40 && refused > 40, "held {held}, refused {refused}");
    let on_ndarray = client.list(Some(1)).await.unwrap();
    assert_eq!(
        on_ndarray.len(),
        held,
        "exactly the held tensors are registered"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_process_api_shares_the_workers_the_service_uses() {
    let node = start_with(&["flex", "flex"]).await;
    let data = samples::plain(DType::BF16, &[3, 5], 3);
    node.node
        .insert(
            &TensorKey::new(0, "embedded"),
            data.clone(),
            IfExists::Refuse,
        )
        .await
        .unwrap();
    let mut client = node.client().await;
    let fetched = client.get(&TensorKey::new(0, "embedded")).await.unwrap();
    assert_same(&fetched, &data, "inserted in process, read over TCP");
    client
        .put(&TensorKey::new(1, "remote"), &data)
        .await
        .unwrap();
    let key = TensorKey::new(1, "remote");
    let taken = node.node.take(&key).await.unwrap();
    assert_same(&taken, &data, "put over TCP, taken in process");
    assert_eq!(code_of(client.get(&key).await), ErrorCode::NotFound);
    node.shutdown().await;
}

/// A source sends a Flex tensor straight from the registered tensor: the plain buffer, or a
/// quantized tensor's values followed by its scale bytes. Whichever way, what arrives is exactly
/// `into_data`'s bytes, for every sample: inserted in process (so the registered buffer is the
/// very one handed in) and read back over TCP. (That the single-level ones go without a host
/// copy, and that the parts are laid end to end, is checked inside the node:
/// `server/src/node/registered_tests.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_source_sends_from_the_registered_tensor_is_exactly_into_data() {
    let node = start_with(&["flex"]).await;
    let mut client = node.client().await;
    for (i, sample) in samples::full_matrix().iter().enumerate() {
        let name = format!("s{i}");
        let desc = node
            .node
            .insert(
                &TensorKey::new(0, &name),
                sample.data.clone(),
                IfExists::Refuse,
            )
            .await
            .unwrap();
        assert_eq!(
            desc.bytes,
            sample.data.as_bytes().len() as u64,
            "{}",
            sample.name
        );
        let key = TensorKey::new(0, &name);
        let (info, sent) = client.get_with_info(&key).await.unwrap();
        assert_eq!(info.bytes, desc.bytes, "{}", sample.name);
        assert_same(&sent, &sample.data, &sample.name);
        node.node.remove(&key).await.unwrap();
    }
    node.shutdown().await;
}

/// 16 clients, 50 mixed operations each, against one node; every read is checked against what
/// that client last wrote, and at the end the node holds exactly what the clients left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_clients_fifty_mixed_operations_each() {
    let node = start_with(&["flex", "flex", "ndarray"]).await;
    let addr = node.addr;
    let mut tasks = Vec::new();
    for c in 0..16u64 {
        tasks.push(tokio::spawn(async move {
            let mut client = ferry_client::Client::connect(addr).await.unwrap();
            let mut model = std::collections::BTreeMap::new();
            let dtypes = [DType::F32, DType::I64, DType::U8, DType::BF16];
            for op in 0..50u64 {
                let slot = op % 4;
                let name = format!("c{c}-t{slot}");
                match (op * 7 + c) % 5 {
                    0 | 1 => {
                        let dtype = dtypes[((op + c) % 4) as usize];
                        let data = samples::plain(dtype, &[16, (op % 5 + 1) as usize], op + c);
                        client
                            .put(&TensorKey::new(0, &name), &data)
                            .if_exists(IfExists::Replace)
                            .await
                            .unwrap();
                        model.insert(TensorKey::new(0, &name), data);
                    }
                    2 => {
                        let src = TensorKey::new(0, &name);
                        let dst = TensorKey::new(1, &name);
                        let result = client
                            .transfer(&src, &src.on(1), Transfer::Copy, IfExists::Replace)
                            .await;
                        match model.get(&src).cloned() {
                            Some(data) => {
                                result.unwrap();
                                model.insert(dst, data);
                            }
                            None => assert_eq!(code_of(result), ErrorCode::NotFound),
                        }
                    }
                    3 => {
                        for key in [TensorKey::new(0, &name), TensorKey::new(1, &name)] {
                            let result = client.get(&key).await;
                            match model.get(&key) {
                                Some(data) => assert_same(&result.unwrap(), data, &name),
                                None => assert_eq!(code_of(result), ErrorCode::NotFound),
                            }
                        }
                    }
                    _ => {
                        let key = TensorKey::new((op % 2) as u32, &name);
                        let result = client.delete(&key).await;
                        match model.remove(&key) {
                            Some(_) => {
                                result.unwrap();
                            }
                            None => assert_eq!(code_of(result), ErrorCode::NotFound),
                        }
                    }
                }
            }
            model
        }));
    }
    let mut expected = std::collections::BTreeMap::new();
    for task in tasks {
        expected.extend(task.await.unwrap());
    }
    let mut client = node.client().await;
    let listed: Vec<TensorKey> = client
        .list(None)
        .await
        .unwrap()
        .into_iter()
        .map(|info| info.key)
        .collect();
    let wanted: Vec<TensorKey> = expected.keys().cloned().collect();
    assert_eq!(
        listed, wanted,
        "the node holds exactly what the clients left"
    );
    for (key, data) in &expected {
        assert_same(&client.get(key).await.unwrap(), data, &key.to_string());
    }
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burn_tensors_go_in_and_come_back_with_their_dtype_quantized_included() {
    use burn_tensor::{Device, Int, Tensor};
    let node = start_with(&["flex", "flex"]).await;
    let mut client = node.client().await;
    let device = Device::flex();
    for (label, scheme) in samples::schemes().into_iter().step_by(7) {
        let float = Tensor::<2>::from_data(samples::plain(DType::F32, &[8, 64], 1), &device);
        let quantized = float.quantize_dynamic(&scheme);
        let expected = quantized.to_data();
        client
            .put(&TensorKey::new(0, &label), quantized)
            .await
            .unwrap();
        let key = TensorKey::new(0, &label);
        let back: Tensor<2> = client.get_tensor(&key, &device).await.unwrap();
        assert_same(&back.into_data(), &expected, &label);
    }
    let ids = samples::plain(DType::U16, &[3, 5], 2);
    client.put(&TensorKey::new(0, "ids"), &ids).await.unwrap();
    let key = TensorKey::new(0, "ids");
    let back: Tensor<2, Int> = client.get_tensor(&key, &device).await.unwrap();
    assert_same(&back.into_data(), &ids, "u16 as Int");
    // The wrong rank or kind is an error, not Burn's panic.
    let wrong_rank = client.get_tensor::<3, Int>(&key, &device).await;
    assert!(wrong_rank.unwrap_err().to_string().contains("rank 2"));
    let wrong_kind = client
        .get_tensor::<2, burn_tensor::Float>(&key, &device)
        .await;
    assert!(wrong_kind.unwrap_err().to_string().contains("Int tensor"));
    node.shutdown().await;
}

/// A payload put from the slices it lies in (`Payload::from_parts`, and `TensorParts` in a
/// batch) arrives exactly as the same bytes put whole, for every quantized scheme split at each boundary a backend could
/// keep (inside the values, at the scales, inside the scales); parts that are no tensor of
/// their dtype and shape are refused with the checker's own error before anything is sent,
/// and the connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_put_from_its_parts_arrives_as_the_whole() {
    use ferry_client::{ClientError, Payload, TensorParts};
    use ferry_proto::MetaError;
    let node = start_with(&["flex"]).await;
    let mut client = node.client().await;
    for (label, scheme) in samples::schemes() {
        let data = samples::quantized(&scheme, &[8, 64], 3);
        let bytes = data.as_bytes();
        let values = 8 * 64 * scheme.value.size_bits() / 8;
        let splits: std::collections::BTreeSet<usize> = [1, values, bytes.len() - 1]
            .into_iter()
            .map(|split| split.min(bytes.len()))
            .collect();
        for split in splits {
            let parts = vec![&bytes[..split], &bytes[split..]];
            let key = TensorKey::new(0, format!("{label}@{split}"));
            let payload =
                Payload::from_parts(data.shape().as_slice().to_vec(), data.dtype(), parts);
            client.put(&key, payload).await.unwrap();
            assert_same(&client.get(&key).await.unwrap(), &data, &key.to_string());
        }
    }
    let plain = samples::plain(DType::F32, &[4, 4], 5);
    let short = vec![&plain.as_bytes()[..60]];
    let refused = client
        .put(
            &TensorKey::new(0, "short"),
            Payload::from_parts(vec![4, 4], DType::F32, short),
        )
        .await;
    assert!(
        matches!(
            refused,
            Err(ClientError::Meta(MetaError::ByteLenMismatch {
                actual: 60,
                ..
            }))
        ),
        "{refused:?}"
    );
    let key = TensorKey::new(0, "after");
    client.put(&key, &plain).await.unwrap();
    assert_same(&client.get(&key).await.unwrap(), &plain, "after a refusal");

    // The same in one pipelined batch: each tensor from its parts, one that is no tensor of
    // its meta answered with the checker's error, the others stored.
    let quantized = samples::quantized(&samples::schemes()[3].1, &[8, 64], 9);
    let (q, p) = (quantized.as_bytes(), plain.as_bytes());
    let batch = vec![
        (
            TensorKey::new(0, "batch/q"),
            TensorParts::new(vec![8, 64], quantized.dtype(), vec![&q[..100], &q[100..]]),
        ),
        (
            TensorKey::new(0, "batch/short"),
            TensorParts::new(vec![4, 4], DType::F32, vec![&p[..60]]),
        ),
        (
            TensorKey::new(0, "batch/plain"),
            TensorParts::new(vec![4, 4], DType::F32, vec![&p[..16], &p[16..]]),
        ),
    ];
    let answers = client.put_batch(&batch).await.unwrap();
    assert!(answers[0].is_ok() && answers[2].is_ok(), "{answers:?}");
    assert!(
        matches!(
            &answers[1],
            Err(ClientError::Meta(MetaError::ByteLenMismatch { .. }))
        ),
        "{:?}",
        answers[1]
    );
    for (name, want) in [("batch/q", &quantized), ("batch/plain", &plain)] {
        let key = TensorKey::new(0, name);
        assert_same(&client.get(&key).await.unwrap(), want, name);
    }
    assert!(client.get(&TensorKey::new(0, "batch/short")).await.is_err());
    node.shutdown().await;
}

/// `Node::wait_for` answers once a tensor is registered under its key, by whichever way it came
/// (a put over TCP from racing clients, an insert in process), never before and never missed:
/// waiters on every key start first, the arrivals race in a seeded random order, and each waiter
/// then reads exactly its tensor's bytes. A key that holds a tensor answers at once; one that
/// never gets one waits until the caller stops waiting; a device the node lacks is an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_hears_of_its_tensor_however_it_arrives_and_never_misses_one() {
    use rand::{Rng, SeedableRng, seq::SliceRandom};
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let node = start_with(&["flex", "flex"]).await;
    let dtypes = [DType::F32, DType::BF16, DType::I8, DType::U16];
    let arrivals: Vec<(TensorKey, ferry_proto::TensorData)> = (0..32)
        .map(|i| {
            let key = TensorKey::new(i % 2, format!("arrival-{i}"));
            let data = samples::plain(dtypes[i as usize % 4], &[1 + i as usize % 5, 7], i.into());
            (key, data)
        })
        .collect();
    let waiters: Vec<_> = arrivals
        .iter()
        .map(|(key, data)| {
            let (node, key, data) = (node.node.clone(), key.clone(), data.clone());
            tokio::spawn(async move {
                let desc =
                    tokio::time::timeout(std::time::Duration::from_secs(20), node.wait_for(&key))
                        .await
                        .unwrap_or_else(|_| panic!("{key}: never heard of"))
                        .unwrap();
                assert_eq!(desc.key, key);
                assert_eq!(desc.bytes, data.as_bytes().len() as u64, "{key}");
                assert_same(&node.get(&key).await.unwrap(), &data, "waited for");
            })
        })
        .collect();
    let mut order: Vec<usize> = (0..arrivals.len()).collect();
    order.shuffle(&mut rng);
    let mut senders = Vec::new();
    for lane in order.chunks(8) {
        let mut client = node.client().await;
        let in_process = node.node.clone();
        let lane: Vec<_> = lane
            .iter()
            .map(|&i| {
                (
                    arrivals[i].clone(),
                    rng.random_bool(0.25),
                    rng.random_range(0..3u64),
                )
            })
            .collect();
        senders.push(tokio::spawn(async move {
            for ((key, data), inserted, pause) in lane {
                tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
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
    // Already there: at once.
    let (key, _) = &arrivals[0];
    let desc = tokio::time::timeout(std::time::Duration::from_secs(1), node.node.wait_for(key))
        .await
        .expect("a registered key answers at once")
        .unwrap();
    assert_eq!(&desc.key, key);
    // Never there: waits until the caller stops.
    let missing = TensorKey::new(0, "never");
    let waited = tokio::time::timeout(
        std::time::Duration::from_millis(200),
        node.node.wait_for(&missing),
    )
    .await;
    assert!(waited.is_err(), "answered for a key nothing was put under");
    match node.node.wait_for(&TensorKey::new(9, "x")).await {
        Err(ferry_server::NodeError::NoSuchDevice { index: 9, count: 2 }) => {}
        other => panic!("a device the node lacks: {other:?}"),
    }
    node.shutdown().await;
}
