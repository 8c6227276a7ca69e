//! `ferry cp` and `ferry mv`: within one node (its devices), or node to node (the target pulls
//! from the source; no tensor byte passes through this process).

use anyhow::bail;
use ferry_client::address::Address;
use ferry_client::{NodeCopy, TensorKey, copy_between};

use crate::Cli;
use crate::connect::connect;
use crate::report::check_all;

pub(crate) async fn transfer(
    cli: &Cli,
    source: &str,
    target: &str,
    remove: bool,
    overwrite: bool,
) -> anyhow::Result<()> {
    let src = Address::parse(source)?;
    let dst = Address::parse(target)?;
    let src_device = src.device("the source")?;
    let dst_device = dst.device("the target")?;
    let mut client = connect(&src.node, cli).await?;
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
    let mut results = Vec::with_capacity(keys.len());
    // Two addresses (TCP and a Unix socket, say) may reach one node: its id tells.
    let mut target = connect(&dst.node, cli).await?;
    if client.identify().await? == target.identify().await? {
        for key in &keys {
            let answer = client
                .transfer(key, dst_device, dst.name.as_deref(), remove, overwrite)
                .await;
            results.push((key.to_string(), answer));
        }
    } else {
        // Node to node: the target pulls from the source; no tensor byte passes through here.
        let how = NodeCopy {
            source_addr: &src.node,
            dst_device,
            dst_name: dst.name.as_deref(),
            remove_source: remove,
            overwrite,
        };
        let answers = copy_between(&mut client, &mut target, &keys, &how).await?;
        for (key, answer) in keys.iter().zip(answers) {
            results.push((key.to_string(), answer));
        }
    }
    let count = results.len();
    check_all(results)?;
    let verb = if remove { "moved" } else { "copied" };
    eprintln!("{verb} {count} tensors to {}/{dst_device}", dst.node);
    Ok(())
}
