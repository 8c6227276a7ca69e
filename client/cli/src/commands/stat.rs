//! `ferry stat NODE`: a node's devices, counters and shared-memory use, as text or JSON; with
//! `--holds`, what each device measured that it stores bit-exact.

use ferry_client::address::Address;
use ferry_proto::dtype_name;

use crate::Cli;
use crate::connect::connect;

pub(crate) async fn stat(cli: &Cli, node: &str, json: bool, holds: bool) -> anyhow::Result<()> {
    let address = Address::parse(node)?;
    let mut client = connect(&address.node, cli).await?;
    let stats = client.stat().await?;
    let mut tables = Vec::new();
    if holds {
        for d in &stats.devices {
            tables.push((d.index, client.holds(d.index).await?));
        }
    }
    if json {
        let mut value = serde_json::to_value(&stats)?;
        if holds {
            let by_device: serde_json::Map<String, serde_json::Value> = tables
                .iter()
                .map(|(index, table)| {
                    let rows = table
                        .iter()
                        .map(|p| {
                            serde_json::json!({
                                "dtype": dtype_name(&p.dtype),
                                "shape": p.shape,
                                "refused": p.refused,
                            })
                        })
                        .collect();
                    (index.to_string(), serde_json::Value::Array(rows))
                })
                .collect();
            value["holds"] = serde_json::Value::Object(by_device);
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        // 0: a node of a minor before 7, which does not say.
        let up = match stats.uptime_ms {
            0 => String::new(),
            ms => format!(", up {:.0} s", ms as f64 / 1e3),
        };
        println!(
            "{} {} ({} policy{up})",
            stats.agent, stats.node_id, stats.transfer_policy
        );
        for d in &stats.devices {
            let mut limit = d
                .memory_limit
                .map_or_else(|| "no limit".to_string(), |l| format!("limit {l}"));
            if let Some(largest) = d.largest_tensor {
                limit.push_str(&format!(", at most {largest} bytes a tensor"));
            }
            println!(
                "device {}: {} {}, {} tensors, {} bytes ({limit}); holds {} of {} probes bit-exact",
                d.index,
                d.backend,
                d.device,
                d.tensors,
                d.bytes_held,
                d.holds_exact,
                d.holds_measured
            );
        }
        println!(
            "transfers: {} done, {} failed; in-node paths: {} native, {} round-trip; {} connections",
            stats.transfers_done,
            stats.transfers_failed,
            stats.native_transfers,
            stats.round_trip_transfers,
            stats.connections
        );
        println!(
            "node to node: {} pulled ({} retries, {} skipped as duplicates), {} served, {} serving now ({} bytes)",
            stats.pulls,
            stats.pull_retries,
            stats.dedup_hits,
            stats.fetches_served,
            stats.fetches_in_flight,
            stats.fetch_bytes_in_flight
        );
        println!(
            "unix socket: {}; shared memory: {}; {} payloads sent and {} received through it ({} bytes), {} regions in flight",
            stats.unix_socket.as_deref().unwrap_or("none"),
            if stats.shared_memory { "on" } else { "off" },
            stats.shm_payloads_sent,
            stats.shm_payloads_received,
            stats.shm_bytes,
            stats.regions_in_flight
        );
        println!(
            "memory: {} resident ({} peak); receive pool {} bytes, {} free, {} misses; {} recycled bytes kept",
            stats.resident_bytes,
            stats.peak_resident_bytes,
            stats.pool_bytes,
            stats.pool_free_bytes,
            stats.pool_misses,
            stats.recycled_bytes
        );
        for (index, table) in &tables {
            println!("device {index} holds:");
            for p in table {
                let what = format!("{} {:?}", dtype_name(&p.dtype), p.shape);
                match &p.refused {
                    None => println!("  {what:<52} exact"),
                    Some(why) => println!("  {what:<52} refused: {why}"),
                }
            }
        }
    }
    Ok(())
}
