//! `ferry cp --model SOURCE/DEVICE/MODEL TARGET/DEVICE[/MODEL]...`: a model's current version
//! copied whole, as a new version of the model on each target with the source's metadata, or
//! nothing of it; to several targets relayed along a chain in the order given, the source
//! sending each byte about once. `ferry mv --model`: the same to one target, and the source's
//! model deleted then, only if that version is still its current one.

use anyhow::{Context, bail};
use ferry_client::address::Address;
use ferry_client::{ClientError, ErrorCode, ModelCopy, Transfer};

use super::relay::{chain_address, chain_of, one_place};
use crate::Cli;
use crate::connect::{connect_to, reach};

pub(crate) async fn copy_model(
    cli: &Cli,
    source: &str,
    targets: &[String],
    overwrite: bool,
) -> anyhow::Result<()> {
    let (src, src_device, name) = model_source(source, "cp")?;
    let (dsts, dst_device, dst_name) = one_place(targets)?;
    let dst_name = dst_name.unwrap_or_else(|| name.clone());
    let src_node = reach(&src.node, cli).await?;
    let mut source_client = connect_to(&src_node, cli).await?;
    let copy = ModelCopy::new(chain_address(&src_node), src_device, &name)
        .to(dst_device, &dst_name)
        .replace(overwrite);
    let (labels, mut chain) = chain_of(cli, &dsts, dst_device).await?;
    let outcome = copy
        .run_relayed(&mut source_client, &mut chain)
        .await
        .with_context(|| format!("holding model {name} on {}/{src_device}", src_node.label()))?;
    let mut failed = 0;
    for (label, outcome) in labels.iter().zip(outcome) {
        match outcome {
            Ok(manifest) => eprintln!(
                "copied model {name} ({} tensors) to {label} as {dst_name} version {}",
                manifest.tensors.len(),
                manifest.version
            ),
            Err(e) => {
                let hint = overwrite_hint(&e);
                eprintln!("error: {label}: {e}{hint}; nothing of it was kept there");
                failed += 1;
            }
        }
    }
    if failed > 0 {
        bail!(
            "model {name} reached {} of {} targets",
            labels.len() - failed,
            labels.len()
        );
    }
    Ok(())
}

pub(crate) async fn move_model(
    cli: &Cli,
    source: &str,
    target: &str,
    overwrite: bool,
) -> anyhow::Result<()> {
    let (src, src_device, name) = model_source(source, "mv")?;
    let (dsts, dst_device, dst_name) = one_place(std::slice::from_ref(&target.to_string()))?;
    let dst_name = dst_name.unwrap_or_else(|| name.clone());
    let src_node = reach(&src.node, cli).await?;
    let dst_node = reach(&dsts[0].node, cli).await?;
    let mut source_client = connect_to(&src_node, cli).await?;
    let mut target_client = connect_to(&dst_node, cli).await?;
    let moved = ModelCopy::new(chain_address(&src_node), src_device, &name)
        .to(dst_device, &dst_name)
        .replace(overwrite)
        .transfer(Transfer::Move)
        .run(&mut source_client, &mut target_client)
        .await
        .map_err(|e| {
            let hint = overwrite_hint(&e);
            anyhow::anyhow!("{e}{hint}")
        })
        .with_context(|| {
            format!(
                "moving model {name} from {}/{src_device} to {}/{dst_device}",
                src_node.label(),
                dst_node.label()
            )
        })?;
    eprintln!(
        "moved model {name} ({} tensors) to {}/{dst_device} as {dst_name} version {}",
        moved.tensors.len(),
        dst_node.label(),
        moved.version
    );
    Ok(())
}

/// A model's place, `HOST:PORT/DEVICE/MODEL`: parsed, with its device and name.
fn model_source(source: &str, command: &str) -> anyhow::Result<(Address, u32, String)> {
    let src = Address::parse(source)?;
    let device = src.device("the source")?;
    let Some(name) = src.name.clone() else {
        bail!("{command} --model takes HOST:PORT/DEVICE/MODEL as its source");
    };
    Ok((src, device, name))
}

/// What a person adds to a refusal to get their way: `--overwrite` where the target holds the
/// model already.
fn overwrite_hint(error: &ClientError) -> &'static str {
    match error.code() {
        Some(ErrorCode::AlreadyExists) => " (--overwrite replaces it)",
        _ => "",
    }
}
