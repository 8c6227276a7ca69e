//! Nodes in a cluster kept in a real etcd: registration and discovery, a directory equal to what
//! the nodes hold after a randomized history of puts, copies, moves and deletes, etcd stopped
//! and restarted mid-run (the nodes keep serving; the directory converges), and membership as
//! the peer allowlist (a non-member refused; under TLS, a member that is not who it registered
//! as refused).

use ferry_server::PullConfig;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use ferry_client::cluster::{Directory, DirectoryError, ReachError, connect_member};
use ferry_client::{Client, ClientError, ConnectOptions, ErrorCode};
use ferry_proto::cluster::MemberRecord;
use ferry_proto::{DType, TensorKey};
use ferry_server::cluster::{ClusterConfig, Membership};
use ferry_server::{ClusterMembers, NodeConfig, PeerPolicy, ServiceConfig};
use ferry_testkit::samples;
use ferry_testkit::{
    Etcd, TestNode, TestPki, assert_same, copy_one, devices, eventually, eventually_async, how,
    start, start_with, tls_client,
};
use rand::{Rng, SeedableRng};

/// The lease's time to live in these tests.
const TTL: Duration = ferry_testkit::MEMBER_TTL;

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
                    ferry_proto::dtype_name(&dtype),
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
            etcd.member(name, &node),
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
        assert_eq!(&member.node_id, node.node.node_id());
        assert_eq!(member.devices.len(), 2);
    }
    for (_, client) in clients.iter_mut() {
        let data = samples::plain(DType::F32, &[64, 33], 1);
        client
            .put(&TensorKey::new(1, "encoder.w"), &data)
            .await
            .unwrap();
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

/// What [`random_op`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Op {
    Put,
    Copy,
    Move,
    Delete,
}

