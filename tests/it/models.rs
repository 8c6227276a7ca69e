//! Models on a node (`Node::begin_model`, `ModelWriter::commit`, `Node::open_model`): a version
//! is committed whole and applied whole. Racing collects, applies, replacements, aborts and
//! deletes form random histories in which every apply reads exactly one version's tensors,
//! bit-exact, and the node ends holding exactly the current version.

use std::collections::BTreeMap;
use std::time::Duration;

use ferry_proto::message::PathsDigest;
use ferry_proto::{DType, TensorData, TensorKey};
use ferry_server::{IfExists, ModelError, Node, NodeError, Replace};
use ferry_testkit::samples;
use ferry_testkit::{assert_same, start_with};

/// The tensors of a collect numbered `n`: two to four of them, sized and filled by `n`, so that
/// any tensor read tells which collect wrote it.
fn model_of(n: u64) -> BTreeMap<String, TensorData> {
    let dtypes = [DType::F32, DType::BF16, DType::I8, DType::U16];
    (0..2 + n % 3)
        .map(|i| {
            let path = format!("layer{i}.weight");
            let data = samples::plain(
                dtypes[(n + i) as usize % 4],
                &[3, 1 + i as usize],
                n * 16 + i,
            );
            (path, data)
        })
        .collect()
}

/// Writes collect `n` as a new version and commits it, or gives it up half way.
async fn collect(node: &Node, n: u64, replace: Replace, give_up: bool) -> Result<u64, NodeError> {
    let writer = node.begin_model(0, "model", replace)?;
    let tensors = model_of(n);
    for (i, (path, data)) in tensors.iter().enumerate() {
        if give_up && i == 1 {
            writer.abort().await;
            return Err(NodeError::Backend("given up".into()));
        }
        node.insert(&writer.key(path), data.clone(), IfExists::Refuse)
            .await?;
        tokio::task::yield_now().await;
    }
    let metadata = BTreeMap::from([("collect".to_string(), n.to_string())]);
    let sent = PathsDigest::of(tensors.keys().map(String::as_str));
    let manifest = writer.commit(Some(sent), metadata).await?;
    Ok(manifest.version)
}

/// Applies the current version: every tensor its manifest lists, read while held, and all of
/// them from the one collect its metadata names.
async fn apply(node: &Node) -> Option<u64> {
    let pin = match node.open_model(0, "model") {
        Ok(pin) => pin,
        Err(NodeError::Model(ModelError::NoModel { .. })) => return None,
        Err(other) => panic!("open: {other}"),
    };
    let manifest = pin.manifest().clone();
    let n: u64 = manifest.metadata["collect"].parse().unwrap();
    let wanted = model_of(n);
    let paths: Vec<&String> = manifest.tensors.iter().map(|t| &t.path).collect();
    assert_eq!(
        paths,
        wanted.keys().collect::<Vec<_>>(),
        "version {}",
        manifest.version
    );
    for tensor in &manifest.tensors {
        tokio::task::yield_now().await;
        let read = node.get(&pin.key(&tensor.path)).await.unwrap();
        assert_same(&read, &wanted[&tensor.path], &tensor.path);
    }
    Some(manifest.version)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_collects_applies_and_deletes_each_see_one_whole_version() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let node = start_with(&["flex"]).await;
    let mut tasks = Vec::new();
    for task in 0..6u64 {
        let node = node.node.clone();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ task);
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for round in 0..12u64 {
                let n = task * 100 + round;
                match rng.random_range(0..10) {
                    0..4 => {
                        let replace = if rng.random_bool(0.8) {
                            Replace::Allow
                        } else {
                            Replace::Refuse
                        };
                        match collect(&node, n, replace, rng.random_bool(0.15)).await {
                            Ok(_) => {}
                            Err(NodeError::Backend(_))
                            | Err(NodeError::Model(
                                ModelError::Exists { .. } | ModelError::Superseded { .. },
                            )) => {}
                            Err(other) => panic!("collect {n}: {other}"),
                        }
                    }
                    4..9 => seen.extend(apply(&node).await),
                    _ => match node.delete_model(0, "model", None).await {
                        Ok(_) | Err(NodeError::Model(ModelError::NoModel { .. })) => {}
                        Err(other) => panic!("delete: {other}"),
                    },
                }
            }
            seen
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    // Every version let go is deleted: the device holds exactly the current version's tensors.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let held: Vec<String> = node
        .node
        .list(Some(0))
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.key.name)
        .collect();
    let expected: Vec<String> = match node.node.models(Some(0)).first() {
        Some((current, pins)) => {
            assert_eq!(*pins, 0, "no apply holds it any more");
            current
                .tensors
                .iter()
                .map(|t| current.key(&t.path).name)
                .collect()
        }
        None => Vec::new(),
    };
    assert_eq!(held, expected, "what the node holds after the history");
    node.shutdown().await;
}

