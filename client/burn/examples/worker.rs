//! The worker of the deployment example: a process that embeds a ferry node on its own Flex
//! device, serves it, and answers each batch of token ids it is sent with its model's output.
//! The model arrives through the node: a coordinator sends it (`FerryStore::connected`), and
//! the worker applies it straight from its node (`FerryStore::embedded`), sharing the node's
//! buffers.
//!
//! ```text
//! cargo run --example worker -- [--listen 127.0.0.1:0] [--cluster etcd://HOST:PORT --name NAME]
//! ```
//!
//! It prints `listening on ADDR` first, then serves until it is killed or its standard input
//! closes.

#[path = "shared/tiny_lm.rs"]
#[allow(dead_code)] // The worker builds the architecture; the coordinator quantizes.
mod tiny_lm;

use std::io::{BufRead, Write};
use std::time::Duration;

use anyhow::Context;
use burn_core::tensor::{Device, Int, Tensor};
use burn_store::ModuleStore;
use ferry_burn::{FerryStore, HandoffError, NodeTensors};
use ferry_proto::{IfExists, TensorKey};
use ferry_server::cluster::{ClusterConfig, Membership};
use ferry_server::{DeviceSpec, Node, NodeConfig, NodeError, Service, ServiceConfig};
use tiny_lm::TinyLm;

fn main() -> anyhow::Result<()> {
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
    let node = Node::start(NodeConfig {
        devices: vec![DeviceSpec::Flex],
        ..NodeConfig::default()
    })?;
    let service = runtime
        .block_on(Service::bind(
            node.clone(),
            listen.parse()?,
            ServiceConfig::default(),
        ))
        .with_context(|| format!("binding {listen}"))?;
    let addr = service.local_addr()?;
    println!("listening on {addr}");
    std::io::stdout().flush()?;
    // Registered (`@NAME`) for as long as the process lives.
    let _membership = match (flag("--cluster"), flag("--name")) {
        (Some(cluster), Some(name)) => Some(Membership::join(
            node.clone(),
            ClusterConfig {
                endpoints: ferry_proto::cluster::endpoints(&cluster)
                    .map_err(|e| anyhow::anyhow!("--cluster {cluster:?}: {e}"))?,
                name,
                advertise: addr.to_string(),
                unix: None,
                ttl: Duration::from_secs(10),
                etcd_user: None,
            },
        )),
        _ => None,
    };
    runtime.spawn(service.run(std::future::pending()));
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
        let tokens: Tensor<2, Int> = match runtime.block_on(node.take_tensor(&batch)) {
            Ok(tokens) => tokens,
            Err(HandoffError::Node(NodeError::NotFound(_))) => {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        // The model the coordinator sent before the batch, applied from this node.
        FerryStore::embedded(node.clone(), runtime.handle().clone(), 0, "model")
            .apply_to(&mut model)?;
        let output = model.forward(tokens);
        runtime.block_on(node.insert_tensor(
            &TensorKey::new(0, "output"),
            &output,
            IfExists::Replace,
        ))?;
    }
}
