//! `ferry put FILE NODE/DEVICE`: every tensor of a file onto a device.

use std::path::Path;

use anyhow::{Context, bail};
use ferry_client::address::Address;
use ferry_client::{Client, IfExists, TensorData, TensorKey};
use ferry_files::read_tensors;

use super::BATCH;
use crate::Cli;
use crate::connect::{connect_to, reach};
use crate::progress::progress;
use crate::report::check_all;

pub(crate) async fn put(
    cli: &Cli,
    file: &Path,
    target: &str,
    prefix: &str,
    overwrite: bool,
    lanes: u8,
) -> anyhow::Result<()> {
    let address = Address::parse(target)?;
    let device = address.device("put")?;
    if address.name.is_some() {
        bail!("put takes HOST:PORT/DEVICE; tensor names come from the file");
    }
    // Read and validated in full before anything reaches the node.
    let tensors = read_tensors(file).with_context(|| format!("reading {}", file.display()))?;
    let tensors: Vec<(TensorKey, TensorData)> = tensors
        .into_iter()
        .map(|(name, data)| (TensorKey::new(device, format!("{prefix}{name}")), data))
        .collect();
    let total: u64 = tensors.iter().map(|(_, d)| d.as_bytes().len() as u64).sum();
    let bar = progress(total);
    let node = reach(&address.node, cli).await?;
    let wanted = usize::from(lanes).min(tensors.len()).max(1);
    let mut clients = vec![connect_to(&node, cli).await?];
    while clients.len() < wanted {
        // A connection that cannot be opened (a node's per-address limit, say) leaves the put
        // to those that could.
        match connect_to(&node, cli).await {
            Ok(client) => clients.push(client),
            Err(e) => {
                eprintln!(
                    "warning: putting over {} lanes of {wanted}: {e:#}",
                    clients.len()
                );
                break;
            }
        }
    }
    let mut results = Vec::with_capacity(tensors.len());
    for batch in tensors.chunks(BATCH * clients.len()) {
        let answers =
            Client::put_batch_in_lanes(&mut clients, batch, IfExists::from_overwrite(overwrite))
                .await;
        for ((key, data), answer) in batch.iter().zip(answers) {
            if let Some(bar) = &bar {
                bar.inc(data.as_bytes().len() as u64);
            }
            results.push((key.name.clone(), answer));
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let count = results.len();
    check_all(results)?;
    eprintln!(
        "put {count} tensors ({total} bytes) on {}/{device}",
        address.node
    );
    Ok(())
}