/// A collect is refused where a model is and it may not replace it, and its tensors never
/// appear; a committed version is neither written nor deleted by a client or program; a commit
/// whose tensors are not those sent is refused and leaves nothing; a version being written is
/// invisible to applies until its commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_version_is_sealed_once_committed() {
    let node = start_with(&["flex"]).await;
    let node = &node.node;
    assert_eq!(collect(node, 1, Replace::Refuse, false).await.unwrap(), 0);
    match node.begin_model(0, "model", Replace::Refuse) {
        Err(NodeError::Model(ModelError::Exists { version: 0, .. })) => {}
        other => panic!("a second collect without replace: {other:?}"),
    }
    let pin = node.open_model(0, "model").unwrap();
    let key = pin.key("layer0.weight");
    let data = samples::plain(DType::F32, &[3, 1], 9);
    assert!(matches!(
        node.insert(&key, data.clone(), IfExists::Replace).await,
        Err(NodeError::Model(ModelError::Sealed { .. }))
    ));
    assert!(matches!(
        node.remove(&key).await,
        Err(NodeError::Model(ModelError::Sealed { .. }))
    ));
    assert_same(
        &node.get(&key).await.unwrap(),
        &model_of(1)["layer0.weight"],
        "sealed",
    );
    drop(pin);

    // A writer's tensors are invisible until committed, and a commit of other tensors than sent
    // is refused and deletes them.
    let writer = node.begin_model(0, "model", Replace::Allow).unwrap();
    node.insert(&writer.key("w"), data.clone(), IfExists::Refuse)
        .await
        .unwrap();
    assert_eq!(node.open_model(0, "model").unwrap().manifest().version, 0);
    let version = writer.version();
    match writer
        .commit(Some(PathsDigest::of(["other"])), BTreeMap::new())
        .await
    {
        Err(
            error @ NodeError::ModelIncomplete {
                held: 1, sent: 1, ..
            },
        ) => {
            assert!(error.to_string().contains("under other paths"), "{error}");
        }
        other => panic!("a commit of what was not sent: {other:?}"),
    }
    let written = TensorKey::new(0, format!("model/.v{version}/w"));
    assert!(
        node.describe(&written).await.is_err(),
        "a refused version's tensors go"
    );
    assert!(
        node.insert(&written, data, IfExists::Refuse).await.is_err(),
        "and it takes no more"
    );

    // A writer dropped half way: what it wrote goes.
    let writer = node.begin_model(0, "model", Replace::Allow).unwrap();
    let half = writer.key("w");
    node.insert(
        &half,
        model_of(2)["layer0.weight"].clone(),
        IfExists::Refuse,
    )
    .await
    .unwrap();
    drop(writer);
    for _ in 0..100 {
        if node.describe(&half).await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        node.describe(&half).await.is_err(),
        "a dropped writer's tensors go"
    );
    assert_eq!(node.open_model(0, "model").unwrap().manifest().version, 0);
}