/// One random operation on one of the nodes, and whether it was applied. Every answer is
/// checked: a success describes the tensor asked for; a refusal is one the race explains (the
/// name taken, gone or replaced meanwhile); anything else fails the test.
async fn random_op(rng: &mut rand::rngs::StdRng, clients: &mut [(&str, Client)]) -> (Op, bool) {
    let n = rng.random_range(0..clients.len());
    let client = &mut clients[n].1;
    let name = format!("t{}", rng.random_range(0..12));
    let device = rng.random_range(0..2u32);
    let key = TensorKey::new(device, &name);
    let other = key.on(1 - device);
    let (op, answer, expected, refusals): (_, _, _, &[ErrorCode]) = match rng.random_range(0..4) {
        0 => {
            let dtype = [DType::F32, DType::I8, DType::U16][rng.random_range(0..3)];
            let data = samples::plain(dtype, &[rng.random_range(1..9), 3], rng.random());
            let answer = client.put(&key, &data).await;
            let answer = answer.inspect(|info| {
                assert_eq!(info.bytes, data.as_bytes().len() as u64, "{key}");
            });
            (Op::Put, answer, &key, &[ErrorCode::AlreadyExists])
        }
        // `Changed`: the source was replaced again and again while the node tried to copy it,
        // or (a move) after its copy was registered, so the move removed nothing.
        1 => {
            let answer = client.copy(&key, &other).await;
            let refusals = &[
                ErrorCode::NotFound,
                ErrorCode::AlreadyExists,
                ErrorCode::Changed,
            ];
            (Op::Copy, answer, &other, refusals)
        }
        2 => {
            let answer = client.move_to(&key, &other).await;
            let refusals = &[
                ErrorCode::NotFound,
                ErrorCode::AlreadyExists,
                ErrorCode::Changed,
            ];
            (Op::Move, answer, &other, refusals)
        }
        _ => {
            let answer = client.delete(&key).await;
            (Op::Delete, answer, &key, &[ErrorCode::NotFound])
        }
    };
    match answer {
        Ok(info) => {
            assert_eq!(&info.key, expected, "{op:?}");
            (op, true)
        }
        Err(refused) => {
            let code = refused.code();
            assert!(
                code.is_some_and(|code| refusals.contains(&code)),
                "{op:?} {key}: {refused}"
            );
            (op, false)
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_racing_random_operations_leave_a_directory_equal_to_what_the_nodes_list() {
    let seed: u64 = std::env::var("FERRY_CLUSTER_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("FERRY_CLUSTER_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let etcd = Etcd::start().await;
    let (nodes, joined, mut clients) = join_all(&etcd, &["a", "b", "c"]).await;
    // Four clients of every node race each other, 250 operations each, every one on its own
    // seeded stream (the interleaving is the scheduler's).
    let mut racers = Vec::new();
    for _ in 0..4 {
        let mut own = Vec::new();
        for (name, node) in ["a", "b", "c"].into_iter().zip(&nodes) {
            own.push((name, node.client().await));
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(rng.random());
        racers.push(tokio::spawn(async move {
            let mut applied = Vec::new();
            for _ in 0..250 {
                applied.push(random_op(&mut rng, &mut own).await);
            }
            applied
        }));
    }
    let mut applied: HashMap<Op, usize> = HashMap::new();
    for racer in racers {
        for (op, done) in racer.await.unwrap() {
            *applied.entry(op).or_default() += usize::from(done);
        }
    }
    // Every kind of operation was applied many times: the race is not one of refusals only.
    for op in [Op::Put, Op::Copy, Op::Move, Op::Delete] {
        let done = applied.get(&op).copied().unwrap_or(0);
        assert!(done >= 20, "{op:?} applied only {done} times: {applied:?}");
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
        let _applied_or_refused = random_op(&mut rng, &mut clients).await;
    }
    converges(&etcd, &mut clients, Duration::from_secs(10)).await;
    etcd.stop();
    // The nodes keep serving while etcd is away: puts and gets succeed, bit-exact.
    let data = samples::plain(DType::F32, &[16, 16], 3);
    for (_, client) in clients.iter_mut() {
        client
            .put(&TensorKey::new(0, "while-away"), &data)
            .await
            .unwrap();
        let back = client.get(&TensorKey::new(0, "while-away")).await.unwrap();
        assert_eq!(back.as_bytes(), data.as_bytes());
    }
    for _ in 0..100 {
        let _applied_or_refused = random_op(&mut rng, &mut clients).await;
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

/// A node whose peers are its cluster's members, with `tls` where given.
async fn member_node(tls: Option<ferry_io::NodeTls>) -> TestNode {
    member_node_with(tls, ClusterMembers::new(), None).await
}

/// A node that pulls from the members `members` takes, presenting `peer_token` (in clear).
async fn member_node_with(
    tls: Option<ferry_io::NodeTls>,
    members: ClusterMembers,
    peer_token: Option<&str>,
) -> TestNode {
    start(
        NodeConfig {
            devices: devices(&["flex"]),
            tls,
            pulls: PullConfig {
                peer_token: peer_token.map(Into::into),
                peers: PeerPolicy::Members {
                    members,
                    listed: Vec::new(),
                },
                ..PullConfig::default()
            },
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await
}

/// A pull the target refused as not from an allowed peer, nothing sent to the source.
fn refused_as_stranger(
    result: Result<ferry_proto::TensorInfo, ferry_client::ClientError>,
    what: &str,
) {
    match result {
        Err(ferry_client::ClientError::Node { code, message }) => {
            assert_eq!(code, ErrorCode::BadRequest, "{what}: {message}");
            assert!(message.contains("not an allowed peer"), "{what}: {message}");
        }
        other => panic!("{what}: expected a refusal, got {other:?}"),
    }
}

/// `target` pulls `w` (device 0) from `member` bit-exact, and refuses to pull it from
/// `stranger` (`who`): nothing fetched there, nothing registered.
async fn member_yes_stranger_no(
    target: &mut Client,
    member: (&mut Client, &str),
    stranger: (&mut Client, &str),
    data: &ferry_proto::TensorData,
    who: &str,
) {
    let key = TensorKey::new(0, "w");
    let pulled = copy_one(member.0, target, &key, &how(member.1, 0)).await;
    let pulled = pulled.unwrap_or_else(|e| panic!("a pull from a member: {e}"));
    assert_same(
        &target.get(&pulled.key).await.unwrap(),
        data,
        "pulled from a member",
    );
    target.delete(&pulled.key).await.unwrap();
    let refused = copy_one(stranger.0, target, &key, &how(stranger.1, 0)).await;
    refused_as_stranger(refused, who);
    let served = stranger.0.stat().await.unwrap().fetches_served;
    assert_eq!(served, 0, "{who}: nothing fetched from it");
    assert!(
        target.list(None).await.unwrap().is_empty(),
        "{who}: nothing registered"
    );
}

/// Member `a` as the directory has it.
async fn member_a(d: &mut Directory) -> MemberRecord {
    d.resolve("a").await.unwrap()
}

/// Waits until `node`'s member list says `addr` is (or is not) a member.
async fn sees(node: &TestNode, addr: &str, member: bool) {
    let what = format!("{addr} a member: {member}");
    eventually(&what, Duration::from_secs(10), || {
        node.node.config().pulls.peers.allows(addr) == member
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_pulls_only_from_registered_members() {
    let etcd = Etcd::start().await;
    let (a, b) = (member_node(None).await, member_node(None).await);
    let outsider = start_with(&["flex"]).await;
    let joined_a = Membership::join(a.node.clone(), etcd.member("a", &a));
    let joined_b = Membership::join(b.node.clone(), etcd.member("b", &b));
    let (mut ca, mut cb, mut cx) = (a.client().await, b.client().await, outsider.client().await);
    let data = samples::plain(DType::F32, &[64, 33], 7);
    let key = TensorKey::new(0, "w");
    ca.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    cx.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let (a_addr, x_addr) = (a.addr.to_string(), outsider.addr.to_string());
    sees(&b, &a_addr, true).await;

    member_yes_stranger_no(
        &mut cb,
        (&mut ca, &a_addr),
        (&mut cx, &x_addr),
        &data,
        "a non-member",
    )
    .await;

    // More refused pulls than a client may hold grants: each refused pull gives its grant
    // back, so none is left outstanding to block the next.
    for _ in 0..70 {
        let refused = copy_one(&mut cx, &mut cb, &key, &how(&x_addr, 0)).await;
        refused_as_stranger(refused, "a non-member, again");
    }
    // A copy of the version a directory listed refuses another one, and copies nothing.
    let listed = ferry_testkit::How {
        version: Some(ferry_proto::ContentHash::from_digest([0; 32])),
        ..how(&a_addr, 0)
    };
    let other = copy_one(&mut ca, &mut cb, &key, &listed).await;
    assert!(
        matches!(other, Err(ClientError::NotTheListedVersion { .. })),
        "{other:?}"
    );
    assert!(cb.list(None).await.unwrap().is_empty());

    // A client reaching a member checks it is the node registered there.
    let mut d = Directory::connect(&etcd.cluster()).await.unwrap();
    let record = d.resolve("a").await.unwrap();
    let mut reached = connect_member(&record, &a_addr, ConnectOptions::default())
        .await
        .unwrap();
    assert_eq!(&reached.identify().await.unwrap(), a.node.node_id());
    let stale = MemberRecord {
        node_id: "some-other-node".into(),
        ..record
    };
    let wrong = connect_member(&stale, &a_addr, ConnectOptions::default()).await;
    assert!(
        matches!(wrong, Err(ClientError::NotTheMember { .. })),
        "{:?}",
        wrong.err()
    );

    // The one-call form: resolved, connected, checked.
    let (mut reached, record) = d.reach("a", ConnectOptions::default()).await.unwrap();
    assert_eq!(reached.identify().await.unwrap(), record.node_id);
    assert!(matches!(
        d.reach("nobody", ConnectOptions::default()).await,
        Err(ReachError::Directory(DirectoryError::UnknownMember(_)))
    ));

    // A token never goes in clear to an address only the directory vouches for.
    let tokened = ConnectOptions::default().token("secret");
    let unchecked = connect_member(&member_a(&mut d).await, &a_addr, tokened).await;
    assert!(
        matches!(unchecked, Err(ClientError::UncheckedMember { .. })),
        "{:?}",
        unchecked.err()
    );

    // A member's Unix socket counts only where the member runs on this machine.
    for (name, host) in [
        ("here", ferry_io::machine::name()),
        ("elsewhere", "another-machine".to_string()),
    ] {
        let record = MemberRecord {
            name: name.into(),
            node_id: format!("id-{name}").into(),
            tcp: format!("192.0.2.1:{}", if name == "here" { 1 } else { 2 }),
            unix: Some(format!("unix:/run/ferry-{name}.sock")),
            host,
            devices: Vec::new(),
        };
        let key = ferry_proto::cluster::member_key(name);
        etcd.put(&key, &ferry_proto::cluster::encode(&record)).await;
    }
    sees(&b, "unix:/run/ferry-here.sock", true).await;
    sees(&b, "192.0.2.1:2", true).await;
    assert!(
        !b.node
            .config()
            .pulls
            .peers
            .allows("unix:/run/ferry-elsewhere.sock")
    );

    // A member that left is a stranger again.
    joined_a.leave().await;
    sees(&b, &a_addr, false).await;
    let refused = copy_one(&mut ca, &mut cb, &key, &how(&a_addr, 0)).await;
    refused_as_stranger(refused, "a pull from a member that left");
    assert!(cb.list(None).await.unwrap().is_empty());
    joined_b.leave().await;
}

/// The plain record `plain` sealed by `by` (a node's certificate of the cluster's CA), stored
/// under `key`.
async fn put_sealed(etcd: &Etcd, by: &ferry_io::NodeTls, key: &str, plain: &[u8]) {
    let sealed = by.record_signer().seal(key.as_bytes(), plain).unwrap();
    etcd.put(key, &sealed).await;
}

/// Under TLS only what a member sealed itself counts: an etcd writer's plain record, or one
/// sealed with another node's certificate of the same CA, adds no member, moves none and places
/// no tensor, for the nodes' member lists and for clients' directories alike. What a member
/// sealed itself is still checked at connect: its certificate must name it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_tls_only_what_a_member_sealed_counts_and_a_member_must_show_its_identity() {
    let etcd = Etcd::start().await;
    let pki = TestPki::new();
    let a = member_node(Some(pki.node("node-a"))).await;
    let b = member_node(Some(pki.node("node-b"))).await;
    // A node the CA signed, but not a member; its key is the etcd writer's.
    let c_tls = pki.node("node-c");
    let c = start(
        NodeConfig {
            devices: devices(&["flex"]),
            tls: Some(c_tls.clone()),
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await;
    // Under TLS a member's name is its certificate's.
    let joined_a = Membership::join(a.node.clone(), etcd.member("node-a", &a));
    let joined_b = Membership::join(b.node.clone(), etcd.member("node-b", &b));
    let (a_addr, c_addr) = (a.addr.to_string(), c.addr.to_string());
    let record = |name: &str, node_id: &str, tcp: &str| MemberRecord {
        name: name.into(),
        node_id: node_id.into(),
        tcp: tcp.into(),
        unix: None,
        host: String::new(),
        devices: Vec::new(),
    };
    use ferry_proto::cluster::{encode, member_key, tensor_key};
    // An impostor at c's address: plain (any etcd writer), and sealed with c's key.
    let impostor = record("node-x", "node-x", &c_addr);
    etcd.put(&member_key("node-x"), &encode(&impostor)).await;
    put_sealed(
        &etcd,
        &c_tls,
        &member_key("node-z"),
        &encode(&record("node-z", "node-z", &c_addr)),
    )
    .await;
    // a's own name taken over (its address moved to c's), and a record under one name naming
    // a's id (@node-y), both sealed with c's key.
    put_sealed(
        &etcd,
        &c_tls,
        &member_key("node-y"),
        &encode(&record("node-y", "node-a", "192.0.2.7:7070")),
    )
    .await;
    // A tensor entry placing a tensor on a that a never wrote: plain, and sealed by c.
    let entry = ferry_proto::cluster::TensorRecord {
        dtype: "f32".into(),
        shape: vec![4],
        bytes: 16,
        content_hash: None,
    };
    etcd.put(&tensor_key("node-a", 0, "fake"), &encode(&entry))
        .await;
    put_sealed(
        &etcd,
        &c_tls,
        &tensor_key("node-a", 0, "fake-sealed"),
        &encode(&entry),
    )
    .await;
    // Written after them, and sealed by its own member: once b lists it, b has read the rest.
    let w_tls = pki.node("node-w");
    put_sealed(
        &etcd,
        &w_tls,
        &member_key("node-w"),
        &encode(&record("node-w", "node-w", "192.0.2.8:7070")),
    )
    .await;
    sees(&b, "192.0.2.8:7070", true).await;
    sees(&b, &a_addr, true).await;
    for forged in [c_addr.as_str(), "192.0.2.7:7070"] {
        assert!(!b.node.config().pulls.peers.allows(forged), "{forged}");
    }

    let user = pki.client("user");
    let mut ca = tls_client(&a, &user).await.unwrap();
    let mut cb = tls_client(&b, &user).await.unwrap();
    let mut cc = tls_client(&c, &user).await.unwrap();
    let data = samples::plain(DType::F32, &[64, 33], 8);
    ca.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    cc.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    member_yes_stranger_no(&mut cb, (&mut ca, &a_addr), (&mut cc, &c_addr), &data, "c").await;

    // A client's directory, reached with its certificate: the same records count.
    let mut d = Directory::connect_with(&etcd.cluster(), Some(&user))
        .await
        .unwrap();
    let names: Vec<String> = d
        .members()
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.name)
        .collect();
    assert_eq!(names, ["node-a", "node-b", "node-w"]);
    for (name, why) in [
        ("node-x", "not sealed"),
        ("node-z", "signed by node \"node-c\""),
        ("node-y", "signed by node \"node-c\""),
    ] {
        let refused = d.resolve(name).await;
        assert!(
            matches!(&refused, Err(DirectoryError::Record { member, source }) if member == name && source.to_string().contains(why)),
            "{name}: {refused:?}"
        );
    }
    eventually_async(
        "a's w in the directory",
        Duration::from_secs(10),
        || async {
            Directory::connect_with(&etcd.cluster(), Some(&user))
                .await
                .unwrap()
                .holders("w")
                .await
                .unwrap()
                .iter()
                .any(|h| h.member == "node-a")
        },
    )
    .await;
    let placed: Vec<String> = d
        .tensors(Some("node-a"))
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(placed, ["w"], "only what a sealed");
    assert!(d.holders("fake").await.unwrap().is_empty());
    assert!(d.holders("fake-sealed").await.unwrap().is_empty());

    // What a member sealed is still checked at connect: a record handed in directly (as a
    // directory in clear might) naming node-x at c's address, or @node-y naming a's id.
    let options = ConnectOptions::default().tls(user.clone());
    let wrong = connect_member(&impostor, &c_addr, options.clone()).await;
    assert!(
        matches!(&wrong, Err(ClientError::NotTheNode { certified: Some(c), .. }) if c == "node-c"),
        "{:?}",
        wrong.err()
    );
    let borrowed = record("node-y", a.node.node_id().as_str(), &a_addr);
    let refused = connect_member(&borrowed, &a_addr, options.clone()).await;
    assert!(
        matches!(&refused, Err(ClientError::NameIsNotIdentity { member, .. }) if member == "node-y"),
        "{:?}",
        refused.err()
    );
    let record_a = d.resolve("node-a").await.unwrap();
    connect_member(&record_a, &a_addr, options).await.unwrap();

    // c registering under its own name, at a's address (a second claim on it, which any node
    // of the CA can seal): the certificate there still names node-a, so b still pulls from a.
    put_sealed(
        &etcd,
        &c_tls,
        &member_key("node-c"),
        &encode(&record("node-c", "node-c", &a_addr)),
    )
    .await;
    put_sealed(
        &etcd,
        &w_tls,
        &member_key("node-w"),
        &encode(&record("node-w", "node-w", "192.0.2.10:7070")),
    )
    .await;
    sees(&b, "192.0.2.10:7070", true).await;
    let v = TensorKey::new(0, "v");
    ca.put(&v, &samples::plain(DType::F32, &[8, 8], 9))
        .await
        .unwrap();
    let pulled = copy_one(&mut ca, &mut cb, &v, &how(&a_addr, 0)).await;
    assert!(pulled.is_ok(), "{:?}", pulled.err());
    joined_a.leave().await;
    joined_b.leave().await;
}

/// A member record naming a Unix socket that a root process serves, not the member: the node
/// (root here, as the tests run in CI, so "root or this user" is no check at all) pulls from it
/// as the directory says, and the process learns no token, since none goes over a Unix socket.
/// The operator's CLI, sent to the same record by name, sends it none either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_daemon_at_a_members_unix_socket_learns_no_token() {
    use ferry_proto::Request;
    let etcd = Etcd::start().await;
    let a = start_with(&["flex"]).await;
    let b = member_node_with(None, ClusterMembers::new(), Some("the-peer-token")).await;
    let joined_b = Membership::join(b.node.clone(), etcd.member("b", &b));

    // Not a node: it reads each hello it is sent, keeps its token, and hangs up.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("daemon.sock");
    let daemon = tokio::net::UnixListener::bind(&path).unwrap();
    let (heard, mut hellos) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((socket, _)) = daemon.accept().await {
            let mut conn = ferry_io::Connection::new(
                ferry_io::Stream::Unix(ferry_io::transport::UnixTransport::new(socket)),
                Default::default(),
            );
            if let Ok(Some(Request::Hello(hello))) = conn.read_request().await {
                let _ = heard.send(hello.token.map(|t| t.as_str().to_string()));
            }
        }
    });
    let unix = format!("unix:{}", path.display());
    let record = MemberRecord {
        name: "daemon".into(),
        node_id: "id-daemon".into(),
        tcp: "192.0.2.1:1".into(),
        unix: Some(unix.clone()),
        host: ferry_io::machine::name(),
        devices: Vec::new(),
    };
    etcd.put(
        &ferry_proto::cluster::member_key("daemon"),
        &ferry_proto::cluster::encode(&record),
    )
    .await;
    sees(&b, &unix, true).await;

    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let key = TensorKey::new(0, "w");
    ca.put(&key, &samples::plain(DType::F32, &[4], 1))
        .await
        .unwrap();
    let failed = copy_one(&mut ca, &mut cb, &key, &how(&unix, 0)).await;
    assert!(failed.is_err(), "the daemon is no node");
    let token = tokio::time::timeout(Duration::from_secs(5), hellos.recv())
        .await
        .expect("the node said hello to the daemon")
        .unwrap();
    assert_eq!(token, None, "the peer token went to a root daemon");
    assert!(cb.list(None).await.unwrap().is_empty());

    // The operator's client, reaching the member by name with a token of its own.
    let mut directory = Directory::connect(&etcd.cluster()).await.unwrap();
    let reached = directory
        .reach(
            "daemon",
            ConnectOptions::default().token("the-operators-token"),
        )
        .await;
    assert!(reached.is_err(), "the daemon is no node");
    let token = tokio::time::timeout(Duration::from_secs(5), hellos.recv())
        .await
        .expect("the client said hello to the daemon")
        .unwrap();
    assert_eq!(token, None, "the operator's token went to a root daemon");
    joined_b.leave().await;
}

/// An etcd writer overwrites member a's record with member b's node id and address (so that
/// `@a` would reach b), then deletes it: each time node a finds its own key holding what it did
/// not write and puts its record back, under its lease, while the hijack of a record whose node
/// is alive lasts no longer than etcd's watch takes to tell it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_record_rewritten_by_an_etcd_writer_is_put_back_by_its_node() {
    let etcd = Etcd::start().await;
    let (a, b) = (member_node(None).await, member_node(None).await);
    let joined_a = Membership::join(a.node.clone(), etcd.member("a", &a));
    let joined_b = Membership::join(b.node.clone(), etcd.member("b", &b));
    let cluster = etcd.cluster();
    let a_addr = a.addr.to_string();
    // What the directory says of @a, read afresh: a's own record.
    let is_as = || async {
        let mut d = Directory::connect(&cluster).await.unwrap();
        d.resolve("a")
            .await
            .is_ok_and(|m| m.tcp == a_addr && m.node_id == *a.node.node_id())
    };
    eventually_async("a registered", Duration::from_secs(10), is_as).await;
    let mut d = Directory::connect(&cluster).await.unwrap();
    let b_record = d.resolve("b").await.unwrap();
    let key = ferry_proto::cluster::member_key("a");
    let hijacked = MemberRecord {
        name: "a".into(),
        ..b_record
    };
    for round in 0..3 {
        etcd.put(&key, &ferry_proto::cluster::encode(&hijacked))
            .await;
        eventually_async(
            &format!("a's record put back after the overwrite, round {round}"),
            Duration::from_secs(5),
            is_as,
        )
        .await;
    }
    etcd.delete(&key).await;
    eventually_async(
        "a's record put back after the delete",
        Duration::from_secs(5),
        is_as,
    )
    .await;
    // @a reaches a.
    let (mut reached, _) = d
        .reach("a", ConnectOptions::default())
        .await
        .expect("@a reaches a");
    assert_eq!(&reached.identify().await.unwrap(), a.node.node_id());
    joined_a.leave().await;
    joined_b.leave().await;
}

/// A TLS client of etcd that trusts `ca` and presents `holder`'s certificate (or none).
fn trusting(
    ca: &std::path::Path,
    holder: Option<&ferry_io::TlsFiles>,
) -> tokio_rustls::TlsConnector {
    let config = crate::tls::hand_built_client(ca, holder);
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
}

/// etcd over TLS (`etcds://`, etcd's `--client-cert-auth`): a node registers with its own
/// certificate and a client with a certificate of the cluster reads the directory and reaches
/// the member; without a certificate, or with another CA's, or in clear, etcd is not reached at
/// all, so no one without a certificate of the cluster reads or writes the directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_on_etcd_over_tls_admits_only_certificates_of_the_cluster() {
    let pki = TestPki::new();
    let etcd = Etcd::start_tls(&pki).await;
    let cluster = etcd.cluster();
    assert!(cluster.starts_with("etcds://"), "{cluster}");
    let a = member_node(Some(pki.node("node-a"))).await;
    let joined = Membership::join(a.node.clone(), etcd.member("node-a", &a));
    let user = pki.client("user");
    let registered = || async {
        let Ok(mut d) = Directory::connect_with(&cluster, Some(&user)).await else {
            return false;
        };
        d.resolve("node-a").await.is_ok()
    };
    eventually_async(
        "node-a registered over TLS",
        Duration::from_secs(10),
        registered,
    )
    .await;
    let mut d = Directory::connect_with(&cluster, Some(&user))
        .await
        .unwrap();
    let (mut reached, _) = d
        .reach("node-a", ConnectOptions::default().tls(user.clone()))
        .await
        .unwrap();
    assert_eq!(&reached.identify().await.unwrap(), a.node.node_id());

    // Nothing to reach it with: said before connecting.
    let none = Directory::connect(&cluster)
        .await
        .err()
        .expect("no TLS, no etcd");
    assert!(
        none.to_string().contains("needs the cluster's CA"),
        "{none}"
    );
    // etcd's own refusals (`--client-cert-auth`): a client that trusts the cluster's CA but
    // presents no certificate, or one of another CA, reads nothing.
    let endpoints = ferry_proto::cluster::endpoints(&cluster).unwrap();
    let ca = pki.files("user").ca;
    let other = TestPki::new();
    other.client("user");
    for (presented, what) in [
        (None, "no certificate"),
        (Some(other.files("user")), "another CA's"),
    ] {
        let read = async {
            let connector = trusting(&ca, presented.as_ref());
            let mut etcd =
                ferry_etcd::Etcd::connect_with(&endpoints, Duration::from_secs(2), Some(connector))
                    .await?;
            etcd.get(b"/ferry/members/node-a").await
        };
        assert!(read.await.is_err(), "etcd answered a client with {what}");
    }
    // The same client with the cluster's certificate reads it.
    let connector = trusting(&ca, Some(&pki.files("user")));
    let mut etcd =
        ferry_etcd::Etcd::connect_with(&endpoints, Duration::from_secs(2), Some(connector))
            .await
            .unwrap();
    assert_eq!(
        etcd.get(b"/ferry/members/node-a").await.unwrap().kvs.len(),
        1
    );
    // In clear, to the TLS port: not etcd's answer.
    let clear = cluster.replace("etcds://", "etcd://");
    let in_clear = async {
        let mut d = Directory::connect(&clear).await?;
        d.resolve("node-a").await
    };
    assert!(in_clear.await.is_err());
    joined.leave().await;
}

/// A writer that keeps rewriting a live node's record (a second node under its name, say) gets a
/// bounded answer: the node puts its record back a few times per session, then ends the session
/// and registers again after a backoff, rather than racing the other writer on one key as fast
/// as etcd answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_rewritten_without_end_is_put_back_a_bounded_number_of_times() {
    let etcd = Etcd::start().await;
    let a = member_node(None).await;
    let joined = Membership::join(a.node.clone(), etcd.member("a", &a));
    let cluster = etcd.cluster();
    let registered = || async {
        let Ok(mut d) = Directory::connect(&cluster).await else {
            return false;
        };
        d.resolve("a").await.is_ok()
    };
    eventually_async("a registered", Duration::from_secs(10), registered).await;
    let key = ferry_proto::cluster::member_key("a");
    let endpoints = ferry_proto::cluster::endpoints(&cluster).unwrap();
    let mut reader = ferry_etcd::Etcd::connect(&endpoints, Duration::from_secs(5))
        .await
        .unwrap();
    let from = reader.get(key.as_bytes()).await.unwrap().revision + 1;
    let mut watch = reader.watch_prefix(key.as_bytes(), from).await.unwrap();
    // The node's puts carry its lease; the rewriter's none.
    let counted = tokio::spawn(async move {
        let mut by_node = 0usize;
        while let Ok(Ok(Some(batch))) =
            tokio::time::timeout(Duration::from_secs(1), watch.next()).await
        {
            if let ferry_etcd::WatchBatch::Events(events) = batch {
                by_node += events
                    .iter()
                    .filter(|e| e.kind == ferry_etcd::EventKind::Put && e.kv.lease != 0)
                    .count();
            }
        }
        by_node
    });
    let forged = MemberRecord {
        name: "a".into(),
        node_id: "someone-else".into(),
        tcp: "192.0.2.9:7070".into(),
        unix: None,
        host: String::new(),
        devices: Vec::new(),
    };
    let rewrites = 150;
    for _ in 0..rewrites {
        etcd.put(&key, &ferry_proto::cluster::encode(&forged)).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let by_node = counted.await.unwrap();
    // About 3 s of rewrites: sessions restarted after 0.2, 0.4, 0.8 and 1.6 s backoffs at most,
    // each registering once and putting back five times at most.
    assert!(by_node >= 1, "the node never put its record back");
    assert!(
        by_node <= 30,
        "{by_node} puts by the node against {rewrites} rewrites: not bounded"
    );
    joined.leave().await;
}

/// Which node ids may be members is the operator's list: a node given one pulls from no member
/// of another id (self-registered, by a stranger with etcd access or a retired certificate),
/// and a directory given one refuses to resolve such a member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_node_ids_the_operator_lists_are_members() {
    let etcd = Etcd::start().await;
    let (a, c) = (member_node(None).await, member_node(None).await);
    let a_id = a.node.node_id().clone();
    let b = member_node_with(None, ClusterMembers::admitting([a_id.to_string()]), None).await;
    let joined_b = Membership::join(b.node.clone(), etcd.member("b", &b));
    // c registers first; once b lists a, it has read c's record too.
    let joined_c = Membership::join(c.node.clone(), etcd.member("c", &c));
    let cluster = etcd.cluster();
    let c_registered = || async {
        let Ok(mut d) = Directory::connect(&cluster).await else {
            return false;
        };
        d.resolve("c").await.is_ok()
    };
    eventually_async("c registered", Duration::from_secs(10), c_registered).await;
    let joined_a = Membership::join(a.node.clone(), etcd.member("a", &a));
    let (a_addr, c_addr) = (a.addr.to_string(), c.addr.to_string());
    sees(&b, &a_addr, true).await;
    assert!(
        !b.node.config().pulls.peers.allows(&c_addr),
        "c is not on the list"
    );

    let (mut ca, mut cb, mut cc) = (a.client().await, b.client().await, c.client().await);
    let data = samples::plain(DType::F32, &[16, 16], 21);
    ca.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    cc.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    member_yes_stranger_no(
        &mut cb,
        (&mut ca, &a_addr),
        (&mut cc, &c_addr),
        &data,
        "c, registered but not on the operator's list",
    )
    .await;

    let mut d = Directory::connect(&cluster)
        .await
        .unwrap()
        .admitting([a_id.clone()]);
    assert_eq!(d.resolve("a").await.unwrap().node_id, a_id);
    assert!(matches!(
        d.resolve("c").await,
        Err(DirectoryError::NotAdmitted { member, .. }) if member == "c"
    ));
    // Nor is c listed, or offered as a holder (a copy by name would otherwise pick it as a
    // source, or find the name ambiguous), once the directory shows c's w at all.
    eventually_async(
        "c's w in the directory",
        Duration::from_secs(10),
        || async {
            let mut all = Directory::connect(&cluster).await.unwrap();
            all.holders("w")
                .await
                .unwrap()
                .iter()
                .any(|h| h.member == "c")
        },
    )
    .await;
    let names: Vec<String> = d
        .members()
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.name)
        .collect();
    assert!(!names.contains(&"c".to_string()), "{names:?}");
    let holders = d.holders("w").await.unwrap();
    assert!(holders.iter().all(|h| h.member != "c"), "{holders:?}");
    assert!(d.tensors(Some("c")).await.unwrap().is_empty());
    joined_a.leave().await;
    joined_b.leave().await;
    joined_c.leave().await;
}

/// With etcd's auth on and ferry's roles (`ferry_client::etcd_roles`), a member writes its own
/// keys alone: an etcd writer holding one member's password can neither move another member
/// nor place a tensor on it, a reader's password writes nothing, no password anything; the
/// cluster works as without auth (members register and publish, a reader resolves and lists,
/// a copy between members by the directory's address goes through), a wrong password is
/// refused at login, and a client whose token expired unused logs in again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_auth_on_a_member_writes_its_own_keys_alone() {
    use ferry_etcd::{EtcdError, EtcdUser};
    let mut etcd = Etcd::start().await;
    etcd.enable_auth(&["a", "b"], &["ops"]).await;
    let (node_a, node_b) = (start_with(&["flex"]).await, start_with(&["flex"]).await);
    let as_user = |name: &str, node: &TestNode| ClusterConfig {
        etcd_user: Some(Etcd::user(name)),
        ..etcd.member(name, node)
    };
    let _a = Membership::join(node_a.node.clone(), as_user("a", &node_a));
    let _b = Membership::join(node_b.node.clone(), as_user("b", &node_b));
    let (mut ca, mut cb) = (node_a.client().await, node_b.client().await);
    let data = samples::plain(DType::F32, &[64, 33], 1);
    ca.put(&TensorKey::new(0, "w"), &data).await.unwrap();

    let cluster = etcd.cluster();
    let reader = || Directory::connect_as(&cluster, None, Some(Etcd::user("ops")));
    eventually_async(
        "both members and a's tensor, read as ops",
        TTL * 5,
        || async {
            let Ok(mut d) = reader().await else {
                return false;
            };
            let members = d.members().await.map(|m| m.len()).unwrap_or(0);
            let tensors = d.tensors(None).await.unwrap_or_default();
            members == 2 && tensors.iter().any(|t| t.member == "a" && t.name == "w")
        },
    )
    .await;
    let mut ops = reader().await.unwrap();
    let a = ops.resolve("a").await.unwrap();
    assert_eq!(a.tcp, node_a.addr.to_string());
    let key = TensorKey::new(0, "w");
    let pulled = copy_one(&mut ca, &mut cb, &key, &how(&a.tcp, 0))
        .await
        .unwrap();
    assert_same(
        &cb.get(&pulled.key).await.unwrap(),
        &data,
        "pulled under auth",
    );

    // The attacks of an etcd writer, each refused by etcd itself.
    let a_record = serde_json::to_vec(&a).unwrap();
    let denied = |what: &str, result: Result<(), EtcdError>, says: &str| match result {
        Err(EtcdError::Refused { message, .. }) => {
            assert!(message.contains(says), "{what}: {message}");
        }
        other => panic!("{what}: expected etcd's refusal, got {other:?}"),
    };
    let as_a = Some(Etcd::user("a"));
    denied(
        "a's password writing b's member record",
        etcd.put_as(as_a.clone(), "/ferry/members/b", &a_record)
            .await,
        "permission denied",
    );
    denied(
        "a's password placing a tensor on b",
        etcd.put_as(as_a.clone(), "/ferry/tensors/b/0/w", b"{}")
            .await,
        "permission denied",
    );
    denied(
        "a's password writing a member of a name a is a prefix of",
        etcd.put_as(as_a.clone(), "/ferry/members/ab", &a_record)
            .await,
        "permission denied",
    );
    denied(
        "the reader's password writing",
        etcd.put_as(Some(Etcd::user("ops")), "/ferry/members/ops", &a_record)
            .await,
        "permission denied",
    );
    denied(
        "no password",
        etcd.put_as(None, "/ferry/members/b", &a_record).await,
        "user name is empty",
    );
    let wrong = EtcdUser::new("a", "not-a-password").unwrap();
    denied(
        "a wrong password",
        etcd.put_as(Some(wrong), "/ferry/members/a", &a_record)
            .await,
        "authentication failed",
    );
    assert!(
        matches!(
            ferry_etcd::Etcd::connect_as(
                &["http://192.0.2.1:2379".to_string()],
                Duration::from_secs(5),
                None,
                as_a.clone(),
            )
            .await,
            Err(EtcdError::PasswordInClear(_))
        ),
        "a password is not sent in clear beyond loopback"
    );
    // A password goes to no endpoint in clear beyond loopback, not even one a call could
    // reconnect to.
    let mut two = ferry_etcd::Etcd::connect(
        &[
            cluster.replace("etcd://", "http://"),
            "http://192.0.2.1:2379".to_string(),
        ],
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert!(
        matches!(
            two.user_add("someone", "secret").await,
            Err(EtcdError::PasswordInClear(_))
        ),
        "a new user's password is not sent where a reconnection could take it in clear"
    );
    // a's own keys are a's to write (what a member's session does).
    etcd.put_as(as_a, "/ferry/tensors/a/0/extra", b"{}")
        .await
        .expect("a writes its own keys");
    etcd.delete("/ferry/tensors/a/0/extra").await;

    // b is still where it registered, and the reader's connection, idle past its token's time
    // to live (2 s in the test etcd, which drops expired tokens once a second), logs in again.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let b = ops.resolve("b").await.expect("an expired token is renewed");
    assert_eq!(b.tcp, node_b.addr.to_string());
}

/// etcd over TLS with auth on (a certificate of the cluster's CA, no `--client-cert-auth`): a
/// member under TLS checks etcd's certificate, logs in as its etcd user, registers sealed, and
/// is resolved by a reader that logs in as a reader; a client of the cluster's CA without a
/// password reads and writes nothing (etcd's roles decide what each may do).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_over_tls_with_auth_on_takes_each_member_s_password() {
    use ferry_etcd::EtcdError;
    let pki = TestPki::new();
    let mut etcd = Etcd::start_tls_for_passwords(&pki).await;
    etcd.enable_auth(&["node-a"], &["ops"]).await;
    let cluster = etcd.cluster();
    let a = member_node(Some(pki.node("node-a"))).await;
    let joined = Membership::join(
        a.node.clone(),
        ClusterConfig {
            etcd_user: Some(Etcd::user("node-a")),
            ..etcd.member("node-a", &a)
        },
    );
    let user = pki.client("user");
    let reader = || Directory::connect_as(&cluster, Some(&user), Some(Etcd::user("ops")));
    eventually_async("node-a registered", Duration::from_secs(10), || async {
        match reader().await {
            Ok(mut d) => d.resolve("node-a").await.is_ok(),
            Err(_) => false,
        }
    })
    .await;
    let mut d = reader().await.unwrap();
    let (mut reached, _) = d
        .reach("node-a", ConnectOptions::default().tls(user.clone()))
        .await
        .unwrap();
    assert_eq!(&reached.identify().await.unwrap(), a.node.node_id());
    // A certificate of the cluster and no password: etcd's roles refuse it.
    let no_password = etcd.put_as(None, "/ferry/members/node-a", b"{}").await;
    assert!(
        matches!(&no_password, Err(EtcdError::Refused { message, .. }) if message.contains("user name is empty")),
        "{no_password:?}"
    );
    let no_password = Directory::connect_with(&cluster, Some(&user)).await;
    let listed = match no_password {
        Ok(mut d) => d
            .resolve("node-a")
            .await
            .map(|_| ())
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let refused = listed.expect_err("a certificate without a password read the directory");
    assert!(refused.contains("user name is empty"), "{refused}");
    joined.leave().await;
}
