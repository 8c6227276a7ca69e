//! Fair shares of a node: one credential's holder, from however many loopback addresses, cannot
//! take every connection slot from other identities; and a client failing request after request
//! cannot grow the node's log by a line per request.

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_client::ErrorCode;
use ferry_proto::{
    CapabilityToken, DType, ErrorReply, NodeId, Request, Response, TensorKey, WireDType, tensor,
};
use ferry_server::{NodeConfig, ServiceConfig, parse_token_file};
use ferry_testkit::samples;
use ferry_testkit::{TestNode, start};

use crate::hostile::Raw;

/// Connects to `node` from `source` and says hello with `token`; the answer.
async fn hello_from(node: SocketAddr, source: Ipv4Addr, token: &str) -> (Raw, Response) {
    Raw::connect_from(node, source)
        .await
        .say_hello(Some(token))
        .await
}

/// A node with one flex device, the reader's and the admin's tokens, and `max_connections`.
async fn node_with_tokens(max_connections: usize) -> TestNode {
    start(
        NodeConfig {
            devices: ferry_testkit::devices(&["flex"]),
            ..NodeConfig::default()
        },
        ServiceConfig {
            credentials: parse_token_file(
                "read reader-token\nread,write writer-token\nall admin-token\n",
            )
            .unwrap(),
            max_connections,
            ..ServiceConfig::default()
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_token_from_many_loopback_addresses_leaves_slots_to_other_credentials() {
    const SLOTS: usize = 32;
    let node = node_with_tokens(SLOTS).await;
    let mut held = Vec::new();
    let refusal = loop {
        assert!(held.len() < SLOTS, "the reader took every slot");
        // 127.0.0.1 to 127.0.0.5 in turn: all this host's, counted as one address.
        let source = Ipv4Addr::new(127, 0, 0, 1 + (held.len() % 5) as u8);
        match hello_from(node.addr, source, "reader-token").await {
            (from, Response::Welcome(_)) => held.push(from),
            (_, Response::Error(reply)) => break reply,
            (_, other) => panic!("a hello answered {other:?}"),
        }
    };
    let ErrorReply { code, message } = refusal;
    assert_eq!(code, ErrorCode::LimitExceeded, "{message}");
    assert!(
        message.contains("connections of one credential"),
        "{message}"
    );
    assert_eq!(held.len(), SLOTS - SLOTS / 4, "three quarters, by default");

    for source in [Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::new(127, 0, 0, 200)] {
        let (mut admin, welcome) = hello_from(node.addr, source, "admin-token").await;
        assert!(
            matches!(welcome, Response::Welcome(_)),
            "the admin from {source}: {welcome:?}"
        );
        let listing = admin.ask(&Request::List { device: None }).await;
        assert!(matches!(listing, Some(Response::Listing(_))), "{listing:?}");
    }
    // A slot the reader gives back is its own again.
    drop(held.pop());
    ferry_testkit::eventually_async(
        "the reader connects again",
        Duration::from_secs(5),
        || async {
            matches!(
                hello_from(node.addr, Ipv4Addr::LOCALHOST, "reader-token")
                    .await
                    .1,
                Response::Welcome(_)
            )
        },
    )
    .await;
    drop(held);
    node.shutdown().await;
}

/// Log lines written anywhere on this thread, kept for the test to read.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// On one thread (a current-thread runtime) so that the node's sessions log to this test's
/// subscriber alone.
#[tokio::test]
async fn a_client_failing_request_after_request_cannot_grow_the_log_by_a_line_each() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _logging = tracing::subscriber::set_default(subscriber);

    let node = node_with_tokens(64).await;
    let (mut client, welcome) = hello_from(node.addr, Ipv4Addr::LOCALHOST, "writer-token").await;
    assert!(matches!(welcome, Response::Welcome(_)), "{welcome:?}");
    let long_name = "n".repeat(1024);
    let missing = Request::Get {
        key: TensorKey::new(0, long_name.clone()),
    };
    // The writer's token lacks `peer`.
    let out_of_scope = Request::Fetch {
        capability: CapabilityToken::new("c".repeat(64)),
        node_id: NodeId::new("n".repeat(200)),
        offset: 0,
    };
    let mut bad_meta = tensor::meta_of(&samples::plain(DType::F32, &[2], 1))
        .unwrap()
        .to_wire();
    bad_meta.dtype = WireDType {
        tag: 99,
        quant: None,
    };
    let bad_put = Request::Put {
        device: 0,
        name: Some(long_name),
        meta: bad_meta,
        overwrite: false,
    };
    let kinds = [
        (&missing, ErrorCode::NotFound),
        (&out_of_scope, ErrorCode::AuthRefused),
        (&bad_put, ErrorCode::BadRequest),
    ];
    // 2,000 requests at least, and over more than one interval of the rate limit, so that a
    // later line carries the count of those left out.
    let started = Instant::now();
    let mut asked = 0;
    while asked < 2_000 || started.elapsed() < Duration::from_millis(1_500) {
        let (request, expected) = kinds[asked % kinds.len()];
        match client.ask(request).await {
            Some(Response::Error(ErrorReply { code, .. })) => assert_eq!(code, expected),
            other => panic!("{} answered {other:?}", request.name()),
        }
        asked += 1;
    }
    node.shutdown().await;

    let log = captured.text();
    assert!(
        log.len() < 8 * 1024,
        "{asked} failed requests wrote {} bytes of log:\n{}",
        log.len(),
        &log[..log.len().min(4096)]
    );
    assert!(log.contains("transfer failed"), "{log}");
    assert!(log.contains("put refused"), "{log}");
    let left_out = log
        .lines()
        .filter_map(|line| line.split("refused_since_last_line=").nth(1))
        .filter_map(|count| count.split_whitespace().next()?.parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    assert!(left_out > 0, "no line counts the ones left out:\n{log}");
    assert!(
        !log.contains(&"n".repeat(200)),
        "a client's long name is cut short in the log"
    );
}
