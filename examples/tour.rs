//! A runnable tour of the client API: every `Client` method against two real nodes on loopback.
//!
//! `cargo run --example tour`. It starts two nodes in process (each with two flex devices) on
//! free ports, so it needs nothing else running.
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

use burn_tensor::quantization::{QuantScheme, QuantStore, QuantValue};
use burn_tensor::{Device, Tensor};
use ferry_client::{Client, ClientError, IfExists, NodeCopy, PutTo, TensorKey, Transfer};
use ferry_proto::{DType, TensorData};
use ferry_server::{Node, NodeConfig, Service, ServiceConfig};

/// Starts a node on a free loopback port and returns its address.
async fn start_node() -> std::net::SocketAddr {
    let node = Node::start(NodeConfig::default()).expect("node starts");
    let service = Service::bind(
        node,
        "127.0.0.1:0".parse().unwrap(),
        ServiceConfig::default(),
    )
    .await
    .expect("binds");
    let addr = service.local_addr().unwrap();
    tokio::spawn(service.run(std::future::pending()));
    addr
}

#[tokio::main]
async fn main() -> Result<(), ClientError> {
    let (a, b) = (start_node().await, start_node().await);

    // connect: a token is needed only when the node was started with one.
    let mut client = Client::connect(a).await?;

    // put: upload under a name; answered once the node registered it.
    let weights = TensorData::new((0..12).map(|i| i as f32 / 7.0).collect::<Vec<_>>(), [3, 4]);
    let info = client
        .put(&TensorKey::new(0, "encoder.w"), &weights)
        .await?;
    println!("put {} ({} bytes, {:?})", info.key, info.bytes, info.shape);

    // put's options: a node-chosen name, or replace an existing tensor.
    let named = client.put(PutTo::Device(0), &weights).await?;
    client
        .put(&TensorKey::new(0, "encoder.w"), &weights)
        .if_exists(IfExists::Replace)
        .await?;
    println!("the node named the second upload {}", named.key);

    // get / get_with_info: the same bytes and dtype back.
    let key = TensorKey::new(0, "encoder.w");
    let back = client.get(&key).await?;
    assert_eq!(back.as_bytes(), weights.as_bytes());
    let (info, _) = client.get_with_info(&key).await?;
    println!("get {} path={}", info.key, info.path);

    // put_batch / get_batch: a whole model in one pipelined exchange, one answer per tensor.
    let model: Vec<(TensorKey, TensorData)> = (0..4)
        .map(|i| {
            (
                TensorKey::new(1, format!("layer{i}.b")),
                TensorData::new(vec![i as i64; 8], [8]),
            )
        })
        .collect();
    for answer in client.put_batch(&model).await? {
        answer?;
    }
    let keys: Vec<TensorKey> = model.iter().map(|(key, _)| key.clone()).collect();
    for (answer, (key, data)) in client.get_batch(&keys).await?.into_iter().zip(&model) {
        assert_eq!(answer?.as_bytes(), data.as_bytes(), "{key}");
    }

    // put / get_tensor: Burn tensors, quantized ones included, on a device you name.
    let device = Device::flex();
    let scheme = QuantScheme::default()
        .with_value(QuantValue::Q8S)
        .with_store(QuantStore::Native);
    let quantized = Tensor::<2>::from_data(weights.clone(), &device).quantize_dynamic(&scheme);
    client
        .put(&TensorKey::new(0, "encoder.q"), quantized.clone())
        .await?;
    let fetched: Tensor<2> = client
        .get_tensor(&TensorKey::new(0, "encoder.q"), &device)
        .await?;
    assert_eq!(fetched.dtype(), DType::QFloat(scheme));
    assert_eq!(
        fetched.into_data().as_bytes(),
        quantized.into_data().as_bytes()
    );

    // copy / move_to / transfer: between devices of one node, answered once the target holds it.
    client.copy(&key, &key.on(1)).await?;
    client
        .move_to(
            &TensorKey::new(0, "encoder.q"),
            &TensorKey::new(1, "encoder.q8"),
        )
        .await?;
    client
        .transfer(
            &TensorKey::new(1, "encoder.w"),
            &TensorKey::new(0, "encoder.w2"),
            Transfer::Move,
            IfExists::Refuse,
        )
        .await?;

    // delete / list / stat.
    client.delete(&named.key).await?;
    for info in client.list(None).await? {
        println!("  {} {} bytes ({})", info.key, info.bytes, info.path);
    }
    let stats = client.stat().await?;
    println!(
        "{}: {} native and {} round-trip in-node transfers",
        stats.node_id, stats.native_transfers, stats.round_trip_transfers
    );

    // identify / NodeCopy: node to node, the bytes never pass through this client.
    let mut target = Client::connect(b).await?;
    println!("node b is {}", target.identify().await?);
    let copy = NodeCopy::new(a.to_string()).tensor(key.clone(), key.clone());
    for answer in copy.run(&mut client, &mut target).await? {
        let info = answer?;
        println!("pulled {} to node b ({})", info.key, info.path);
    }
    assert_eq!(target.get(&key).await?.as_bytes(), weights.as_bytes());
    Ok(())
}
