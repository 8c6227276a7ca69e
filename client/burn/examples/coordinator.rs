//! The coordinator of the deployment example: sends a small quantized model to a worker (see
//! `worker.rs`), by address or by cluster name, runs a batch there, and checks that the output is
//! bit-exact the coordinator's own.
//!
//! ```text
//! cargo run --example coordinator -- ADDR
//! cargo run --example coordinator -- --cluster etcd://HOST:PORT --name NAME
//! ```

#[path = "shared/coordinator.rs"]
mod coordinator;
#[path = "shared/tiny_lm.rs"]
#[allow(dead_code)]
mod tiny_lm;

use ferry_client::{BlockingClient, ConnectOptions};
use tiny_lm::Quantization;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let connect = || -> anyhow::Result<BlockingClient> {
        match args.as_slice() {
            [flag, cluster, name_flag, name] if flag == "--cluster" && name_flag == "--name" => {
                Ok(BlockingClient::reach(cluster, name, ConnectOptions::default())?.0)
            }
            [addr] => Ok(BlockingClient::connect(addr.as_str()).blocking()?),
            _ => anyhow::bail!("usage: coordinator ADDR | --cluster etcd://HOST:PORT --name NAME"),
        }
    };
    for quantization in [Quantization::PerTensor, Quantization::PerBlock] {
        let outputs = coordinator::ship_and_run(connect()?, connect()?, quantization)?;
        let same = outputs.here.dtype() == outputs.worker.dtype()
            && outputs.here.shape() == outputs.worker.shape()
            && outputs.here.as_bytes() == outputs.worker.as_bytes();
        println!(
            "{quantization:?}: output {:?} {:?}, bit-exact: {same}",
            outputs.worker.dtype(),
            outputs.worker.shape()
        );
        anyhow::ensure!(same, "the worker's output differs from the coordinator's");
    }
    Ok(())
}
