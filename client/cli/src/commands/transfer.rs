//! `ferry cp` and `ferry mv`: within one node (its devices), or node to node (the target pulls
//! from the source; no tensor byte passes through this process). Either side may be a cluster
//! member, `@NAME`; with `--cluster`, a copy's source may be a tensor's name alone, and the
//! directory picks a holder (the target itself, then a member on its machine, then the least
//! busy of the others that answer: `cluster::choose_weighed`).

use anyhow::bail;
use ferry_client::address::{Address, AddressError};
use ferry_client::cluster::{Located, Source, address_for, choose_weighed};
use ferry_client::{Client, ContentHash, IfExists, Lane, NodeCopy, TensorKey, Transfer};

use crate::Cli;
use crate::connect::{Reached, connect_options, connect_to, directory, reach};
use crate::report::check_all;
use ferry_client::{ClientError, ErrorCode, TensorInfo};
use ferry_proto::cluster::MemberRecord;

pub(crate) async fn transfer(
    cli: &Cli,
    source: &str,
    target: &str,
    remove: bool,
    overwrite: bool,
    lanes: u8,
) -> anyhow::Result<()> {
    let dst = Address::parse(target)?;
    let dst_device = dst.device("the target")?;
    let dst_node = reach(&dst.node, cli).await?;
    let src = match Address::parse(source) {
        Ok(src) => src,
        Err(AddressError::NoNode(_)) if cli.cluster.is_some() && !source.starts_with('@') => {
            if remove {
                bail!(
                    "mv needs the tensor's place, @MEMBER/DEVICE/{source}: a name alone may name \
                     copies on several members"
                );
            }
            return copy_by_name(cli, source, &dst, dst_device, &dst_node, overwrite).await;
        }
        Err(e) => return Err(e.into()),
    };
    let src_device = src.device("the source")?;
    let src_node = reach(&src.node, cli).await?;
    let mut client = connect_to(&src_node, cli).await?;
    let names: Vec<String> = match &src.name {
        Some(name) => vec![name.clone()],
        None => {
            if dst.name.is_some() {
                bail!("a whole device goes to HOST:PORT/DEVICE, without a name");
            }
            client
                .list(Some(src_device))
                .await?
                .into_iter()
                .map(|i| i.key.name)
                .collect()
        }
    };
    let keys: Vec<TensorKey> = names
        .iter()
        .map(|n| TensorKey::new(src_device, n.clone()))
        .collect();
    let mut first = Lane {
        source: client,
        target: connect_to(&dst_node, cli).await?,
    };
    // Between the devices of one node there is nothing to spread: one lane.
    let same_node = same_node(&mut first).await?;
    let wanted = if same_node {
        1
    } else {
        usize::from(lanes).min(keys.len()).max(1)
    };
    let mut lanes = vec![first];
    while lanes.len() < wanted {
        // A lane that cannot be opened (a node's per-address limit, say) leaves the copy to
        // those that could.
        let opened = async {
            Ok::<_, anyhow::Error>(Lane {
                source: connect_to(&src_node, cli).await?,
                target: connect_to(&dst_node, cli).await?,
            })
        };
        match opened.await {
            Ok(lane) => lanes.push(lane),
            Err(e) => {
                eprintln!(
                    "warning: copying over {} lanes of {wanted}: {e:#}",
                    lanes.len()
                );
                break;
            }
        }
    }
    let pull_from = pull_address(&src_node, &dst_node);
    let how = Plan {
        dst: &dst,
        dst_device,
        transfer: Transfer::from_remove_source(remove),
        if_exists: IfExists::from_overwrite(overwrite),
        expect_version: None,
    };
    let count = keys.len();
    how.run(&mut lanes, same_node, &keys, &pull_from).await?;
    let verb = if remove { "moved" } else { "copied" };
    eprintln!(
        "{verb} {count} tensors to {}/{dst_device}",
        dst_node.label()
    );
    Ok(())
}

/// Whether a lane's source and target are one node (two addresses may reach one node: its id
/// tells).
async fn same_node(lane: &mut Lane) -> anyhow::Result<bool> {
    Ok(lane.source.identify().await? == lane.target.identify().await?)
}

/// Where the target node pulls from: an address, and for a member's Unix socket its TCP
/// address to fall back on (a socket that is not there, or another user's, from the target's
/// side: the machine's name that made them look alike can be shared by clones).
struct PullFrom {
    addr: String,
    tcp: Option<String>,
}

impl PullFrom {
    fn member(member: &MemberRecord, addr: String) -> PullFrom {
        let tcp = (addr != member.tcp).then(|| member.tcp.clone());
        PullFrom { addr, tcp }
    }
}

