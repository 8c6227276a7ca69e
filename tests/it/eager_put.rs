//! Eager puts (`Request::PutEager`): a payload that follows its request without waiting for
//! `Ready` is stored bit-exact; one the node refuses, whatever the reason, is read and dropped,
//! and the connection goes on; one over the eager limit, or whose chunks break the rules, closes
//! the connection. And the client sends small payloads so, a batch with a refusal inside.

use ferry_client::{ClientError, ErrorCode, IfExists};
use ferry_proto::frame;
use ferry_proto::message::EAGER_PUT_MAX_BYTES;
use ferry_proto::{DType, Request, Response, TensorData, TensorKey, WireDType, control, tensor};
use ferry_server::{NodeConfig, ServiceConfig, parse_token_file};
use ferry_testkit::{assert_same, samples, start, start_with};

use crate::hostile::{Raw, node_still_serves};

/// An eager put's request followed at once by its payload in chunks of `chunk` bytes.
fn eager(key: &TensorKey, data: &TensorData, overwrite: bool, chunk: usize) -> Vec<u8> {
    let mut bytes = control::encode_request(&Request::PutEager {
        device: key.device,
        name: Some(key.name.clone()),
        meta: tensor::meta_of(data).unwrap().to_wire(),
        overwrite,
    })
    .unwrap();
    for (offset, piece) in frame::chunks(data.as_bytes(), chunk) {
        bytes.extend_from_slice(&frame::encode_chunk(offset, piece));
    }
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eager_put_is_stored_and_one_refused_is_dropped_with_the_connection_going_on() {
    let node = start_with(&["flex"]).await;
    let key = TensorKey::new(0, "bias");
    let first = samples::quantized(&samples::schemes()[3].1, &[4, 8], 1);
    let second = samples::plain(DType::F32, &[3, 5], 2);
    let (mut raw, _) = Raw::hello(&node, None).await;

    raw.send(&eager(&key, &first, false, 7)).await;
    assert!(
        matches!(raw.response().await, Some(Response::Stored(_))),
        "an eager put is answered Stored, with no Ready before"
    );
    // Refused for its key, for its device, and for its meta: each payload is read and dropped,
    // and the next request on the connection is answered.
    raw.send(&eager(&key, &second, false, 5)).await;
    let taken = raw.expect_error(ErrorCode::AlreadyExists).await;
    assert!(taken.contains("bias"), "{taken}");
    raw.send(&eager(&TensorKey::new(9, "x"), &second, false, 5))
        .await;
    let device = raw.expect_error(ErrorCode::BadRequest).await;
    assert!(device.contains("no device 9"), "{device}");
    let mut unknown = control::encode_request(&Request::PutEager {
        device: 0,
        name: Some("odd".into()),
        meta: ferry_proto::WireMeta {
            dtype: WireDType {
                tag: 99,
                quant: None,
            },
            ..tensor::meta_of(&second).unwrap().to_wire()
        },
        overwrite: false,
    })
    .unwrap();
    unknown.extend_from_slice(&frame::encode_chunk(0, second.as_bytes()));
    raw.send(&unknown).await;
    raw.expect_error(ErrorCode::BadRequest).await;
    assert!(matches!(
        raw.ask(&Request::Stat).await,
        Some(Response::Stats(_))
    ));

    let mut client = node.client().await;
    assert_same(
        &client.get(&key).await.unwrap(),
        &first,
        "the first put stands",
    );
    let listed: Vec<String> = client
        .list(None)
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.key.name)
        .collect();
    assert_eq!(listed, ["bias"], "nothing of the refused puts is left");
    // Replacing, eagerly.
    raw.send(&eager(&key, &second, true, 64)).await;
    assert!(matches!(raw.response().await, Some(Response::Stored(_))));
    assert_same(&client.get(&key).await.unwrap(), &second, "replaced");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eager_put_over_the_limit_or_with_broken_chunks_closes_the_connection() {
    let node = start_with(&["flex"]).await;
    let data = samples::plain(DType::U8, &[16], 3);
    let meta = tensor::meta_of(&data).unwrap().to_wire();

    // Over the eager limit: refused from its request, before any payload byte is read.
    let over = EAGER_PUT_MAX_BYTES + 1;
    let (mut raw, _) = Raw::hello(&node, None).await;
    raw.send(
        &control::encode_request(&Request::PutEager {
            device: 0,
            name: Some("big".into()),
            meta: ferry_proto::WireMeta {
                shape: vec![over],
                byte_len: over,
                ..meta.clone()
            },
            overwrite: false,
        })
        .unwrap(),
    )
    .await;
    let message = raw.expect_fatal(ErrorCode::Protocol).await;
    assert!(message.contains("eager put of"), "{message}");

    // Chunks out of order, admitted or refused: the payload's end cannot be found.
    for name in ["fresh", "taken"] {
        let (mut raw, _) = Raw::hello(&node, None).await;
        if name == "taken" {
            raw.send(&eager(&TensorKey::new(0, "taken"), &data, false, 16))
                .await;
            assert!(matches!(raw.response().await, Some(Response::Stored(_))));
        }
        let mut bytes = control::encode_request(&Request::PutEager {
            device: 0,
            name: Some(name.into()),
            meta: meta.clone(),
            overwrite: false,
        })
        .unwrap();
        bytes.extend_from_slice(&frame::encode_chunk(8, &data.as_bytes()[8..]));
        raw.send(&bytes).await;
        let message = raw.expect_fatal(ErrorCode::Protocol).await;
        assert!(message.contains("expected offset 0"), "{name}: {message}");
    }
    let mut client = node.client().await;
    client.delete(&TensorKey::new(0, "taken")).await.unwrap();
    node_still_serves(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eager_put_its_token_does_not_allow_is_dropped_and_refused() {
    let node = start(
        NodeConfig {
            devices: ferry_testkit::devices(&["flex"]),
            ..NodeConfig::light()
        },
        ServiceConfig {
            credentials: parse_token_file("read reader-token\nall admin-token\n").unwrap(),
            ..ServiceConfig::default()
        },
    )
    .await;
    let data = samples::plain(DType::F32, &[2, 3], 4);
    let (mut raw, _) = Raw::hello(&node, Some("reader-token")).await;
    raw.send(&eager(&TensorKey::new(0, "w"), &data, false, 8))
        .await;
    let message = raw.expect_error(ErrorCode::AuthRefused).await;
    assert!(message.contains("write"), "{message}");
    assert!(matches!(
        raw.ask(&Request::List { device: None }).await,
        Some(Response::Listing(listed)) if listed.is_empty()
    ));
}

/// The client sends a batch of small tensors eagerly, one request ahead: a refused one in the
/// middle is answered with its error, every other is stored bit-exact, and a single put of a
/// small tensor is refused the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_batch_of_small_tensors_with_a_refusal_inside() {
    let node = start_with(&["flex"]).await;
    let mut client = node.client().await;
    let taken = TensorKey::new(0, "t3");
    let earlier = samples::plain(DType::I32, &[5], 9);
    client.put(&taken, &earlier).await.unwrap();
    let tensors: Vec<(TensorKey, TensorData)> = (0..8)
        .map(|i| {
            let data = match i % 3 {
                0 => samples::plain(DType::F32, &[16, 3], i),
                1 => samples::quantized(&samples::schemes()[i as usize].1, &[2, 32], i),
                _ => samples::plain(DType::BF16, &[7], i),
            };
            (TensorKey::new(0, format!("t{i}")), data)
        })
        .collect();
    let answers = client.put_batch(&tensors).await.unwrap();
    for (i, ((key, data), answer)) in tensors.iter().zip(&answers).enumerate() {
        if *key == taken {
            let refused = answer.as_ref().unwrap_err();
            assert!(matches!(refused, ClientError::Node { .. }), "{refused:?}");
            assert_eq!(refused.code(), Some(ErrorCode::AlreadyExists), "{refused}");
            assert_same(&client.get(key).await.unwrap(), &earlier, "kept");
        } else {
            answer.as_ref().unwrap();
            assert_same(&client.get(key).await.unwrap(), data, &format!("t{i}"));
        }
    }
    let refused = client.put(&taken, &tensors[0].1).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::AlreadyExists), "{refused}");
    client
        .put(&taken, &tensors[0].1)
        .if_exists(IfExists::Replace)
        .await
        .unwrap();
    assert_same(
        &client.get(&taken).await.unwrap(),
        &tensors[0].1,
        "replaced",
    );
    assert!(client.stat().await.is_ok(), "the connection goes on");
}
