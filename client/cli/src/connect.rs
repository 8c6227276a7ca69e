//! Connecting to a node with the command line's token, TLS and shared-memory settings.

use anyhow::Context;
use ferry_client::{Client, ClientConfig};

use crate::Cli;

pub(crate) async fn connect(node: &str, cli: &Cli) -> anyhow::Result<Client> {
    Client::connect_with(node, client_config(cli)?)
        .await
        .with_context(|| format!("connecting to {node}"))
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
    let tls = match (&cli.tls_ca, &cli.tls_cert, &cli.tls_key) {
        (Some(ca), Some(cert), Some(key)) => {
            let files = ferry_io::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            };
            Some(ferry_io::ClientTls::load(&files).context("loading the TLS files")?)
        }
        // clap requires all three together.
        _ => None,
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
