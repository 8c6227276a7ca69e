//! What a node refuses before it trusts a peer: an empty token at start, a start beyond loopback
//! without TLS and a credential, sockets that never say hello (closed to make room at the
//! connection limit, or at the hello deadline), more connections from one address than its share,
//! a flood of wrong tokens (each refused, logged at a bounded rate), and an agent string that
//! would forge a log line (escaped), garbage hellos and refusals at a limit (logged at a bounded
//! rate), and metrics in clear beyond loopback without --insecure.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry_client::Client;
use ferry_io::connection::{Connection, ConnectionLimits};
use ferry_io::transport::Endpoint;
use ferry_proto::{DType, TensorKey};
use ferry_proto::{
    ErrorCode, FEATURES, Hello, PROTOCOL_MINOR, PROTOCOL_VERSION, Request, Response,
};
use ferry_testkit::samples;
use ferry_testkit::{LoggedServer, TestPki, assert_same, spawn_server};

use crate::ferry_server;
use crate::metrics::{free_port, sample, scrape};

#[test]
fn an_empty_token_is_refused_at_start() {
    for (args, env) in [
        (vec!["--token", ""], None),
        (vec![], Some(("FERRY_TOKEN", ""))),
        (vec!["--peer-token", ""], None),
    ] {
        let mut command = Command::new(ferry_server());
        command
            .args(["--listen", "127.0.0.1:0"])
            .args(&args)
            .env_remove("FERRY_TOKEN")
            .env_remove("FERRY_PEER_TOKEN");
        if let Some((key, value)) = env {
            command.env(key, value);
        }
        let output = command.output().expect("ferry-server runs");
        assert!(!output.status.success(), "{args:?} {env:?} started");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("is empty"), "{args:?} {env:?}: {stderr}");
    }
}

#[test]
fn a_start_beyond_loopback_without_tls_and_a_credential_is_refused_unless_insecure() {
    let pki = TestPki::new();
    pki.node("node-a");
    let files = pki.files("node-a");
    let (cert, key, ca) = (
        files.cert.to_str().unwrap(),
        files.key.to_str().unwrap(),
        files.ca.to_str().unwrap(),
    );
    let tls = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca];
    let start = |extra: &[&str]| {
        Command::new(ferry_server())
            .args(["--listen", "0.0.0.0:0", "--device", "flex"])
            .args(extra)
            .env_remove("FERRY_TOKEN")
            .env_remove("FERRY_PEER_TOKEN")
            .env_remove("FERRY_NODE_TLS_CERT")
            .env_remove("FERRY_NODE_TLS_KEY")
            .env_remove("FERRY_NODE_TLS_CA")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Neither, a credential without TLS, TLS without a credential: refused, saying what lacks.
    for (extra, lacks) in [
        (vec![], "no TLS and no credential"),
        (vec!["--token", "t0k"], "no TLS"),
        (tls.to_vec(), "no credential"),
    ] {
        let refused = start(&extra).wait_with_output().unwrap();
        assert!(!refused.status.success(), "{extra:?} started");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(stderr.contains("--insecure"), "{stderr}");
        assert!(stderr.contains(&format!("with {lacks}:")), "{stderr}");
    }
    // Under TLS the credential is a grant to a certificate's name; a token is refused there,
    // saying what to give instead.
    let with_token: Vec<&str> = tls.iter().copied().chain(["--token", "t0k"]).collect();
    let refused = start(&with_token).wait_with_output().unwrap();
    assert!(!refused.status.success(), "TLS with a token started");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("tokens are not taken under TLS"),
        "{stderr}"
    );
    assert!(stderr.contains("--grant NAME=SCOPES"), "{stderr}");
    // With both, or told --insecure, it starts (and warns of what it is exposed to).
    let both: Vec<&str> = tls.iter().copied().chain(["--grant", "me=all"]).collect();
    for extra in [
        &["--insecure"][..],
        &["--token", "t0k", "--insecure"][..],
        &both[..],
    ] {
        let mut child = start(extra);
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(
            line.starts_with("listening on 0.0.0.0:"),
            "{extra:?}: {line}"
        );
        child.kill().unwrap();
        let _ = child.wait();
    }
    // A TLS flag alone is a usage error (the three go together), on loopback too.
    let partial = Command::new(ferry_server())
        .args(["--listen", "127.0.0.1:0", "--tls-cert", cert])
        .output()
        .unwrap();
    assert!(!partial.status.success());
    let stderr = String::from_utf8_lossy(&partial.stderr);
    assert!(stderr.contains("required arguments"), "{stderr}");
}

#[test]
fn metrics_beyond_loopback_are_refused_unless_insecure() {
    let start = |extra: &[&str]| {
        let metrics = format!("0.0.0.0:{}", free_port());
        Command::new(ferry_server())
            .args(["--listen", "127.0.0.1:0", "--device", "flex"])
            .args(["--metrics", &metrics])
            .args(extra)
            .env_remove("FERRY_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let refused = start(&[]).wait_with_output().unwrap();
    assert!(
        !refused.status.success(),
        "metrics in clear beyond loopback started"
    );
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("refusing to serve metrics") && stderr.contains("--insecure"),
        "{stderr}"
    );
    let mut child = start(&["--insecure"]);
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("listening on 127.0.0.1:"), "{line}");
    child.kill().unwrap();
    let _ = child.wait();
}

