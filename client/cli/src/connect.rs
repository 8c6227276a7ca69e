//! Connecting to a node with the command line's token, TLS and shared-memory settings.

use anyhow::Context;
use ferry_client::{Client, ClientConfig, Endpoint};

use crate::Cli;

pub(crate) async fn connect(node: &str, cli: &Cli) -> anyhow::Result<Client> {
    let config = client_config(cli)?;
    check_token_stays_private(node, &config, cli)?;
    Client::connect_with(node, config)
        .await
        .with_context(|| format!("connecting to {node}"))
}

/// A token sent over TCP in clear to a host beyond loopback can be read by anyone on the path:
/// refused unless TLS is on or the user said `--insecure`.
pub(crate) fn check_token_stays_private(
    node: &str,
    config: &ClientConfig,
    cli: &Cli,
) -> anyhow::Result<()> {
    let Endpoint::Tcp(addr) = Endpoint::parse(node) else {
        return Ok(());
    };
    if config.token.is_none() || config.tls.is_some() || cli.insecure || is_loopback(&addr) {
        return Ok(());
    }
    anyhow::bail!(
        "refusing to send a token to {addr} in clear: give --tls-ca, --tls-cert and --tls-key \
         (or FERRY_TLS_*), or pass --insecure on a network you trust"
    )
}

/// Whether `HOST:PORT` names this machine's loopback (`localhost`, `127.0.0.0/8`, `::1`).
fn is_loopback(addr: &str) -> bool {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

pub(crate) fn client_config(cli: &Cli) -> anyhow::Result<ClientConfig> {
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
    };
    let files = ferry_io::TlsFiles::from_flags(
        cli.tls_cert.as_deref(),
        cli.tls_key.as_deref(),
        cli.tls_ca.as_deref(),
    )?;
    let tls = match files {
        Some(files) => Some(ferry_io::ClientTls::load(&files).context("loading the TLS files")?),
        None => None,
    };
    Ok(ClientConfig {
        token,
        tls,
        disable_shared_memory: cli.no_shm,
        limits: ferry_client::ConnectionLimits {
            region_min: usize::try_from(cli.shm_min.as_u64()).unwrap_or(usize::MAX),
            ..Default::default()
        },
        ..ClientConfig::default()
    })
}
