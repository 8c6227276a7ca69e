//! Bad input against a live node: each gets its typed error, the node stays up, a second client
//! still puts and gets bit-exact, and nothing half-registered is left behind.

use ferry_server::NodeLimits;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use ferry_client::{Client, ErrorCode};
use ferry_proto::frame::{self, FrameKind};
use ferry_proto::{
    ContentHash, DType, ErrorReply, FEATURES, Hello, PROTOCOL_MINOR, PROTOCOL_VERSION, Request,
    Response, TensorData, TensorKey, Token, Transfer, WireDType, control, tensor,
};
use ferry_server::TENSOR_OVERHEAD;
use ferry_server::{IfExists, NodeConfig, ServiceConfig};
use ferry_testkit::samples;
use ferry_testkit::{TestNode, assert_same, eventually, start, start_with};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A raw connection that speaks frames by hand.
pub(crate) struct Raw {
    pub(crate) stream: TcpStream,
    buf: BytesMut,
}

impl Raw {
    pub(crate) async fn connect(node: &TestNode) -> Raw {
        Raw {
            stream: TcpStream::connect(node.addr).await.unwrap(),
            buf: BytesMut::new(),
        }
    }

    /// Connects to `node` from `source` (any port): a connection from one of loopback's many
    /// addresses.
    pub(crate) async fn connect_from(
        node: std::net::SocketAddr,
        source: std::net::Ipv4Addr,
    ) -> Raw {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind((source, 0).into()).unwrap();
        Raw {
            stream: socket.connect(node).await.unwrap(),
            buf: BytesMut::new(),
        }
    }

    pub(crate) async fn hello(node: &TestNode, token: Option<&str>) -> (Raw, Response) {
        Raw::connect(node).await.say_hello(token).await
    }

    /// Says hello with `token`; the connection and the node's reply.
    pub(crate) async fn say_hello(mut self, token: Option<&str>) -> (Raw, Response) {
        let welcome = self
            .ask(&Request::Hello(Hello {
                major: PROTOCOL_VERSION,
                minor: PROTOCOL_MINOR,
                features: FEATURES.iter().map(|f| f.to_string()).collect(),
                token: token.map(Token::from),
                agent: "hostile-test".into(),
            }))
            .await
            .expect("a reply to hello");
        (self, welcome)
    }

    /// Sends `request`; the answer, or `None` once the node closed the connection.
    pub(crate) async fn ask(&mut self, request: &Request) -> Option<Response> {
        self.send(&control::encode_request(request).unwrap()).await;
        self.response().await
    }

    pub(crate) async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    /// The next response, or `None` once the node closed the connection.
    pub(crate) async fn response(&mut self) -> Option<Response> {
        loop {
            if let Some(frame) = frame::parse(&mut self.buf, 1 << 24).unwrap() {
                assert_eq!(frame.kind, FrameKind::Control);
                return Some(control::decode_response(&frame.body).unwrap());
            }
            let read =
                tokio::time::timeout(Duration::from_secs(10), self.stream.read_buf(&mut self.buf))
                    .await
                    .expect("the node answers or closes");
            match read {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            }
        }
    }

    /// The node's error reply, then the connection closes.
    pub(crate) async fn expect_fatal(&mut self, code: ErrorCode) -> String {
        let message = self.expect_error(code).await;
        assert!(
            self.response().await.is_none(),
            "the node closes the connection"
        );
        message
    }

    pub(crate) async fn expect_error(&mut self, code: ErrorCode) -> String {
        match self.response().await {
            Some(Response::Error(ErrorReply { code: got, message })) => {
                assert_eq!(got, code, "{message}");
                message
            }
            other => panic!("expected an {code:?} error, got {other:?}"),
        }
    }
}

pub(crate) fn put_request(device: u32, name: &str, meta: ferry_proto::WireMeta) -> Vec<u8> {
    control::encode_request(&Request::Put {
        device,
        name: Some(name.into()),
        meta,
        overwrite: false,
    })
    .unwrap()
}

/// A node with one flex device and `service`'s limits.
async fn flex_node(service: ServiceConfig) -> TestNode {
    start(
        NodeConfig {
            devices: ferry_testkit::devices(&["flex"]),
            ..NodeConfig::light()
        },
        service,
    )
    .await
}

/// After each attack: a second client puts and gets bit-exact and the node holds only its tensor.
pub(crate) async fn node_still_serves(node: &TestNode) {
    serves(node.client().await).await;
}