/// `wait_for_model` answers with the version a commit makes current: at once where one newer
/// than asked is there, else at that commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_hears_of_the_next_version() {
    let node = start_with(&["flex"]).await;
    let waiter = {
        let node = node.node.clone();
        tokio::spawn(async move { node.wait_for_model(0, "model", None).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiter.is_finished(), "answered before any commit");
    collect(&node.node, 5, Replace::Refuse, false)
        .await
        .unwrap();
    let first = waiter.await.unwrap().unwrap();
    assert_eq!((first.version, &first.metadata["collect"][..]), (0, "5"));
    let next = {
        let node = node.node.clone();
        tokio::spawn(async move { node.wait_for_model(0, "model", Some(0)).await })
    };
    collect(&node.node, 6, Replace::Allow, false).await.unwrap();
    assert_eq!(next.await.unwrap().unwrap().version, 1);
    node.shutdown().await;
}

/// Over the wire: a version is begun, its tensors (every dtype and quantization scheme of the
/// matrix) put over two connections, committed; another client opens it and reads every tensor
/// bit-exact under the manifest's names, which lists each with its verified hash; the listing
/// shows it; a second collect without replace is refused; a collector whose connection ends
/// before its commit leaves nothing, and the model is still the version committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_goes_over_the_wire_whole() {
    let node = start_with(&["flex"]).await;
    let matrix = samples::full_matrix();
    let mut collector = node.client().await;
    let mut lane = node.client().await;
    let version = collector.begin_model(0, "net", false).await.unwrap();
    for (i, sample) in matrix.iter().enumerate() {
        let key = TensorKey::new(0, format!("net/.v{version}/{}", sample.name));
        let client = if i % 2 == 0 {
            &mut collector
        } else {
            &mut lane
        };
        client.put(&key, &sample.data).await.unwrap();
    }
    let paths = matrix.iter().map(|s| s.name.as_str());
    let metadata = vec![("format".to_string(), "pt".to_string())];
    let manifest = collector
        .commit_model(0, "net", version, paths, metadata.clone())
        .await
        .unwrap();
    assert_eq!((manifest.version, &manifest.metadata), (version, &metadata));
    assert_eq!(manifest.tensors.len(), matrix.len());

    let mut reader = node.client().await;
    let opened = reader.open_model(0, "net").await.unwrap();
    assert_eq!(opened, manifest);
    for sample in &matrix {
        let entry = opened
            .tensors
            .iter()
            .find(|t| t.path == sample.name)
            .unwrap();
        let key = TensorKey::new(0, opened.name_of(&sample.name));
        let (info, data) = reader.get_with_info(&key).await.unwrap();
        assert_same(&data, &sample.data, &sample.name);
        assert_eq!(info.bytes, entry.meta.byte_len, "{}", sample.name);
        let meta = ferry_proto::tensor::meta_of(&data).unwrap();
        assert_eq!(
            ferry_proto::tensor::content_hash(&meta, data.as_bytes()),
            entry.content_hash,
            "{}",
            sample.name
        );
    }
    let models = reader.models(None).await.unwrap();
    assert_eq!(models.len(), 1);
    assert_eq!((models[0].version, models[0].applies), (version, 1));
    assert_eq!(models[0].bytes, manifest.bytes());
    reader.close_model(&opened).await.unwrap();

    let refused = collector.begin_model(0, "net", false).await.unwrap_err();
    assert_eq!(
        ferry_testkit::code_of::<()>(Err(refused)),
        ferry_client::ErrorCode::AlreadyExists
    );

    // A collector gone before its commit: what it put goes, the model stays as committed.
    let mut gone = node.client().await;
    let next = gone.begin_model(0, "net", true).await.unwrap();
    let half = TensorKey::new(0, format!("net/.v{next}/{}", matrix[0].name));
    gone.put(&half, &matrix[0].data).await.unwrap();
    drop(gone);
    for _ in 0..200 {
        if reader.get(&half).await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        reader.get(&half).await.is_err(),
        "an uncommitted version's tensors go"
    );
    assert_eq!(reader.open_model(0, "net").await.unwrap().version, version);
    node.shutdown().await;
}