/// That the node closes `socket` (within 10 s): whatever it said before, then the end.
fn assert_closed_by_the_node(mut socket: TcpStream) {
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut said = Vec::new();
    let read = socket.read_to_end(&mut said);
    assert!(
        read.is_ok() || read.is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "a silent socket left open"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holds_at_most_its_share_of_connections() {
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let node = spawn_server(
        ferry_server(),
        &[
            "--device",
            "flex",
            "--max-connections-per-address",
            "4",
            // Long enough that no silent socket is closed for its silence during the test.
            "--hello-timeout",
            "60",
            "--metrics",
            &metrics,
        ],
        None,
    );
    // Four silent sockets from this address fill its share (not the node: 1024 slots); each
    // client that speaks takes the slot of the oldest (closed to make room, once it has been
    // silent a moment).
    let silent: Vec<TcpStream> = (0..4)
        .map(|_| TcpStream::connect(node.addr.as_str()).unwrap())
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut speakers = Vec::new();
    for _ in 0..4 {
        let mut client = Client::connect(node.addr.as_str()).await.unwrap();
        assert_eq!(client.stat().await.unwrap().devices.len(), 1);
        speakers.push(client);
    }
    for socket in silent {
        assert_closed_by_the_node(socket);
    }
    // Four that spoke fill it: a newcomer is refused, saying why.
    let refused = Client::connect(node.addr.as_str()).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::LimitExceeded), "{refused}");
    assert!(
        refused.to_string().contains("from one address"),
        "{refused}"
    );
    // One closes: its slot comes back once the node sees it go (well before any deadline).
    drop(speakers.pop());
    let mut client = None;
    for _ in 0..40 {
        if let Ok(connected) = Client::connect(node.addr.as_str()).await {
            client = Some(connected);
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let mut client = client.expect("the closed connection's slot came back within a second");
    assert_eq!(client.stat().await.unwrap().devices.len(), 1);
    let full = Client::connect(node.addr.as_str()).await.unwrap_err();
    assert_eq!(full.code(), Some(ErrorCode::LimitExceeded), "{full}");
    drop(speakers);
    let text = tokio::task::spawn_blocking(move || scrape(port))
        .await
        .unwrap();
    let refused = sample(
        &text,
        &[
            "ferry_connections_refused_total{",
            "reason=\"address_limit\"",
        ],
    );
    assert!(refused >= Some(1.0), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockets_that_never_say_hello_do_not_keep_a_client_out() {
    let node = spawn_server(
        ferry_server(),
        &[
            "--device",
            "flex",
            "--max-connections",
            "16",
            "--hello-timeout",
            "2",
        ],
        None,
    );
    let silent: Vec<TcpStream> = (0..16)
        .map(|_| TcpStream::connect(node.addr.as_str()).unwrap())
        .collect();
    // Every slot is held by a socket that never spoke: a client that does speak takes the
    // oldest one's slot, at once (well within the hello deadline), and the others' after it.
    let mut clients = Vec::new();
    for _ in 0..3 {
        let mut client = Client::connect(node.addr.as_str()).await.unwrap();
        assert_eq!(client.stat().await.unwrap().devices.len(), 1);
        clients.push(client);
    }
    assert_eq!(
        clients[0].stat().await.unwrap().connections,
        16,
        "three silent ones made room"
    );
    // The node closes every silent socket itself: the oldest made room, the rest at the
    // deadline.
    for socket in silent {
        assert_closed_by_the_node(socket);
    }
}

/// Sends one `Hello` with `token` and `agent`; the node's answer.
async fn hello(addr: &str, token: &str, agent: &str) -> Response {
    let stream = Endpoint::parse(addr).connect(None).await.unwrap();
    let mut conn = Connection::new(stream, ConnectionLimits::default());
    conn.write_request(&Request::Hello(Hello {
        major: PROTOCOL_VERSION,
        minor: PROTOCOL_MINOR,
        features: FEATURES.iter().map(|f| f.to_string()).collect(),
        token: Some(token.into()),
        agent: agent.to_string(),
    }))
    .await
    .unwrap();
    conn.read_response().await.unwrap()
}

#[test]
fn wrong_tokens_are_each_refused_and_logged_at_a_bounded_rate_with_the_agent_escaped() {
    let node = LoggedServer::start(
        ferry_server(),
        &["--device", "flex"],
        &[("FERRY_TOKEN", "the-right-token")],
    );
    let addr = node.addr.clone();
    const GUESSES: usize = 300;
    let started = Instant::now();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        for i in 0..GUESSES {
            let answer = hello(&addr, &format!("guess-{i}"), "evil\nFORGED line").await;
            assert!(
                matches!(&answer, Response::Error(e) if e.code == ErrorCode::AuthRefused),
                "{answer:?}"
            );
        }
        // The right token still opens the node.
        assert!(matches!(
            hello(&addr, "the-right-token", "ferry-test").await,
            Response::Welcome(_)
        ));
    });
    let elapsed = started.elapsed();
    let log = node.stop();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("authentication refused"))
        .collect();
    // One line per second at most (the first at once), however many guesses.
    let bound = 2 + elapsed.as_secs() as usize;
    assert!(
        !refusals.is_empty() && refusals.len() <= bound,
        "{} refusal lines for {GUESSES} guesses in {elapsed:?} (at most {bound}):\n{log}",
        refusals.len()
    );
    assert!(
        refusals.iter().all(|l| l.contains(r"evil\nFORGED line")),
        "the agent is escaped:\n{log}"
    );
    assert!(
        refusals.iter().all(|l| l.contains("peer=127.0.0.1:")),
        "the line names who was refused:\n{log}"
    );
    assert!(
        !log.lines().any(|l| l.starts_with("FORGED")),
        "no forged line:\n{log}"
    );
}

/// Every line a stranger can cause is bounded in rate (issue 29, item 8): hundreds of
/// connections that send garbage for a hello, and hundreds refused at the per-address limit,
/// each get their answer, and the log holds a line a second of each at most.
#[test]
fn garbage_hellos_and_refusals_at_a_limit_are_logged_at_a_bounded_rate() {
    use std::io::Write;
    const EACH: usize = 300;
    let node = LoggedServer::start(
        ferry_server(),
        &["--device", "flex", "--max-connections-per-address", "2"],
        &[],
    );
    let started = Instant::now();
    for _ in 0..EACH {
        let mut socket = TcpStream::connect(&node.addr).unwrap();
        socket.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        // The node closes it: no frame of ours.
        let mut rest = Vec::new();
        socket
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let _ = socket.read_to_end(&mut rest);
    }
    // The address's two slots held by clients that said hello: every newcomer is refused.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let _held = (
            Client::connect(node.addr.as_str()).await.unwrap(),
            Client::connect(node.addr.as_str()).await.unwrap(),
        );
        for _ in 0..EACH {
            let refused = Client::connect(node.addr.as_str()).await;
            assert_eq!(
                refused.map(drop).err().and_then(|e| e.code()),
                Some(ErrorCode::LimitExceeded)
            );
        }
    });
    let elapsed = started.elapsed();
    let log = node.stop();
    let bound = 2 + elapsed.as_secs() as usize;
    for line in [
        "connection closed before its hello",
        "connection refused: at the per-address limit",
    ] {
        let count = log.lines().filter(|l| l.contains(line)).count();
        assert!(
            (1..=bound).contains(&count),
            "{count} lines of {line:?} for {EACH} in {elapsed:?} (at most {bound}):\n{log}"
        );
    }
}