/// `client`'s node still takes a put, gives it back bit-exact and leaves nothing behind.
async fn serves(mut client: Client) {
    let data = samples::quantized(&samples::schemes()[6].1, &[3, 5, 7], 11);
    client
        .put(&TensorKey::new(0, "after"), &data)
        .await
        .unwrap();
    let key = TensorKey::new(0, "after");
    assert_same(&client.get(&key).await.unwrap(), &data, "after the attack");
    client.delete(&key).await.unwrap();
    let left = client.list(None).await.unwrap();
    assert!(left.is_empty(), "leftovers: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_instead_of_a_frame() {
    let node = start_with(&["flex"]).await;
    let mut raw = Raw::connect(&node).await;
    raw.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let message = raw.expect_fatal(ErrorCode::Protocol).await;
    assert!(message.contains("magic"), "{message}");
    node_still_serves(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_of_another_major_version_is_refused_clearly() {
    let node = start_with(&["flex"]).await;
    let mut raw = Raw::connect(&node).await;
    let mut hello = control::encode_request(&Request::Stat).unwrap();
    hello[4] = PROTOCOL_VERSION + 1;
    raw.send(&hello).await;
    let message = raw.expect_fatal(ErrorCode::VersionMismatch).await;
    assert!(message.contains("version"), "{message}");
    node_still_serves(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lying_frame_length_is_refused_before_allocation() {
    let node = start_with(&["flex"]).await;
    let (mut raw, _) = Raw::hello(&node, None).await;
    let mut frame = control::encode_request(&Request::Stat).unwrap();
    frame[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    raw.send(&frame[..16]).await;
    let message = raw.expect_fatal(ErrorCode::Protocol).await;
    assert!(message.contains("exceeds the maximum"), "{message}");
    node_still_serves(&node).await;
}

/// A control frame larger than any request is refused from its header (issue 29, item 7): a
/// welcomed peer cannot make the node hold a 16 MiB control frame (before, it waited for the
/// body, and held it whole); the node answers at once, without the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_frame_larger_than_any_request_is_refused_from_its_header() {
    let node = start_with(&["flex"]).await;
    let (mut raw, _) = Raw::hello(&node, None).await;
    let mut frame = control::encode_request(&Request::Stat).unwrap();
    let declared: u32 = 4 << 20; // within the 16 MiB payload limit, far past any request
    frame[8..12].copy_from_slice(&declared.to_le_bytes());
    raw.send(&frame[..16]).await;
    let answered = Instant::now();
    let message = raw.expect_fatal(ErrorCode::Protocol).await;
    assert!(message.contains("exceeds the maximum"), "{message}");
    assert!(
        answered.elapsed() < Duration::from_secs(5),
        "answered from the header, not after the idle timeout"
    );
    node_still_serves(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quantized_payload_one_byte_short_or_long_is_refused_with_both_lengths() {
    let node = start_with(&["flex"]).await;
    let (mut raw, _) = Raw::hello(&node, None).await;
    let data = samples::quantized(&samples::schemes()[1].1, &[8, 64], 2);
    let meta = tensor::meta_of(&data).unwrap().to_wire();
    let expected = meta.byte_len;
    for actual in [expected - 1, expected + 1] {
        let mut lying = meta.clone();
        lying.byte_len = actual;
        raw.send(&put_request(0, "q", lying)).await;
        // Refused before any chunk is sent, and the connection stays usable.
        let message = raw.expect_error(ErrorCode::BadRequest).await;
        assert!(message.contains("[8, 64]"), "{message}");
        assert!(message.contains(&expected.to_string()), "{message}");
        assert!(message.contains(&actual.to_string()), "{message}");
        assert!(message.contains("qfloat"), "{message}");
    }
    // The declared length is right but the stream is one byte short and then ends.
    raw.send(&put_request(0, "q", meta)).await;
    assert_eq!(raw.response().await, Some(Response::Ready));
    let bytes = data.as_bytes();
    raw.send(&frame::encode_chunk(0, &bytes[..bytes.len() - 1]))
        .await;
    drop(raw);
    node_still_serves(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_past_the_declared_length_or_out_of_order_or_corrupt_is_refused() {
    let node = start_with(&["flex"]).await;
    let data = samples::plain(DType::F32, &[4, 4], 5);
    let meta = tensor::meta_of(&data).unwrap().to_wire();
    let bytes = data.as_bytes().to_vec();

    let mut longer = bytes.clone();
    longer.push(0);
    let mut corrupt = frame::encode_chunk(0, &bytes);
    let last = corrupt.len() - 1;
    corrupt[last] ^= 0x40;
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (frame::encode_chunk(0, &longer), "runs past"),
        (frame::encode_chunk(4, &bytes[4..]), "expected offset 0"),
        (corrupt, "checksum"),
        (
            control::encode_request(&Request::Stat).unwrap(),
            "expected a chunk frame",
        ),
    ];
    for (chunk, words) in cases {
        let (mut raw, _) = Raw::hello(&node, None).await;
        raw.send(&put_request(0, "t", meta.clone())).await;
        assert_eq!(raw.response().await, Some(Response::Ready));
        raw.send(&chunk).await;
        let message = raw.expect_fatal(ErrorCode::Protocol).await;
        assert!(message.contains(words), "{words}: {message}");
    }
    node_still_serves(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_dtype_code_is_a_typed_error() {
    let node = start_with(&["flex"]).await;
    let (mut raw, _) = Raw::hello(&node, None).await;
    let data = samples::plain(DType::F32, &[2], 1);
    let mut meta = tensor::meta_of(&data).unwrap().to_wire();
    meta.dtype = WireDType {
        tag: 99,
        quant: None,
    };
    raw.send(&put_request(0, "t", meta)).await;
    let message = raw.expect_error(ErrorCode::BadRequest).await;
    assert!(message.contains("unknown dtype tag code 99"), "{message}");
    node_still_serves(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_source_with_control_characters_is_refused_before_any_connection() {
    let node = start_with(&["flex"]).await;
    let (mut raw, _) = Raw::hello(&node, None).await;
    for source in ["127.0.0.1:1\nFORGED line", "", &"h".repeat(2000)] {
        let pull = Request::Pull {
            source: source.to_string(),
            capability: "c".into(),
            src: TensorKey::new(0, "w"),
            dst_device: 0,
            dst_name: None,
            overwrite: false,
            content_hash: Some(ContentHash::from_digest([0; 32])),
        };
        raw.send(&control::encode_request(&pull).unwrap()).await;
        let message = raw.expect_error(ErrorCode::BadRequest).await;
        assert!(message.contains("not a source address"), "{message}");
        assert!(!message.contains('\n'), "shown escaped: {message}");
    }
    node_still_serves(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_closed_mid_upload_registers_nothing() {
    let node = start_with(&["flex"]).await;
    let (mut raw, _) = Raw::hello(&node, None).await;
    let data = samples::plain(DType::F64, &[64, 33], 9);
    raw.send(&put_request(
        0,
        "cut",
        tensor::meta_of(&data).unwrap().to_wire(),
    ))
    .await;
    assert_eq!(raw.response().await, Some(Response::Ready));
    let bytes = data.as_bytes();
    raw.send(&frame::encode_chunk(0, &bytes[..1000])).await;
    // Half a frame, then the connection goes away.
    raw.send(&frame::encode_chunk(1000, &bytes[1000..2000])[..500])
        .await;
    drop(raw);
    node_still_serves(&node).await;
    let mut client = node.client().await;
    assert!(client.stat().await.unwrap().transfers_failed >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_mid_frame_is_dropped_after_the_idle_timeout() {
    let mut service = ServiceConfig::default();
    service.limits.idle_timeout = Duration::from_millis(300);
    let node = flex_node(service).await;
    let (mut raw, _) = Raw::hello(&node, None).await;
    raw.send(&control::encode_request(&Request::Stat).unwrap()[..10])
        .await;
    let message = raw.expect_fatal(ErrorCode::Protocol).await;
    assert!(message.contains("sent nothing"), "{message}");
    node_still_serves(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_before_any_command_runs() {
    let node = flex_node(ServiceConfig {
        credentials: vec![ferry_server::Credential::full("s3cret").unwrap()],
        ..ServiceConfig::default()
    })
    .await;
    for token in [None, Some("wrong")] {
        let (mut raw, reply) = Raw::hello(&node, token).await;
        let Response::Error(ErrorReply { code, .. }) = reply else {
            panic!("expected a refusal, got {reply:?}");
        };
        assert_eq!(code, ErrorCode::AuthRefused);
        // Disconnected: a command sent now is never answered.
        raw.send(&control::encode_request(&Request::List { device: None }).unwrap())
            .await;
        assert!(raw.response().await.is_none());
        let refused = Client::connect(node.addr)
            .token_if_any(token.map(Token::from))
            .await;
        assert_eq!(ferry_testkit::code_of(refused), ErrorCode::AuthRefused);
    }
    let mut client = Client::connect(node.addr).token("s3cret").await.unwrap();
    let data = samples::plain(DType::U16, &[3, 5, 7], 4);
    client.put(&TensorKey::new(0, "ok"), &data).await.unwrap();
    let back = client.get(&TensorKey::new(0, "ok")).await.unwrap();
    assert_same(&back, &data, "with the right token");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_refuse_before_allocation_and_connections_over_the_limit_are_told() {
    let node = start(
        NodeConfig {
            devices: ferry_testkit::devices(&["flex"]),
            limits: NodeLimits {
                max_tensor_bytes: 1024,
                // 1500 bytes of payload beside one tensor's bookkeeping.
                memory_limit: Some(1500 + TENSOR_OVERHEAD),
                ..NodeLimits::default()
            },
            ..NodeConfig::light()
        },
        ServiceConfig {
            max_connections: 2,
            ..ServiceConfig::default()
        },
    )
    .await;
    let mut client = node.client().await;
    let big = samples::plain(DType::F32, &[300], 1);
    assert_eq!(
        ferry_testkit::code_of(client.put(&TensorKey::new(0, "big"), &big).await),
        ErrorCode::LimitExceeded
    );
    let fits = samples::plain(DType::F32, &[200], 1);
    client.put(&TensorKey::new(0, "a"), &fits).await.unwrap();
    // 800 bytes held: another 800 (and its bookkeeping) would pass the budget.
    let over = client.put(&TensorKey::new(0, "b"), &fits).await;
    assert_eq!(ferry_testkit::code_of(over), ErrorCode::LimitExceeded);
    client.delete(&TensorKey::new(0, "a")).await.unwrap();
    client.put(&TensorKey::new(0, "b"), &fits).await.unwrap();

    let _second = node.client().await;
    let third = Client::connect(node.addr).await;
    assert_eq!(ferry_testkit::code_of(third), ErrorCode::LimitExceeded);
    // The accepted clients are not starved.
    let back = client.get(&TensorKey::new(0, "b")).await.unwrap();
    assert_same(&back, &fits, "under the limit");
    node.shutdown().await;
}

/// A small deterministic generator, so a failure replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Valid frames of every kind a client sends, to corrupt one field of at a time.
fn valid_frames() -> Vec<Vec<u8>> {
    let data = samples::quantized(&samples::schemes()[3].1, &[4, 32], 5);
    let meta = tensor::meta_of(&data).unwrap().to_wire();
    let key = TensorKey::new(0, "w");
    let mut frames: Vec<Vec<u8>> = [
        Request::Put {
            device: 0,
            name: Some("w".into()),
            meta: meta.clone(),
            overwrite: true,
        },
        Request::Get { key: key.clone() },
        Request::Copy {
            src: key.clone(),
            dst_device: 1,
            dst_name: None,
            remove_source: false,
            overwrite: true,
        },
        Request::Delete { key: key.clone() },
        Request::List { device: None },
        Request::Stat,
        Request::Grant {
            key,
            audience: "x".into(),
        },
        Request::Fetch {
            capability: "c".into(),
            node_id: "n".into(),
            offset: 0,
        },
    ]
    .iter()
    .map(|r| control::encode_request(r).unwrap())
    .collect();
    frames.push(frame::encode_chunk(0, data.as_bytes()));
    frames.push(
        frame::RegionDescriptor {
            len: data.as_bytes().len() as u64,
            crc32c: 0,
        }
        .frame(),
    );
    frames
}

/// One attack: a valid frame with one field corrupted, random bytes, or a valid frame cut short.
fn hostile_frame(rng: &mut Rng, valid: &[Vec<u8>]) -> Vec<u8> {
    let mut frame = valid[rng.below(valid.len())].clone();
    match rng.below(6) {
        // One header field: magic, version, kind, flags, length, checksum.
        0 => {
            let field = [0usize, 4, 5, 6, 8, 12][rng.below(6)];
            frame[field] ^= 1 << rng.below(8);
        }
        // The length set to something else entirely.
        1 => {
            let len = [0u32, 1, 7, 23, u32::MAX, 1 << 24, (1 << 24) + 1][rng.below(7)];
            frame[8..12].copy_from_slice(&len.to_le_bytes());
        }
        // A body byte changed, and the checksum fixed up so that the body itself is judged.
        2 if frame.len() > frame::HEADER_LEN => {
            let at = frame::HEADER_LEN + rng.below(frame.len() - frame::HEADER_LEN);
            frame[at] = rng.next() as u8;
            let crc = crc32c::crc32c(&frame[frame::HEADER_LEN..]);
            frame[12..16].copy_from_slice(&crc.to_le_bytes());
        }
        // A body cut short, or extended, with the header re-made to match.
        3 => {
            let body = &frame[frame::HEADER_LEN..];
            let mut body = body[..rng.below(body.len() + 1)].to_vec();
            if rng.below(2) == 0 {
                body.extend((0..rng.below(64)).map(|_| rng.next() as u8));
            }
            let kind = FrameKind::try_from(frame[5]).unwrap_or(FrameKind::Control);
            frame = frame::encode(kind, &body);
        }
        // Pure noise.
        4 => frame = (0..rng.below(80)).map(|_| rng.next() as u8).collect(),
        // A valid frame, cut off mid-way (the connection then closes).
        _ => frame.truncate(rng.below(frame.len())),
    }
    frame
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_corrupted_frames_leave_the_node_serving_and_empty() {
    let mut service = ServiceConfig::default();
    service.limits.idle_timeout = Duration::from_millis(200);
    let node = start(
        NodeConfig {
            devices: ferry_testkit::devices(&["flex", "flex"]),
            ..NodeConfig::light()
        },
        service,
    )
    .await;
    let valid = valid_frames();
    let mut rng = Rng(0x5EED_F00D_1234_5678);
    let mut sent = 0;
    // Each connection says hello properly, then sends attacks until the node hangs up or a
    // handful went through; every reply must be a well-formed frame (or the close).
    while sent < 3000 {
        let (mut raw, welcome) = Raw::hello(&node, None).await;
        assert!(matches!(welcome, Response::Welcome(_)));
        for _ in 0..rng.below(12) + 1 {
            let attack = hostile_frame(&mut rng, &valid);
            sent += 1;
            if raw.stream.write_all(&attack).await.is_err() {
                break;
            }
        }
        let _ = raw.stream.shutdown().await;
        // Drain what the node says until it closes: only whole, valid frames may come back.
        loop {
            match frame::parse(&mut raw.buf, 1 << 24) {
                Ok(Some(frame)) => {
                    assert_eq!(frame.kind, FrameKind::Control, "the node only answers");
                    control::decode_response(&frame.body).expect("a valid answer");
                    continue;
                }
                Ok(None) => {}
                Err(e) => panic!("the node sent a broken frame: {e}"),
            }
            match tokio::time::timeout(Duration::from_secs(5), raw.stream.read_buf(&mut raw.buf))
                .await
            {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(_)) => {}
                Err(_) => panic!("the node neither answered nor closed"),
            }
        }
    }
    // Valid puts among the attacks may have registered whole tensors under `w`; nothing else.
    let mut client = node.client().await;
    for info in client.list(None).await.unwrap() {
        assert_eq!(
            info.key.name, "w",
            "only whole tensors under the attacked name"
        );
        client.delete(&info.key).await.unwrap();
    }
    node_still_serves(&node).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_header_then_silence_is_dropped_after_the_idle_timeout() {
    let mut service = ServiceConfig::default();
    service.limits.idle_timeout = Duration::from_millis(300);
    let node = flex_node(service).await;
    let (mut raw, _) = Raw::hello(&node, None).await;
    let frame = control::encode_request(&Request::Stat).unwrap();
    raw.send(&frame[..frame::HEADER_LEN]).await;
    let message = raw.expect_fatal(ErrorCode::Protocol).await;
    assert!(message.contains("sent nothing"), "{message}");
    node_still_serves(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_so_they_cannot_hold_every_slot() {
    // Long enough that a loaded machine opens the third connection before the first two are
    // closed as idle.
    let node = flex_node(ServiceConfig {
        max_connections: 2,
        keepalive: Duration::from_secs(2),
        ..ServiceConfig::default()
    })
    .await;
    let _idle_a = node.client().await;
    let _idle_b = node.client().await;
    let refused = Client::connect(node.addr).await;
    assert_eq!(ferry_testkit::code_of(refused), ErrorCode::LimitExceeded);
    // The two idle ones are closed after the keepalive; their slots are free again.
    let deadline = Instant::now() + Duration::from_secs(10);
    let client = loop {
        match Client::connect(node.addr).await {
            Ok(client) => break client,
            Err(e) => assert!(Instant::now() < deadline, "still refused: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    serves(client).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_flood_is_refused_while_accepted_clients_carry_on() {
    let node = flex_node(ServiceConfig {
        max_connections: 4,
        ..ServiceConfig::default()
    })
    .await;
    let mut worker = node.client().await;
    let addr = node.addr;
    let flood = tokio::spawn(async move {
        let mut refused = 0;
        let mut held = Vec::new();
        for _ in 0..300 {
            match Client::connect(addr).await {
                Ok(client) => held.push(client),
                Err(e) => {
                    assert_eq!(e.code(), Some(ErrorCode::LimitExceeded), "{e}");
                    refused += 1;
                }
            }
        }
        (refused, held.len())
    });
    for i in 0..20 {
        let data = samples::plain(DType::F32, &[64, 64], i);
        let key = TensorKey::new(0, format!("t{i}"));
        worker
            .put(&TensorKey::new(0, &key.name), &data)
            .await
            .unwrap();
        assert_same(&worker.get(&key).await.unwrap(), &data, "during the flood");
        worker.delete(&key).await.unwrap();
    }
    let (refused, held) = flood.await.unwrap();
    assert_eq!(held, 3, "the slots left next to the working client");
    assert_eq!(refused, 297);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_clients_together_cannot_push_a_device_past_its_budget() {
    const BUDGET: u64 = 1 << 20;
    let node = start(
        NodeConfig {
            devices: ferry_testkit::devices(&["flex"]),
            limits: NodeLimits {
                memory_limit: Some(BUDGET),
                ..NodeLimits::default()
            },
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await;
    // 24 clients each putting 96 KiB at once: 2.25 MiB asked of a 1 MiB budget.
    let mut tasks = Vec::new();
    for i in 0..24u64 {
        let addr = node.addr;
        tasks.push(tokio::spawn(async move {
            let mut client = Client::connect(addr).await.unwrap();
            let data = samples::plain(DType::F32, &[96, 256], i);
            match client.put(&TensorKey::new(0, format!("t{i}")), &data).await {
                Ok(info) => Some(info.bytes),
                Err(e) => {
                    assert_eq!(e.code(), Some(ErrorCode::LimitExceeded), "{e}");
                    None
                }
            }
        }));
    }
    let mut stored = 0;
    let mut refused = 0;
    for task in tasks {
        match task.await.unwrap() {
            Some(bytes) => stored += bytes,
            None => refused += 1,
        }
    }
    assert!(
        stored <= BUDGET,
        "{stored} bytes held past a {BUDGET}-byte budget"
    );
    assert!(refused > 0 && stored > 0);
    let mut client = node.client().await;
    let held = client.stat().await.unwrap().devices[0].bytes_held;
    assert_eq!(held, stored);
    node.shutdown().await;
}

/// Every field of a `Stats` answer set, so that one missing after a trip shows.
fn full_stats(agent: &str) -> ferry_proto::NodeStats {
    ferry_proto::NodeStats {
        agent: agent.into(),
        devices: vec![ferry_proto::DeviceStats {
            index: 3,
            backend: "flex".into(),
            device: "Cpu".into(),
            tensors: 4,
            bytes_held: 5,
            memory_limit: Some(6),
            holds_measured: 7,
            holds_exact: 8,
            largest_tensor: Some(9),
        }],
        transfers_done: 10,
        connections: 1,
        transfer_policy: "auto".into(),
        node_id: "older".into(),
        unix_socket: Some("/run/ferry.sock".into()),
        shared_memory: true,
        resident_bytes: 11,
        hashes_pending: 12,
        pool_bytes: 13,
        uptime_ms: 14,
        ..Default::default()
    }
}

/// Peers of two minors, both ways: a node of every older minor answers `stat` in its own
/// encoding, and this client reads it whole (what that minor lacks at its default); a client of
/// an older minor gets this node's answer in its encoding, which it reads to the last byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stat_answer_crosses_minors_both_ways() {
    for older in 0..PROTOCOL_MINOR {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sent = full_stats("ferry-server/older");
        let answer = sent.clone();
        let node = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.unwrap();
            let mut conn = ferry_io::Connection::new(socket, Default::default());
            assert!(matches!(
                conn.read_request().await.unwrap(),
                Some(Request::Hello(_))
            ));
            let welcome = Response::Welcome(ferry_proto::Welcome {
                major: PROTOCOL_VERSION,
                minor: older,
                features: FEATURES.iter().map(|f| f.to_string()).collect(),
                agent: "ferry-server/older".into(),
                max_body: frame::DEFAULT_MAX_BODY as u64,
                chunk_size: 4 << 20,
            });
            conn.write_response(&welcome).await.unwrap();
            // From here on, what a node of that minor writes.
            conn.set_peer_minor(older);
            assert_eq!(conn.read_request().await.unwrap(), Some(Request::Stat));
            conn.write_response(&Response::Stats(answer)).await.unwrap();
            conn
        });
        let mut client = Client::connect(addr).await.unwrap();
        let got = client.stat().await.unwrap();
        // What that minor carries of the answer, and nothing newer.
        let body = control::encode_response_for(&Response::Stats(sent.clone()), older).unwrap();
        let Response::Stats(expected) =
            control::decode_response_from(&body[frame::HEADER_LEN..], older).unwrap()
        else {
            panic!("not stats");
        };
        assert_eq!(got, expected, "minor {older}");
        assert_eq!(got.agent, sent.agent, "minor {older}");
        let uptime = if older >= 7 { sent.uptime_ms } else { 0 };
        assert_eq!(got.uptime_ms, uptime, "minor {older}: uptime since minor 7");
        assert_eq!(
            got.devices[0].largest_tensor,
            (older >= 6).then_some(9),
            "minor {older}"
        );
        drop(node.await.unwrap());
    }

    // The other way: a client of the previous minor, against a node of this one.
    let real = start_with(&["flex"]).await;
    let older = PROTOCOL_MINOR - 1;
    let socket = TcpStream::connect(real.addr).await.unwrap();
    let mut conn = ferry_io::Connection::new(socket, Default::default());
    conn.write_request(&Request::Hello(Hello {
        major: PROTOCOL_VERSION,
        minor: older,
        features: FEATURES.iter().map(|f| f.to_string()).collect(),
        token: None,
        agent: "ferry-client/older".into(),
    }))
    .await
    .unwrap();
    let Response::Welcome(welcome) = conn.read_response().await.unwrap() else {
        panic!("not welcomed");
    };
    assert_eq!(welcome.minor, PROTOCOL_MINOR);
    // An older client reads every answer as of its own minor: to the last byte, or it fails.
    conn.set_peer_minor(older);
    conn.write_request(&Request::Stat).await.unwrap();
    let Response::Stats(stats) = conn.read_response().await.unwrap() else {
        panic!("no stats");
    };
    assert_eq!(stats.devices.len(), 1);
    assert_eq!(stats.node_id, real.node.node_id().as_str());
    if older < 7 {
        assert_eq!(stats.uptime_ms, 0, "minor {older} has no uptime");
    }
    // A client of this minor reads it.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let now = real.client().await.stat().await.unwrap();
    assert!(now.uptime_ms >= 5, "{}", now.uptime_ms);
    real.shutdown().await;
}

// Memory budgets and limits under concurrency and against peers that hold on to them.

const MIB: u64 = 1 << 20;

/// An f32 tensor of exactly `mib` MiB, its values made from `seed`.
fn f32_mib(mib: usize, seed: u64) -> TensorData {
    samples::plain(DType::F32, &[mib * 256, 1024], seed)
}

/// A node with one device of each of `specs`, a budget of `limit` bytes per device and
/// `service`'s limits.
async fn budget_node(specs: &[&str], limit: u64, service: ServiceConfig) -> TestNode {
    start(
        NodeConfig {
            devices: ferry_testkit::devices(specs),
            limits: NodeLimits {
                memory_limit: Some(limit),
                ..NodeLimits::default()
            },
            ..NodeConfig::light()
        },
        service,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_in_node_copies_never_push_a_device_past_its_budget() {
    const LIMIT: u64 = 64 * MIB;
    let node = budget_node(&["flex", "flex"], LIMIT, ServiceConfig::default()).await;
    // 4 KiB and 40 MiB: a device holds one large tensor next to small ones, never two, so a copy
    // of the large source onto a device that already holds a large one must be refused.
    let small = Arc::new(samples::plain(DType::F32, &[1024], 1));
    let large = Arc::new(f32_mib(40, 2));
    let src = TensorKey::new(0, "src");
    let mut writer = node.client().await;
    writer
        .put(&TensorKey::new(0, "src"), &*small)
        .if_exists(IfExists::Replace)
        .await
        .unwrap();

    let end = Instant::now() + Duration::from_secs(3);
    let writes = tokio::spawn({
        let (small, large) = (small.clone(), large.clone());
        async move {
            let mut writes = 0u32;
            while Instant::now() < end {
                let data = if writes.is_multiple_of(2) {
                    &large
                } else {
                    &small
                };
                // Never refused: an overwrite holds the old tensor until the new one replaces
                // it, and one large with one small fits device 0 (an in-node copy between two
                // flex devices is native and reads no host copy out of the source).
                writer
                    .put(&TensorKey::new(0, "src"), &**data)
                    .if_exists(IfExists::Replace)
                    .await
                    .unwrap();
                writes += 1;
            }
            writes
        }
    });
    let large_len = large.as_bytes().len() as u64;
    let mut copiers = Vec::new();
    for i in 0..4 {
        let (addr, src) = (node.addr, src.clone());
        copiers.push(tokio::spawn(async move {
            let mut client = Client::connect(addr).await.unwrap();
            let dst = format!("dst-{i}");
            // Copies of the large and of the small version, refused copies, and copies whose
            // source was overwritten between the node's look at it and its read (refused as
            // `Changed` rather than mixing two versions).
            let (mut large, mut small, mut refused, mut changed) = (0u32, 0u32, 0u32, 0u32);
            while Instant::now() < end {
                match client
                    .transfer(
                        &src,
                        &TensorKey::new(1, &dst),
                        Transfer::Copy,
                        IfExists::Replace,
                    )
                    .await
                {
                    Ok(info) if info.bytes == large_len => large += 1,
                    Ok(_) => small += 1,
                    Err(e) => match e.code() {
                        Some(ErrorCode::LimitExceeded) => refused += 1,
                        Some(ErrorCode::Changed) => changed += 1,
                        _ => panic!("copy to {dst}: {e}"),
                    },
                }
            }
            [large, small, refused, changed]
        }));
    }

    // Every sample, on both devices: what is claimed and what is registered stay in the budget.
    let budgets = [0, 1].map(|d| node.node.device(d).unwrap());
    let mut peak = [0u64; 2];
    let mut sampled = 0u32;
    while Instant::now() < end {
        for (d, budget) in budgets.iter().enumerate() {
            let used = budget.memory_used();
            assert!(
                used <= LIMIT,
                "device {d} claims {used} of a {LIMIT}-byte budget"
            );
            peak[d] = peak[d].max(used);
        }
        for device in node.node.stats().await.unwrap().devices {
            assert!(
                device.bytes_held <= LIMIT,
                "device {} holds {} bytes past a {LIMIT}-byte budget",
                device.index,
                device.bytes_held
            );
        }
        sampled += 1;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let writes = writes.await.unwrap();
    let mut totals = [0u32; 4];
    for copier in copiers {
        for (total, n) in totals.iter_mut().zip(copier.await.unwrap()) {
            *total += n;
        }
    }
    let [large_copies, small_copies, refused, changed] = totals;
    eprintln!(
        "{writes} writes, {large_copies} large and {small_copies} small copies, {refused} \
         refused, {changed} changed, {sampled} samples, peaks {peak:?}"
    );
    // The race ran: both versions were copied, and copies were refused for want of room.
    assert!(writes >= 4, "only {writes} writes");
    assert!(large_copies > 0 && small_copies > 0, "{totals:?}");
    assert!(refused > 0, "no copy was refused: {totals:?}");
    assert!(peak[1] > large_len, "device 1 never held the large tensor");
    assert!(sampled > 10);

    // Every target is one of the two versions, whole; and once everything is quiet, each
    // device claims exactly its tensors with their overhead: refused and changed copies gave
    // back all they claimed.
    let mut client = node.client().await;
    let targets = client.list(Some(1)).await.unwrap();
    assert_eq!(targets.len(), 4, "{targets:?}");
    for info in &targets {
        let back = client.get(&info.key).await.unwrap();
        let expected = if back.as_bytes().len() as u64 == large_len {
            &large
        } else {
            &small
        };
        assert_same(&back, expected, &info.key.to_string());
    }
    let stats = client.stat().await.unwrap();
    for (d, budget) in budgets.iter().enumerate() {
        let listed = client.list(Some(d as u32)).await.unwrap();
        // The running totals `stat` reports survived every overwrite and refusal.
        let held: u64 = listed.iter().map(|i| i.bytes).sum();
        let device = &stats.devices[d];
        assert_eq!(
            (device.tensors, device.bytes_held),
            (listed.len() as u64, held),
            "device {d}"
        );
        let registered: u64 = listed.iter().map(|i| i.bytes + TENSOR_OVERHEAD).sum();
        eventually(
            &format!("device {d} claims only its tensors"),
            Duration::from_secs(5),
            || budget.memory_used() == registered,
        )
        .await;
    }
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_counts_each_tensor_and_max_tensors_caps_them() {
    // Empty tensors cost no payload, only their overhead: a budget still bounds how many.
    const BUDGET: u64 = MIB;
    let node = budget_node(&["flex"], BUDGET, ServiceConfig::default()).await;
    let mut client = node.client().await;
    let empty = samples::plain(DType::F32, &[0], 0);
    let mut stored = 0u64;
    let refusal = loop {
        match client
            .put(&TensorKey::new(0, format!("e{stored}")), &empty)
            .await
        {
            Ok(info) => assert_eq!(info.bytes, 0),
            Err(e) => break e,
        }
        stored += 1;
        assert!(
            stored <= BUDGET / TENSOR_OVERHEAD,
            "{stored} empty tensors in a {BUDGET}-byte budget"
        );
    };
    assert_eq!(refusal.code(), Some(ErrorCode::LimitExceeded), "{refusal}");
    assert!(refusal.to_string().contains("budget"), "{refusal}");
    // Exactly as many as the overhead divides the budget into.
    assert_eq!(stored, BUDGET / TENSOR_OVERHEAD);
    assert_eq!(node.node.device(0).unwrap().memory_used(), BUDGET);
    let device = &client.stat().await.unwrap().devices[0];
    assert_eq!((device.tensors, device.bytes_held), (stored, 0));
    node.shutdown().await;

    // The tensor cap, with no byte budget at all.
    let node = start(
        NodeConfig {
            devices: ferry_testkit::devices(&["flex"]),
            limits: NodeLimits {
                max_tensors: Some(10),
                ..NodeLimits::default()
            },
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await;
    let mut client = node.client().await;
    let data = samples::plain(DType::F32, &[16], 3);
    for i in 0..10 {
        client
            .put(&TensorKey::new(0, format!("t{i}")), &data)
            .await
            .unwrap();
    }
    let over = client
        .put(&TensorKey::new(0, "t10"), &data)
        .await
        .unwrap_err();
    assert_eq!(over.code(), Some(ErrorCode::LimitExceeded), "{over}");
    assert!(over.to_string().contains("--max-tensors"), "{over}");
    // A copy within the device makes a tensor too.
    let copy = client
        .copy(&TensorKey::new(0, "t0"), &TensorKey::new(0, "c"))
        .await;
    assert_eq!(ferry_testkit::code_of(copy), ErrorCode::LimitExceeded);
    // Refusals hold no slot: one delete lets exactly one put through.
    client.delete(&TensorKey::new(0, "t3")).await.unwrap();
    client.put(&TensorKey::new(0, "t10"), &data).await.unwrap();
    let again = client.put(&TensorKey::new(0, "t11"), &data).await;
    assert_eq!(ferry_testkit::code_of(again), ErrorCode::LimitExceeded);
    let back = client.get(&TensorKey::new(0, "t10")).await.unwrap();
    assert_same(&back, &data, "the put after a delete");
    // At the cap, a tensor that replaces another takes its slot: overwrites and copies onto an
    // existing name still go through.
    let newer = samples::plain(DType::F32, &[16], 4);
    client
        .put(&TensorKey::new(0, "t0"), &newer)
        .if_exists(IfExists::Replace)
        .await
        .unwrap();
    client
        .transfer(
            &TensorKey::new(0, "t0"),
            &TensorKey::new(0, "t1"),
            Transfer::Copy,
            IfExists::Replace,
        )
        .await
        .unwrap();
    assert_same(
        &client.get(&TensorKey::new(0, "t1")).await.unwrap(),
        &newer,
        "copied onto an existing name at the cap",
    );
    assert_eq!(client.stat().await.unwrap().devices[0].tensors, 10);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_upload_gives_its_reservation_back() {
    const SIZE: u64 = 32 * MIB;
    let mut service = ServiceConfig::default();
    service.limits.idle_timeout = Duration::from_secs(1);
    service.limits.min_rate = 16 * MIB;
    // 1 s of idle timeout plus 32 MiB at 16 MiB/s.
    let deadline = Duration::from_secs(3);
    assert_eq!(service.limits.payload_deadline(SIZE), Some(deadline));
    let node = budget_node(&["flex"], 48 * MIB, service).await;
    let budget = node.node.device(0).unwrap();
    let data = f32_mib(32, 7);
    assert_eq!(data.as_bytes().len() as u64, SIZE);

    let (mut raw, _) = Raw::hello(&node, None).await;
    let meta = tensor::meta_of(&data).unwrap().to_wire();
    raw.send(&put_request(0, "slow", meta)).await;
    assert_eq!(raw.response().await, Some(Response::Ready));
    let ready = Instant::now();
    assert_eq!(
        budget.memory_used(),
        SIZE + TENSOR_OVERHEAD,
        "claimed before a byte arrived"
    );
    // Two such tensors do not fit: while the trickler holds its claim, an honest put is refused.
    let mut client = node.client().await;
    let refused = client.put(&TensorKey::new(0, "fast"), &data).await;
    assert_eq!(ferry_testkit::code_of(refused), ErrorCode::LimitExceeded);

    // 64 bytes every half second: within the idle timeout each time, far below the rate.
    let bytes = data.as_bytes();
    let mut offset = 0;
    let reply = loop {
        tokio::select! {
            // The node's answer first, whenever it is there: a chunk written after the node
            // closed could make the kernel reset the connection before the answer is read.
            biased;
            reply = raw.response() => break reply,
            () = tokio::time::sleep(Duration::from_millis(500)) => {
                assert!(
                    ready.elapsed() < Duration::from_secs(8),
                    "the trickler is still connected after {:?}",
                    ready.elapsed()
                );
                let chunk = frame::encode_chunk(offset as u64, &bytes[offset..offset + 64]);
                if raw.stream.write_all(&chunk).await.is_ok() {
                    offset += 64;
                }
            }
        }
    };
    let dropped_after = ready.elapsed();
    // Dropped for its whole-payload deadline, not for silence, and told why.
    match reply {
        Some(Response::Error(ErrorReply { code, message })) => {
            assert_eq!(code, ErrorCode::Protocol, "{message}");
            assert!(message.contains("deadline"), "{message}");
            assert!(message.contains(&SIZE.to_string()), "{message}");
        }
        other => panic!("expected the node's reason, got {other:?}"),
    }
    assert!(
        dropped_after >= deadline - Duration::from_millis(300),
        "dropped after {dropped_after:?}, before its {deadline:?} deadline"
    );
    assert!(offset >= 4 * 64, "only {offset} bytes trickled");
    assert!(
        raw.response().await.is_none(),
        "the node closes the connection"
    );

    eventually(
        "the trickler's claim is given back",
        Duration::from_secs(5),
        || budget.memory_used() == 0,
    )
    .await;
    client.put(&TensorKey::new(0, "fast"), &data).await.unwrap();
    let back = client.get(&TensorKey::new(0, "fast")).await.unwrap();
    assert_same(&back, &data, "the put after the trickler");
    let names: Vec<String> = client
        .list(None)
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.key.name)
        .collect();
    assert_eq!(
        names,
        ["fast"],
        "nothing of the trickled upload was registered"
    );
    node.shutdown().await;
}

/// A get of `key` (of `size` bytes) on a connection of its own, whose reader takes the
/// tensor's description and then reads nothing more: the node's send of the payload stalls.
async fn stalled_get(node: &TestNode, key: &TensorKey, size: u64) -> Raw {
    let (mut raw, _) = Raw::hello(node, None).await;
    raw.send(&control::encode_request(&Request::Get { key: key.clone() }).unwrap())
        .await;
    match raw.response().await {
        Some(Response::Tensor { info, .. }) => assert_eq!(info.bytes, size),
        other => panic!("expected the tensor's description, got {other:?}"),
    }
    raw
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_get_holds_its_bytes_in_the_budget_until_its_deadline() {
    const SIZE: u64 = 40 * MIB;
    let mut service = ServiceConfig::default();
    service.limits.idle_timeout = Duration::from_secs(1);
    service.limits.min_rate = 64 * MIB;
    let node = budget_node(&["flex"], 64 * MIB, service).await;
    let budget = node.node.device(0).unwrap();
    let data = f32_mib(40, 5);
    // Made before the stall begins: the refusal below must come while the stall lasts.
    let other = f32_mib(40, 6);
    let key = TensorKey::new(0, "t");
    let mut client = node.client().await;
    client.put(&TensorKey::new(0, "t"), &data).await.unwrap();

    // The description arrives; then the reader reads nothing more. 40 MiB is far more than
    // loopback socket buffers take, so the node's send blocks.
    let mut raw = stalled_get(&node, &key, SIZE).await;
    let stalled = Instant::now();
    client.delete(&key).await.unwrap();
    // Unregistered, but its bytes are still being sent: still counted.
    assert_eq!(budget.memory_used(), SIZE + TENSOR_OVERHEAD);
    assert_eq!(client.stat().await.unwrap().devices[0].bytes_held, 0);
    let refused = client.put(&TensorKey::new(0, "u"), &other).await;
    assert_eq!(ferry_testkit::code_of(refused), ErrorCode::LimitExceeded);

    eventually(
        "the stalled send is dropped and gives its bytes back",
        Duration::from_secs(8),
        || budget.memory_used() == 0,
    )
    .await;
    let held_for = stalled.elapsed();
    assert!(
        held_for >= Duration::from_millis(800),
        "given back after {held_for:?}, before the 1 s idle timeout"
    );
    client.put(&TensorKey::new(0, "u"), &other).await.unwrap();
    let back = client.get(&TensorKey::new(0, "u")).await.unwrap();
    assert_same(&back, &other, "the put after the stall");

    // The stalled reader got part of the tensor, then the close.
    loop {
        let read = tokio::time::timeout(Duration::from_secs(5), raw.stream.read_buf(&mut raw.buf))
            .await
            .expect("the node closed the stalled connection");
        if matches!(read, Ok(0) | Err(_)) {
            break;
        }
    }
    assert!(
        (raw.buf.len() as u64) < SIZE,
        "{} bytes reached the stalled reader",
        raw.buf.len()
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ndarray_read_copy_is_counted() {
    const LARGE: u64 = 40 * MIB;
    const SMALL: u64 = 16 * MIB;
    let node = budget_node(&["ndarray"], 64 * MIB, ServiceConfig::default()).await;
    let budget = node.node.device(0).unwrap();
    let mut client = node.client().await;
    let large = f32_mib(40, 8);
    let large_key = TensorKey::new(0, "large");
    client
        .put(&TensorKey::new(0, "large"), &large)
        .await
        .unwrap();
    assert_eq!(budget.memory_used(), LARGE + TENSOR_OVERHEAD);

    // NdArray cannot lend its storage: a get reads a host copy out, which would not fit.
    let refused = client.get(&large_key).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::LimitExceeded), "{refused}");
    let message = refused.to_string();
    assert!(message.contains("budget"), "{message}");
    assert!(message.contains(&LARGE.to_string()), "{message}");
    assert_eq!(
        budget.memory_used(),
        LARGE + TENSOR_OVERHEAD,
        "no copy is left"
    );

    // A 16 MiB tensor fits next to it, but its copy does not (40 + 16 + 16 MiB).
    let small = f32_mib(16, 9);
    let small_key = TensorKey::new(0, "small");
    client
        .put(&TensorKey::new(0, "small"), &small)
        .await
        .unwrap();
    assert_eq!(
        ferry_testkit::code_of(client.get(&small_key).await),
        ErrorCode::LimitExceeded
    );
    // Alone, it and its copy fit.
    client.delete(&large_key).await.unwrap();
    let back = client.get(&small_key).await.unwrap();
    assert_same(&back, &small, "a get with room for its copy");
    eventually(
        "the copy is given back once sent",
        Duration::from_secs(5),
        || budget.memory_used() == SMALL + TENSOR_OVERHEAD,
    )
    .await;
    node.shutdown().await;
}

/// Readers that stall their gets on a copying backend (NdArray: each get is a host copy, held
/// until its payload deadline) hold at most their share of the budget, half of it: the next
/// reader is told to try again (`Busy`), and a writer still has room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_readers_of_copies_cannot_starve_a_writer() {
    const SIZE: u64 = 12 * MIB;
    let mut service = ServiceConfig::default();
    service.limits.idle_timeout = Duration::from_secs(30);
    service.limits.min_rate = 1;
    let node = budget_node(&["ndarray"], 64 * MIB, service).await;
    let budget = node.node.device(0).unwrap();
    let mut client = node.client().await;
    let key = TensorKey::new(0, "read");
    client.put(&key, &f32_mib(12, 10)).await.unwrap();

    // Two readers take a copy each and read nothing of it: 24 MiB, all but 8 MiB of the share
    // copies may hold (32 MiB).
    let mut stalled = Vec::new();
    for _ in 0..2 {
        stalled.push(stalled_get(&node, &key, SIZE).await);
    }
    assert_eq!(budget.memory_used(), 3 * SIZE + TENSOR_OVERHEAD);
    // A third would fit the budget (48 of 64 MiB) but not the share: it is told to try again
    // (without the share, a third and a fourth reader would leave the writer 4 MiB).
    let busy = client.get(&key).await.unwrap_err();
    assert_eq!(busy.code(), Some(ErrorCode::Busy), "{busy}");
    assert!(busy.to_string().contains("try again"), "{busy}");
    assert_eq!(
        budget.memory_used(),
        3 * SIZE + TENSOR_OVERHEAD,
        "no copy left"
    );

    // The writer's room: what the readers could not take.
    let written = f32_mib(15, 11);
    client
        .put(&TensorKey::new(0, "written"), &written)
        .await
        .unwrap();
    drop(client);
    let mut fresh = node.client().await;
    drop(stalled);
    eventually(
        "the stalled copies are given back when their readers go",
        Duration::from_secs(5),
        || budget.memory_used() == SIZE + 15 * MIB + 2 * TENSOR_OVERHEAD,
    )
    .await;
    let back = fresh.get(&TensorKey::new(0, "written")).await.unwrap();
    assert_same(&back, &written, "the writer's tensor");
    node.shutdown().await;
}

/// A pull from a copying backend (NdArray: each fetch is a host copy) whose sending share is
/// held by stalled readers is answered `Busy`, and the target tries again (as after a dropped
/// link) rather than fail the copy: it lands, bit-exact, once the readers go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_told_busy_by_a_source_whose_share_of_copies_is_taken_tries_again() {
    // Larger than loopback's socket buffers can absorb, so that a stalled reader's copy stays.
    const SIZE: u64 = 32 * MIB;
    let mut service = ServiceConfig::default();
    service.limits.idle_timeout = Duration::from_secs(30);
    service.limits.min_rate = 1;
    let source = budget_node(&["ndarray"], 160 * MIB, service).await;
    let mut config = NodeConfig {
        devices: ferry_testkit::devices(&["flex"]),
        ..NodeConfig::light()
    };
    // Up to 50 + 100 + ... + 1600 ms of waiting between fetches.
    config.pulls.retries = 6;
    config.pulls.retry_backoff = Duration::from_millis(50);
    let target = start(config, ServiceConfig::default()).await;
    let key = TensorKey::new(0, "w");
    let data = f32_mib(32, 12);
    let mut src = source.client().await;
    src.put(&key, &data).await.unwrap();
    // Two stalled readers hold 64 MiB of the 80 MiB share: a fetch's copy fits the budget (128
    // of 160 MiB) but not the share.
    let mut stalled = Vec::new();
    for _ in 0..2 {
        stalled.push(stalled_get(&source, &key, SIZE).await);
    }
    let busy = src.get(&key).await.unwrap_err();
    assert_eq!(busy.code(), Some(ErrorCode::Busy), "{busy}");

    let mut dst = target.client().await;
    let addr = source.addr.to_string();
    let how = ferry_testkit::how(&addr, 0);
    let copy = ferry_testkit::copy_keys(&mut src, &mut dst, std::slice::from_ref(&key), &how);
    let readers_go = async {
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(
            target.node.list(Some(0)).await.unwrap().is_empty(),
            "nothing lands while the share is taken"
        );
        drop(stalled);
    };
    let (copied, ()) = tokio::join!(copy, readers_go);
    let stored = copied.unwrap().into_iter().next().unwrap();
    let stored = stored.unwrap_or_else(|e| panic!("the pull gave up on a busy source: {e}"));
    assert_eq!(stored.path, ferry_proto::TransferPath::Pull);
    assert_same(
        &dst.get(&stored.key).await.unwrap(),
        &data,
        "pulled after Busy",
    );
    source.shutdown().await;
    target.shutdown().await;
}

/// The name and the bytes of the `i`th of many tiny tensors: its own index, so that any mixup
/// between names shows.
fn tiny(i: usize) -> (String, TensorData) {
    let bytes = u32::try_from(i).unwrap().to_le_bytes().to_vec();
    (format!("t{i:06}"), TensorData::new(bytes, [4]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_tensors_list_and_copy_as_a_device() {
    const COUNT: usize = 100_000;
    const COPY_CLIENTS: usize = 4;
    let node = start_with(&["flex", "flex"]).await;
    let started = Instant::now();
    // In process, a few at a time, so the device worker always has the next one queued.
    let mut inserts = Vec::new();
    for part in 0..4 {
        let node = node.node.clone();
        inserts.push(tokio::spawn(async move {
            for i in (part..COUNT).step_by(4) {
                let (name, data) = tiny(i);
                node.insert(&TensorKey::new(0, &name), data, IfExists::Refuse)
                    .await
                    .unwrap();
            }
        }));
    }
    for insert in inserts {
        insert.await.unwrap();
    }
    let inserted = started.elapsed();

    let mut client = node.client().await;
    let listed = client.list(Some(0)).await.unwrap();
    let keys: Vec<TensorKey> = listed.iter().map(|i| i.key.clone()).collect();
    let expected: Vec<TensorKey> = (0..COUNT).map(|i| TensorKey::new(0, tiny(i).0)).collect();
    assert!(keys == expected, "not every tensor, or not sorted by name");
    assert!(listed.iter().all(|i| i.bytes == 4));
    let (page, next) = client.list_page(Some(0), None, 10).await.unwrap();
    let names: Vec<String> = page.into_iter().map(|i| i.key.name).collect();
    let first: Vec<String> = (0..10).map(|i| tiny(i).0).collect();
    assert_eq!(names, first);
    assert_eq!(next, Some(TensorKey::new(0, "t000009")));
    let listing = started.elapsed();

    // The old, unpaged listing cannot hold them: refused with the count and the way out.
    let (mut raw, _) = Raw::hello(&node, None).await;
    for device in [Some(0), None] {
        raw.send(&control::encode_request(&Request::List { device }).unwrap())
            .await;
        let message = raw.expect_error(ErrorCode::LimitExceeded).await;
        assert!(message.contains(&COUNT.to_string()), "{message}");
        assert!(message.contains("ListPage"), "{message}");
    }

    // As `ferry cp NODE/0 NODE/1` does it: the listing, then one copy per key; here from a few
    // clients at once, each with its share of the keys, so that a debug build keeps up.
    let keys = Arc::new(keys);
    let mut copies = Vec::new();
    for part in 0..COPY_CLIENTS {
        let (addr, keys) = (node.addr, keys.clone());
        copies.push(tokio::spawn(async move {
            let mut client = Client::connect(addr).await.unwrap();
            for key in keys.iter().skip(part).step_by(COPY_CLIENTS) {
                let info = client
                    .transfer(key, &key.on(1), Transfer::Copy, IfExists::Refuse)
                    .await
                    .unwrap();
                assert_eq!(info.key, TensorKey::new(1, key.name.clone()));
            }
        }));
    }
    for copy in copies {
        copy.await.unwrap();
    }
    let copied = started.elapsed();
    // A new connection: the first one sat idle through the copies, which may have outlasted the
    // node's keepalive.
    let mut client = node.client().await;
    let targets: Vec<String> = client
        .list(Some(1))
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.key.name)
        .collect();
    assert!(
        targets.iter().eq(keys.iter().map(|k| &k.name)),
        "device 1 does not hold the same {COUNT} names"
    );
    let sample: Vec<usize> = (0..COUNT).step_by(997).chain([COUNT - 1]).collect();
    let sample_keys: Vec<TensorKey> = sample
        .iter()
        .map(|&i| TensorKey::new(1, tiny(i).0))
        .collect();
    for (&i, back) in sample
        .iter()
        .zip(client.get_batch(&sample_keys).await.unwrap())
    {
        assert_same(&back.unwrap(), &tiny(i).1, &tiny(i).0);
    }
    eprintln!(
        "{COUNT} tensors: inserted in {inserted:?}, listed by {listing:?}, copied by \
         {copied:?}, checked by {:?}",
        started.elapsed()
    );
    node.shutdown().await;
}

/// The next number of a xorshift64* sequence: enough randomness for a seeded history, with the
/// seed printed so that a failing one can be replayed.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// The `Welcome` announces the body size the connection takes once welcomed (what a client may
/// send), not the small frames it took before the hello (issue 29, item 10).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_welcome_announces_the_body_size_taken_after_the_hello() {
    let node = flex_node(ServiceConfig::default()).await;
    let client = node.client().await;
    let taken = ServiceConfig::default().limits.max_body as u64;
    assert!(taken > 64 << 10, "more than the hello's frames");
    assert_eq!(client.welcome().max_body, taken);
    node.shutdown().await;
}

/// One local user's silent sockets cannot lock another out of a loopback node (issue 29, item
/// 5): every slot of the address held by silent sockets, each reopened as soon as the node
/// closes it, and a client of the same address still gets in, every time (within a few tries),
/// while the node-wide limit is far. An address whose slots all said hello still refuses a
/// newcomer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sockets_of_one_address_give_way_to_a_client_of_that_address() {
    const SLOTS: usize = 4;
    let node = flex_node(ServiceConfig {
        max_connections_per_address: std::num::NonZeroUsize::new(SLOTS).unwrap(),
        hello_timeout: Duration::from_secs(60),
        ..ServiceConfig::default()
    })
    .await;
    let addr = node.addr;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reopened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let attackers: Vec<_> = (0..SLOTS)
        .map(|_| {
            let (stop, reopened) = (stop.clone(), reopened.clone());
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let Ok(mut socket) = TcpStream::connect(addr).await else {
                        continue;
                    };
                    // Silent until the node closes it (to make room), then at once again.
                    let mut byte = [0u8; 1];
                    let _ = socket.read(&mut byte).await;
                    reopened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            })
        })
        .collect();
    // The attackers hold every slot first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A client gets in, every time: at once, or after a refusal or two where it arrived as the
    // attackers' own newcomers had every slot spoken for (before, it was refused for as long
    // as the attack lasted).
    let mut attempts = 0;
    for i in 0..10 {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut client = loop {
            attempts += 1;
            match Client::connect(addr).await {
                Ok(client) => break client,
                // Refused where every silent slot was already closing, or closed itself where
                // its hello came late on a loaded machine: it tries again.
                Err(e) => {
                    assert!(Instant::now() < deadline, "connection {i}: locked out: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        client.stat().await.unwrap();
    }
    println!("10 clients in, {attempts} attempts");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(
        reopened.load(std::sync::atomic::Ordering::Relaxed) >= 10,
        "each client made room by closing a silent socket"
    );
    for attacker in &attackers {
        attacker.abort();
    }
    for attacker in attackers {
        let _ = attacker.await;
    }

    // Every slot held by a client that said hello: a newcomer is refused, nothing evicted.
    let mut speakers = Vec::new();
    for _ in 0..SLOTS {
        speakers.push(
            eventually_connected(addr)
                .await
                .expect("the silent sockets are gone"),
        );
    }
    let refused = Client::connect(addr).await;
    assert_eq!(
        refused.map(drop).err().and_then(|e| e.code()),
        Some(ErrorCode::LimitExceeded)
    );
    for speaker in &mut speakers {
        speaker.stat().await.unwrap();
    }
    node.shutdown().await;
}

/// A client of `addr`, once one is let in (within 5 s).
async fn eventually_connected(addr: std::net::SocketAddr) -> Option<Client> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok(client) = Client::connect(addr).await {
            return Some(client);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Silent sockets and clients that speak race for four slots, in a seeded random history: a
/// speaker is served or turned away, never left hanging; the node never serves more than its
/// limit; and once the race is over every slot comes back, so neither eviction, refusal nor a
/// close before the hello leaks a permit or a place in the queue of those awaiting a hello.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sockets_and_speakers_racing_for_slots_leak_none() {
    race_for_slots(ServiceConfig {
        max_connections: SLOTS,
        hello_timeout: Duration::from_secs(1),
        ..ServiceConfig::default()
    })
    .await;
}

/// The same race for the four slots of one address (every racer is on loopback), the node-wide
/// limit far: eviction at the address's limit leaks no slot either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sockets_and_speakers_racing_for_one_addresss_slots_leak_none() {
    race_for_slots(ServiceConfig {
        max_connections_per_address: std::num::NonZeroUsize::new(SLOTS).unwrap(),
        hello_timeout: Duration::from_secs(1),
        ..ServiceConfig::default()
    })
    .await;
}

/// The slots the racing tests race for.
const SLOTS: usize = 4;

/// Racers for [`SLOTS`] slots (node-wide or of one address, as `service` limits them).
async fn race_for_slots(service: ServiceConfig) {
    let node = flex_node(service).await;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    println!("history seed {seed}");
    let addr = node.addr;
    let racers: Vec<_> = (0..24u64)
        .map(|i| {
            let mut state = seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            tokio::spawn(async move {
                let (mut most_served, mut served, mut turned_away) = (0u64, 0u32, 0u32);
                for _ in 0..6 {
                    let roll = next_random(&mut state);
                    let hold = Duration::from_millis(roll % 150);
                    if roll.is_multiple_of(3) {
                        // Connects and says nothing, for a while.
                        if let Ok(socket) = TcpStream::connect(addr).await {
                            tokio::time::sleep(hold).await;
                            drop(socket);
                        }
                        continue;
                    }
                    let connect = Client::connect(addr);
                    match tokio::time::timeout(Duration::from_secs(5), connect).await {
                        Err(_) => panic!("seed {seed}: a client that speaks was left hanging"),
                        Ok(Ok(mut client)) => {
                            served += 1;
                            if let Ok(stats) = client.stat().await {
                                most_served = most_served.max(stats.connections);
                            }
                            tokio::time::sleep(hold).await;
                        }
                        // Turned away at the limit, or closed as the oldest silent one before
                        // its hello was read: both are answers.
                        Ok(Err(_)) => turned_away += 1,
                    }
                }
                (most_served, served, turned_away)
            })
        })
        .collect();
    let (mut served, mut turned_away) = (0, 0);
    for racer in racers {
        let (most, racer_served, racer_turned_away) = racer.await.unwrap();
        assert!(
            most <= SLOTS as u64,
            "seed {seed}: {most} connections served at once"
        );
        served += racer_served;
        turned_away += racer_turned_away;
    }
    println!("{served} speakers served, {turned_away} turned away");
    // Every slot is back: four clients at once, each served.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut clients = Vec::new();
        for _ in 0..SLOTS {
            if let Ok(client) = Client::connect(addr).await {
                clients.push(client);
            }
        }
        if clients.len() == SLOTS {
            for client in &mut clients {
                assert_eq!(client.stat().await.unwrap().connections, SLOTS as u64);
            }
            break;
        }
        drop(clients);
        assert!(
            Instant::now() < deadline,
            "seed {seed}: slots did not come back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A content hash that is not 64 hex digits is no hash: a protocol error, answered and closed,
/// whatever request carries it; the node serves the next connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_content_hash_that_is_not_hex_is_a_protocol_error() {
    let node = start_with(&["flex"]).await;
    let good = ContentHash::from_digest([0xab; 32]).to_string();
    let bad = format!("{}zz", &good[..62]);
    let requests = [
        Request::DeleteIf {
            key: TensorKey::new(0, "w"),
            content_hash: ContentHash::from_digest([0xab; 32]),
        },
        Request::Pull {
            source: "127.0.0.1:1".into(),
            capability: "c".into(),
            src: TensorKey::new(0, "w"),
            dst_device: 0,
            dst_name: None,
            overwrite: false,
            content_hash: Some(ContentHash::from_digest([0xab; 32])),
        },
    ];
    for request in requests {
        let (mut raw, welcome) = Raw::hello(&node, None).await;
        assert!(matches!(welcome, Response::Welcome(_)));
        let whole = control::encode_request(&request).unwrap();
        let body = String::from_utf8_lossy(&whole[frame::HEADER_LEN..]).into_owned();
        assert!(body.contains(&good));
        // The same bytes with two digits that are no hex digits: same lengths throughout.
        let mut forged = whole[frame::HEADER_LEN..].to_vec();
        let at = forged
            .windows(good.len())
            .position(|w| w == good.as_bytes())
            .unwrap();
        forged[at..at + 64].copy_from_slice(bad.as_bytes());
        raw.send(&frame::encode(FrameKind::Control, &forged)).await;
        let message = raw.expect_fatal(ErrorCode::Protocol).await;
        assert!(message.contains("content hash"), "{message}");
    }
    let mut client = node.client().await;
    assert!(client.list(None).await.unwrap().is_empty());
}