/// Over the wire, racing: collectors replace the model over their own connections (some give up
/// half way, by aborting or by hanging up), appliers open it, read every tensor and close it, and
/// a waiter hears of each new version: every apply reads exactly one version, bit-exact, and the
/// node ends holding exactly the current version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_wire_every_apply_reads_one_whole_version() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let node = start_with(&["flex"]).await;
    let mut tasks = Vec::new();
    for task in 0..4u64 {
        let mut client = node.client().await;
        let addr = node.addr;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ task);
        tasks.push(tokio::spawn(async move {
            for round in 0..8u64 {
                let n = task * 100 + round;
                if rng.random_bool(0.5) {
                    let give_up = rng.random_range(0..6);
                    let Ok(version) = client.begin_model(0, "wire", true).await else {
                        continue;
                    };
                    let tensors = model_of(n);
                    for (i, (path, data)) in tensors.iter().enumerate() {
                        let key = TensorKey::new(0, format!("wire/.v{version}/{path}"));
                        client.put(&key, data).await.unwrap();
                        if give_up == 0 && i == 0 {
                            client.abort_model(0, "wire", version).await.unwrap();
                            break;
                        }
                        if give_up == 1 && i == 0 {
                            // Hangs up: a new connection goes on.
                            client = ferry_client::Client::connect(addr).open().await.unwrap();
                            break;
                        }
                    }
                    if give_up > 1 {
                        let metadata = vec![("collect".to_string(), n.to_string())];
                        let paths = tensors.keys().map(String::as_str);
                        match client
                            .commit_model(0, "wire", version, paths, metadata)
                            .await
                        {
                            Ok(_) => {}
                            Err(e) if e.code() == Some(ferry_client::ErrorCode::Changed) => {}
                            Err(e) => panic!("commit {n}: {e}"),
                        }
                    }
                } else {
                    let Ok(manifest) = client.open_model(0, "wire").await else {
                        continue;
                    };
                    let n: u64 = manifest.metadata[0].1.parse().unwrap();
                    let wanted = model_of(n);
                    let paths: Vec<&String> = manifest.tensors.iter().map(|t| &t.path).collect();
                    assert_eq!(paths, wanted.keys().collect::<Vec<_>>());
                    for entry in &manifest.tensors {
                        let key = TensorKey::new(0, manifest.name_of(&entry.path));
                        let data = client.get(&key).await.unwrap();
                        assert_same(&data, &wanted[&entry.path], &entry.path);
                    }
                    client.close_model(&manifest).await.unwrap();
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let mut client = node.client().await;
    let mut held = Vec::new();
    let mut expected = Vec::new();
    for _ in 0..200 {
        held = client
            .list(Some(0))
            .await
            .unwrap()
            .into_iter()
            .map(|t| t.key.name)
            .collect::<Vec<_>>();
        expected = match client.open_model(0, "wire").await {
            Ok(m) => m.tensors.iter().map(|t| m.name_of(&t.path)).collect(),
            Err(_) => Vec::new(),
        };
        if held == expected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(held, expected, "what the node holds after the history");
    node.shutdown().await;
}

/// A client waiting for a model over the wire hears of the version a commit makes current.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_waits_for_the_next_version() {
    let node = start_with(&["flex"]).await;
    let mut waiter = node.client().await;
    let waiting = tokio::spawn(async move {
        waiter
            .wait_for_model(0, "model", None, Duration::from_secs(30))
            .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished());
    collect(&node.node, 3, Replace::Refuse, false)
        .await
        .unwrap();
    let manifest = waiting.await.unwrap().unwrap().unwrap();
    assert_eq!(manifest.version, 0);
    let mut client = node.client().await;
    let none = client
        .wait_for_model(0, "model", Some(0), Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!(none, None, "no newer version within the timeout");
    node.shutdown().await;
}

/// Puts collect `n` as a new version of `prefix` on `client`'s node over the wire, committed.
async fn collect_over(
    client: &mut ferry_client::Client,
    prefix: &str,
    tensors: &[(String, TensorData)],
    replace: bool,
) -> u64 {
    let version = client.begin_model(0, prefix, replace).await.unwrap();
    for (path, data) in tensors {
        let key = TensorKey::new(0, format!("{prefix}/.v{version}/{path}"));
        client.put(&key, data).await.unwrap();
    }
    let paths = tensors.iter().map(|(p, _)| p.as_str());
    let metadata = vec![("format".to_string(), "pt".to_string())];
    client
        .commit_model(0, prefix, version, paths, metadata)
        .await
        .unwrap()
        .version
}

/// A model copied between nodes arrives whole, bit-exact (every dtype and quantization scheme),
/// with the source's metadata, as a new version of the target's model; refused onto a model
/// without replace; a tensor the target refuses gives its version up and leaves its model as it
/// was; a move deletes the source's model once the target committed its copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_copies_between_nodes_whole_or_not_at_all() {
    use ferry_client::{ClientError, ModelCopy};
    use ferry_proto::Transfer;
    let (a, b) = (
        start_with(&["flex"]).await,
        start_with(&["flex", "ndarray"]).await,
    );
    let tensors: Vec<(String, TensorData)> = samples::full_matrix()
        .into_iter()
        .map(|s| (s.name, s.data))
        .collect();
    let (mut source, mut target) = (a.client().await, b.client().await);
    collect_over(&mut source, "net", &tensors, false).await;

    let copied = ModelCopy::new(a.addr.to_string(), 0, "net")
        .run(&mut source, &mut target)
        .await
        .unwrap();
    assert_eq!(
        copied.metadata,
        vec![("format".to_string(), "pt".to_string())]
    );
    assert_eq!(copied.tensors.len(), tensors.len());
    for (path, data) in &tensors {
        let key = TensorKey::new(0, copied.name_of(path));
        assert_same(&target.get(&key).await.unwrap(), data, path);
    }
    // Onto a model, only when asked.
    let refused = ModelCopy::new(a.addr.to_string(), 0, "net")
        .run(&mut source, &mut target)
        .await;
    assert_eq!(
        refused.unwrap_err().code(),
        Some(ferry_client::ErrorCode::AlreadyExists)
    );
    let again = ModelCopy::new(a.addr.to_string(), 0, "net")
        .replace(true)
        .run(&mut source, &mut target)
        .await
        .unwrap();
    assert_eq!(again.version, copied.version + 1);

    // NdArray on the target's device 1 holds no quantized tensor of Flex's layouts for every
    // scheme: a refused tensor leaves nothing there, and no model.
    let quantized: Vec<(String, TensorData)> = tensors
        .iter()
        .filter(|(_, d)| matches!(d.dtype(), DType::QFloat(_)))
        .cloned()
        .collect();
    collect_over(&mut source, "q", &quantized, false).await;
    match ModelCopy::new(a.addr.to_string(), 0, "q")
        .to(1, "q")
        .run(&mut source, &mut target)
        .await
    {
        Err(ClientError::ModelNotCopied { path, .. }) => assert!(!path.is_empty()),
        other => panic!("a copy onto a device that refuses a tensor: {other:?}"),
    }
    assert!(
        target.open_model(1, "q").await.is_err(),
        "no model where a tensor was refused"
    );
    let left: Vec<_> = target.list(Some(1)).await.unwrap();
    assert!(
        left.is_empty(),
        "nothing left on the refusing device: {left:?}"
    );

    // A move onto its own place (one node through two connections, the same device and prefix)
    // is refused before anything is held or written: the model stays the version it was.
    let before = source.open_model(0, "net").await.unwrap();
    source.close_model(&before).await.unwrap();
    let mut again = a.client().await;
    for replace in [false, true] {
        match ModelCopy::new(a.addr.to_string(), 0, "net")
            .replace(replace)
            .transfer(Transfer::Move)
            .run(&mut source, &mut again)
            .await
        {
            Err(ClientError::ModelMoveOntoItself { device: 0, prefix }) => {
                assert_eq!(prefix, "net")
            }
            other => panic!("a move onto itself: {other:?}"),
        }
    }
    let after = source.open_model(0, "net").await.unwrap();
    assert_eq!(after.version, before.version, "the model as it was");
    source.close_model(&after).await.unwrap();
    // On the same node to another prefix, a move goes: the model is there, and gone from here.
    collect_over(&mut source, "spare", &tensors[..2], false).await;
    let renamed = ModelCopy::new(a.addr.to_string(), 0, "spare")
        .to(0, "renamed")
        .transfer(Transfer::Move)
        .run(&mut source, &mut again)
        .await
        .unwrap();
    assert_eq!(
        (renamed.prefix.as_str(), renamed.tensors.len()),
        ("renamed", 2)
    );
    assert!(source.open_model(0, "spare").await.is_err(), "moved away");

    // A move: the source's model goes once the target committed.
    let moved = ModelCopy::new(a.addr.to_string(), 0, "net")
        .to(0, "moved")
        .transfer(Transfer::Move)
        .run(&mut source, &mut target)
        .await
        .unwrap();
    assert_eq!(moved.prefix, "moved");
    assert!(
        source.open_model(0, "net").await.is_err(),
        "the source's model went"
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// A model moved while its source commits a newer version (during the pull, which a link that
/// pauses holds open): the target commits the version copied, the source keeps its newer one,
/// and the answer says both remain, naming both versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_moved_while_its_source_changes_is_kept_on_both() {
    use ferry_client::{ClientError, ModelCopy};
    use ferry_proto::Transfer;
    use ferry_testkit::{Fault, eventually_async, proxy};
    let (a, b) = (start_with(&["flex"]).await, start_with(&["flex"]).await);
    let first = vec![("w".to_string(), samples::plain(DType::F32, &[4 << 20], 1))];
    let newer = vec![("w".to_string(), samples::plain(DType::F32, &[8], 2))];
    let (mut source, mut target) = (a.client().await, b.client().await);
    let copied_version = collect_over(&mut source, "net", &first, false).await;
    let paused = proxy(a.addr, Fault::PauseAfter(64 * 1024, Duration::from_secs(2))).await;
    let mover = tokio::spawn(async move {
        let moved = ModelCopy::new(paused.to_string(), 0, "net")
            .transfer(Transfer::Move)
            .run(&mut source, &mut target)
            .await;
        (moved, target)
    });
    let within = Duration::from_secs(10);
    eventually_async("the pull is under way", within, || async {
        a.client().await.stat().await.unwrap().fetches_in_flight == 1
    })
    .await;
    let newer_version = collect_over(&mut a.client().await, "net", &newer, true).await;
    let (moved, mut target) = mover.await.unwrap();
    match moved {
        Err(ClientError::ModelSourceChanged {
            prefix,
            version,
            stored,
        }) => {
            assert_eq!((prefix.as_str(), version), ("net", copied_version));
            let key = TensorKey::new(0, stored.name_of("w"));
            assert_same(&target.get(&key).await.unwrap(), &first[0].1, "the copy");
        }
        other => panic!("a move whose source changed: {other:?}"),
    }
    let mut source = a.client().await;
    let kept = source.open_model(0, "net").await.unwrap();
    assert_eq!(kept.version, newer_version);
    let key = TensorKey::new(0, kept.name_of("w"));
    assert_same(&source.get(&key).await.unwrap(), &newer[0].1, "the newer");
}

/// A put into a model version is hashed as it arrives (its commit needs every hash): registered
/// with its hash already verified, where a plain put to a Flex device is answered first and
/// hashed after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_into_a_model_version_is_hashed_as_it_arrives() {
    use ferry_server::HashState;
    let node = start_with(&["flex"]).await;
    let mut client = node.client().await;
    let data = samples::plain(DType::F32, &[1024, 1024], 4);
    let version = client.begin_model(0, "hashed", false).await.unwrap();
    let key = TensorKey::new(0, format!("hashed/.v{version}/w"));
    client.put(&key, &data).await.unwrap();
    let desc = node.node.describe(&key).await.unwrap();
    let meta = ferry_proto::tensor::meta_of(&data).unwrap();
    let truth = ferry_proto::tensor::content_hash(&meta, data.as_bytes());
    assert_eq!(desc.content_hash, HashState::Verified(truth));
    node.shutdown().await;
}

/// A connection writes at most 16 versions and holds at most 64 at once: the next is refused
/// with `LimitExceeded`, and one committed or closed makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_writes_and_holds_a_bounded_number_of_versions() {
    use ferry_client::ErrorCode;
    let node = start_with(&["flex"]).await;
    let mut client = node.client().await;
    let mut begun = Vec::new();
    for i in 0..16 {
        begun.push((
            i,
            client
                .begin_model(0, &format!("m{i}"), false)
                .await
                .unwrap(),
        ));
    }
    let refused = client.begin_model(0, "m16", false).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::LimitExceeded), "{refused}");
    let (i, version) = begun[0];
    client
        .commit_model(0, &format!("m{i}"), version, [], Vec::new())
        .await
        .unwrap();
    client.begin_model(0, "m16", false).await.unwrap();

    let mut held = Vec::new();
    for _ in 0..64 {
        held.push(client.open_model(0, "m0").await.unwrap());
    }
    let refused = client.open_model(0, "m0").await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::LimitExceeded), "{refused}");
    client.close_model(&held[0]).await.unwrap();
    client.open_model(0, "m0").await.unwrap();
    node.shutdown().await;
}