/// A connection with `token` to the node at `addr`.
async fn connect_as(addr: &str, token: &str) -> Client {
    Client::connect(addr).token(token).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_credential_allows_its_scopes_only() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens");
    std::fs::write(
        &file,
        "# who may do what\nread reader-token\nread,write writer-token\npeer peer-token\n",
    )
    .unwrap();
    let node = spawn_server(
        ferry_server(),
        &["--device", "flex", "--token-file", file.to_str().unwrap()],
        None,
    );
    let key = TensorKey::new(0, "w");
    let data = samples::plain(DType::F32, &[16, 16], 3);
    let mut writer = connect_as(&node.addr, "writer-token").await;
    writer.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    assert_same(&writer.get(&key).await.unwrap(), &data, "w");

    let mut reader = connect_as(&node.addr, "reader-token").await;
    assert_same(&reader.get(&key).await.unwrap(), &data, "w");
    assert_eq!(reader.list(None).await.unwrap().len(), 1);
    reader.stat().await.unwrap();
    for refused in [
        reader
            .put(&TensorKey::new(0, "v"), &data)
            .await
            .err()
            .unwrap(),
        reader.delete(&key).await.err().unwrap(),
    ] {
        assert_eq!(refused.code(), Some(ErrorCode::AuthRefused), "{refused}");
        assert!(refused.to_string().contains("needs write"), "{refused}");
    }
    // The refused requests changed nothing, and the connection carries on.
    assert_same(&reader.get(&key).await.unwrap(), &data, "w");

    // A peer credential serves other nodes, and reads nothing itself.
    let mut peer = connect_as(&node.addr, "peer-token").await;
    let refused = peer.get(&key).await.err().unwrap();
    assert_eq!(refused.code(), Some(ErrorCode::AuthRefused), "{refused}");
    assert!(refused.to_string().contains("needs read"), "{refused}");

    // Tokens that are no credential's are refused at hello.
    for wrong in ["", "writer", "read reader-token"] {
        assert!(
            Client::connect(node.addr.as_str())
                .token(wrong)
                .await
                .is_err()
        );
    }
}
