//! The worker of the deployment example: a process that embeds a ferry node on its own Flex
//! device, serves it, and answers each batch of token ids it is sent with its model's output.
//! The model arrives through the node: a coordinator sends it (`FerryStore::connected`), and
//! the worker applies it straight from its node (`FerryStore::embedded`), sharing the node's
//! buffers.
//!
//! ```text
//! cargo run --example worker -- [--listen 127.0.0.1:0] [--token-file PATH]
//!     [--tls DIR/NAME --grant NAME=SCOPES] [--cluster etcd://HOST:PORT --name NAME]
//! ```
//!
//! Across machines it listens beyond loopback, which the node library allows only behind a
//! credential: a token file (`SCOPES TOKEN` lines; the coordinator presents the token), or
//! mutual TLS from `ferry certs` (`DIR/NAME.pem`, `DIR/NAME.key`, `DIR/ca.pem`) with a grant
//! for the coordinator's certificate name. A batch it cannot take (a tensor of another
//! kind) is reported on stderr and the worker goes on.
//!
//! It prints `listening on ADDR` first, then serves until it is killed or its standard input
//! closes.

#[path = "shared/tiny_lm.rs"]
#[allow(dead_code)] // The worker builds the architecture; the coordinator quantizes.
mod tiny_lm;

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Duration;

use burn_core::tensor::{Device, Int, Tensor};
use burn_store::ModuleStore;
use ferry_burn::{FerryStore, HandoffError, NodeTensors};
use ferry_proto::{IfExists, TensorKey};
use ferry_server::{ClusterJoin, DeviceSpec, NodeError, Server};
use tiny_lm::TinyLm;

fn main() -> anyhow::Result<()> {
    // First, before any other thread allocates: the node's allocator policy holds whole only
    // then (one arena), as in `ferry-server`.
    ferry_server::tune_allocator();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let listen = flag("--listen").unwrap_or_else(|| "127.0.0.1:0".into());

    // The node runs on a runtime of its own threads; the model runs on this one.
    let runtime = tokio::runtime::Runtime::new()?;
    let _entered = runtime.enter();
    let mut server = Server::builder()
        .listen(listen.parse()?)
        .devices(vec![DeviceSpec::Flex]);
    if let Some(path) = flag("--token-file") {
        server = server.token_file(path);
    }
    if let Some(holder) = flag("--tls").map(PathBuf::from) {
        let dir = holder.parent().map(PathBuf::from).unwrap_or_default();
        server = server.tls_files(ferry_server::TlsFiles {
            cert: holder.with_extension("pem"),
            key: holder.with_extension("key"),
            ca: dir.join("ca.pem"),
        });
    }
    if let Some(grant) = flag("--grant") {
        server = server.grants([grant.parse().map_err(anyhow::Error::msg)?]);
    }
    if let (Some(cluster), Some(name)) = (flag("--cluster"), flag("--name")) {
        // Registered (`@NAME`) for as long as the process lives.
        server = server.cluster(ClusterJoin {
            ttl: Duration::from_secs(10),
            ..ClusterJoin::new(cluster, name)
        });
    }
    let server = runtime.block_on(server.start())?;
    let node = server.node().clone();
    println!("listening on {}", server.local_addr()?);
    std::io::stdout().flush()?;
    runtime.spawn(server.run(std::future::pending()));
    // The one who started the worker is gone once its standard input closes.
    std::thread::spawn(|| {
        for _ in std::io::stdin().lock().lines() {}
        std::process::exit(0);
    });
    drop(_entered);

    let device = Device::flex();
    // This worker's own copy of the architecture: its weights are whatever it is sent.
    let mut model = TinyLm::new(&device);
    let batch = TensorKey::new(0, "batch");
    loop {
        // Woken by the batch's arrival, not by polling.
        runtime.block_on(node.wait_for(&batch))?;
        let tokens: Tensor<2, Int> = match runtime.block_on(node.take_tensor(&batch)) {
            Ok(tokens) => tokens,
            // Taken or removed between the wake-up and the take: wait again.
            Err(HandoffError::Node(NodeError::NotFound(_))) => continue,
            // A batch of another kind (or shape) is the sender's mistake, not the worker's end:
            // reported, and cleared so that the next batch can come.
            Err(e) => {
                eprintln!("worker: batch refused: {e}");
                let _ = runtime.block_on(node.remove(&batch));
                continue;
            }
        };
        // The model the coordinator sent before the batch, applied from this node.
        let applied = FerryStore::embedded(node.clone(), runtime.handle().clone(), 0, "model")
            .apply_to(&mut model);
        if let Err(e) = applied {
            eprintln!("worker: the model could not be applied: {e}");
            continue;
        }
        let output = model.forward(tokens);
        runtime.block_on(node.insert_tensor(
            &TensorKey::new(0, "output"),
            &output,
            IfExists::Replace,
        ))?;
    }
}
