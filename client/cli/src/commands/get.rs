//! `ferry get NODE/DEVICE[/NAME] FILE`: one tensor or a whole device into a file.
//!
//! Into a `.safetensors` file the tensors are received straight into the file's pages: its
//! layout is computed from the node's listing, the file is created beside its path, sized and
//! mapped, each tensor's payload lands in its range, and the file is renamed onto the path once
//! every tensor arrived as listed. Into a `.bpk` file they are received first, then written.

use std::path::Path;

use anyhow::{Context, bail};
use ferry_client::address::Address;
use ferry_client::{Client, TensorKey};
use ferry_files::{FileFormat, SafetensorsOutput, write_tensors};
use ferry_proto::{DType, TensorInfo};

use super::BATCH;
use crate::Cli;
use crate::connect::connect;
use crate::progress::progress;

pub(crate) async fn get(cli: &Cli, source: &str, output: &Path) -> anyhow::Result<()> {
    let address = Address::parse(source)?;
    let device = address.device("get")?;
    let format = FileFormat::from_path(output)?;
    let mut client = connect(&address.node, cli).await?;
    let mut listing = client.list(Some(device)).await?;
    if let Some(name) = &address.name {
        listing.retain(|i| &i.key.name == name);
        if listing.is_empty() {
            bail!(
                "getting {}: no tensor {name} on device {device}",
                address.node
            );
        }
    }
    let written = match format {
        FileFormat::Safetensors => get_into_safetensors(&mut client, &listing, output).await?,
        FileFormat::Burnpack => get_then_write(&mut client, &listing, output).await?,
    };
    eprintln!("wrote {written} tensors to {}", output.display());
    Ok(())
}

/// Receives every listed tensor straight into its place in a new safetensors file.
async fn get_into_safetensors(
    client: &mut Client,
    listing: &[TensorInfo],
    output: &Path,
) -> anyhow::Result<usize> {
    let described = listing
        .iter()
        .map(|info| {
            let dtype = DType::try_from(&info.dtype)
                .with_context(|| format!("the node lists {} with a bad dtype", info.key))?;
            let shape = info
                .shape
                .iter()
                .map(|&d| usize::try_from(d))
                .collect::<Result<Vec<usize>, _>>()
                .with_context(|| format!("the node lists {} with a shape too large", info.key))?;
            Ok((info.key.name.clone(), dtype, shape))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut file = SafetensorsOutput::create(output, &described)
        .with_context(|| format!("writing {}", output.display()))?;
    let order = file.data_order().to_vec();
    let bar = progress(listing.iter().map(|i| i.bytes).sum());
    for batch in order.chunks(BATCH) {
        let keys: Vec<TensorKey> = batch.iter().map(|&i| listing[i].key.clone()).collect();
        let answers = client
            .get_batch_into(&keys, |j, meta| {
                let (_, dtype, shape) = &described[batch[j]];
                // Into the file only as listed; anything else is refused below.
                (meta.dtype() == *dtype && meta.shape() == shape.as_slice())
                    .then(|| file.buffer(batch[j]))
                    .flatten()
            })
            .await?;
        for (&index, answer) in batch.iter().zip(answers) {
            let key = &listing[index].key;
            let data = answer.with_context(|| format!("getting {key}"))?;
            let (_, dtype, shape) = &described[index];
            if data.dtype() != *dtype || data.shape().as_slice() != shape.as_slice() {
                bail!(
                    "{key} changed while it was being read (listed as {dtype:?} {shape:?}, now \
                     {:?} {:?}); nothing was written: run get again",
                    data.dtype(),
                    data.shape()
                );
            }
            if let Some(bar) = &bar {
                bar.inc(data.as_bytes().len() as u64);
            }
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    file.commit()
        .with_context(|| format!("writing {}", output.display()))?;
    Ok(listing.len())
}

/// Receives every listed tensor, then writes them all.
async fn get_then_write(
    client: &mut Client,
    listing: &[TensorInfo],
    output: &Path,
) -> anyhow::Result<usize> {
    let keys: Vec<TensorKey> = listing.iter().map(|i| i.key.clone()).collect();
    let bar = progress(listing.iter().map(|i| i.bytes).sum());
    let mut tensors = Vec::with_capacity(keys.len());
    for batch in keys.chunks(BATCH) {
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
    Ok(tensors.len())
}
