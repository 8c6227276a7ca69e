//! Mutual TLS between real nodes and clients on loopback: tensors bit-exact across it, node
//! identities from certificates (capabilities bound to them, not to claims), and every way a
//! certificate can be wrong refused: another CA, expired, issued for another host, no
//! certificate at all; and bytes altered on the path fail the connection, registering nothing.

use ferry_proto::TransferPath;
use ferry_server::PullConfig;
use ferry_testkit::copy_keys;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ferry_certs::{Role, Validity};
use ferry_client::ErrorCode;
use ferry_io::connection::{Connection, ConnectionLimits};
use ferry_io::{ClientTls, Endpoint, NodeTls, TlsFiles, Transport, handshake};
use ferry_io::{Dial, ExchangeError, PeerCheck, SharedMemory};
use ferry_proto::{DType, NodeId, TensorKey};
use ferry_server::{NodeConfig, Peer, PeerPolicy, ServiceConfig};
use ferry_testkit::samples;
use ferry_testkit::{
    Fault, TestNode, TestPki, assert_same, copy_one, devices, how, on_device, proxy, start,
    tls_client,
};
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// A node under mutual TLS, serving in 64 KiB chunks (so that a fault lands mid-stream and a
/// resume starts past the beginning).
async fn tls_node(tls: NodeTls, peers: PeerPolicy, pull_retries: u32) -> TestNode {
    let mut service = ServiceConfig::default();
    service.limits.chunk_size = 64 * 1024;
    start(
        NodeConfig {
            devices: devices(&["flex", "ndarray"]),
            tls: Some(tls),
            pulls: PullConfig {
                peers,
                retries: pull_retries,
                retry_backoff: Duration::from_millis(20),
                ..PullConfig::default()
            },
            ..NodeConfig::light()
        },
        service,
    )
    .await
}

