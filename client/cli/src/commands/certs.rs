//! `ferry certs`: a CA and node and client certificates for a first cluster, in one directory
//! (a CA already there is reused; nothing is overwritten).

use std::path::Path;

use anyhow::{Context, bail};
use ferry_certs::{CA_CERT, CertDir, Role, Validity};

/// How long the CA `ferry certs` makes is valid: long enough that a first cluster's
/// certificates expire before it does.
const CA_DAYS: u32 = 3650;

/// Makes the CA (unless `dir` holds one) and a certificate for each node (`NAME` or
/// `NAME=HOST[,HOST...]`) and client (`NAME`).
pub(crate) fn certs(
    dir: &Path,
    nodes: &[String],
    clients: &[String],
    days: u32,
) -> anyhow::Result<()> {
    if nodes.is_empty() && clients.is_empty() {
        bail!("name at least one --node or --client");
    }
    if days == 0 {
        bail!("--days must be at least 1");
    }
    let certs = CertDir::open(dir)?;
    let (authority, new) = certs.authority(Validity::days(CA_DAYS))?;
    let ca = certs.path(CA_CERT);
    if new {
        println!(
            "made a CA: {} (its key {} stays here)",
            ca.display(),
            certs.path(ferry_certs::CA_KEY).display()
        );
    } else {
        println!("using the CA in {}", ca.display());
    }
    let validity = Validity::days(days);
    for node in nodes {
        let (name, hosts) = match node.split_once('=') {
            Some((name, hosts)) => (
                name,
                hosts
                    .split(',')
                    .filter(|h| !h.is_empty())
                    .map(str::to_string)
                    .collect(),
            ),
            None => (node.as_str(), Vec::new()),
        };
        let role = Role::Node { hosts };
        certs
            .issue(&authority, name, &role, validity)
            .with_context(|| format!("node {name}"))?;
        println!(
            "node {name}: ferry-server --tls-cert {} --tls-key {} --tls-ca {}",
            certs.cert(name).display(),
            certs.key(name).display(),
            ca.display()
        );
    }
    for name in clients {
        certs
            .issue(&authority, name, &Role::Client, validity)
            .with_context(|| format!("client {name}"))?;
        println!(
            "client {name}: ferry --tls-cert {} --tls-key {} --tls-ca {} ...",
            certs.cert(name).display(),
            certs.key(name).display(),
            ca.display()
        );
    }
    Ok(())
}
