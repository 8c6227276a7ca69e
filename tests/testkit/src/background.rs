//! [`BackgroundNode`]: an in-process node on a thread and runtime of its own, for sync tests.

use std::net::SocketAddr;

use ferry_server::{Node, NodeConfig, Service, ServiceConfig};
use tokio::sync::oneshot;

/// A node in this process, served by a runtime on a thread of its own, for synchronous tests (a
/// command line run against it); stopped when dropped.
pub struct BackgroundNode {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// `unix:PATH`, where it also listens on a Unix socket.
    pub unix: Option<String>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BackgroundNode {
    /// Serves a node of `config` with `service`'s settings on `127.0.0.1:0`, and on the Unix
    /// socket `unix` where given.
    pub fn start(
        config: NodeConfig,
        service: ServiceConfig,
        unix: Option<&std::path::Path>,
    ) -> BackgroundNode {
        let unix = unix.map(std::path::Path::to_path_buf);
        let (ready, addresses) = std::sync::mpsc::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async move {
                let node = Node::start(config).expect("node starts");
                let loopback: SocketAddr = "127.0.0.1:0".parse().expect("an address");
                let mut service = Service::bind(node, loopback, service).await.expect("bind");
                if let Some(path) = &unix {
                    service = service.listen_unix(path).expect("bind the Unix socket");
                }
                let addr = service.local_addr().expect("bound").to_string();
                let unix = unix.map(|p| format!("unix:{}", p.display()));
                ready.send((addr, unix)).expect("the test waits");
                service
                    .run(async {
                        let _ = stopped.await;
                    })
                    .await
                    .expect("service ran");
            });
        });
        let (addr, unix) = addresses.recv().expect("the node started");
        BackgroundNode {
            addr,
            unix,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for BackgroundNode {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
