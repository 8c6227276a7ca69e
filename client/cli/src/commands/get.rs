//! `ferry get NODE/DEVICE[/NAME] FILE`: one tensor or a whole device into a file.

use std::path::Path;

use anyhow::Context;
use ferry_cli::files::write_tensors;
use ferry_client::TensorKey;
use ferry_client::address::Address;

use super::BATCH;
use crate::Cli;
use crate::connect::connect;
use crate::progress::progress;

pub(crate) async fn get(cli: &Cli, source: &str, output: &Path) -> anyhow::Result<()> {
    let address = Address::parse(source)?;
    let device = address.device("get")?;
    let mut client = connect(&address.node, cli).await?;
    let infos = match &address.name {
        Some(name) => vec![TensorKey::new(device, name.clone())],
        None => client
            .list(Some(device))
            .await?
            .into_iter()
            .map(|i| i.key)
            .collect(),
    };
    let mut listing = client.list(Some(device)).await?;
    listing.retain(|i| infos.contains(&i.key));
    let total: u64 = listing.iter().map(|i| i.bytes).sum();
    let bar = progress(total);
    let mut tensors = Vec::with_capacity(infos.len());
    for batch in infos.chunks(BATCH) {
        for (key, answer) in batch.iter().zip(client.get_batch(batch).await?) {
            let data = answer.with_context(|| format!("getting {key}"))?;
            if let Some(bar) = &bar {
                bar.inc(data.as_bytes().len() as u64);
            }
            tensors.push((key.name.clone(), data));
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    write_tensors(output, &tensors).with_context(|| format!("writing {}", output.display()))?;
    eprintln!("wrote {} tensors to {}", tensors.len(), output.display());
    Ok(())
}