/// The address the target node pulls from: the one the user gave, or for a member the one
/// nearest the target (its Unix socket where both run on one machine, else its TCP address).
fn pull_address(src: &Reached, dst: &Reached) -> PullFrom {
    match (&src.member, &dst.member) {
        (Some(s), Some(d)) => PullFrom::member(s, address_for(s, &d.host)),
        (Some(s), None) => PullFrom::member(s, s.tcp.clone()),
        (None, _) => PullFrom {
            addr: src.addr.clone(),
            tcp: None,
        },
    }
}

/// `ferry cp NAME @TARGET/DEVICE[/NAME]`: the directory's holders of NAME, one chosen.
async fn copy_by_name(
    cli: &Cli,
    name: &str,
    dst: &Address,
    dst_device: u32,
    dst_node: &Reached,
    overwrite: bool,
) -> anyhow::Result<()> {
    let mut directory = directory(cli, "a copy by tensor name").await?;
    let holders = directory.holders(name).await?;
    let members = directory.members().await?;
    // A target named by address may still be a member: its record says which machine it is on.
    let target = dst_node.member_among(&members);
    // The destination itself is no source: a copy onto itself is no copy.
    let dst_name = dst.name.as_deref().unwrap_or(name);
    let is_destination = |h: &ferry_client::cluster::Located| {
        target.as_ref().is_some_and(|t| t.name == h.member)
            && h.device == dst_device
            && h.name == dst_name
    };
    let at_target = holders.iter().find(|h| is_destination(h)).cloned();
    let holders: Vec<_> = holders.into_iter().filter(|h| !is_destination(h)).collect();
    if let Some(listed) = at_target
        && holders.is_empty()
    {
        // The directory's word is not the node's: only the target itself says it holds it.
        let mut target_client = connect_to(dst_node, cli).await?;
        let key = TensorKey::new(dst_device, dst_name);
        confirm_held(&mut target_client, &key, listed.record.content_hash)
            .await
            .map_err(|why| {
                anyhow::anyhow!(
                    "the directory lists {name} on {}/{dst_device}, but {why}; no other member \
                     holds it",
                    dst_node.label()
                )
            })?;
        eprintln!("{}/{dst_device} already holds {name}", dst_node.label());
        return Ok(());
    }
    let (chosen, src_node) = choose_and_say(cli, name, &holders, &members, target.as_ref()).await?;
    let mut lane = Lane {
        source: connect_to(&src_node, cli).await?,
        target: connect_to(dst_node, cli).await?,
    };
    let same_node = same_node(&mut lane).await?;
    let keys = [TensorKey::new(chosen.holder.device, name)];
    let how = Plan {
        dst,
        dst_device,
        transfer: Transfer::Copy,
        if_exists: IfExists::from_overwrite(overwrite),
        expect_version: chosen.holder.record.content_hash,
    };
    let pull_from = PullFrom::member(&chosen.member, chosen.addr.clone());
    how.run(
        std::slice::from_mut(&mut lane),
        same_node,
        &keys,
        &pull_from,
    )
    .await?;
    eprintln!("copied 1 tensors to {}/{dst_device}", dst_node.label());
    Ok(())
}

/// The holder of `name` a copy to `target` reads from (`cluster::choose_weighed`), said on
/// stderr with its load, and reached from here.
pub(crate) async fn choose_and_say(
    cli: &Cli,
    name: &str,
    holders: &[Located],
    members: &[MemberRecord],
    target: Option<&MemberRecord>,
) -> anyhow::Result<(Source, Reached)> {
    let options = connect_options(cli)?;
    let chosen = choose_weighed(name, holders, members, target, &options).await?;
    let load = chosen
        .load
        .as_ref()
        .map_or_else(String::new, |load| format!("; {load}"));
    eprintln!(
        "source: @{}/{}/{name} ({}{load})",
        chosen.holder.member, chosen.holder.device, chosen.addr
    );
    let src_node = Reached {
        addr: address_for(&chosen.member, &ferry_io::machine::name()),
        member: Some(chosen.member.clone()),
    };
    Ok((chosen, src_node))
}

/// That the node `client` reaches holds `key` itself, in the version `listed` (where the
/// directory listed one): its own answer, through a capability granted to itself and given back
/// at once (a capability carries the verified content hash of what the node holds). `Err` says
/// why not.
async fn confirm_held(
    client: &mut Client,
    key: &TensorKey,
    listed: Option<ContentHash>,
) -> Result<(), String> {
    let itself = client.identify().await.map_err(|e| e.to_string())?;
    let grant = match client.grant(key, &itself).await {
        Ok(grant) => grant,
        Err(e) if e.code() == Some(ErrorCode::NotFound) => {
            return Err("that node does not hold it".into());
        }
        Err(e) => return Err(format!("that node did not confirm it: {e}")),
    };
    let held = grant.content_hash;
    client.release(&grant).await.map_err(|e| e.to_string())?;
    match listed {
        Some(listed) if listed != held => Err(format!(
            "that node holds another version ({held}, the directory says {listed})"
        )),
        _ => Ok(()),
    }
}

