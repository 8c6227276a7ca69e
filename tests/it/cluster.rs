//! Nodes in a cluster kept in a real etcd: registration and discovery, a directory equal to what
//! the nodes hold after a randomized history of puts, copies, moves and deletes, and etcd stopped
//! and restarted mid-run (the nodes keep serving; the directory converges).

use std::collections::BTreeMap;
use std::time::Duration;

use ferry::client::Client;
use ferry::client::cluster::Directory;
use ferry::proto::{DType, TensorKey};
use ferry::samples;
use ferry::server::cluster::{ClusterConfig, Membership};
use ferry::testing::{Etcd, TestNode, eventually_async, start_with};
use rand::{Rng, SeedableRng};

/// The lease's time to live in these tests.
const TTL: Duration = Duration::from_secs(2);

fn config(etcd: &Etcd, name: &str, node: &TestNode) -> ClusterConfig {
    ClusterConfig {
        endpoints: ferry::proto::cluster::endpoints(&etcd.cluster()).unwrap(),
        name: name.to_string(),
        advertise: node.addr.to_string(),
        unix: None,
        ttl: TTL,
    }
}

/// What the directory says every member holds: `(member, device, name) -> (dtype, shape, bytes,
/// has a content hash)`.
type Placed = BTreeMap<(String, u32, String), (String, Vec<u64>, u64, bool)>;

async fn directory(etcd: &Etcd) -> Option<Placed> {
    let mut directory = Directory::connect(&etcd.cluster()).await.ok()?;
    let found = directory.tensors(None).await.ok()?;
    Some(
        found
            .into_iter()
            .map(|t| {
                let r = t.record;
                (
                    (t.member, t.device, t.name),
                    (r.dtype, r.shape, r.bytes, r.content_hash.is_some()),
                )
            })
            .collect(),
    )
}

/// What the nodes themselves list, as the directory should say it (every hash computed).
async fn listings(nodes: &mut [(&str, Client)]) -> Placed {
    let mut all = Placed::new();
    for (name, client) in nodes.iter_mut() {
        for info in client.list(None).await.unwrap() {
            let dtype = DType::try_from(&info.dtype).unwrap();
            all.insert(
                (name.to_string(), info.key.device, info.key.name),
                (
                    ferry::proto::dtype_name(&dtype),
                    info.shape,
                    info.bytes,
                    true,
                ),
            );
        }
    }
    all
}

