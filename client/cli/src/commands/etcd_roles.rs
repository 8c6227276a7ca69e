//! `ferry etcd-roles`: etcd's users and roles for a ferry cluster, so that with etcd's auth on
//! each member writes its own keys alone (`ferry_client::etcd_roles`).

use std::path::Path;

use anyhow::{Context, bail};
use ferry_client::etcd_roles;
use ferry_etcd::Etcd;

use crate::Cli;
use crate::connect::{client_tls, etcd_user, password_in};

/// How long etcd may take to answer each call.
const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Adds each member (`NAME=PASSWORD_FILE`) and reader (`USER=PASSWORD_FILE`), then turns auth
/// on where `enable_auth` gives root's password.
pub(crate) async fn etcd_roles(
    cli: &Cli,
    members: &[String],
    readers: &[String],
    enable_auth: Option<&Path>,
) -> anyhow::Result<()> {
    if members.is_empty() && readers.is_empty() && enable_auth.is_none() {
        bail!("name at least one --member or --reader, or --enable-auth");
    }
    // Every file read and every name checked before etcd is changed at all.
    let members = members
        .iter()
        .map(|m| named_password(m, "--member"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    for (name, _) in &members {
        anyhow::ensure!(
            ferry_proto::cluster::valid_member_name(name),
            "--member {name:?}: 1 to 63 letters, digits, '-', '_' or '.', not starting with '.'"
        );
    }
    let readers = readers
        .iter()
        .map(|r| named_password(r, "--reader"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let root = enable_auth.map(password_in).transpose()?;
    let Some(cluster) = &cli.cluster else {
        bail!(
            "etcd-roles changes the cluster's etcd: say --cluster etcd://HOST:PORT (or FERRY_CLUSTER)"
        );
    };
    let endpoints = ferry_proto::cluster::endpoints(cluster)
        .map_err(|e| anyhow::anyhow!("--cluster {cluster:?}: {e}"))?;
    let tls = client_tls(cli)?.map(|t| t.connector());
    let mut etcd = Etcd::connect_as(&endpoints, TIMEOUT, tls, etcd_user(cli)?).await?;
    for (name, password) in &members {
        etcd_roles::add_member(&mut etcd, name, name, Some(password))
            .await
            .with_context(|| format!("adding member {name}"))?;
        println!(
            "member {name}: etcd user {name}, role {}",
            etcd_roles::member_role(name)
        );
    }
    for (user, password) in &readers {
        etcd_roles::add_reader(&mut etcd, user, Some(password))
            .await
            .with_context(|| format!("adding reader {user}"))?;
        println!("reader {user}: role {}", etcd_roles::READER_ROLE);
    }
    if let Some(root) = root {
        etcd_roles::enable_auth(&mut etcd, &root)
            .await
            .context("turning etcd's auth on")?;
        println!("auth on: from now on etcd's users and roles decide (user root for changes)");
    }
    Ok(())
}

/// `NAME=PASSWORD_FILE`: the name and the file's password.
fn named_password(arg: &str, flag: &str) -> anyhow::Result<(String, String)> {
    let (name, path) = arg
        .split_once('=')
        .filter(|(name, path)| !name.is_empty() && !path.is_empty())
        .with_context(|| format!("{flag} {arg:?}: NAME=PASSWORD_FILE"))?;
    Ok((name.to_string(), password_in(Path::new(path))?))
}
