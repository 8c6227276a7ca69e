//! A copy to several targets relayed along a chain (`NodeCopy::run_relayed`): every target
//! bit-exact, each byte leaving the source once, a refusing target passed over, a relay that
//! dies routed around, and every target landing one version while the source is overwritten.

use ferry_client::{ClientError, ErrorCode, NodeCopy, RelayTarget, TensorInfo};
use ferry_proto::{DType, TensorData, TensorKey};
use ferry_testkit::samples;
use ferry_testkit::{Fault, TestNode, assert_same, proxy, start_with};

/// Plain and quantized tensors, of several dtypes and schemes, on `node`'s device 0.
async fn fill(node: &TestNode) -> Vec<(TensorKey, TensorData)> {
    let mut tensors: Vec<(TensorKey, TensorData)> = [DType::F32, DType::BF16, DType::I64]
        .into_iter()
        .enumerate()
        .map(|(i, dtype)| {
            let data = samples::plain(dtype, &[256, 1024], i as u64);
            (TensorKey::new(0, format!("plain{i}")), data)
        })
        .collect();
    for (label, scheme) in samples::schemes()
        .into_iter()
        .filter(|(label, _)| ["Q8S-tensor-F32", "Q4S-block32-UE8M0"].contains(&label.as_str()))
    {
        let data = samples::quantized(&scheme, &[256, 256], 7);
        tensors.push((TensorKey::new(0, label), data));
    }
    assert_eq!(tensors.len(), 5, "every sample present");
    let mut client = node.client().await;
    for answer in client.put_batch(&tensors).await.unwrap() {
        answer.unwrap();
    }
    tensors
}

/// A chain member: `addr` as the other nodes reach it (the node's own, or a proxy in front).
async fn relay_target(node: &TestNode, addr: String) -> RelayTarget {
    RelayTarget {
        addr,
        pulls: node.client().await,
        grants: node.client().await,
    }
}

/// The copy of every tensor of `tensors` to device 0 of each target.
fn copy_of(source: &TestNode, tensors: &[(TensorKey, TensorData)]) -> NodeCopy {
    NodeCopy::new(source.addr.to_string()).tensors_to(tensors.iter().map(|(k, _)| k.clone()), 0)
}

/// Asserts that `node` holds every one of `tensors`, bit-exact.
async fn holds_all(node: &TestNode, tensors: &[(TensorKey, TensorData)], what: &str) {
    let mut client = node.client().await;
    for (key, data) in tensors {
        assert_same(
            &client.get(key).await.unwrap(),
            data,
            &format!("{what}: {key}"),
        );
    }
}

fn all_ok(answers: &[Result<TensorInfo, ClientError>], what: &str) {
    for answer in answers {
        assert!(answer.is_ok(), "{what}: {answer:?}");
    }
}

async fn fetches_served(node: &TestNode) -> u64 {
    node.client().await.stat().await.unwrap().fetches_served
}

/// A source holding the samples, and `n` empty targets.
async fn nodes(n: usize) -> (TestNode, Vec<TestNode>, Vec<(TensorKey, TensorData)>) {
    let source = start_with(&["flex"]).await;
    let mut targets = Vec::with_capacity(n);
    for _ in 0..n {
        targets.push(start_with(&["flex"]).await);
    }
    let tensors = fill(&source).await;
    (source, targets, tensors)
}

