//! `ferry get NODE/DEVICE[/NAME] FILE`: one tensor, a whole device, or a model's current version
//! (with its metadata) into a file.
//!
//! Into a `.safetensors` file the tensors are received straight into the file's pages: its
//! layout is computed from the node's listing, the file is created beside its path, sized and
//! mapped, each tensor's payload lands in its range, and the file is renamed onto the path once
//! every tensor arrived as listed. Into a `.bpk` file they are received first, then written.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, bail};
use ferry_client::address::Address;
use ferry_client::{Client, ClientError, ErrorCode, TensorKey};
use ferry_files::{FileFormat, SafetensorsOutput, write_file};
use ferry_proto::message::ModelManifest;
use ferry_proto::{DType, TensorInfo, WireDType};

use super::BATCH;
use crate::Cli;
use crate::connect::connect;
use crate::progress::progress;

/// One tensor to fetch: where the node holds it, and what it is in the file.
struct Wanted {
    key: TensorKey,
    /// Its name in the file.
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    bytes: u64,
}

impl Wanted {
    fn new(
        key: TensorKey,
        name: String,
        dtype: &WireDType,
        shape: &[u64],
        bytes: u64,
    ) -> anyhow::Result<Wanted> {
        let dtype = DType::try_from(dtype)
            .with_context(|| format!("the node lists {key} with a bad dtype"))?;
        let shape = shape
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<Vec<usize>, _>>()
            .with_context(|| format!("the node lists {key} with a shape too large"))?;
        Ok(Wanted {
            key,
            name,
            dtype,
            shape,
            bytes,
        })
    }

    fn listed(info: &TensorInfo) -> anyhow::Result<Wanted> {
        let name = info.key.name.clone();
        Wanted::new(info.key.clone(), name, &info.dtype, &info.shape, info.bytes)
    }
}

pub(crate) async fn get(cli: &Cli, source: &str, output: &Path, model: bool) -> anyhow::Result<()> {
    let address = Address::parse(source)?;
    let device = address.device("get")?;
    let format = FileFormat::from_path(output)?;
    let mut client = connect(&address.node, cli).await?;
    let place = format!("{}/{device}", address.node);
    if model && address.name.is_none() {
        bail!("get --model takes HOST:PORT/DEVICE/MODEL");
    }
    let mut listing = Vec::new();
    if !model {
        listing = client.list(Some(device)).await?;
    }
    if let Some(name) = &address.name {
        listing.retain(|i| &i.key.name == name);
        // Not a tensor: the model of that name, if there is one.
        if model || (listing.is_empty() && holds_model(&mut client, device, name).await?) {
            return get_model(&mut client, &place, device, name, format, output).await;
        }
        if listing.is_empty() {
            bail!(
                "getting {}: no tensor or model {name} on device {device}",
                address.node
            );
        }
    }
    let wanted = listing
        .iter()
        .map(Wanted::listed)
        .collect::<anyhow::Result<Vec<_>>>()?;
    let written = fetch(&mut client, &wanted, &BTreeMap::new(), format, output).await?;
    eprintln!("wrote {written} tensors to {}", output.display());
    Ok(())
}

