//! `ferry rm NODE/DEVICE/NAME`: deletes one tensor.

use anyhow::anyhow;
use ferry_client::TensorKey;
use ferry_client::address::Address;

use crate::Cli;
use crate::connect::connect;

pub(crate) async fn rm(cli: &Cli, tensor: &str) -> anyhow::Result<()> {
    let address = Address::parse(tensor)?;
    let device = address.device("rm")?;
    let name = address
        .name
        .clone()
        .ok_or_else(|| anyhow!("rm takes a tensor: HOST:PORT/DEVICE/NAME"))?;
    let mut client = connect(&address.node, cli).await?;
    client.delete(&TensorKey::new(device, name)).await?;
    Ok(())
}
