//! An embedded node built as `ferry-server` builds one (`Server::builder`): the same receive
//! pool by default, and the same door: refused beyond loopback without TLS and a credential
//! (and a peer list), metrics in clear beyond loopback refused, tokens beside TLS and empty
//! tokens refused, unless the program says the network is trusted.

use std::time::Duration;

use ferry_server::{
    BindError, Missing, Node, NodeConfig, PeerToken, ProcessTuning, ReadyMemory, ReceiveBuffers,
    Server, ServerBuilder, Service, ServiceConfig, StartError,
};
use ferry_testkit::TestPki;

/// A builder as a test uses it: the process's allocator left alone (the test harness shares
/// the process), a free port.
fn builder() -> ServerBuilder {
    Server::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .process_tuning(ProcessTuning::Untouched)
}

/// What a start was refused for, as the door says it.
fn missing(started: Result<Server, StartError>) -> Missing {
    match started {
        Err(StartError::Bind(BindError::Exposed(e))) => e.missing,
        Err(StartError::MetricsExposed(e)) => e.missing,
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("started"),
    }
}

#[tokio::test]
async fn an_embedded_server_keeps_receive_memory_ready_as_ferry_server_does() {
    let server = builder()
        .receive_buffers(ReceiveBuffers::Elastic(ReadyMemory::Kept(8 << 20)))
        .start()
        .await
        .unwrap();
    let pool = server
        .node()
        .config()
        .receive_buffers
        .pool()
        .expect("a pool");
    assert!(pool.capacity() >= 8 << 20, "{}", pool.capacity());
    // The default of a node and of a server alike: an elastic pool ready for a model.
    assert!(matches!(
        NodeConfig::default().receive_buffers,
        ReceiveBuffers::Elastic(ReadyMemory::ForAModel)
    ));
    assert!(matches!(
        NodeConfig::light().receive_buffers,
        ReceiveBuffers::Fresh
    ));
    // And `stat` says so to a client.
    let addr = server.local_addr().unwrap();
    tokio::spawn(server.run(std::future::pending()));
    let mut client = ferry_client::Client::connect(addr).await.unwrap();
    let stats = client.stat().await.unwrap();
    assert!(stats.pool_bytes >= 8 << 20, "{stats:?}");
}

#[tokio::test]
async fn beyond_loopback_a_server_needs_tls_a_credential_and_a_peer_list() {
    let wildcard = "0.0.0.0:0".parse().unwrap();
    let light = || builder().receive_buffers(ReceiveBuffers::Fresh);
    assert_eq!(
        missing(light().listen(wildcard).start().await),
        Missing::TlsAndCredential
    );
    assert_eq!(
        missing(light().listen(wildcard).token("t0k").start().await),
        Missing::Tls
    );
    let pki = TestPki::new();
    pki.node("node-a");
    assert_eq!(
        missing(
            light()
                .listen(wildcard)
                .tls(pki.node("node-a"))
                .start()
                .await
        ),
        Missing::Credential
    );
    // The service alone, as a program that builds a node by hand binds it: the same door.
    let node = Node::start(NodeConfig::light()).unwrap();
    let bound = Service::bind(node.clone(), wildcard, ServiceConfig::default()).await;
    assert!(
        matches!(&bound, Err(BindError::Exposed(e)) if e.missing == Missing::TlsAndCredential),
        "{bound:?}"
    );
    // A token in clear: refused too.
    let config = ServiceConfig {
        credentials: vec![ferry_server::Credential::full("t0k").unwrap()],
        ..ServiceConfig::default()
    };
    let bound = Service::bind(node, wildcard, config).await;
    assert!(
        matches!(&bound, Err(BindError::Exposed(e)) if e.missing == Missing::Tls),
        "{bound:?}"
    );
    // TLS and grants, but a node that pulls from any address a client names (a client could
    // make it dial any host its network reaches): refused; the builder lists peers instead.
    let tls_node = Node::start(NodeConfig {
        tls: Some(pki.node("node-a")),
        ..NodeConfig::light()
    })
    .unwrap();
    let granted = ServiceConfig {
        grants: vec!["me=all".parse().unwrap()],
        ..ServiceConfig::default()
    };
    let bound = Service::bind(tls_node, wildcard, granted).await;
    assert!(
        matches!(&bound, Err(BindError::Exposed(e)) if e.missing == Missing::PeerList),
        "{bound:?}"
    );
    // Metrics are clear HTTP with no credential: beyond loopback only on a trusted network.
    assert_eq!(
        missing(light().metrics(wildcard).start().await),
        Missing::Everything
    );
}

#[tokio::test]
async fn what_ferry_server_refuses_at_start_a_program_is_refused_too() {
    let pki = TestPki::new();
    let light = || builder().receive_buffers(ReceiveBuffers::Fresh);
    let refused = |started: Result<Server, StartError>| match started {
        Err(e) => e,
        Ok(_) => panic!("started"),
    };
    assert!(matches!(
        refused(light().token("").start().await),
        StartError::EmptyToken(_)
    ));
    assert!(matches!(
        refused(
            light()
                .peer_token(PeerToken::Given("".into()))
                .start()
                .await
        ),
        StartError::EmptyToken(_)
    ));
    assert!(matches!(
        refused(
            light()
                .timeouts(Duration::ZERO, Duration::ZERO, Duration::ZERO)
                .start()
                .await
        ),
        StartError::HelloTimeoutZero
    ));
    assert!(matches!(
        refused(light().tls(pki.node("node-b")).token("t0k").start().await),
        StartError::TokensUnderTls
    ));
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("tokens");
    std::fs::write(&empty, "# nothing\n").unwrap();
    assert!(matches!(
        refused(light().token_file(&empty).start().await),
        StartError::NoCredential(_)
    ));
    let refusal = refused(light().token_file(dir.path().join("absent")).start().await);
    assert!(refusal.to_string().contains("absent"), "{refusal}");
}