/// A copy or move of some of the source node's tensors to the target's device.
struct Plan<'a> {
    dst: &'a Address,
    dst_device: u32,
    transfer: Transfer,
    if_exists: IfExists,
    /// The version a copy by name must copy (the directory's hash), where it listed one.
    expect_version: Option<ContentHash>,
}

impl Plan<'_> {
    /// Where `src` goes on the target: the name given, else its own.
    fn dst_key(&self, src: &TensorKey) -> TensorKey {
        let name = self.dst.name.clone().unwrap_or_else(|| src.name.clone());
        TensorKey::new(self.dst_device, name)
    }

    /// The node-to-node copy of `keys` from the node at `source_addr` (as the target reaches it).
    fn node_copy(&self, source_addr: &str, keys: &[TensorKey]) -> NodeCopy {
        let copy = NodeCopy::new(source_addr)
            .transfer(self.transfer)
            .if_exists(self.if_exists);
        keys.iter()
            .fold(copy, |copy, src| match self.expect_version {
                Some(version) => copy.tensor_at(src.clone(), self.dst_key(src), version),
                None => copy.tensor(src.clone(), self.dst_key(src)),
            })
    }

    /// Between the devices of one node where source and target are one ([`same_node`]),
    /// over the first lane; else node to node: the target pulls from `pull_from`, on every
    /// lane at once.
    async fn run(
        &self,
        lanes: &mut [Lane],
        same_node: bool,
        keys: &[TensorKey],
        pull_from: &PullFrom,
    ) -> anyhow::Result<()> {
        let Some(first) = lanes.first_mut() else {
            bail!("no connection to copy over");
        };
        let mut results = Vec::with_capacity(keys.len());
        if same_node {
            for key in keys {
                let answer = first
                    .source
                    .transfer(key, &self.dst_key(key), self.transfer, self.if_exists)
                    .await;
                results.push((key.to_string(), answer));
            }
        } else {
            let answers = self.pull_in_lanes(lanes, keys, pull_from).await;
            for (key, answer) in keys.iter().zip(answers) {
                results.push((key.to_string(), answer));
            }
        }
        check_all(results)
    }

    /// Node to node: the target pulls every key from `pull_from`, over every lane at once
    /// ([`NodeCopy::run_in_lanes`]), one answer per key. Over a member's Unix socket one tensor
    /// goes first, so that a socket that does not serve (not there, another user's, another
    /// node's: two machines may share a name) is found on one pull rather than on all; the
    /// pulls it did not serve go again over the member's TCP address (a failed pull registered
    /// and removed nothing).
    async fn pull_in_lanes(
        &self,
        lanes: &mut [Lane],
        keys: &[TensorKey],
        pull_from: &PullFrom,
    ) -> Vec<Result<TensorInfo, ClientError>> {
        let from = pull_from.addr.as_str();
        let Some(tcp) = pull_from.tcp.as_deref().filter(|_| !keys.is_empty()) else {
            return self.node_copy(from, keys).run_in_lanes(lanes).await;
        };
        // The probe runs alone, on the first lane: the others wait for one tensor's pull.
        let first = &keys[..1];
        let probe = lanes.get_mut(..1).unwrap_or_default();
        let mut answers = self.node_copy(from, first).run_in_lanes(probe).await;
        if unserved(&answers[0]) {
            eprintln!(
                "{} did not serve a pull; pulling over {tcp}",
                pull_from.addr
            );
            return self.node_copy(tcp, keys).run_in_lanes(lanes).await;
        }
        let rest = &keys[1..];
        answers.extend(self.node_copy(from, rest).run_in_lanes(lanes).await);
        let again: Vec<usize> = (0..keys.len()).filter(|&i| unserved(&answers[i])).collect();
        // Over connections still in step: a lane that failed carries nothing more, and the
        // unserved answers say why better than a retry that cannot run.
        if !again.is_empty() && lanes.iter().any(Lane::in_step) {
            eprintln!(
                "{} did not serve {} pulls; pulling those over {tcp}",
                pull_from.addr,
                again.len()
            );
            let retry: Vec<TensorKey> = again.iter().map(|&i| keys[i].clone()).collect();
            let retried = self.node_copy(tcp, &retry).run_in_lanes(lanes).await;
            for (i, answer) in again.into_iter().zip(retried) {
                answers[i] = answer;
            }
        }
        answers
    }
}

/// Whether a pull over a member's Unix socket failed at that socket (unreachable, refused, not
/// an allowed peer of the target, or another node there refusing the capability) rather than
/// at the tensor or the target.
fn unserved(answer: &Result<TensorInfo, ClientError>) -> bool {
    match answer {
        Err(ClientError::Node { code, message }) => {
            matches!(code, ErrorCode::PeerFailed | ErrorCode::CapabilityRefused)
                || (*code == ErrorCode::BadRequest && message.contains("not an allowed peer"))
        }
        _ => false,
    }
}
