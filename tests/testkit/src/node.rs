//! In-process nodes on loopback: [`TestNode`] and the ways to start one.

use std::net::SocketAddr;

use ferry_client::Client;
use ferry_server::{DeviceSpec, Node, NodeConfig, Service, ServiceConfig};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A node serving on `127.0.0.1:0` (and a Unix socket in a temporary directory, where asked)
/// inside the test process, through real sockets.
/// Shared-memory region counts are per process, and every test of this binary shares one: a
/// test that counts them, or makes them in this process (a node or client on a Unix socket),
/// holds this, so that no count sees another test's regions.
pub static REGIONS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub struct TestNode {
    pub addr: SocketAddr,
    pub node: Node,
    /// `unix:PATH`, where the node also listens on a Unix socket.
    pub unix: Option<String>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
    _dir: Option<tempfile::TempDir>,
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
        Client::connect(self.addr).await.expect("connect")
    }
}

pub fn devices(specs: &[&str]) -> Vec<DeviceSpec> {
    specs
        .iter()
        .map(|s| s.parse().expect("device spec"))
        .collect()
}

pub async fn start(config: NodeConfig, service: ServiceConfig) -> TestNode {
    start_service(config, service, false).await
}

/// A node that also listens on a Unix socket in a fresh temporary directory.
pub async fn start_unix(config: NodeConfig, service: ServiceConfig) -> TestNode {
    start_service(config, service, true).await
}

async fn start_service(config: NodeConfig, service: ServiceConfig, unix: bool) -> TestNode {
    let node = Node::start(config).expect("node starts");
    let mut service = Service::bind(node.clone(), "127.0.0.1:0".parse().unwrap(), service)
        .await
        .expect("bind");
    let mut dir = None;
    let mut unix_addr = None;
    if unix {
        let tmp = tempfile::tempdir().expect("temporary directory");
        let path = tmp.path().join("node.sock");
        service = service.listen_unix(&path).expect("bind the Unix socket");
        unix_addr = Some(format!("unix:{}", path.display()));
        dir = Some(tmp);
    }
    let addr = service.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(service.run(async {
        let _ = stopped.await;
    }));
    TestNode {
        addr,
        node,
        unix: unix_addr,
        stop: Some(stop),
        task: Some(task),
        _dir: dir,
    }
}

pub async fn start_with(specs: &[&str]) -> TestNode {
    start(
        NodeConfig {
            devices: devices(specs),
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await
}
