//! `ferry ls NODE[/DEVICE]`: the tensors and models a node holds, as text or JSON (NODE may be
//! `@NAME`);
//! `ferry ls @[NAME]`: a cluster's members and where each tensor lives, from its etcd
//! (`--cluster`).

use anyhow::bail;
use ferry_client::ClientError;
use ferry_client::address::Address;

use crate::Cli;
use crate::connect::connect;
use crate::report::dtype_text;

pub(crate) async fn ls(cli: &Cli, location: &str, json: bool) -> anyhow::Result<()> {
    if let Some(member) = location.strip_prefix('@')
        && !member.contains('/')
    {
        return ls_cluster(cli, member, json).await;
    }
    let address = Address::parse(location)?;
    if address.name.is_some() {
        bail!("ls takes HOST:PORT or HOST:PORT/DEVICE");
    }
    let mut client = connect(&address.node, cli).await?;
    let all = client.list(address.device).await?;
    // A node older than models has none to list.
    let models = match client.models(address.device).await {
        Ok(models) => models,
        Err(ClientError::NodeTooOld { .. }) => Vec::new(),
        Err(e) => return Err(e.into()),
    };
    if json {
        let tensors = all.iter().map(|i| {
            serde_json::json!({
                "device": i.key.device,
                "name": i.key.name,
                "dtype": dtype_text(i),
                "shape": i.shape,
                "bytes": i.bytes,
                "path": i.path,
            })
        });
        let models = models.iter().map(|m| {
            serde_json::json!({
                "device": m.device,
                "name": m.prefix,
                "model": {
                    "version": m.version,
                    "tensors": m.tensors,
                    "bytes": m.bytes,
                    "applies": m.applies,
                },
            })
        });
        let rows: Vec<serde_json::Value> = tensors.chain(models).collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        for i in &all {
            let shape: Vec<String> = i.shape.iter().map(|d| d.to_string()).collect();
            println!(
                "{}\t{}\t{}\t[{}]\t{}",
                i.key.device,
                i.key.name,
                dtype_text(i),
                shape.join(", "),
                i.bytes
            );
        }
        // A model's line: its prefix, the version applies read, and its tensors (each listed
        // above under PREFIX/.vVERSION/).
        for m in &models {
            println!(
                "{}\t{}\tmodel v{}\t{} tensors\t{}\t{} applies",
                m.device, m.prefix, m.version, m.tensors, m.bytes, m.applies
            );
        }
    }
    Ok(())
}

/// `ferry ls @` (every member) or `ferry ls @NAME` (one).
async fn ls_cluster(cli: &Cli, member: &str, json: bool) -> anyhow::Result<()> {
    let member = (!member.is_empty()).then_some(member);
    let mut directory = crate::connect::directory(cli, "ls @").await?;
    let mut members = directory.members().await?;
    if let Some(name) = member {
        members.retain(|m| m.name == name);
        if members.is_empty() {
            bail!("no member @{name} is registered in the cluster");
        }
    }
    let tensors = directory.tensors(member).await?;
    if json {
        let members: Vec<serde_json::Value> = members
            .iter()
            .map(|m| {
                serde_json::json!({
                    "name": m.name, "node_id": m.node_id, "tcp": m.tcp, "unix": m.unix,
                    "host": m.host,
                    "devices": m.devices.iter().map(|d| serde_json::json!({
                        "index": d.index, "backend": d.backend, "device": d.device,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        let tensors: Vec<serde_json::Value> = tensors
            .iter()
            .map(|t| {
                serde_json::json!({
                    "member": t.member, "device": t.device, "name": t.name,
                    "dtype": t.record.dtype, "shape": t.record.shape, "bytes": t.record.bytes,
                    "content_hash": t.record.content_hash,
                })
            })
            .collect();
        let value = serde_json::json!({"members": members, "tensors": tensors});
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        for m in &members {
            let devices: Vec<String> = m
                .devices
                .iter()
                .map(|d| format!("{}:{}", d.index, d.backend))
                .collect();
            println!(
                "@{}\t{}\t{}\t[{}]",
                m.name,
                m.tcp,
                m.unix.as_deref().unwrap_or("-"),
                devices.join(", ")
            );
        }
        for t in &tensors {
            let shape: Vec<String> = t.record.shape.iter().map(|d| d.to_string()).collect();
            println!(
                "@{}/{}/{}\t{}\t[{}]\t{}",
                t.member,
                t.device,
                t.name,
                t.record.dtype,
                shape.join(", "),
                t.record.bytes
            );
        }
    }
    Ok(())
}