/// The chain of `targets`, each reached at its own address.
async fn chain_of(targets: &[TestNode]) -> Vec<RelayTarget> {
    let mut chain = Vec::with_capacity(targets.len());
    for target in targets {
        chain.push(relay_target(target, target.addr.to_string()).await);
    }
    chain
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_target_lands_every_tensor_and_the_source_sends_each_once() {
    let (source, targets, tensors) = nodes(3).await;
    let mut chain = chain_of(&targets).await;
    let answers = copy_of(&source, &tensors)
        .run_relayed(&mut source.client().await, &mut chain)
        .await;
    assert_eq!(answers.len(), 3);
    for (at, (target, answers)) in targets.iter().zip(&answers).enumerate() {
        assert_eq!(answers.len(), tensors.len());
        all_ok(answers, &format!("target {at}"));
        holds_all(target, &tensors, &format!("target {at}")).await;
    }
    // The source sent each tensor once (to the first target), which passed each on once; the
    // last target served nobody.
    assert_eq!(fetches_served(&source).await, tensors.len() as u64);
    assert_eq!(fetches_served(&targets[0]).await, tensors.len() as u64);
    assert_eq!(fetches_served(&targets[1]).await, tensors.len() as u64);
    assert_eq!(fetches_served(&targets[2]).await, 0);
}

/// A target that refuses a tensor (it holds that key already) keeps its own and answers the
/// refusal; the target after it takes that tensor from the one before, never the refuser's
/// bytes, and the rest from the refuser as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_target_is_passed_over_for_what_it_refused() {
    let (source, targets, tensors) = nodes(2).await;
    let (refused_key, _) = &tensors[1];
    let its_own = samples::plain(DType::BF16, &[256, 1024], 99);
    let mut on_first = targets[0].client().await;
    on_first.put(refused_key, &its_own).await.unwrap();
    let mut chain = chain_of(&targets).await;
    let answers = copy_of(&source, &tensors)
        .run_relayed(&mut source.client().await, &mut chain)
        .await;
    for (i, answer) in answers[0].iter().enumerate() {
        match i {
            1 => assert_eq!(
                answer.as_ref().map_err(ClientError::code).unwrap_err(),
                Some(ErrorCode::AlreadyExists)
            ),
            _ => assert!(answer.is_ok(), "{answer:?}"),
        }
    }
    assert_same(&on_first.get(refused_key).await.unwrap(), &its_own, "kept");
    all_ok(&answers[1], "the target after the refuser");
    holds_all(&targets[1], &tensors, "the target after the refuser").await;
}

/// A relay that dies mid-stream, as the nodes after it see it (a proxy in front of it cuts the
/// first fetch and refuses every later one): they take each tensor from the node before it,
/// and land every one bit-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_dies_mid_stream_is_routed_around() {
    let (source, targets, tensors) = nodes(3).await;
    let dying = proxy(targets[0].addr, Fault::DieAfter(64 * 1024)).await;
    let mut chain = vec![relay_target(&targets[0], dying.to_string()).await];
    chain.extend(chain_of(&targets[1..]).await);
    let answers = copy_of(&source, &tensors)
        .run_relayed(&mut source.client().await, &mut chain)
        .await;
    for (at, (target, answers)) in targets.iter().zip(&answers).enumerate() {
        all_ok(answers, &format!("target {at}"));
        holds_all(target, &tensors, &format!("target {at}")).await;
    }
    // Only the first target's own pulls went through the source and the dead relay's link
    // never completed one: the second target took every tensor from the source.
    assert_eq!(fetches_served(&targets[1]).await, tensors.len() as u64);
}

