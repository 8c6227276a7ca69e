//! The coordinator of the deployment example: sends a small quantized model to a worker (see
//! `worker.rs`), by address or by cluster name, runs a batch there, and checks that the output is
//! bit-exact the coordinator's own.
//!
//! ```text
//! cargo run --example coordinator -- ADDR [--token-file PATH]
//! cargo run --example coordinator -- --cluster etcd://HOST:PORT --name NAME
//! ```
//!
//! With `--token-file`, the token (the file's first line that is not blank or a comment) goes to
//! the worker over loopback, or beyond it only under TLS: the client library keeps it back from
//! any other address, and from a loopback port another user holds.

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
            [addr, flag, path] if flag == "--token-file" => {
                let text = std::fs::read_to_string(path)?;
                let token = text
                    .lines()
                    .map(str::trim)
                    .find(|l| !l.is_empty() && !l.starts_with('#'))
                    .ok_or_else(|| anyhow::anyhow!("{path} holds no token"))?;
                // A token file of the node's form (`SCOPES TOKEN`) holds the token last.
                let token = token.rsplit(' ').next().unwrap_or(token);
                Ok(BlockingClient::connect(addr.as_str())
                    .token(token)
                    .blocking()?)
            }
            _ => anyhow::bail!(
                "usage: coordinator ADDR [--token-file PATH] | --cluster etcd://HOST:PORT --name NAME"
            ),
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
