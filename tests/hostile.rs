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
    let node = start(
        NodeConfig {
            devices: common::devices(&["flex"]),
            ..NodeConfig::default()
        },
        service,
    )
    .await;
    let (mut raw, _) = Raw::hello(&node, None).await;
    raw.send(&control::encode_request(&Request::Stat)[..10])
        .await;
    let message = raw.expect_fatal(ErrorCode::Protocol).await;
    assert!(message.contains("sent nothing"), "{message}");
    node_still_serves(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_before_any_command_runs() {
    let node = start(
        NodeConfig {
            devices: common::devices(&["flex"]),
            ..NodeConfig::default()
        },
        ServiceConfig {
            token: Some("s3cret".into()),
            ..ServiceConfig::default()
        },
    )
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
