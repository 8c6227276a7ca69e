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
    let mut first = connect_to(&node, cli).await?;
    // More connections only to a node that says who it is, each checked to be that node: an
    // address behind a balancer may reach several, and the file would be scattered over them.
    let node_id = match wanted {
        1 => None,
        _ => match first.identify().await {
            Ok(id) => Some(id),
            // Refused (a token without the read scope): one connection it is.
            Err(e) if first.in_step() => {
                eprintln!("warning: putting over one connection: the node did not say its id: {e}");
                None
            }
            Err(e) => return Err(e).context("asking the node its id"),
        },
    };
    let mut clients = vec![first];
    while let Some(node_id) = &node_id
        && clients.len() < wanted
    {
        // A connection that cannot be opened (a node's per-address limit, say) leaves the put
        // to those that could.
        let opened = async {
            let mut client = connect_to(&node, cli).await?;
            let reached = client.identify().await?;
            anyhow::ensure!(
                reached == *node_id,
                "it reached node {reached}, not {node_id}"
            );
            Ok(client)
        };
        match opened.await {
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
        let (first, others) = clients
            .split_first_mut()
            .context("no connection to put over")?;
        let answers = first
            .put_batch(batch)
            .if_exists(IfExists::from_overwrite(overwrite))
            .lanes(others)
            .await;
        for ((key, data), answer) in batch.iter().zip(answers) {
            if let Some(bar) = &bar {
                bar.inc(data.as_bytes().len() as u64);
            }
            results.push((key.name.clone(), answer));
        }
        // Every connection failed: the rest is not tried, one tensor at a time.
        if !clients.iter().any(Client::in_step) {
            break;
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let count = results.len();
    let unsent = tensors.len() - count;
    let checked = check_all(results);
    if unsent > 0 {
        if let Err(e) = checked {
            eprintln!("error: {e:#}");
        }
        bail!("{unsent} more tensors not sent: every connection to the node failed");
    }
    checked?;
    eprintln!(
        "put {count} tensors ({total} bytes) on {}/{device}",
        address.node
    );
    Ok(())
}
