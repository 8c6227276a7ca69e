//! `ferry put FILE NODE/DEVICE`: every tensor of a file onto a device, as tensors of their own or
//! (`--model NAME`) as a new version of a model, committed with the file's metadata.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};
use ferry_client::address::Address;
use ferry_client::{Client, ClientError, ErrorCode, IfExists, TensorData, TensorInfo, TensorKey};
use ferry_files::{FileContents, read_file};

use super::BATCH;
use crate::Cli;
use crate::connect::{Reached, connect_to, reach};
use crate::progress::progress;
use crate::report::check_all;

pub(crate) async fn put(
    cli: &Cli,
    file: &Path,
    target: &str,
    prefix: &str,
    model: Option<&str>,
    overwrite: bool,
    lanes: u8,
) -> anyhow::Result<()> {
    let address = Address::parse(target)?;
    let device = address.device("put")?;
    if address.name.is_some() {
        bail!("put takes HOST:PORT/DEVICE; tensor names come from the file");
    }
    // Read and validated in full before anything reaches the node.
    let contents = read_file(file).with_context(|| format!("reading {}", file.display()))?;
    let node = reach(&address.node, cli).await?;
    let place = format!("{}/{device}", address.node);
    let mut clients = open_lanes(cli, &node, lanes, contents.tensors.len()).await?;
    if let Some(name) = model {
        return put_model(&mut clients, &place, device, name, contents, overwrite).await;
    }
    let tensors: Vec<(TensorKey, TensorData)> = contents
        .tensors
        .into_iter()
        .map(|(name, data)| (TensorKey::new(device, format!("{prefix}{name}")), data))
        .collect();
    let total = sent_bytes(&tensors);
    let count = send(&mut clients, tensors, IfExists::from_overwrite(overwrite)).await?;
    eprintln!("put {count} tensors ({total} bytes) on {place}");
    Ok(())
}

/// The file as a new version of the model `name`: begun and committed (with the file's
/// metadata) on the first connection, its tensors put over every lane. Any failure gives the
/// version up, so that nothing of it is kept.
async fn put_model(
    clients: &mut Vec<Client>,
    place: &str,
    device: u32,
    name: &str,
    contents: FileContents,
    overwrite: bool,
) -> anyhow::Result<()> {
    let FileContents { tensors, metadata } = contents;
    let version = match clients[0].begin_model(device, name, overwrite).await {
        Ok(version) => version,
        Err(e) if e.code() == Some(ErrorCode::AlreadyExists) => bail!(
            "{place} already holds model {name}; nothing was put (--overwrite puts the file as \
             its new version)"
        ),
        Err(e) => return Err(e).with_context(|| format!("beginning model {name} on {place}")),
    };
    let paths: Vec<String> = tensors.iter().map(|(path, _)| path.clone()).collect();
    let tensors: Vec<(TensorKey, TensorData)> = tensors
        .into_iter()
        .map(|(path, data)| {
            let key = TensorKey::new(device, format!("{name}/.v{version}/{path}"));
            (key, data)
        })
        .collect();
    let total = sent_bytes(&tensors);
    let written = async {
        let count = send(clients, tensors, IfExists::Refuse).await?;
        let metadata: Vec<(String, String)> = metadata.into_iter().collect();
        let manifest = clients[0]
            .commit_model(
                device,
                name,
                version,
                paths.iter().map(String::as_str),
                metadata,
            )
            .await
            .context("committing it")?;
        anyhow::Ok((count, manifest))
    }
    .await;
    match written {
        Ok((count, manifest)) => {
            eprintln!(
                "put model {name} version {} ({count} tensors, {total} bytes, {} metadata \
                 pairs) on {place}",
                manifest.version,
                manifest.metadata.len()
            );
            Ok(())
        }
        Err(e) => {
            // The node gives the version up when this connection ends, too; a version the
            // commit already took (and refused) answers that it is not being written.
            if let Some(first) = clients.first_mut()
                && first.in_step()
            {
                let _ = first.abort_model(device, name, version).await;
            }
            Err(e.context(format!(
                "putting model {name} version {version} on {place} failed; nothing of it was kept"
            )))
        }
    }
}

fn sent_bytes(tensors: &[(TensorKey, TensorData)]) -> u64 {
    tensors.iter().map(|(_, d)| d.as_bytes().len() as u64).sum()
}

/// Up to `lanes` connections to the node (no more than the tensors), the first first.
async fn open_lanes(
    cli: &Cli,
    node: &Reached,
    lanes: u8,
    tensors: usize,
) -> anyhow::Result<Vec<Client>> {
    let wanted = usize::from(lanes).min(tensors).max(1);
    let mut first = connect_to(node, cli).await?;
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
            let mut client = connect_to(node, cli).await?;
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
    Ok(clients)
}

/// Puts every tensor, in pipelined batches over the connections, each connection's share sent
/// by a task of its own (so on as many cores): how many, once all are in; an `error:` line per
/// tensor refused, and an error, where any was not.
async fn send(
    clients: &mut Vec<Client>,
    tensors: Vec<(TensorKey, TensorData)>,
    if_exists: IfExists,
) -> anyhow::Result<usize> {
    let bar = progress(sent_bytes(&tensors));
    let count = tensors.len();
    let mut results: Vec<(String, Result<TensorInfo, ClientError>)> = Vec::with_capacity(count);
    let per_batch = BATCH * clients.len().max(1);
    let mut rest = tensors.into_iter().peekable();
    while rest.peek().is_some() {
        // Moved, not copied: a tensor's bytes are sent from where they lie.
        let batch: Arc<[(TensorKey, TensorData)]> = rest.by_ref().take(per_batch).collect();
        let lanes = std::mem::take(clients);
        let given = lanes.len();
        let (lanes, answers) = Client::put_batch_spread(lanes, batch.clone(), if_exists).await;
        // Every lane comes back unless the runtime is shutting down under the command; the
        // first must stay first, as a model version is committed on the connection it began on.
        let all_back = lanes.len() == given;
        *clients = lanes;
        if !all_back {
            bail!("the put was stopped: its runtime is shutting down");
        }
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
    let unsent = count - results.len();
    let count = results.len();
    let checked = check_all(results);
    if unsent > 0 {
        if let Err(e) = checked {
            eprintln!("error: {e:#}");
        }
        bail!("{unsent} more tensors not sent: every connection to the node failed");
    }
    checked?;
    Ok(count)
}
