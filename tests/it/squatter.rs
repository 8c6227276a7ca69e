//! A token in clear goes only where it may: a loopback port another local user bound first (a
//! squatter, as one can while the node is down) gets nothing from a client or a pulling node,
//! not even the hello; an address beyond loopback gets it only with the explicit opt-in.
//! Binding as another user needs root, as the tests run in CI: elsewhere these tests say they
//! were skipped.

use std::future::IntoFuture;
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::time::Duration;

use ferry_client::{ClearTokens, Client, ClientError, ErrorCode, LocalServer, TokenWithheld};
use ferry_proto::{DType, IfExists, TensorKey};
use ferry_server::{NodeConfig, Peer, PeerPolicy, PullConfig, ServiceConfig};
use ferry_testkit::samples;
use ferry_testkit::squatter::{NOBODY, Squatter};
use ferry_testkit::{devices, start, start_with};

/// How long a squatter keeps listening for bytes after the attempt failed.
const SETTLE: Duration = Duration::from_secs(2);

/// How long a refusal may take: it comes before any byte is sent, so at once. (Without the
/// check, a connection would wait on a squatter that never answers.)
const AT_ONCE: Duration = Duration::from_secs(5);

/// Whether `haystack` holds `needle`.
fn holds(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sends_nothing_to_a_loopback_port_another_user_holds() {
    let Some(squatter) =
        Squatter::bind("a_client_sends_nothing_to_a_loopback_port_another_user_holds")
    else {
        return;
    };
    let refused = tokio::time::timeout(
        AT_ONCE,
        Client::connect(squatter.addr())
            .token("s3cret")
            .into_future(),
    )
    .await
    .expect("refused at once, not left waiting on the squatter");
    match refused {
        Err(ClientError::TokenWithheld(TokenWithheld::OtherLocalUser { addr, uid, .. })) => {
            assert_eq!((addr, uid), (squatter.addr(), NOBODY));
        }
        other => panic!("expected the token withheld from user {NOBODY}, got {other:?}"),
    }
    // The opt-in for beyond loopback changes nothing here, nor does a name for the address.
    let anywhere = ClearTokens::Anywhere {
        server: LocalServer::ThisUserOrRoot,
    };
    let by_name = format!("localhost:{}", squatter.addr().port());
    let refused = tokio::time::timeout(
        AT_ONCE,
        Client::connect(by_name.as_str())
            .token("s3cret")
            .clear_tokens(anywhere)
            .into_future(),
    )
    .await
    .expect("refused at once, not left waiting on the squatter");
    assert!(
        matches!(
            refused,
            Err(ClientError::TokenWithheld(
                TokenWithheld::OtherLocalUser { .. }
            ))
        ),
        "{refused:?}"
    );
    let got = squatter.received_after(SETTLE);
    assert!(got.is_empty(), "the squatter received {} bytes", got.len());
    assert!(
        squatter.connections() >= 2,
        "the client reached the port and refused there"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_told_to_expect_that_user_sends_its_token() {
    let Some(squatter) = Squatter::bind("a_client_told_to_expect_that_user_sends_its_token") else {
        return;
    };
    let expecting = ClearTokens::LoopbackOnly {
        server: LocalServer::AlsoUser(NOBODY),
    };
    // The squatter never answers the hello: the attempt is cut short once the bytes are out.
    let connect = Client::connect(squatter.addr())
        .token("s3cret")
        .clear_tokens(expecting)
        .into_future();
    let _ = tokio::time::timeout(Duration::from_millis(500), connect).await;
    let got = squatter.received_after(Duration::from_millis(200));
    assert!(holds(&got, "s3cret"), "the expected user got the token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_sends_its_peer_token_to_no_squatter_and_the_pull_says_why() {
    let Some(squatter) = Squatter::bind("a_node_sends_its_peer_token_to_no_squatter") else {
        return;
    };
    let source = start_with(&["flex"]).await;
    let squatted = squatter.addr().to_string();
    let mut pulls = PullConfig {
        peers: PeerPolicy::Listed(vec![Peer {
            addr: squatted.clone(),
            identity: None,
        }]),
        peer_token: Some("peer-s3cret".into()),
        retries: 0,
        ..PullConfig::default()
    };
    // Without the check, the pull would wait on a squatter that never answers: not for long.
    pulls.peer_limits.idle_timeout = Duration::from_secs(2);
    let target = start(
        NodeConfig {
            devices: devices(&["flex"]),
            pulls,
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await;
    let mut from = source.client().await;
    let mut to = target.client().await;
    let key = TensorKey::new(0, "w");
    from.put(&key, &samples::plain(DType::F32, &[8, 8], 1))
        .await
        .unwrap();
    let grant = from
        .grant(&key, &to.identify().await.unwrap())
        .await
        .unwrap();
    // The target is told to pull from the squatter's address, a peer it lists.
    let pulled = tokio::time::timeout(AT_ONCE, to.pull(&squatted, &grant, &key, IfExists::Refuse))
        .await
        .expect("refused at once, not left waiting on the squatter");
    match pulled {
        Err(ClientError::Node { code, message }) => {
            assert_eq!(code, ErrorCode::PeerFailed, "{message}");
            assert!(
                message.contains(&squatted) && message.contains(&format!("user {NOBODY}")),
                "{message}"
            );
        }
        other => panic!("expected the pull refused, got {other:?}"),
    }
    let got = squatter.received_after(SETTLE);
    assert!(got.is_empty(), "the squatter received {} bytes", got.len());
    assert!(squatter.connections() >= 1, "the node reached the port");
}

/// One of this host's addresses beyond loopback: the one it would send from towards a
/// documentation address (no packet is sent), if it has a route there.
fn address_beyond_loopback() -> Option<std::net::IpAddr> {
    ["203.0.113.1:9", "192.0.2.1:9", "[2001:db8::1]:9"]
        .iter()
        .find_map(|far| {
            let bind = if far.starts_with('[') {
                "[::]:0"
            } else {
                "0.0.0.0:0"
            };
            let socket = UdpSocket::bind(bind).ok()?;
            socket.connect(far).ok()?;
            let ip = socket.local_addr().ok()?.ip();
            (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_goes_in_clear_beyond_loopback_only_with_the_opt_in() {
    let Some(ip) = address_beyond_loopback() else {
        eprintln!(
            "SKIPPED a_token_goes_in_clear_beyond_loopback_only_with_the_opt_in: this host has \
             no address beyond loopback"
        );
        return;
    };
    // This process's own listener, on every address: it records what reaches it.
    let listener = TcpListener::bind(SocketAddr::new(
        if ip.is_ipv4() {
            std::net::Ipv4Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        },
        0,
    ))
    .unwrap();
    let there = SocketAddr::new(ip, listener.local_addr().unwrap().port());
    let refused = tokio::time::timeout(
        AT_ONCE,
        Client::connect(there).token("s3cret").into_future(),
    )
    .await
    .expect("refused at once, not left waiting on the listener");
    match refused {
        Err(ClientError::TokenWithheld(TokenWithheld::BeyondLoopback { addr })) => {
            assert_eq!(addr, there);
        }
        other => panic!("expected the token withheld beyond loopback, got {other:?}"),
    }
    let said = Client::connect(there)
        .token("s3cret")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        said.contains(&there.to_string()) && said.contains("in clear") && said.contains("TLS"),
        "{said}"
    );

    // With the opt-in the token goes (and nothing was sent before it).
    let reader = std::thread::spawn(move || {
        use std::io::Read;
        let (mut stream, _) = listener.accept().unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = stream.read(&mut buf) {
            got.extend_from_slice(&buf[..n]);
        }
        got
    });
    let anywhere = ClearTokens::Anywhere {
        server: LocalServer::ThisUserOrRoot,
    };
    let connect = Client::connect(there)
        .token("s3cret")
        .clear_tokens(anywhere)
        .into_future();
    // Nobody answers the hello there: the attempt is cut short once the bytes are out.
    let _ = tokio::time::timeout(Duration::from_millis(300), connect).await;
    let got = reader.join().unwrap();
    assert!(holds(&got, "s3cret"), "the token went with the opt-in");
}
