//! Mutual TLS between real nodes and clients on loopback: tensors bit-exact across it, node
//! identities from certificates (capabilities bound to them, not to claims), and every way a
//! certificate can be wrong refused: another CA, expired, issued for another host, no
//! certificate at all; and bytes altered on the path fail the connection, registering nothing.

use std::time::{Duration, SystemTime};

use ferry::certs::{Role, Validity};
use ferry::client::{ClientConfig, ErrorCode, copy_between};
use ferry::io::{ClientTls, NodeTls};
use ferry::proto::{DType, TensorKey};
use ferry::samples;
use ferry::server::{NodeConfig, PeerPolicy, ServiceConfig, SourceConfig, SourceConnection};
use ferry::testing::{
    Fault, TestNode, TestPki, assert_same, devices, how, proxy, source_code_of, start, tls_client,
};

/// A node under mutual TLS, serving in 64 KiB chunks (so that a fault lands mid-stream and a
/// resume starts past the beginning).
async fn tls_node(tls: NodeTls, peers: PeerPolicy, pull_retries: u32) -> TestNode {
    let mut service = ServiceConfig::default();
    service.limits.chunk_size = 64 * 1024;
    start(
        NodeConfig {
            devices: devices(&["flex", "ndarray"]),
            tls: Some(tls),
            peers,
            pull_retries,
            retry_backoff: Duration::from_millis(20),
            ..NodeConfig::default()
        },
        service,
    )
    .await
}

