//! `ferry`: the command line for putting, getting, copying and listing tensors on ferry nodes.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, anyhow, bail};
use clap::{Parser, Subcommand};
use ferry_client::files::{read_tensors, write_tensors};
use ferry_client::load::LoadConfig;
use ferry_client::{
    Client, ClientConfig, Endpoint, NodeCopy, TensorData, TensorInfo, TensorKey, copy_between,
};
use ferry_proto::{DType, dtype_name};
use indicatif::{ProgressBar, ProgressStyle};

/// Transfers over this many bytes show a progress bar (when stderr is a terminal).
const PROGRESS_THRESHOLD: u64 = 64 << 20;
/// Tensors per pipelined batch between two progress updates.
const BATCH: usize = 16;

/// Move Burn tensors between ferry nodes, devices and files.
///
/// A node is HOST:PORT or unix:PATH (a Unix socket); a tensor is NODE/DEVICE/NAME; NODE/DEVICE
/// is every tensor on that device. On a Unix socket, payloads go through shared memory unless
/// --no-shm.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// The nodes' shared token.
    #[arg(long, global = true, env = "FERRY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Never move payloads through shared memory, even over a Unix socket.
    #[arg(long, global = true)]
    no_shm: bool,
    /// Smallest payload this command sends through shared memory (suffixes like 64KiB work);
    /// smaller ones go through the socket.
    #[arg(long, global = true, default_value = "256KiB")]
    shm_min: bytesize::ByteSize,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Upload every tensor in FILE (.bpk or .safetensors) to HOST:PORT/DEVICE under its name.
    Put {
        /// The file.
        file: PathBuf,
        /// HOST:PORT/DEVICE.
        target: String,
        /// Prepended to every tensor name.
        #[arg(long, default_value = "")]
        prefix: String,
        /// Replace tensors that already exist.
        #[arg(long)]
        overwrite: bool,
    },
    /// Download one tensor, or a whole device, into FILE (.bpk or .safetensors).
    Get {
        /// HOST:PORT/DEVICE[/NAME].
        source: String,
        /// The file to write.
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Copy a tensor (or every tensor of a device) to HOST:PORT/DEVICE[/NAME].
    Cp {
        /// HOST:PORT/DEVICE[/NAME].
        source: String,
        /// HOST:PORT/DEVICE[/NAME].
        target: String,
        /// Replace tensors that already exist.
        #[arg(long)]
        overwrite: bool,
    },
    /// Move a tensor (or every tensor of a device): the source goes once the target holds it.
    Mv {
        /// HOST:PORT/DEVICE[/NAME].
        source: String,
        /// HOST:PORT/DEVICE[/NAME].
        target: String,
        /// Replace tensors that already exist.
        #[arg(long)]
        overwrite: bool,
    },
    /// List the tensors on a node, or on one of its devices.
    Ls {
        /// HOST:PORT[/DEVICE].
        location: String,
        /// Print a JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Delete a tensor.
    Rm {
        /// HOST:PORT/DEVICE/NAME.
        tensor: String,
    },
    /// Check that a node answers: exit status 0 and `ok` when it does within the timeout (for
    /// supervisors and readiness probes), non-zero and an error line when not.
    Health {
        /// HOST:PORT or unix:PATH.
        node: String,
        /// Seconds to wait for the answer.
        #[arg(long, default_value_t = 5)]
        timeout: u64,
    },
    /// Put load on a node: many clients putting, getting, copying and deleting tensors of mixed
    /// sizes and dtypes, every transfer checked byte for byte. Prints throughput, latency
    /// percentiles, errors and the node's memory; exits non-zero on any error or mismatch.
    Load {
        /// HOST:PORT or unix:PATH.
        node: String,
        /// Clients at once, one connection each.
        #[arg(long, default_value_t = 16)]
        clients: usize,
        /// Rounds per client (put, get, copy, get, two deletes).
        #[arg(long)]
        rounds: Option<u64>,
        /// Run for this many seconds instead (or as well: whichever ends first).
        #[arg(long)]
        seconds: Option<u64>,
        /// Smallest tensor (suffixes work).
        #[arg(long, default_value = "4KiB")]
        min_size: bytesize::ByteSize,
        /// Largest tensor (suffixes work); sizes are spread evenly on a log scale.
        #[arg(long, default_value = "64MiB")]
        max_size: bytesize::ByteSize,
        /// Tensor bytes this command holds at once across its clients.
        #[arg(long, default_value = "2GiB")]
        max_in_flight: bytesize::ByteSize,
        /// The device tensors are put on.
        #[arg(long, default_value_t = 0)]
        device: u32,
        /// The device they are copied to.
        #[arg(long, default_value_t = 1)]
        copy_device: u32,
        /// Seed for sizes, dtypes and contents (tensor names carry it).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Unmeasured rounds per client first, so that "before" includes what the node keeps
        /// for good (connection buffers, allocator state).
        #[arg(long, default_value_t = 1)]
        warmup_rounds: u64,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show a node's devices, tensors and transfer counters.
    Stat {
        /// HOST:PORT.
        node: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// A parsed `NODE[/DEVICE[/NAME]]`, where NODE is `HOST:PORT` or `unix:PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Address {
    node: String,
    device: Option<u32>,
    name: Option<String>,
}

impl Address {
    fn parse(text: &str) -> anyhow::Result<Address> {
        Self::parse_with(text, &|path| {
            use std::os::unix::fs::FileTypeExt;
            std::fs::metadata(path).is_ok_and(|m| m.file_type().is_socket())
        })
    }

    /// Parses with `is_socket` telling which paths are Unix sockets: a socket path can hold any
    /// number of `/` (and digit-only parts like `/run/user/1000`), so the node is the longest
    /// prefix that is a socket, and what follows it is DEVICE/NAME.
    fn parse_with(text: &str, is_socket: &dyn Fn(&Path) -> bool) -> anyhow::Result<Address> {
        let (node, rest) = match text.strip_prefix(ferry_io::transport::UNIX_PREFIX) {
            Some(path) => {
                let ends = path
                    .match_indices('/')
                    .map(|(i, _)| i)
                    .chain([path.len()])
                    .filter(|&i| i > 0)
                    .rev();
                let Some(end) = ends.into_iter().find(|&i| is_socket(Path::new(&path[..i]))) else {
                    bail!("{text:?}: no Unix socket found at unix:PATH");
                };
                let rest = path[end..].strip_prefix('/');
                (&text[..ferry_io::transport::UNIX_PREFIX.len() + end], rest)
            }
            None => match text.split_once('/') {
                Some((node, rest)) => (node, Some(rest)),
                None => (text, None),
            },
        };
        if node.is_empty() || !node.contains(':') {
            bail!("{text:?} does not start with a node address HOST:PORT or unix:PATH");
        }
        let (device, name) = match rest {
            None | Some("") => (None, None),
            Some(rest) => {
                let (device, name) = match rest.split_once('/') {
                    Some((device, name)) => (device, Some(name)),
                    None => (rest, None),
                };
                let device = device
                    .parse::<u32>()
                    .map_err(|_| anyhow!("{text:?}: device {device:?} is not a device index"))?;
                let name = name.filter(|n| !n.is_empty()).map(str::to_string);
                (Some(device), name)
            }
        };
        Ok(Address {
            node: node.to_string(),
            device,
            name,
        })
    }

    fn device(&self, what: &str) -> anyhow::Result<u32> {
        self.device
            .ok_or_else(|| anyhow!("{what} needs a device: HOST:PORT/DEVICE"))
    }
}

fn dtype_text(info: &TensorInfo) -> String {
    DType::try_from(&info.dtype)
        .map(|d| dtype_name(&d))
        .unwrap_or_else(|_| format!("unknown({})", info.dtype.tag))
}

fn progress(total: u64) -> Option<ProgressBar> {
    if total <= PROGRESS_THRESHOLD || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(total);
    if let Ok(style) =
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} {eta}")
    {
        bar.set_style(style);
    }
    Some(bar)
}

async fn connect(node: &str, cli: &Cli) -> anyhow::Result<Client> {
    Client::connect_with(node, client_config(cli))
        .await
        .with_context(|| format!("connecting to {node}"))
}

fn client_config(cli: &Cli) -> ClientConfig {
    ClientConfig {
        token: cli.token.clone(),
        disable_shared_memory: cli.no_shm,
        limits: ferry_client::ConnectionLimits {
            region_min: usize::try_from(cli.shm_min.as_u64()).unwrap_or(usize::MAX),
            ..Default::default()
        },
        ..ClientConfig::default()
    }
}

fn check_all(
    results: Vec<(String, Result<TensorInfo, ferry_client::ClientError>)>,
) -> anyhow::Result<()> {
    let mut failed = 0;
    for (name, result) in &results {
        if let Err(e) = result {
            eprintln!("error: {name}: {e}");
            failed += 1;
        }
    }
    if failed > 0 {
        bail!("{failed} of {} tensors failed", results.len());
    }
    Ok(())
}

async fn put(
    cli: &Cli,
    file: &Path,
    target: &str,
    prefix: &str,
    overwrite: bool,
) -> anyhow::Result<()> {
    let address = Address::parse(target)?;
    let device = address.device("put")?;
    if address.name.is_some() {
        bail!("put takes HOST:PORT/DEVICE; tensor names come from the file");
    }
    // Read and validated in full before anything reaches the node.
    let tensors = read_tensors(file).with_context(|| format!("reading {}", file.display()))?;
    let tensors: Vec<(String, TensorData)> = tensors
        .into_iter()
        .map(|(name, data)| (format!("{prefix}{name}"), data))
        .collect();
    let total: u64 = tensors.iter().map(|(_, d)| d.as_bytes().len() as u64).sum();
    let bar = progress(total);
    let mut client = connect(&address.node, cli).await?;
    let mut results = Vec::with_capacity(tensors.len());
    for batch in tensors.chunks(BATCH) {
        let answers = client.put_batch(device, batch, overwrite).await?;
        for ((name, data), answer) in batch.iter().zip(answers) {
            if let Some(bar) = &bar {
                bar.inc(data.as_bytes().len() as u64);
            }
            results.push((name.clone(), answer));
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let count = results.len();
    check_all(results)?;
    eprintln!(
        "put {count} tensors ({total} bytes) on {}/{device}",
        address.node
    );
    Ok(())
}

async fn get(cli: &Cli, source: &str, output: &Path) -> anyhow::Result<()> {
    let address = Address::parse(source)?;
    let device = address.device("get")?;
    let mut client = connect(&address.node, cli).await?;
    let infos = match &address.name {
        Some(name) => vec![TensorKey::new(device, name.clone())],
        None => client
            .list(Some(device))
            .await?
            .into_iter()
            .map(|i| i.key)
            .collect(),
    };
    let mut listing = client.list(Some(device)).await?;
    listing.retain(|i| infos.contains(&i.key));
    let total: u64 = listing.iter().map(|i| i.bytes).sum();
    let bar = progress(total);
    let mut tensors = Vec::with_capacity(infos.len());
    for batch in infos.chunks(BATCH) {
        for (key, answer) in batch.iter().zip(client.get_batch(batch).await?) {
            let data = answer.with_context(|| format!("getting {key}"))?;
            if let Some(bar) = &bar {
                bar.inc(data.as_bytes().len() as u64);
            }
            tensors.push((key.name.clone(), data));
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    write_tensors(output, &tensors).with_context(|| format!("writing {}", output.display()))?;
    eprintln!("wrote {} tensors to {}", tensors.len(), output.display());
    Ok(())
}

async fn transfer(
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

async fn ls(cli: &Cli, location: &str, json: bool) -> anyhow::Result<()> {
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

async fn rm(cli: &Cli, tensor: &str) -> anyhow::Result<()> {
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

async fn stat(cli: &Cli, node: &str, json: bool) -> anyhow::Result<()> {
    let address = Address::parse(node)?;
    let mut client = connect(&address.node, cli).await?;
    let stats = client.stat().await?;
    if json {
        let value = serde_json::to_value(&stats)?;
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        println!(
            "{} {} ({} policy)",
            stats.agent, stats.node_id, stats.transfer_policy
        );
        for d in &stats.devices {
            let limit = d
                .memory_limit
                .map_or_else(|| "no limit".to_string(), |l| format!("limit {l}"));
            println!(
                "device {}: {} {}, {} tensors, {} bytes ({limit})",
                d.index, d.backend, d.device, d.tensors, d.bytes_held
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
            "node to node: {} pulled ({} retries, {} skipped as duplicates), {} served",
            stats.pulls, stats.pull_retries, stats.dedup_hits, stats.fetches_served
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
    }
    Ok(())
}

async fn run(cli: &Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::Put {
            file,
            target,
            prefix,
            overwrite,
        } => put(cli, file, target, prefix, *overwrite).await,
        Command::Get { source, output } => get(cli, source, output).await,
        Command::Cp {
            source,
            target,
            overwrite,
        } => transfer(cli, source, target, false, *overwrite).await,
        Command::Mv {
            source,
            target,
            overwrite,
        } => transfer(cli, source, target, true, *overwrite).await,
        Command::Ls { location, json } => ls(cli, location, *json).await,
        Command::Rm { tensor } => rm(cli, tensor).await,
        Command::Stat { node, json } => stat(cli, node, *json).await,
        Command::Health { node, timeout } => health(cli, node, *timeout).await,
        Command::Load {
            node,
            clients,
            rounds,
            seconds,
            min_size,
            max_size,
            max_in_flight,
            device,
            copy_device,
            seed,
            warmup_rounds,
            json,
        } => {
            let to_usize =
                |b: &bytesize::ByteSize| usize::try_from(b.as_u64()).unwrap_or(usize::MAX);
            let config = LoadConfig {
                endpoint: Endpoint::parse(&Address::parse(node)?.node),
                client: client_config(cli),
                clients: *clients,
                rounds: *rounds,
                duration: seconds.map(std::time::Duration::from_secs),
                min_bytes: to_usize(min_size),
                max_bytes: to_usize(max_size),
                max_in_flight_bytes: to_usize(max_in_flight),
                device: *device,
                copy_device: *copy_device,
                seed: *seed,
                warmup_rounds: *warmup_rounds,
            };
            load(config, *json).await
        }
    }
}

async fn health(cli: &Cli, node: &str, timeout: u64) -> anyhow::Result<()> {
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

async fn load(config: LoadConfig, json: bool) -> anyhow::Result<()> {
    let report = ferry_client::load::run(config).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!(
            "{} clients, {} rounds, {} operations in {:.1} s: {:.3} GB/s of payload",
            report.clients, report.rounds, report.operations, report.seconds, report.gbps
        );
        println!(
            "errors {}, mismatches {}, tensors left {}",
            report.errors, report.mismatches, report.tensors_left
        );
        for (op, l) in [
            ("put", report.put),
            ("get", report.get),
            ("copy", report.copy),
            ("delete", report.delete),
        ] {
            println!(
                "{op:<6} {:>7} ops  p50 {:>8.2} ms  p99 {:>8.2} ms  max {:>8.2} ms",
                l.count, l.p50_ms, l.p99_ms, l.max_ms
            );
        }
        println!(
            "node resident memory: {:.1} MiB before, {:.1} MiB peak, {:.1} MiB after ({:+.1}% of before)",
            mib(report.node_resident_before),
            mib(report.node_resident_peak),
            mib(report.node_resident_after),
            (report.node_resident_after as f64 / report.node_resident_before.max(1) as f64 - 1.0)
                * 100.0
        );
    }
    if !json {
        let growth = report.memory_growth() * 100.0;
        println!(
            "targets: no error {}; no mismatch {}; memory after within 10% of before {} ({growth:+.1}%)",
            if report.errors == 0 {
                "holds"
            } else {
                "MISSED"
            },
            if report.mismatches == 0 {
                "holds"
            } else {
                "MISSED"
            },
            if growth <= 10.0 { "holds" } else { "MISSED" },
        );
    }
    if !report.clean() {
        bail!(
            "{} errors, {} mismatches, {} tensors left",
            report.errors,
            report.mismatches,
            report.tensors_left
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One line: the context chain joined.
            let chain: Vec<String> = error.chain().map(|e| e.to_string()).collect();
            eprintln!("error: {}", chain.join(": "));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(
            Address::parse("127.0.0.1:7070/1/encoder.layer1/weight").unwrap(),
            Address {
                node: "127.0.0.1:7070".into(),
                device: Some(1),
                name: Some("encoder.layer1/weight".into())
            }
        );
        assert_eq!(
            Address::parse("host:1/0").unwrap(),
            Address {
                node: "host:1".into(),
                device: Some(0),
                name: None
            }
        );
        assert_eq!(Address::parse("[::1]:7/2/x").unwrap().node, "[::1]:7");
        assert!(Address::parse("nohost/0").is_err());
        let sockets =
            |p: &Path| p == Path::new("/run/user/1000/ferry.sock") || p == Path::new("/s");
        assert_eq!(
            Address::parse_with("unix:/run/user/1000/ferry.sock/2/a/b", &sockets).unwrap(),
            Address {
                node: "unix:/run/user/1000/ferry.sock".into(),
                device: Some(2),
                name: Some("a/b".into())
            }
        );
        assert_eq!(
            Address::parse_with("unix:/s", &sockets).unwrap(),
            Address {
                node: "unix:/s".into(),
                device: None,
                name: None
            }
        );
        assert_eq!(
            Address::parse_with("unix:/s/0", &sockets).unwrap().device,
            Some(0)
        );
        assert!(Address::parse_with("unix:/nowhere/0/x", &sockets).is_err());
        assert!(Address::parse("h:1/gpu/x").is_err());
    }
}