async fn converges(etcd: &Etcd, nodes: &mut [(&str, Client)], within: Duration) {
    let started = std::time::Instant::now();
    loop {
        let want = listings(nodes).await;
        let have = directory(etcd).await;
        if have.as_ref() == Some(&want) {
            return;
        }
        assert!(
            started.elapsed() < within,
            "the directory did not converge in {within:?}:\nnodes: {want:?}\netcd: {have:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Nodes of two flex devices each, joined to the cluster under `names`, with a client of each.
async fn join_all(
    etcd: &Etcd,
    names: &[&'static str],
) -> (Vec<TestNode>, Vec<Membership>, Vec<(&'static str, Client)>) {
    let (mut nodes, mut joined, mut clients) = (Vec::new(), Vec::new(), Vec::new());
    for &name in names {
        let node = start_with(&["flex", "flex"]).await;
        joined.push(Membership::join(
            node.node.clone(),
            config(etcd, name, &node),
        ));
        clients.push((name, node.client().await));
        nodes.push(node);
    }
    (nodes, joined, clients)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_register_are_discovered_and_publish_what_they_hold() {
    let etcd = Etcd::start().await;
    let names = ["cache", "worker-1", "worker-2"];
    let (nodes, mut joined, mut clients) = join_all(&etcd, &names).await;
    let cluster = etcd.cluster();
    eventually_async("three members", Duration::from_secs(10), || {
        let cluster = cluster.clone();
        async move {
            let mut d = Directory::connect(&cluster).await.unwrap();
            d.members().await.unwrap().len() == 3
        }
    })
    .await;
    let mut d = Directory::connect(&cluster).await.unwrap();
    let members = d.members().await.unwrap();
    for (member, node) in members.iter().zip(&nodes) {
        assert_eq!(member.tcp, node.addr.to_string());
        assert_eq!(member.node_id, node.node.node_id());
        assert_eq!(member.devices.len(), 2);
    }
    for (_, client) in clients.iter_mut() {
        let data = samples::plain(DType::F32, &[64, 33], 1);
        client.put(1, "encoder.w", &data).await.unwrap();
    }
    converges(&etcd, &mut clients, Duration::from_secs(10)).await;
    let placed = directory(&etcd).await.unwrap();
    assert_eq!(placed.len(), 3);
    assert!(placed.values().all(|(_, _, _, hashed)| *hashed));
    // A member that leaves is gone at once (its lease revoked), with its entries.
    joined.remove(0).leave().await;
    let mut d = Directory::connect(&cluster).await.unwrap();
    let members: Vec<String> = d
        .members()
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.name)
        .collect();
    assert_eq!(members, ["worker-1", "worker-2"]);
    assert!(d.tensors(Some("cache")).await.unwrap().is_empty());
    for membership in joined {
        membership.leave().await;
    }
}

/// One random operation on one of the nodes; refusals (a name taken or gone) are part of the
/// history.
async fn random_op(rng: &mut rand::rngs::StdRng, clients: &mut [(&str, Client)]) {
    let n = rng.random_range(0..clients.len());
    let client = &mut clients[n].1;
    let name = format!("t{}", rng.random_range(0..12));
    let device = rng.random_range(0..2u32);
    let key = TensorKey::new(device, &name);
    match rng.random_range(0..4) {
        0 => {
            let dtype = [DType::F32, DType::I8, DType::U16][rng.random_range(0..3)];
            let data = samples::plain(dtype, &[rng.random_range(1..9), 3], rng.random());
            let _ = client.put(device, &name, &data).await;
        }
        1 => {
            let _ = client.copy(&key, 1 - device, None).await;
        }
        2 => {
            let _ = client.move_to(&key, 1 - device, None).await;
        }
        _ => {
            let _ = client.delete(&key).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_random_operations_leave_a_directory_equal_to_what_the_nodes_list() {
    let seed: u64 = std::env::var("FERRY_CLUSTER_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("FERRY_CLUSTER_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let etcd = Etcd::start().await;
    let (_nodes, joined, mut clients) = join_all(&etcd, &["a", "b", "c"]).await;
    for _ in 0..1000 {
        random_op(&mut rng, &mut clients).await;
    }
    converges(&etcd, &mut clients, Duration::from_secs(15)).await;
    for membership in joined {
        membership.leave().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_stopped_and_restarted_mid_run_loses_nothing_and_the_directory_converges() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut etcd = Etcd::start().await;
    let (_nodes, joined, mut clients) = join_all(&etcd, &["a", "b"]).await;
    for _ in 0..100 {
        random_op(&mut rng, &mut clients).await;
    }
    converges(&etcd, &mut clients, Duration::from_secs(10)).await;
    etcd.stop();
    // The nodes keep serving while etcd is away: puts and gets succeed, bit-exact.
    let data = samples::plain(DType::F32, &[16, 16], 3);
    for (_, client) in clients.iter_mut() {
        client.put(0, "while-away", &data).await.unwrap();
        let back = client.get(&TensorKey::new(0, "while-away")).await.unwrap();
        assert_eq!(back.as_bytes(), data.as_bytes());
    }
    for _ in 0..100 {
        random_op(&mut rng, &mut clients).await;
    }
    tokio::time::sleep(2 * TTL).await;
    etcd.resume().await;
    // Each node registers again (backoff at most 5 s); entries of its old lease that no longer
    // hold expire with that lease, one TTL after etcd is back.
    converges(&etcd, &mut clients, Duration::from_secs(20)).await;
    let mut d = Directory::connect(&etcd.cluster()).await.unwrap();
    assert_eq!(d.members().await.unwrap().len(), 2);
    for membership in joined {
        membership.leave().await;
    }
}
