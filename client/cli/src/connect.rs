//! Connecting to a node, named by address or as `@NAME` (a member of the cluster `--cluster`
//! names), with the command line's token, TLS and shared-memory settings.

use anyhow::{Context, bail};
use ferry_client::cluster::{Directory, EtcdUser, address_for, connect_nearest};
use ferry_client::{ClearTokens, Client, ConnectOptions, LocalServer, SharedMemory, Token};
use ferry_proto::NodeId;
use ferry_proto::cluster::MemberRecord;

use crate::Cli;

/// A node the command line named, found: the address to dial, and the member it is where it was
/// named `@NAME`.
pub(crate) struct Reached {
    pub(crate) addr: String,
    pub(crate) member: Option<MemberRecord>,
}

impl Reached {
    /// The member this node is: the one it was named as, or, named by address, the member
    /// registered at that address (its record says which machine it is on).
    pub(crate) fn member_among(&self, members: &[MemberRecord]) -> Option<MemberRecord> {
        self.member.clone().or_else(|| {
            members
                .iter()
                .find(|m| m.tcp == self.addr || m.unix.as_deref() == Some(&self.addr))
                .cloned()
        })
    }

    /// How the node reads in messages: `@NAME (ADDR)` or `ADDR`.
    pub(crate) fn label(&self) -> String {
        match &self.member {
            Some(m) => format!("@{} ({})", m.name, self.addr),
            None => self.addr.clone(),
        }
    }
}

/// The cluster's directory, from `--cluster`.
pub(crate) async fn directory(cli: &Cli, what: &str) -> anyhow::Result<Directory> {
    let Some(cluster) = &cli.cluster else {
        bail!(
            "{what} reads the cluster's directory: say --cluster etcd://HOST:PORT (or FERRY_CLUSTER)"
        );
    };
    // etcd over TLS (`etcds://`) takes this command's certificate.
    let directory =
        Directory::connect_as(cluster, client_tls(cli)?.as_ref(), etcd_user(cli)?).await?;
    Ok(if cli.member_ids.is_empty() {
        directory
    } else {
        directory.admitting(cli.member_ids.iter().map(|id| NodeId::from(id.as_str())))
    })
}

/// The etcd user of `--etcd-user` and `--etcd-password-file`.
pub(crate) fn etcd_user(cli: &Cli) -> anyhow::Result<Option<EtcdUser>> {
    let (Some(name), Some(path)) = (&cli.etcd_user, &cli.etcd_password_file) else {
        return Ok(None);
    };
    let password = password_in(path).context("--etcd-password-file")?;
    EtcdUser::new(name.clone(), password)
        .map(Some)
        .context("--etcd-user is empty")
}

/// The password in a file: its first line that is neither blank nor a `#` comment.
pub(crate) fn password_in(path: &std::path::Path) -> anyhow::Result<String> {
    use std::os::unix::fs::PermissionsExt;
    let metadata =
        std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if metadata.permissions().mode() & 0o077 != 0 {
        eprintln!(
            "warning: {} is readable by other users; chmod 600 it",
            path.display()
        );
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    ferry_io::credential::token_from_file(&text).with_context(|| format!("{}", path.display()))
}

/// Finds the node `node` names: an address as it is, `@NAME` through the directory (its Unix
/// socket where it runs on this machine, else its TCP address).
pub(crate) async fn reach(node: &str, cli: &Cli) -> anyhow::Result<Reached> {
    let Some(name) = node.strip_prefix('@') else {
        return Ok(Reached {
            addr: node.to_string(),
            member: None,
        });
    };
    let member = directory(cli, &format!("@{name}"))
        .await?
        .resolve(name)
        .await?;
    Ok(Reached {
        addr: address_for(&member, &ferry_io::machine::name()),
        member: Some(member),
    })
}

pub(crate) async fn connect(node: &str, cli: &Cli) -> anyhow::Result<Client> {
    connect_to(&reach(node, cli).await?, cli).await
}

/// Connects to a node found by [`reach`]; a member must be the node it registered as
/// ([`connect_nearest`]).
pub(crate) async fn connect_to(reached: &Reached, cli: &Cli) -> anyhow::Result<Client> {
    let options = connect_options(cli)?;
    let connected = match &reached.member {
        // A token in clear over TCP to a member is refused there (`UncheckedMember`).
        Some(member) => connect_nearest(member, options).await,
        None => options.to(reached.addr.as_str()).await,
    };
    connected.with_context(|| format!("connecting to {}", reached.label()))
}

/// This command's TLS, where its flags give it.
pub(crate) fn client_tls(cli: &Cli) -> anyhow::Result<Option<ferry_io::ClientTls>> {
    let files = ferry_io::TlsFiles::from_flags(
        cli.tls_cert.as_deref(),
        cli.tls_key.as_deref(),
        cli.tls_ca.as_deref(),
    )?;
    Ok(match files {
        Some(files) => Some(ferry_io::ClientTls::load(&files).context("loading the TLS files")?),
        None => None,
    })
}

/// How every connection of this command connects: the token, TLS, `--insecure` and
/// shared-memory flags. The library keeps a token in clear to loopback ports this user or root
/// holds; `--insecure` lets it go in clear beyond loopback too.
pub(crate) fn connect_options(cli: &Cli) -> anyhow::Result<ConnectOptions> {
    let token = match &cli.token_file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            Some(
                ferry_io::credential::token_from_file(&text)
                    .with_context(|| format!("{}", path.display()))?,
            )
        }
        None => cli.token.clone(),
    }
    .map(Token::from);
    let tls = client_tls(cli)?;
    if token.is_some() && tls.is_some() {
        // Once a command: it may open several connections.
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            eprintln!(
                "warning: the token is not sent under TLS (the certificate is the credential \
                 there); a node that still asks for one under TLS refuses this command"
            );
        });
    }
    let shared_memory = if cli.no_shm {
        SharedMemory::Decline
    } else {
        SharedMemory::Offer
    };
    let clear_tokens = if cli.insecure {
        ClearTokens::Anywhere {
            server: LocalServer::ThisUserOrRoot,
        }
    } else {
        ClearTokens::LoopbackOnly {
            server: LocalServer::ThisUserOrRoot,
        }
    };
    Ok(ConnectOptions::default()
        .token_if_any(token)
        .tls_if_any(tls)
        .clear_tokens(clear_tokens)
        .shared_memory(shared_memory)
        .limits(ferry_client::ConnectionLimits {
            region_min: usize::try_from(cli.shm_min.as_u64()).unwrap_or(usize::MAX),
            ..Default::default()
        }))
}
