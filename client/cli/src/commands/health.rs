//! `ferry health NODE`: exits 0 with one `ok` line if the node answers within the timeout.

use anyhow::anyhow;
use ferry_client::address::Address;

use crate::Cli;
use crate::connect::connect;

pub(crate) async fn health(cli: &Cli, node: &str, timeout: u64) -> anyhow::Result<()> {
    let address = Address::parse(node)?;
    let check = async {
        let mut client = connect(&address.node, cli).await?;
        let stats = client.stat().await?;
        anyhow::Ok(stats)
    };
    let stats = tokio::time::timeout(std::time::Duration::from_secs(timeout), check)
        .await
        .map_err(|_| anyhow!("{node} did not answer within {timeout} s"))??;
    let tensors: u64 = stats.devices.iter().map(|d| d.tensors).sum();
    println!(
        "ok {} ({} devices, {tensors} tensors, {} connections)",
        stats.node_id,
        stats.devices.len(),
        stats.connections
    );
    Ok(())
}
