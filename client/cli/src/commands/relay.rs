//! `ferry cp SOURCE TARGET TARGET...`: one copy to several nodes, relayed along a chain in the
//! order given (`NodeCopy::run_relayed`): each target pulls every tensor from the nearest node
//! before it that holds it, so the source sends each byte about once. Every target names the
//! same DEVICE[/NAME]; the report says, per target, what it holds. With `--cluster`, the source
//! may be a tensor's name alone: the chain starts at the holder `cluster::choose_weighed` picks
//! for the first target.

use anyhow::bail;
use ferry_client::address::{Address, AddressError};
use ferry_client::cluster::Located;
use ferry_client::{ClientError, IfExists, NodeCopy, RelayTarget, TensorInfo, TensorKey};

use super::transfer::choose_and_say;
use crate::Cli;
use crate::connect::{Reached, connect_to, directory, reach};

pub(crate) async fn copy_to_many(
    cli: &Cli,
    source: &str,
    targets: &[String],
    overwrite: bool,
) -> anyhow::Result<()> {
    let src = match Address::parse(source) {
        Ok(src) => src,
        Err(AddressError::NoNode(_)) if cli.cluster.is_some() && !source.starts_with('@') => {
            return relay_by_name(cli, source, targets, overwrite).await;
        }
        Err(e) => return Err(e.into()),
    };
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
    report(&labels, src_device, &names, &answers)
}

/// `ferry cp NAME NODE/DEVICE[/NAME]...` with `--cluster`: the holder of NAME chosen for the
/// first target (nearest, least busy, answering), its listed version relayed along the chain.
async fn relay_by_name(
    cli: &Cli,
    name: &str,
    targets: &[String],
    overwrite: bool,
) -> anyhow::Result<()> {
    let (dsts, dst_device, dst_name) = one_place(targets)?;
    let dst_name = dst_name.unwrap_or_else(|| name.to_string());
    let mut directory = directory(cli, "a copy by tensor name").await?;
    let members = directory.members().await?;
    let reached = reach_all(cli, &dsts).await?;
    // A target named by address may still be a member: its record says which machine it is on.
    let target_members: Vec<_> = reached.iter().map(|r| r.member_among(&members)).collect();
    // A target is no source for the chain it is in.
    let is_target = |h: &Located| {
        h.device == dst_device
            && h.name == dst_name
            && target_members.iter().flatten().any(|t| t.name == h.member)
    };
    let (at_targets, holders): (Vec<Located>, Vec<Located>) = directory
        .holders(name)
        .await?
        .into_iter()
        .partition(|h| is_target(h));
    if holders.is_empty() && !at_targets.is_empty() {
        bail!(
            "every holder of {name} the directory lists is one of the targets (as {dst_device}/\
             {dst_name}): there is no other to copy from"
        );
    }
    let first = target_members.first().cloned().flatten();
    let (chosen, src_node) = choose_and_say(cli, name, &holders, &members, first.as_ref()).await?;
    let mut source_client = connect_to(&src_node, cli).await?;
    let src = TensorKey::new(chosen.holder.device, name);
    let dst = TensorKey::new(dst_device, dst_name);
    let copy = NodeCopy::new(chain_address(&src_node));
    let copy = match chosen.holder.record.content_hash {
        Some(version) => copy.tensor_at(src, dst, version),
        None => copy.tensor(src, dst),
    }
    .if_exists(IfExists::from_overwrite(overwrite));
    let (labels, mut chain) = connect_chain(cli, &reached, dst_device).await?;
    let answers = copy.run_relayed(&mut source_client, &mut chain).await;
    report(&labels, chosen.holder.device, &[name.to_string()], &answers)
}

/// Says, per target, which of `names` (from `src_device`) it holds and why each other failed;
/// an error where any failed.
fn report(
    labels: &[String],
    src_device: u32,
    names: &[String],
    answers: &[Vec<Result<TensorInfo, ClientError>>],
) -> anyhow::Result<()> {
    let mut failed = 0;
    for (label, answers) in labels.iter().zip(answers) {
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
            names.len() * labels.len(),
            names.len(),
            labels.len()
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
    connect_chain(cli, &reach_all(cli, dsts).await?, device).await
}

/// Each of `dsts`' nodes, found.
async fn reach_all(cli: &Cli, dsts: &[Address]) -> anyhow::Result<Vec<Reached>> {
    let mut reached = Vec::with_capacity(dsts.len());
    for dst in dsts {
        reached.push(reach(&dst.node, cli).await?);
    }
    Ok(reached)
}

/// [`chain_of`] for nodes already reached.
async fn connect_chain(
    cli: &Cli,
    reached: &[Reached],
    device: u32,
) -> anyhow::Result<(Vec<String>, Vec<RelayTarget>)> {
    let mut labels = Vec::with_capacity(reached.len());
    let mut chain = Vec::with_capacity(reached.len());
    for node in reached {
        chain.push(RelayTarget {
            addr: chain_address(node),
            pulls: connect_to(node, cli).await?,
            grants: connect_to(node, cli).await?,
        });
        labels.push(format!("{}/{device}", node.label()));
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