fn listed(nodes: &[&TestNode]) -> PeerPolicy {
    PeerPolicy::Listed(nodes.iter().map(|n| Peer::at(n.addr.to_string())).collect())
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
    // A TLS stream vouches for its bytes (so chunk checksums are skipped on it), and carries the
    // node's certified identity.
    let stream = Endpoint::from(a.addr).connect(Some(&me)).await.unwrap();
    assert!(stream.authenticated());
    assert_eq!(stream.peer_identity().map(|id| id.as_str()), Some("node-a"));
    assert_eq!(target.identify().await.unwrap(), "node-b");
    let matrix = samples::full_matrix();
    let tensors: Vec<_> = matrix
        .iter()
        .map(|s| (s.name.clone(), s.data.clone()))
        .collect();
    for answer in source.put_batch(&on_device(0, &tensors)).await.unwrap() {
        answer.unwrap();
    }
    for sample in &matrix {
        let back = source.get(&TensorKey::new(0, &sample.name)).await.unwrap();
        assert_same(&back, &sample.data, &sample.name);
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
}

/// A pull striped over mutual TLS: every helper connection presents the target's certificate
/// and is served as the node it names; the stripes land bit-exact, a fetch each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_striped_pull_crosses_mutual_tls_bit_exact() {
    let pki = TestPki::new();
    let a = tls_node(pki.node("node-a"), PeerPolicy::Any, 0).await;
    let mut service = ServiceConfig::default();
    service.limits.chunk_size = 64 * 1024;
    let b = start(
        NodeConfig {
            devices: devices(&["flex"]),
            tls: Some(pki.node("node-b")),
            pulls: PullConfig {
                peers: listed(&[&a]),
                striping: ferry_server::Striping::new(
                    3,
                    ferry_proto::stripes::StripeLen::new(256 << 10).unwrap(),
                ),
                ..PullConfig::default()
            },
            ..NodeConfig::light()
        },
        service,
    )
    .await;
    let me = pki.client("me");
    let mut source = tls_client(&a, &me).await.unwrap();
    let mut target = tls_client(&b, &me).await.unwrap();
    // 4 MiB: 17 stripes of 256 KiB.
    let data = samples::plain(DType::BF16, &[1024, 2048], 11);
    let key = TensorKey::new(0, "w");
    source.put(&key, &data).await.unwrap();
    let info = copy_one(&mut source, &mut target, &key, &how(&a.addr.to_string(), 0))
        .await
        .unwrap();
    assert_eq!(info.path, TransferPath::Pull);
    assert_same(&target.get(&key).await.unwrap(), &data, "striped over TLS");
    assert_eq!(a.node.stats().await.unwrap().fetches_served, 17);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_id_that_is_not_the_certificates_is_refused_at_start() {
    let pki = TestPki::new();
    let config = NodeConfig {
        devices: devices(&["flex"]),
        tls: Some(pki.node("node-a")),
        node_id: Some("someone-else".into()),
        ..NodeConfig::light()
    };
    let error = ferry_server::Node::start(config).err().unwrap();
    assert!(error.to_string().contains("someone-else"), "{error}");
    assert!(error.to_string().contains("node-a"), "{error}");
}

/// What connecting with ferry's client under `tls` gives: the error's text, or `None` when it
/// got through.
async fn client_error(node: &TestNode, tls: Option<ClientTls>) -> Option<String> {
    ferry_client::Client::connect(node.addr)
        .tls_if_any(tls)
        .await
        .err()
        .map(|e| e.to_string())
}

/// A TLS client configuration built by hand, which trusts `ca` and presents `holder`'s
/// certificate (or none): what ferry's own client never does (it always presents one).
pub(crate) fn hand_built_client(ca: &Path, holder: Option<&TlsFiles>) -> rustls::ClientConfig {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots);
    match holder {
        Some(files) => {
            let chain = CertificateDer::pem_file_iter(&files.cert)
                .unwrap()
                .collect::<Result<Vec<_>, _>>()
                .unwrap();
            let key = PrivateKeyDer::from_pem_file(&files.key).unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    }
}

/// A TLS client built by hand (ferry's own checks its certificate before it connects): trusting
/// `ca`, presenting `holder`'s certificate (or none), it says hello; what the node answered, or
/// `None` when it was welcomed.
async fn hand_built_hello(node: &TestNode, ca: &Path, holder: Option<&TlsFiles>) -> Option<String> {
    let config = hand_built_client(ca, holder);
    let tcp = tokio::net::TcpStream::connect(node.addr).await.unwrap();
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let tls = match tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
    {
        Ok(tls) => tokio_rustls::TlsStream::from(tls),
        Err(e) => return Some(e.to_string()),
    };
    let mut conn = Connection::new(tls, ConnectionLimits::default());
    let offer = handshake::Offer {
        token: None,
        agent: "hand-built",
        shared_memory: false,
    };
    handshake::hello(&mut conn, offer)
        .await
        .err()
        .map(|e| e.to_string())
}

fn assert_refused(error: Option<String>, because: &str, what: &str) {
    let error = error.unwrap_or_else(|| panic!("{what}: got through"));
    assert!(error.contains(because), "{what}: {error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_certificates_are_refused_both_ways_and_the_node_stays_up() {
    let pki = TestPki::new();
    let a = tls_node(pki.node("node-a"), PeerPolicy::Any, 0).await;
    let me = pki.client("me");
    let ca = pki.files("me").ca;
    assert_eq!(
        hand_built_hello(&a, &ca, Some(&pki.files("me"))).await,
        None
    );

    // The node refuses TCP in clear, a client with no certificate, one from another CA, and
    // an expired one.
    assert_refused(client_error(&a, None).await, "", "TCP in clear");
    assert_refused(
        hand_built_hello(&a, &ca, None).await,
        "CertificateRequired",
        "no client certificate",
    );
    let stranger = TestPki::new();
    stranger.issue("me", &Role::Client, Validity::days(1));
    assert_refused(
        hand_built_hello(&a, &ca, Some(&stranger.files("me"))).await,
        "UnknownCA",
        "another CA's client",
    );
    let past = Validity {
        not_before: SystemTime::now() - Duration::from_secs(7 * 86_400),
        not_after: SystemTime::now() - Duration::from_secs(86_400),
    };
    pki.issue("expired", &Role::Client, past);
    assert_refused(
        hand_built_hello(&a, &ca, Some(&pki.files("expired"))).await,
        "CertificateExpired",
        "expired client",
    );

    // The client refuses a node whose certificate another CA signed, or that names another
    // host than the one dialled.
    let mut distrusting = pki.files("me");
    distrusting.ca = stranger.files("me").ca;
    stranger.issue("me-too", &Role::Client, Validity::days(1));
    let mut stranger_client = stranger.files("me-too");
    stranger_client.ca = stranger.files("me").ca;
    assert_refused(
        client_error(&a, Some(ClientTls::load(&stranger_client).unwrap())).await,
        "UnknownIssuer",
        "another CA's roots",
    );
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
    assert_refused(
        client_error(&misnamed, Some(me.clone())).await,
        "not valid for name \"127.0.0.1\"",
        "a certificate for another host",
    );

    // Nobody would accept an expired certificate, or one of another CA: neither a node nor a
    // client starts with one.
    let node_role = Role::Node {
        hosts: vec!["127.0.0.1".into()],
    };
    pki.issue("old-node", &node_role, past);
    let old = NodeTls::load(&pki.files("old-node"))
        .unwrap_err()
        .to_string();
    assert!(
        old.contains("does not verify") && old.contains("expired"),
        "{old}"
    );
    let foreign = ClientTls::load(&distrusting).unwrap_err().to_string();
    assert!(foreign.contains("does not verify"), "{foreign}");

    // Through all of it the node served on.
    let data = samples::plain(DType::F32, &[64, 64], 1);
    let mut client = tls_client(&a, &me).await.unwrap();
    client.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    assert_same(
        &client.get(&TensorKey::new(0, "w")).await.unwrap(),
        &data,
        "after refusals",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capability_serves_only_the_node_its_certificate_names() {
    /// A source's refusal: its message, after checking its code.
    fn refusal<T: std::fmt::Debug>(result: Result<T, ExchangeError>) -> Option<String> {
        let error = result.expect_err("refused");
        assert_eq!(error.code(), Some(ErrorCode::CapabilityRefused), "{error}");
        Some(error.to_string())
    }
    let pki = TestPki::new();
    let a = tls_node(pki.node("node-a"), PeerPolicy::Any, 0).await;
    let me = pki.client("me");
    let mut source = tls_client(&a, &me).await.unwrap();
    let data = samples::plain(DType::F32, &[32, 32], 2);
    source.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let grant = source
        .grant(&TensorKey::new(0, "w"), &NodeId::new("node-c"))
        .await
        .unwrap();

    // node-b, holding its own certificate, claims to be node-c: refused, the claim is not
    // what counts. Claiming to be itself gets it no further: the capability is node-c's.
    let b_tls = pki.node("node-b");
    let open = async |tls| {
        let dial = Dial {
            token: None,
            agent: "tls-test",
            tls: Some(tls),
            check: &PeerCheck::Any,
            clear_tokens: Default::default(),
            shared_memory: SharedMemory::Decline,
            limits: Default::default(),
        };
        dial.open(&a.addr.into()).await.unwrap()
    };
    let (node_b, node_c) = (NodeId::new("node-b"), NodeId::new("node-c"));
    let mut as_b = open(b_tls.client()).await;
    let claim = as_b.fetch(&grant.token, &node_c, 0).await.map(|f| f.meta);
    assert_refused(refusal(claim), "certificate names node-b", "a claim");
    let own = as_b.fetch(&grant.token, &node_b, 0).await.map(|f| f.meta);
    assert_refused(refusal(own), "issued to another node", "its own name");

    // A client's certificate that bears node-c's name (the CA signed it for a client) speaks
    // for no node.
    let impostor = pki
        .authority
        .issue("node-c", &Role::Client, Validity::days(1))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let files = TlsFiles {
        cert: dir.path().join("impostor.pem"),
        key: dir.path().join("impostor.key"),
        ca: pki.files("me").ca,
    };
    std::fs::write(&files.cert, &impostor.cert_pem).unwrap();
    std::fs::write(&files.key, &impostor.key_pem).unwrap();
    let impostor = ClientTls::load(&files).unwrap();
    let mut as_impostor = open(&impostor).await;
    let fetch = as_impostor
        .fetch(&grant.token, &node_c, 0)
        .await
        .map(|f| f.meta);
    assert_refused(
        refusal(fetch),
        "is a client's, not a node's",
        "a client's certificate",
    );

    // node-c, certified, is served, and the bytes are the source's.
    let c_tls = pki.node("node-c");
    let mut as_c = open(c_tls.client()).await;
    let fetch = as_c.fetch(&grant.token, &node_c, 0).await.unwrap();
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
        .put(&TensorKey::new(0, "big"), &data)
        .await
        .unwrap();
    let via = proxy(a.addr, Fault::FlipAt(3 << 19)).await;
    let via_policy = PeerPolicy::Listed(vec![Peer::at(via.to_string())]);

    // Without retries the pull fails: the altered record does not authenticate, the
    // connection is dropped, and nothing is registered.
    let strict = tls_node(pki.node("node-b"), via_policy.clone(), 0).await;
    let mut source = tls_client(&a, &me).await.unwrap();
    let mut target = tls_client(&strict, &me).await.unwrap();
    let via_addr = via.to_string();
    let answer = copy_one(&mut source, &mut target, &key, &how(&via_addr, 0)).await;
    let error = answer.expect_err("the tampered pull fails");
    assert_eq!(error.code(), Some(ErrorCode::PeerFailed), "{error}");
    // Not the per-chunk CRC (a plain link's check): the TLS record failed, and with it the
    // connection ("unreachable" is all a client learns of how).
    assert!(error.to_string().contains("unreachable"), "{error}");
    assert!(
        target.list(None).await.unwrap().is_empty(),
        "nothing registered"
    );

    // With a retry, the next connection (untouched) completes it, bit-exact.
    let via = proxy(a.addr, Fault::FlipAt(3 << 19)).await.to_string();
    let patient = tls_node(
        pki.node("node-c"),
        PeerPolicy::Listed(vec![Peer::at(via.clone())]),
        1,
    )
    .await;
    let mut target = tls_client(&patient, &me).await.unwrap();
    let info = copy_one(&mut source, &mut target, &key, &how(&via, 0))
        .await
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_copy_over_tls_dedups_and_hands_its_capability_back() {
    let pki = TestPki::new();
    let a = tls_node(pki.node("node-a"), PeerPolicy::Any, 0).await;
    let b = tls_node(pki.node("node-b"), listed(&[&a]), 0).await;
    let me = pki.client("me");
    let mut source = tls_client(&a, &me).await.unwrap();
    let mut target = tls_client(&b, &me).await.unwrap();
    let data = samples::plain(DType::F32, &[128, 128], 4);
    source.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let addr = a.addr.to_string();
    let key = TensorKey::new(0, "w");
    let first = copy_one(&mut source, &mut target, &key, &how(&addr, 0))
        .await
        .unwrap();
    assert_eq!(first.path, TransferPath::Pull);
    // The same bytes under another name on B: B already holds them, so the client hands the
    // capability it got back to A itself (over its own certificate, not a node's).
    let again = ferry_testkit::How {
        dst_name: Some("w2".into()),
        ..how(&addr, 0)
    };
    let second = copy_one(&mut source, &mut target, &key, &again)
        .await
        .unwrap();
    assert_eq!(second.path, TransferPath::Dedup);
    assert_same(&target.get(&second.key).await.unwrap(), &data, "dedup copy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_listed_by_name_is_pulled_from_only_if_its_certificate_carries_that_name() {
    let pki = TestPki::new();
    let a = tls_node(pki.node("node-a"), PeerPolicy::Any, 0).await;
    let me = pki.client("me");
    let mut source = tls_client(&a, &me).await.unwrap();
    let data = samples::plain(DType::F32, &[64, 64], 5);
    source.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let key = TensorKey::new(0, "w");
    let addr = a.addr.to_string();

    // Listed as node-x: A's certificate names node-a, so B refuses it after the handshake,
    // before its hello (and its peer token) is sent.
    let wary = Peer::named("node-x", addr.clone());
    let b = tls_node(pki.node("node-b"), PeerPolicy::Listed(vec![wary]), 0).await;
    let mut target = tls_client(&b, &me).await.unwrap();
    let refused = copy_one(&mut source, &mut target, &key, &how(&addr, 0))
        .await
        .expect_err("another node's certificate");
    assert_eq!(refused.code(), Some(ErrorCode::BadRequest), "{refused}");
    assert!(
        refused.to_string().contains("not an allowed peer"),
        "{refused}"
    );
    assert!(
        target.list(None).await.unwrap().is_empty(),
        "nothing registered"
    );

    // Listed as node-a: pulled, bit-exact.
    let trusting = Peer::named("node-a", addr.clone());
    let c = tls_node(pki.node("node-c"), PeerPolicy::Listed(vec![trusting]), 0).await;
    let mut target = tls_client(&c, &me).await.unwrap();
    let info = copy_one(&mut source, &mut target, &key, &how(&addr, 0))
        .await
        .unwrap();
    assert_same(&target.get(&info.key).await.unwrap(), &data, "named peer");

    // A name no certificate could show (no TLS on this node) is refused at start.
    let config = NodeConfig {
        devices: devices(&["flex"]),
        pulls: PullConfig {
            peers: PeerPolicy::Listed(vec![Peer::named("node-a", addr.clone())]),
            ..PullConfig::default()
        },
        ..NodeConfig::light()
    };
    let error = ferry_server::Node::start(config).err().unwrap();
    assert!(error.to_string().contains("listed with a name"), "{error}");
}

/// Under TLS the certificate is the credential (issue: a fake node with a retired node's
/// certificate captured the operator's token and a node's peer token, and could replay them at
/// every node). A node grants scopes to certificate names and `peer` to every node certificate:
/// a reader reads and cannot write, a stranger's certificate gets nothing, a node pulls with no
/// token at all. And a node that holds a certificate of the CA but is not the one meant (here
/// one that records what it is sent) learns no token from a client or a pulling node that has
/// one, since no token is sent under TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_tls_the_certificate_is_the_credential_and_no_token_travels() {
    use ferry_proto::Request;
    use ferry_server::CertificateGrant;
    let pki = TestPki::new();
    let granted = ServiceConfig {
        grants: vec![
            "reader=read".parse::<CertificateGrant>().unwrap(),
            "writer=read,write".parse::<CertificateGrant>().unwrap(),
        ],
        ..ServiceConfig::default()
    };
    let a = start(
        NodeConfig {
            devices: devices(&["flex"]),
            tls: Some(pki.node("node-a")),
            ..NodeConfig::light()
        },
        granted,
    )
    .await;
    let data = samples::plain(DType::F32, &[32, 32], 12);
    let key = TensorKey::new(0, "w");
    let mut writer = tls_client(&a, &pki.client("writer")).await.unwrap();
    writer.put(&key, &data).await.unwrap();
    let mut reader = tls_client(&a, &pki.client("reader")).await.unwrap();
    assert_same(&reader.get(&key).await.unwrap(), &data, "a reader reads");
    let refused = reader.delete(&key).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::AuthRefused), "{refused}");
    assert!(refused.to_string().contains("write"), "{refused}");
    let stranger = tls_client(&a, &pki.client("stranger")).await.unwrap_err();
    assert_eq!(stranger.code(), Some(ErrorCode::AuthRefused), "{stranger}");
    assert!(
        stranger
            .to_string()
            .contains("grants certificate stranger nothing"),
        "{stranger}"
    );

    // Something with a node certificate of the CA that is not a ferry node: it records the
    // token of every hello, and hangs up.
    let evil_tls = pki.node("node-evil");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let evil_addr = listener.local_addr().unwrap().to_string();
    let (heard, mut hellos) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let Ok(link) = evil_tls.accept(socket).await else {
                continue;
            };
            let mut conn = Connection::new(
                ferry_io::Stream::Tls(Box::new(link)),
                ConnectionLimits::default(),
            );
            if let Ok(Some(Request::Hello(hello))) = conn.read_request().await {
                let _ = heard.send(hello.token.map(|t| t.as_str().to_string()));
            }
        }
    });
    let mut heard_token = async || {
        tokio::time::timeout(Duration::from_secs(5), hellos.recv())
            .await
            .expect("a hello reached the impostor")
            .unwrap()
    };

    // The operator's client, holding a token, reaches it: no token goes.
    let operator = ferry_client::Client::connect(evil_addr.as_str())
        .tls(pki.client("writer"))
        .token("the-operators-token")
        .await;
    assert!(operator.is_err(), "the impostor is no node");
    assert_eq!(heard_token().await, None, "the operator's token travelled");

    // A node with a peer token, pulling from A (which grants node certificates `peer`) and,
    // told to, from the impostor.
    let b = start(
        NodeConfig {
            devices: devices(&["flex"]),
            tls: Some(pki.node("node-b")),
            pulls: PullConfig {
                peer_token: Some("the-peer-token".into()),
                peers: PeerPolicy::Listed(vec![
                    Peer::at(a.addr.to_string()),
                    Peer::at(evil_addr.clone()),
                ]),
                ..PullConfig::default()
            },
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await;
    let mut target = tls_client(&b, &pki.client("writer")).await.unwrap();
    let pulled = copy_one(&mut writer, &mut target, &key, &how(&a.addr.to_string(), 0))
        .await
        .unwrap();
    assert_eq!(pulled.path, TransferPath::Pull);
    assert_same(
        &target.get(&key).await.unwrap(),
        &data,
        "pulled by certificate",
    );
    let other = TensorKey::new(0, "v");
    writer
        .put(&other, &samples::plain(DType::F32, &[8], 13))
        .await
        .unwrap();
    let failed = copy_one(&mut writer, &mut target, &other, &how(&evil_addr, 0)).await;
    assert!(failed.is_err(), "the impostor is no node");
    assert_eq!(heard_token().await, None, "the peer token travelled");
    assert!(target.get(&other).await.is_err(), "nothing registered");
}