/// The source's tensors overwritten while they are relayed: every target that holds a tensor
/// holds the version the others hold (the first one granted for it), whole; a target that could
/// not get that version says so (the source granted another, or replaced it before the fetch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_target_lands_one_version_while_the_source_is_overwritten() {
    let (source, targets, tensors) = nodes(3).await;
    let versions: Vec<Vec<TensorData>> = tensors
        .iter()
        .map(|(_, first)| {
            let shape = first.shape().as_slice().to_vec();
            let mut all = vec![first.clone()];
            if first.dtype() == DType::F32 {
                all.extend((1..4).map(|seed| samples::plain(DType::F32, &shape, 100 + seed)));
            }
            all
        })
        .collect();
    let mut chain = chain_of(&targets).await;
    let mut writer = source.client().await;
    let overwrite = async {
        for round in 1..4 {
            for ((key, _), all) in tensors.iter().zip(&versions) {
                if let Some(next) = all.get(round) {
                    writer
                        .put(key, next)
                        .if_exists(ferry_client::IfExists::Replace)
                        .await
                        .unwrap();
                }
            }
        }
    };
    let mut source_client = source.client().await;
    let copy = copy_of(&source, &tensors);
    let ((), answers) = tokio::join!(overwrite, copy.run_relayed(&mut source_client, &mut chain));
    for (i, ((key, _), all)) in tensors.iter().zip(&versions).enumerate() {
        let mut landed: Option<TensorData> = None;
        for (at, target) in targets.iter().enumerate() {
            match &answers[at][i] {
                Ok(_) => {
                    let got = target.client().await.get(key).await.unwrap();
                    assert!(
                        all.iter().any(|v| v.as_bytes() == got.as_bytes()),
                        "target {at}, {key}: a version the source held, whole"
                    );
                    if let Some(first) = &landed {
                        assert_same(&got, first, &format!("target {at}, {key}: one version"));
                    }
                    landed.get_or_insert(got);
                }
                Err(refused) => assert!(
                    matches!(
                        refused,
                        ClientError::NotTheListedVersion { .. } | ClientError::NoAnswer { .. }
                    ) || matches!(
                        refused.code(),
                        Some(ErrorCode::Changed | ErrorCode::CapabilityRefused)
                    ),
                    "target {at}, {key}: {refused:?}"
                ),
            }
        }
    }
}

/// A model's current version relayed to three nodes: each commits a version of its own, whole
/// and bit-exact with the source's metadata, each tensor having left the source once; a target
/// that already holds the model (no replace asked) refuses, and the others commit all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_version_reaches_every_target_whole_or_not_at_all() {
    use ferry_client::ModelCopy;
    let (source, targets, tensors) = nodes(3).await;
    let mut writer = source.client().await;
    let version = writer.begin_model(0, "net", false).await.unwrap();
    for (key, data) in &tensors {
        let in_version = TensorKey::new(0, format!("net/.v{version}/{}", key.name));
        writer.put(&in_version, data).await.unwrap();
    }
    let metadata = vec![("format".to_string(), "pt".to_string())];
    let paths = tensors.iter().map(|(k, _)| k.name.as_str());
    writer
        .commit_model(0, "net", version, paths, metadata.clone())
        .await
        .unwrap();
    let served_before = fetches_served(&source).await;
    // The second target has a model of that name already.
    let mut on_second = targets[1].client().await;
    let (first_key, first_data) = &tensors[0];
    let own = on_second.begin_model(0, "net", false).await.unwrap();
    on_second
        .put(
            &TensorKey::new(0, format!("net/.v{own}/{}", first_key.name)),
            first_data,
        )
        .await
        .unwrap();
    on_second
        .commit_model(0, "net", own, [first_key.name.as_str()], Vec::new())
        .await
        .unwrap();

    let mut chain = chain_of(&targets).await;
    let outcome = ModelCopy::new(source.addr.to_string(), 0, "net")
        .run_relayed(&mut source.client().await, &mut chain)
        .await
        .unwrap();
    assert_eq!(
        outcome[1].as_ref().unwrap_err().code(),
        Some(ErrorCode::AlreadyExists),
        "a target holding the model refuses it"
    );
    for at in [0, 2] {
        let manifest = outcome[at].as_ref().unwrap();
        assert_eq!(manifest.metadata, metadata);
        assert_eq!(manifest.tensors.len(), tensors.len());
        let mut client = targets[at].client().await;
        for (key, data) in &tensors {
            let landed = TensorKey::new(0, manifest.name_of(&key.name));
            assert_same(&client.get(&landed).await.unwrap(), data, &key.name);
        }
    }
    assert_eq!(
        fetches_served(&source).await - served_before,
        tensors.len() as u64,
        "each tensor left the source once"
    );
}