fn listed(nodes: &[&TestNode]) -> PeerPolicy {
    PeerPolicy::Listed(nodes.iter().map(|n| n.addr.to_string()).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dtype_crosses_mutual_tls_bit_exact_and_nodes_are_their_certificates() {
    let pki = TestPki::new();
    let a = tls_node(pki.node("node-a"), PeerPolicy::Any, 0).await;
    let b = tls_node(pki.node("node-b"), listed(&[&a]), 0).await;
    let me = pki.client("me");
    let mut source = tls_client(&a, &me).await.unwrap();
    let mut target = tls_client(&b, &me).await.unwrap();
    assert_eq!(source.identify().await.unwrap(), "node-a");
    assert_eq!(target.identify().await.unwrap(), "node-b");
    let matrix = samples::full_matrix();
    let tensors: Vec<_> = matrix
        .iter()
        .map(|s| (s.name.clone(), s.data.clone()))
        .collect();
    for answer in source.put_batch(0, &tensors, false).await.unwrap() {
        answer.unwrap();
    }
    for sample in &matrix {
        let back = source.get(&TensorKey::new(0, &sample.name)).await.unwrap();
        assert_same(&back, &sample.data, &sample.name);
    }
    let keys: Vec<TensorKey> = matrix.iter().map(|s| TensorKey::new(0, &s.name)).collect();
    let addr = a.addr.to_string();
    let answers = copy_between(&mut source, &mut target, &keys, &how(&addr, 0))
        .await
        .unwrap();
    for (sample, answer) in matrix.iter().zip(answers) {
        let info = answer.unwrap_or_else(|e| panic!("{}: {e}", sample.name));
        assert_eq!(info.path, "pull", "{}", sample.name);
        let back = target.get(&info.key).await.unwrap();
        assert_same(&back, &sample.data, &sample.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_id_that_is_not_the_certificates_is_refused_at_start() {
    let pki = TestPki::new();
    let config = NodeConfig {
        devices: devices(&["flex"]),
        tls: Some(pki.node("node-a")),
        node_id: Some("someone-else".into()),
        ..NodeConfig::default()
    };
    let error = ferry::server::Node::start(config).err().unwrap();
    assert!(error.to_string().contains("someone-else"), "{error}");
    assert!(error.to_string().contains("node-a"), "{error}");
}

/// A client that cannot complete the handshake: the node stays up and serves the next one.
async fn refused(node: &TestNode, tls: Option<ClientTls>, what: &str) {
    let config = ClientConfig {
        tls,
        ..ClientConfig::default()
    };
    let result = ferry::client::Client::connect_with(node.addr, config).await;
    assert!(result.is_err(), "{what}: connected");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_certificates_are_refused_both_ways_and_the_node_stays_up() {
    let pki = TestPki::new();
    let a = tls_node(pki.node("node-a"), PeerPolicy::Any, 0).await;
    let me = pki.client("me");

    // No TLS at all, or a certificate from another CA: the node refuses.
    refused(&a, None, "plain TCP").await;
    let stranger = TestPki::new();
    stranger.issue("me", &Role::Client, Validity::days(1));
    let mut mixed = stranger.files("me");
    mixed.ca = pki.files("me").ca;
    refused(
        &a,
        Some(ClientTls::load(&mixed).unwrap()),
        "another CA's client",
    )
    .await;

    // A client that trusts another CA refuses the node's certificate.
    let mut distrusting = pki.files("me");
    distrusting.ca = stranger.files("me").ca;
    refused(
        &a,
        Some(ClientTls::load(&distrusting).unwrap()),
        "another CA's roots",
    )
    .await;

    // An expired client certificate is refused by the node.
    let past = Validity {
        not_before: SystemTime::now() - Duration::from_secs(7 * 86_400),
        not_after: SystemTime::now() - Duration::from_secs(86_400),
    };
    pki.issue("expired", &Role::Client, past);
    refused(
        &a,
        Some(ClientTls::load(&pki.files("expired")).unwrap()),
        "expired client",
    )
    .await;

    // A node whose certificate expired, or names another host, is refused by the client.
    let old_role = Role::Node {
        hosts: vec!["127.0.0.1".into()],
    };
    pki.issue("old-node", &old_role, past);
    let old = tls_node(
        NodeTls::load(&pki.files("old-node")).unwrap(),
        PeerPolicy::Any,
        0,
    )
    .await;
    refused(&old, Some(me.clone()), "expired node").await;
    let elsewhere = Role::Node {
        hosts: vec!["10.9.9.9".into(), "elsewhere.example".into()],
    };
    pki.issue("elsewhere", &elsewhere, Validity::days(1));
    let misnamed = tls_node(
        NodeTls::load(&pki.files("elsewhere")).unwrap(),
        PeerPolicy::Any,
        0,
    )
    .await;
    refused(
        &misnamed,
        Some(me.clone()),
        "a certificate for another host",
    )
    .await;

    // Through all of it the node served on.
    let data = samples::plain(DType::F32, &[64, 64], 1);
    let mut client = tls_client(&a, &me).await.unwrap();
    client.put(0, "w", &data).await.unwrap();
    assert_same(
        &client.get(&TensorKey::new(0, "w")).await.unwrap(),
        &data,
        "after refusals",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capability_serves_only_the_node_its_certificate_names() {
    let pki = TestPki::new();
    let a = tls_node(pki.node("node-a"), PeerPolicy::Any, 0).await;
    let me = pki.client("me");
    let mut source = tls_client(&a, &me).await.unwrap();
    let data = samples::plain(DType::F32, &[32, 32], 2);
    source.put(0, "w", &data).await.unwrap();
    let grant = source
        .grant(&TensorKey::new(0, "w"), "node-c")
        .await
        .unwrap();

    // node-b, holding its own certificate, claims to be node-c: refused, the claim is not
    // what counts. Claiming to be itself gets it no further: the capability is node-c's.
    let b_tls = pki.node("node-b");
    let config = |tls| SourceConfig {
        token: None,
        limits: Default::default(),
        shared_memory: false,
        tls: Some(tls),
    };
    let mut as_b = SourceConnection::open(a.addr, config(b_tls.client()))
        .await
        .unwrap();
    let claim = as_b.fetch(&grant.token, "node-c", 0).await.map(|f| f.meta);
    assert_eq!(source_code_of(claim), ErrorCode::CapabilityRefused);
    let own = as_b.fetch(&grant.token, "node-b", 0).await.map(|f| f.meta);
    assert_eq!(source_code_of(own), ErrorCode::CapabilityRefused);
    let release = as_b.release(&grant.token, "node-c").await;
    assert_eq!(source_code_of(release), ErrorCode::CapabilityRefused);

    // node-c, certified, is served, and the bytes are the source's.
    let c_tls = pki.node("node-c");
    let mut as_c = SourceConnection::open(a.addr, config(c_tls.client()))
        .await
        .unwrap();
    let fetch = as_c.fetch(&grant.token, "node-c", 0).await.unwrap();
    assert_eq!(fetch.info.bytes, data.as_bytes().len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_altered_on_a_tls_link_fail_the_connection_and_register_nothing() {
    let pki = TestPki::new();
    let a = tls_node(pki.node("node-a"), PeerPolicy::Any, 0).await;
    let me = pki.client("me");
    // 4 MiB: the flipped bit lands in the middle of the payload's records.
    let data = samples::plain(DType::F32, &[1024, 1024], 3);
    let key = TensorKey::new(0, "big");
    tls_client(&a, &me)
        .await
        .unwrap()
        .put(0, "big", &data)
        .await
        .unwrap();
    let via = proxy(a.addr, Fault::FlipAt(3 << 19)).await;
    let via_policy = PeerPolicy::Listed(vec![via.to_string()]);

    // Without retries the pull fails: the altered record does not authenticate, the
    // connection is dropped, and nothing is registered.
    let strict = tls_node(pki.node("node-b"), via_policy.clone(), 0).await;
    let mut source = tls_client(&a, &me).await.unwrap();
    let mut target = tls_client(&strict, &me).await.unwrap();
    let via_addr = via.to_string();
    let answer = copy_between(
        &mut source,
        &mut target,
        std::slice::from_ref(&key),
        &how(&via_addr, 0),
    )
    .await
    .unwrap()
    .remove(0);
    let error = answer.expect_err("the tampered pull fails");
    assert_eq!(error.code(), Some(ErrorCode::PeerFailed), "{error}");
    assert!(
        target.list(None).await.unwrap().is_empty(),
        "nothing registered"
    );

    // With a retry, the next connection (untouched) completes it, bit-exact.
    let via = proxy(a.addr, Fault::FlipAt(3 << 19)).await.to_string();
    let patient = tls_node(pki.node("node-c"), PeerPolicy::Listed(vec![via.clone()]), 1).await;
    let mut target = tls_client(&patient, &me).await.unwrap();
    let info = copy_between(
        &mut source,
        &mut target,
        std::slice::from_ref(&key),
        &how(&via, 0),
    )
    .await
    .unwrap()
    .remove(0)
    .unwrap();
    assert_same(
        &target.get(&info.key).await.unwrap(),
        &data,
        "after a retry",
    );
    let stats = target.stat().await.unwrap();
    assert_eq!(stats.pull_retries, 1, "the altered connection failed");
    assert_eq!(stats.hash_mismatches, 0);
}
