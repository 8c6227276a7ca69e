//! `ferry ls NODE[/DEVICE]`: the tensors a node holds, as text or JSON.

use anyhow::bail;
use ferry_client::address::Address;

use crate::Cli;
use crate::connect::connect;
use crate::report::dtype_text;

pub(crate) async fn ls(cli: &Cli, location: &str, json: bool) -> anyhow::Result<()> {
    let address = Address::parse(location)?;
    if address.name.is_some() {
        bail!("ls takes HOST:PORT or HOST:PORT/DEVICE");
    }
    let mut client = connect(&address.node, cli).await?;
    let all = client.list(address.device).await?;
    if json {
        let rows: Vec<serde_json::Value> = all
            .iter()
            .map(|i| {
                serde_json::json!({
                    "device": i.key.device,
                    "name": i.key.name,
                    "dtype": dtype_text(i),
                    "shape": i.shape,
                    "bytes": i.bytes,
                    "path": i.path,
                })
            })
            .collect();
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
    }
    Ok(())
}
