//! Helpers shared by the integration tests: in-process nodes on loopback and byte comparisons.
#![allow(dead_code)]

use std::net::SocketAddr;

use ferry::client::{Client, ClientError, ErrorCode};
use ferry::proto::TensorData;
use ferry::server::{DeviceSpec, Node, NodeConfig, Service, ServiceConfig};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A node serving on `127.0.0.1:0` inside the test process, through real sockets.
pub struct TestNode {
    pub addr: SocketAddr,
    pub node: Node,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl TestNode {
    /// Stops accepting and waits for the sessions to finish.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.expect("service task").expect("service ran");
        }
    }

    pub async fn client(&self) -> Client {
        Client::connect(self.addr, None).await.expect("connect")
    }
}

pub fn devices(specs: &[&str]) -> Vec<DeviceSpec> {
    specs
        .iter()
        .map(|s| s.parse().expect("device spec"))
        .collect()
}

pub async fn start(config: NodeConfig, service: ServiceConfig) -> TestNode {
    let node = Node::start(config).expect("node starts");
    let service = Service::bind(node.clone(), "127.0.0.1:0".parse().unwrap(), service)
        .await
        .expect("bind");
    let addr = service.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(service.run(async {
        let _ = stopped.await;
    }));
    TestNode {
        addr,
        node,
        stop: Some(stop),
        task: Some(task),
    }
}

pub async fn start_with(specs: &[&str]) -> TestNode {
    start(
        NodeConfig {
            devices: devices(specs),
            ..NodeConfig::default()
        },
        ServiceConfig::default(),
    )
    .await
}

/// Bit-exact: the same bytes, the same dtype (scheme and scales included), the same shape.
pub fn assert_same(actual: &TensorData, expected: &TensorData, what: &str) {
    assert_eq!(actual.dtype(), expected.dtype(), "{what}: dtype");
    assert_eq!(actual.shape(), expected.shape(), "{what}: shape");
    assert!(
        actual.as_bytes() == expected.as_bytes(),
        "{what}: bytes differ ({} vs {} bytes)",
        actual.as_bytes().len(),
        expected.as_bytes().len()
    );
}

/// The node's error code of a failed call.
pub fn code_of<T: std::fmt::Debug>(result: Result<T, ClientError>) -> ErrorCode {
    match result {
        Err(ClientError::Node { code, .. }) => code,
        other => panic!("expected an error reply from the node, got {other:?}"),
    }
}
