//! Bad input against a live node: each gets its typed error, the node stays up, a second client
//! still puts and gets bit-exact, and nothing half-registered is left behind.

mod common;

use std::time::Duration;

use bytes::BytesMut;
use common::{TestNode, assert_same, start, start_with};
use ferry::client::{Client, ErrorCode};
use ferry::proto::frame::{self, FrameKind};
use ferry::proto::{
    DType, ErrorReply, FEATURES, Hello, PROTOCOL_MINOR, PROTOCOL_VERSION, Request, Response,
    TensorKey, WireDType, control, tensor,
};
use ferry::samples;
use ferry::server::{NodeConfig, ServiceConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A raw connection that speaks frames by hand.
struct Raw {
    stream: TcpStream,
    buf: BytesMut,
}

impl Raw {
    async fn connect(node: &TestNode) -> Raw {
        Raw {
            stream: TcpStream::connect(node.addr).await.unwrap(),
            buf: BytesMut::new(),
        }
    }

    async fn hello(node: &TestNode, token: Option<&str>) -> (Raw, Response) {
        let mut raw = Raw::connect(node).await;
        raw.send(&control::encode_request(&Request::Hello(Hello {
            major: PROTOCOL_VERSION,
            minor: PROTOCOL_MINOR,
            features: FEATURES.iter().map(|f| f.to_string()).collect(),
            token: token.map(str::to_string),
            agent: "hostile-test".into(),
        })))
        .await;
        let welcome = raw.response().await.expect("a reply to hello");
        (raw, welcome)
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    /// The next response, or `None` once the node closed the connection.
    async fn response(&mut self) -> Option<Response> {
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
    async fn expect_fatal(&mut self, code: ErrorCode) -> String {
        let message = self.expect_error(code).await;
        assert!(
            self.response().await.is_none(),
            "the node closes the connection"
        );
        message
    }

    async fn expect_error(&mut self, code: ErrorCode) -> String {
        match self.response().await {
            Some(Response::Error(ErrorReply { code: got, message })) => {
                assert_eq!(got, code, "{message}");
                message
            }
            other => panic!("expected an {code:?} error, got {other:?}"),
        }
    }
}

fn put_request(device: u32, name: &str, meta: ferry::proto::WireMeta) -> Vec<u8> {
    control::encode_request(&Request::Put {
        device,
        name: Some(name.into()),
        meta,
        overwrite: false,
    })
}

/// A node with one flex device and `service`'s limits.
async fn flex_node(service: ServiceConfig) -> TestNode {
    start(
        NodeConfig {
            devices: common::devices(&["flex"]),
            ..NodeConfig::default()
        },
        service,
    )
    .await
}

/// After each attack: a second client puts and gets bit-exact and the node holds only its tensor.
async fn node_still_serves(node: &TestNode) {
    let mut client = node.client().await;
    let data = samples::quantized(&samples::schemes()[6].1, &[3, 5, 7], 11);
    client.put(0, "after", &data).await.unwrap();
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
    let mut hello = control::encode_request(&Request::Stat);
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
    let mut frame = control::encode_request(&Request::Stat);
    frame[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    raw.send(&frame[..16]).await;
    let message = raw.expect_fatal(ErrorCode::Protocol).await;
    assert!(message.contains("exceeds the maximum"), "{message}");
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
            control::encode_request(&Request::Stat),
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
    raw.send(&control::encode_request(&Request::Stat)[..10])
        .await;
    let message = raw.expect_fatal(ErrorCode::Protocol).await;
    assert!(message.contains("sent nothing"), "{message}");
    node_still_serves(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_before_any_command_runs() {
    let node = flex_node(ServiceConfig {
        token: Some("s3cret".into()),
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
        raw.send(&control::encode_request(&Request::List { device: None }))
            .await;
        assert!(raw.response().await.is_none());
        let refused = Client::connect(node.addr, token).await;
        assert_eq!(common::code_of(refused), ErrorCode::AuthRefused);
    }
    let mut client = Client::connect(node.addr, Some("s3cret")).await.unwrap();
    let data = samples::plain(DType::U16, &[3, 5, 7], 4);
    client.put(0, "ok", &data).await.unwrap();
    let back = client.get(&TensorKey::new(0, "ok")).await.unwrap();
    assert_same(&back, &data, "with the right token");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_refuse_before_allocation_and_connections_over_the_limit_are_told() {
    let node = start(
        NodeConfig {
            devices: common::devices(&["flex"]),
            max_tensor_bytes: 1024,
            memory_limit: Some(1500),
            ..NodeConfig::default()
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
        common::code_of(client.put(0, "big", &big).await),
        ErrorCode::LimitExceeded
    );
    let fits = samples::plain(DType::F32, &[200], 1);
    client.put(0, "a", &fits).await.unwrap();
    // 800 bytes held: another 800 would pass the 1500-byte budget.
    let over = client.put(0, "b", &fits).await;
    assert_eq!(common::code_of(over), ErrorCode::LimitExceeded);
    client.delete(&TensorKey::new(0, "a")).await.unwrap();
    client.put(0, "b", &fits).await.unwrap();

    let _second = node.client().await;
    let third = Client::connect(node.addr, None).await;
    assert_eq!(common::code_of(third), ErrorCode::LimitExceeded);
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
    .map(control::encode_request)
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
            devices: common::devices(&["flex", "flex"]),
            ..NodeConfig::default()
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
    let frame = control::encode_request(&Request::Stat);
    raw.send(&frame[..frame::HEADER_LEN]).await;
    let message = raw.expect_fatal(ErrorCode::Protocol).await;
    assert!(message.contains("sent nothing"), "{message}");
    node_still_serves(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_so_they_cannot_hold_every_slot() {
    let node = flex_node(ServiceConfig {
        max_connections: 2,
        keepalive: Duration::from_millis(300),
        ..ServiceConfig::default()
    })
    .await;
    let _idle_a = node.client().await;
    let _idle_b = node.client().await;
    let refused = Client::connect(node.addr, None).await;
    assert_eq!(common::code_of(refused), ErrorCode::LimitExceeded);
    tokio::time::sleep(Duration::from_millis(800)).await;
    // The two idle ones were closed; their slots are free again.
    node_still_serves(&node).await;
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
            match Client::connect(addr, None).await {
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
        worker.put(0, &key.name, &data).await.unwrap();
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
            devices: common::devices(&["flex"]),
            memory_limit: Some(BUDGET),
            ..NodeConfig::default()
        },
        ServiceConfig::default(),
    )
    .await;
    // 24 clients each putting 96 KiB at once: 2.25 MiB asked of a 1 MiB budget.
    let mut tasks = Vec::new();
    for i in 0..24u64 {
        let addr = node.addr;
        tasks.push(tokio::spawn(async move {
            let mut client = Client::connect(addr, None).await.unwrap();
            let data = samples::plain(DType::F32, &[96, 256], i);
            match client.put(0, &format!("t{i}"), &data).await {
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

/// A node of an older protocol minor answers `stat` with fewer fields: the client says so in
/// words instead of reporting trailing or missing bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stat_answer_of_another_minor_is_named_as_such() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let older = PROTOCOL_MINOR - 1;
    let node = tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        let mut conn = ferry::client::Connection::new(socket, Default::default());
        assert!(matches!(
            conn.read_request().await.unwrap(),
            Some(Request::Hello(_))
        ));
        let welcome = Response::Welcome(ferry::proto::Welcome {
            major: PROTOCOL_VERSION,
            minor: older,
            features: FEATURES.iter().map(|f| f.to_string()).collect(),
            agent: "ferry-server/older".into(),
            max_body: frame::DEFAULT_MAX_BODY as u64,
            chunk_size: 4 << 20,
        });
        conn.write_response(&welcome).await.unwrap();
        assert_eq!(conn.read_request().await.unwrap(), Some(Request::Stat));
        // This minor's answer without the fields this minor added (four u64 at the end).
        let stats = ferry::proto::NodeStats {
            agent: "ferry-server/older".into(),
            devices: vec![],
            transfers_done: 0,
            transfers_failed: 0,
            native_transfers: 0,
            round_trip_transfers: 0,
            connections: 1,
            transfer_policy: "auto".into(),
            node_id: "older".into(),
            pulls: 0,
            pull_retries: 0,
            dedup_hits: 0,
            fetches_served: 0,
            unix_socket: None,
            shared_memory: false,
            shm_payloads_sent: 0,
            shm_payloads_received: 0,
            shm_bytes: 0,
            regions_in_flight: 0,
            resident_bytes: 0,
            peak_resident_bytes: 0,
            hashes_pending: 0,
            hash_mismatches: 0,
            recycled_bytes: 0,
            regions_kept: 0,
        };
        let whole = control::encode_response(&Response::Stats(stats));
        let body = &whole[frame::HEADER_LEN..whole.len() - 32];
        conn.write_frame(&frame::encode(FrameKind::Control, body))
            .await
            .unwrap();
        conn
    });
    let mut client = Client::connect(addr, None).await.unwrap();
    let error = client.stat().await.unwrap_err();
    assert!(
        matches!(
            error,
            ferry::client::ClientError::StatsOfAnotherMinor { node, client, .. }
                if node == older && client == PROTOCOL_MINOR
        ),
        "{error}"
    );
    assert!(error.to_string().contains("protocol minor"), "{error}");
    drop(node.await.unwrap());
}
