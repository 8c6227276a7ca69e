//! `ferry cp --model SOURCE/DEVICE/MODEL TARGET/DEVICE[/MODEL]...`: a model's current version
//! copied whole, as a new version of the model on each target with the source's metadata, or
//! nothing of it; to several targets relayed along a chain in the order given, the source
//! sending each byte about once.

use anyhow::{Context, bail};
use ferry_client::ModelCopy;
use ferry_client::address::Address;

use super::relay::{chain_address, chain_of, one_place};
use crate::Cli;
use crate::connect::{connect_to, reach};

pub(crate) async fn copy_model(
    cli: &Cli,
    source: &str,
    targets: &[String],
    overwrite: bool,
) -> anyhow::Result<()> {
    let src = Address::parse(source)?;
    let src_device = src.device("the source")?;
    let Some(name) = src.name.clone() else {
        bail!("cp --model takes HOST:PORT/DEVICE/MODEL as its source");
    };
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
                eprintln!("error: {label}: {e}; nothing of it was kept there");
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