/// Whether `device` holds a model `name` (a node older than models holds none).
async fn holds_model(client: &mut Client, device: u32, name: &str) -> anyhow::Result<bool> {
    match client.models(Some(device)).await {
        Ok(models) => Ok(models.iter().any(|m| m.prefix == name)),
        Err(ClientError::NodeTooOld { .. }) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The model's current version, held open while its tensors (named by their paths) and its
/// metadata go into the file.
async fn get_model(
    client: &mut Client,
    place: &str,
    device: u32,
    name: &str,
    format: FileFormat,
    output: &Path,
) -> anyhow::Result<()> {
    let manifest = match client.open_model(device, name).await {
        Ok(manifest) => manifest,
        Err(e) if e.code() == Some(ErrorCode::NotFound) => {
            bail!("getting {place}: no model {name} there")
        }
        Err(e) => return Err(e).with_context(|| format!("opening model {name} on {place}")),
    };
    let fetched = fetch_model(client, &manifest, format, output).await;
    // Let go whether or not it was fetched (the connection's end would, too).
    let closed = client.close_model(&manifest).await;
    let written = fetched?;
    closed.with_context(|| format!("closing model {name} on {place}"))?;
    eprintln!(
        "wrote model {name} version {} ({written} tensors, {} metadata pairs) to {}",
        manifest.version,
        manifest.metadata.len(),
        output.display()
    );
    Ok(())
}

async fn fetch_model(
    client: &mut Client,
    manifest: &ModelManifest,
    format: FileFormat,
    output: &Path,
) -> anyhow::Result<usize> {
    let wanted = manifest
        .tensors
        .iter()
        .map(|entry| {
            let key = TensorKey::new(manifest.device, manifest.name_of(&entry.path));
            let meta = &entry.meta;
            Wanted::new(
                key,
                entry.path.clone(),
                &meta.dtype,
                &meta.shape,
                meta.byte_len,
            )
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let metadata: BTreeMap<String, String> = manifest.metadata.iter().cloned().collect();
    fetch(client, &wanted, &metadata, format, output).await
}

async fn fetch(
    client: &mut Client,
    wanted: &[Wanted],
    metadata: &BTreeMap<String, String>,
    format: FileFormat,
    output: &Path,
) -> anyhow::Result<usize> {
    match format {
        FileFormat::Safetensors => get_into_safetensors(client, wanted, metadata, output).await,
        FileFormat::Burnpack => get_then_write(client, wanted, metadata, output).await,
    }
}

/// Receives every wanted tensor straight into its place in a new safetensors file.
async fn get_into_safetensors(
    client: &mut Client,
    wanted: &[Wanted],
    metadata: &BTreeMap<String, String>,
    output: &Path,
) -> anyhow::Result<usize> {
    let described: Vec<(String, DType, Vec<usize>)> = wanted
        .iter()
        .map(|w| (w.name.clone(), w.dtype, w.shape.clone()))
        .collect();
    let mut file = SafetensorsOutput::create(output, &described, metadata)
        .with_context(|| format!("writing {}", output.display()))?;
    let order = file.data_order().to_vec();
    let bar = progress(wanted.iter().map(|w| w.bytes).sum());
    for batch in order.chunks(BATCH) {
        let keys: Vec<TensorKey> = batch.iter().map(|&i| wanted[i].key.clone()).collect();
        let answers = client
            .get_batch_into(&keys, |j, meta| {
                let w = &wanted[batch[j]];
                // Into the file only as listed; anything else is refused below.
                (meta.dtype() == w.dtype && meta.shape() == w.shape.as_slice())
                    .then(|| file.buffer(batch[j]))
                    .flatten()
            })
            .await?;
        for (&index, answer) in batch.iter().zip(answers) {
            let w = &wanted[index];
            let key = &w.key;
            let data = answer.with_context(|| format!("getting {key}"))?;
            if data.dtype() != w.dtype || data.shape().as_slice() != w.shape.as_slice() {
                bail!(
                    "{key} changed while it was being read (listed as {:?} {:?}, now {:?} \
                     {:?}); nothing was written: run get again",
                    w.dtype,
                    w.shape,
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
    Ok(wanted.len())
}

/// Receives every wanted tensor, then writes them all.
async fn get_then_write(
    client: &mut Client,
    wanted: &[Wanted],
    metadata: &BTreeMap<String, String>,
    output: &Path,
) -> anyhow::Result<usize> {
    let keys: Vec<TensorKey> = wanted.iter().map(|w| w.key.clone()).collect();
    let bar = progress(wanted.iter().map(|w| w.bytes).sum());
    let mut tensors = Vec::with_capacity(keys.len());
    for (batch, names) in keys.chunks(BATCH).zip(wanted.chunks(BATCH)) {
        let answers = client.get_batch(batch).await?;
        for ((key, w), answer) in batch.iter().zip(names).zip(answers) {
            let data = answer.with_context(|| format!("getting {key}"))?;
            if let Some(bar) = &bar {
                bar.inc(data.as_bytes().len() as u64);
            }
            tensors.push((w.name.clone(), data));
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    write_file(output, &tensors, metadata)
        .with_context(|| format!("writing {}", output.display()))?;
    Ok(tensors.len())
}
