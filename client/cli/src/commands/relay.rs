//! `ferry cp SOURCE TARGET TARGET...`: one copy to several nodes, relayed along a chain in the
//! order given (`NodeCopy::run_relayed`): each target pulls every tensor from the nearest node
//! before it that holds it, so the source sends each byte about once. Every target names the
//! same DEVICE[/NAME]; the report says, per target, what it holds.

use anyhow::bail;
use ferry_client::address::Address;
use ferry_client::{IfExists, NodeCopy, RelayTarget, TensorKey};

use crate::Cli;
use crate::connect::{Reached, connect_to, reach};

pub(crate) async fn copy_to_many(
    cli: &Cli,
    source: &str,
    targets: &[String],
    overwrite: bool,
) -> anyhow::Result<()> {
    let src = Address::parse(source)?;
    let src_device = src.device("the source")?;
    let (dsts, dst_device, dst_name) = one_place(targets)?;
    if src.name.is_none() && dst_name.is_some() {
        bail!("a whole device goes to HOST:PORT/DEVICE, without a name");
    }
    let src_node = reach(&src.node, cli).await?;
    let mut source_client = connect_to(&src_node, cli).await?;
    let names: Vec<String> = match &src.name {
        Some(name) => vec![name.clone()],
        None => source_client
            .list(Some(src_device))
            .await?
            .into_iter()
            .map(|i| i.key.name)
            .collect(),
    };
    let mut copy = NodeCopy::new(chain_address(&src_node));
    for name in &names {
        let dst_name = dst_name.clone().unwrap_or_else(|| name.clone());
        copy = copy.tensor(
            TensorKey::new(src_device, name.clone()),
            TensorKey::new(dst_device, dst_name),
        );
    }
    let copy = copy.if_exists(IfExists::from_overwrite(overwrite));
    let (labels, mut chain) = chain_of(cli, &dsts, dst_device).await?;
    let answers = copy.run_relayed(&mut source_client, &mut chain).await;
    let mut failed = 0;
    for (label, answers) in labels.iter().zip(&answers) {
        let held = answers.iter().filter(|a| a.is_ok()).count();
        for (name, answer) in names.iter().zip(answers) {
            if let Err(e) = answer {
                eprintln!("error: {label}: {src_device}/{name}: {e}");
                failed += 1;
            }
        }
        eprintln!("copied {held} of {} tensors to {label}", names.len());
    }
    if failed > 0 {
        bail!(
            "{failed} of {} copies failed ({} tensors to {} targets)",
            names.len() * dsts.len(),
            names.len(),
            dsts.len()
        );
    }
    Ok(())
}

/// The targets, each `NODE/DEVICE[/NAME]` with the same DEVICE[/NAME]: parsed, with that device
/// and name.
pub(crate) fn one_place(targets: &[String]) -> anyhow::Result<(Vec<Address>, u32, Option<String>)> {
    let dsts = targets
        .iter()
        .map(|t| Address::parse(t))
        .collect::<Result<Vec<_>, _>>()?;
    let Some(first) = dsts.first() else {
        bail!("a copy needs a target");
    };
    let device = first.device("a target")?;
    let name = first.name.clone();
    if dsts
        .iter()
        .any(|d| d.device("a target").ok() != Some(device) || d.name != name)
    {
        bail!(
            "a copy to several targets puts each tensor under one key on all of them: give every \
             target the same DEVICE[/NAME]"
        );
    }
    Ok((dsts, device, name))
}

/// The chain of `dsts`, in order: each node reached, with two connections to it; and how each
/// reads in messages (`NODE/DEVICE`).
pub(crate) async fn chain_of(
    cli: &Cli,
    dsts: &[Address],
    device: u32,
) -> anyhow::Result<(Vec<String>, Vec<RelayTarget>)> {
    let mut labels = Vec::with_capacity(dsts.len());
    let mut chain = Vec::with_capacity(dsts.len());
    for dst in dsts {
        let reached = reach(&dst.node, cli).await?;
        chain.push(RelayTarget {
            addr: chain_address(&reached),
            pulls: connect_to(&reached, cli).await?,
            grants: connect_to(&reached, cli).await?,
        });
        labels.push(format!("{}/{device}", reached.label()));
    }
    Ok((labels, chain))
}

/// The address the other nodes pull from this one at: a cluster member's TCP address, else the
/// one given.
pub(crate) fn chain_address(node: &Reached) -> String {
    node.member
        .as_ref()
        .map_or_else(|| node.addr.clone(), |m| m.tcp.clone())
}
