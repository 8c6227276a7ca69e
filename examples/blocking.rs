//! `BlockingClient`: the client API for a program without an async runtime (each call
//! `.wait()`ed in place of `.await`).
//!
//! `cargo run --example blocking`. A node runs in a background thread of this process.
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

use ferry_client::{BlockingClient, TensorKey, Wait};
use ferry_proto::TensorData;
use ferry_server::{Node, NodeConfig, Service, ServiceConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().expect("runtime");
        runtime.block_on(async {
            let node = Node::start(NodeConfig::default()).expect("node starts");
            let addr = "127.0.0.1:0".parse().expect("address");
            let service = Service::bind(node, addr, ServiceConfig::default())
                .await
                .expect("binds");
            tx.send(service.local_addr().expect("address"))
                .expect("send");
            service.run(std::future::pending()).await
        })
    });
    let addr = rx.recv()?;

    let mut client = BlockingClient::connect(addr).blocking()?;
    let data = TensorData::new(vec![1u8, 2, 3, 4], [2, 2]);
    client.put(&TensorKey::new(0, "mask"), &data).wait()?;
    client
        .copy(&TensorKey::new(0, "mask"), &TensorKey::new(0, "mask").on(1))
        .wait()?;
    let back = client.get(&TensorKey::new(1, "mask")).wait()?;
    assert_eq!(back.as_bytes(), data.as_bytes());
    for info in client.list(None).wait()? {
        println!("{} {:?} {} bytes", info.key, info.shape, info.bytes);
    }
    println!("{} transfers done", client.stat().wait()?.transfers_done);
    Ok(())
}
