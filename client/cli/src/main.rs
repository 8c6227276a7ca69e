//! `ferry`: the command line for putting, getting, copying and listing tensors on ferry nodes.
//! One file per command under `commands/`; tensor files are the `ferry_files` library
//! (`client/files/`).

mod commands;
mod connect;
mod load;
mod progress;
mod report;

use std::path::PathBuf;
use std::process::ExitCode;

use crate::load::LoadConfig;
use clap::{Parser, Subcommand};
use ferry_client::Endpoint;
use ferry_client::address::Address;

/// Move Burn tensors between ferry nodes, devices and files.
///
/// A node is HOST:PORT or unix:PATH (a Unix socket); a tensor is NODE/DEVICE/NAME; NODE/DEVICE
/// is every tensor on that device. On a Unix socket, payloads go through shared memory unless
/// --no-shm.
#[derive(Debug, Parser)]
#[command(version, about)]
pub(crate) struct Cli {
    /// The nodes' shared token, sent over TCP in clear only (under TLS the certificate is the
    /// credential, and on a Unix socket this user is). Prefer --token-file or FERRY_TOKEN: a
    /// command line is visible to every user of the machine.
    #[arg(long, global = true, env = "FERRY_TOKEN", hide_env_values = true)]
    pub(crate) token: Option<String>,
    /// A file holding the token (its first line that is not blank or a `#` comment); wins over
    /// --token.
    #[arg(long, global = true, value_name = "PATH")]
    pub(crate) token_file: Option<std::path::PathBuf>,
    /// Never move payloads through shared memory, even over a Unix socket.
    #[arg(long, global = true)]
    pub(crate) no_shm: bool,
    /// Smallest payload this command sends through shared memory (suffixes like 64KiB work);
    /// smaller ones go through the socket.
    #[arg(long, global = true, default_value = "256KiB")]
    pub(crate) shm_min: bytesize::ByteSize,
    /// Send a token over TCP in clear to a host beyond loopback, where anyone on the path can
    /// read it: refused without this flag (under TLS no token is sent at all). A loopback port
    /// held by another local user gets no token either way.
    #[arg(long, global = true)]
    pub(crate) insecure: bool,
    /// The CA certificate (PEM) a node's certificate must chain to: connections over TCP then
    /// use mutual TLS (with --tls-cert and --tls-key; `ferry certs` makes all three).
    #[arg(long, global = true, value_name = "PATH", env = "FERRY_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    pub(crate) tls_ca: Option<PathBuf>,
    /// This client's certificate (PEM), presented to nodes that ask (they all do under TLS).
    #[arg(
        long,
        global = true,
        value_name = "PATH",
        env = "FERRY_TLS_CERT",
        requires = "tls_ca"
    )]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(
        long,
        global = true,
        value_name = "PATH",
        env = "FERRY_TLS_KEY",
        requires = "tls_ca"
    )]
    pub(crate) tls_key: Option<PathBuf>,
    /// The cluster's etcd, `etcd://HOST:PORT[,HOST:PORT...]` (`etcds://` for etcd over TLS,
    /// reached with this command's certificate), for `ls @` and `ls @NAME`.
    #[arg(
        long,
        global = true,
        env = "FERRY_CLUSTER",
        value_name = "etcd[s]://HOST:PORT[,...]"
    )]
    pub(crate) cluster: Option<String>,
    /// A node id that may be a member (repeat, or comma-separate in FERRY_MEMBER_IDS): the
    /// operator's list. `@NAME` whose record names any other id is refused. Default: whoever
    /// registers.
    #[arg(
        long = "member-id",
        global = true,
        env = "FERRY_MEMBER_IDS",
        value_delimiter = ',',
        value_name = "ID"
    )]
    pub(crate) member_ids: Vec<String>,
    /// The etcd user to read the directory as, for an etcd with auth on; with
    /// --etcd-password-file.
    #[arg(
        long,
        global = true,
        env = "FERRY_ETCD_USER",
        requires = "etcd_password_file"
    )]
    pub(crate) etcd_user: Option<String>,
    /// A file whose first line that is not blank or a `#` comment is the etcd user's password.
    /// Sent to etcd over TLS (`etcds://`) or to loopback only.
    #[arg(
        long,
        global = true,
        env = "FERRY_ETCD_PASSWORD_FILE",
        value_name = "PATH",
        requires = "etcd_user"
    )]
    pub(crate) etcd_password_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Upload every tensor in FILE (.bpk or .safetensors) to HOST:PORT/DEVICE under its name.
    ///
    /// With --model NAME, the file becomes a new version of the model NAME instead: its tensors
    /// are held under NAME/.vVERSION/TENSOR and committed as one, with the file's own metadata
    /// (a .safetensors header's __metadata__); if anything fails, nothing of it is kept.
    Put {
        /// The file.
        file: PathBuf,
        /// HOST:PORT/DEVICE.
        target: String,
        /// Prepended to every tensor name.
        #[arg(long, default_value = "", conflicts_with = "model")]
        prefix: String,
        /// Put the file as a new version of the model NAME (refused where the device holds
        /// NAME already, unless --overwrite).
        #[arg(long, value_name = "NAME")]
        model: Option<String>,
        /// Replace tensors that already exist (with --model: replace the model, whose current
        /// version stays readable until the new one is committed).
        #[arg(long)]
        overwrite: bool,
        /// Tensors in flight at once, each over a connection of its own to the node.
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=8))]
        lanes: u8,
    },
    /// Download one tensor, a model, or a whole device, into FILE (.bpk or .safetensors).
    ///
    /// A NAME that is no tensor but a model's is the model: its current version's tensors, named
    /// by their paths in the model, and its metadata (a .safetensors file's __metadata__).
    Get {
        /// HOST:PORT/DEVICE[/NAME].
        source: String,
        /// The file to write.
        #[arg(short, long)]
        output: PathBuf,
        /// NAME is a model, even where a tensor has that name too.
        #[arg(long)]
        model: bool,
    },
    /// Copy a tensor (or every tensor of a device) to HOST:PORT/DEVICE[/NAME], or to several
    /// nodes at once: relayed along a chain in the order given, each target pulling every tensor
    /// from the nearest node before it that holds it, so the source sends each byte about once.
    Cp {
        /// HOST:PORT/DEVICE[/NAME]; with --cluster, a tensor's NAME alone: the directory's
        /// holders of it, the nearest first, then the least busy of those that answer.
        source: String,
        /// HOST:PORT/DEVICE[/NAME]; several (each with the same DEVICE[/NAME]) for one copy to
        /// all of them.
        #[arg(required = true, num_args = 1..)]
        targets: Vec<String>,
        /// Replace tensors that already exist.
        #[arg(long)]
        overwrite: bool,
        /// Tensors of a whole device in flight at once between two nodes, each over a pair of
        /// connections of its own (to the source and to the target); a copy to several
        /// targets runs one chain.
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=8))]
        lanes: u8,
        /// SOURCE names a model (HOST:PORT/DEVICE/MODEL): its current version goes whole to
        /// each target as a new version of the model (of NAME where the targets give one), with
        /// its metadata, or nothing of it; --overwrite replaces a model a target holds.
        #[arg(long)]
        model: bool,
    },
    /// Move a tensor (or every tensor of a device, or a model): the source goes once the target
    /// holds it.
    Mv {
        /// HOST:PORT/DEVICE[/NAME].
        source: String,
        /// HOST:PORT/DEVICE[/NAME].
        target: String,
        /// Replace tensors that already exist.
        #[arg(long)]
        overwrite: bool,
        /// Tensors of a whole device in flight at once between two nodes, each over a pair of
        /// connections of its own (to the source and to the target).
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=8))]
        lanes: u8,
        /// SOURCE names a model (HOST:PORT/DEVICE/MODEL): its current version goes whole to the
        /// target as a new version (of NAME where the target gives one), and the source's model
        /// is deleted then, only if that is still its current version; --overwrite replaces a
        /// model the target holds.
        #[arg(long)]
        model: bool,
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
    /// Make a CA and certificates for a first cluster, in one directory: ca.pem and ca.key, and
    /// NAME.pem and NAME.key for each node and client. A CA already there is reused and nothing
    /// is overwritten; keys are written readable by this user only.
    Certs {
        /// The directory (made if missing).
        #[arg(long, default_value = "ferry-certs")]
        dir: PathBuf,
        /// A node: NAME (its identity), or NAME=HOST[,HOST...] with the DNS names and IP
        /// addresses clients and peers dial it at; repeat for more.
        #[arg(long = "node", value_name = "NAME[=HOSTS]")]
        nodes: Vec<String>,
        /// A client (a user, an application): NAME; repeat for more.
        #[arg(long = "client", value_name = "NAME")]
        clients: Vec<String>,
        /// Days the node and client certificates are valid (the CA: ten years).
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
    /// Give the cluster's etcd (--cluster) ferry's roles: each --member an etcd user that reads
    /// the directory and writes its own keys alone, each --reader one that reads it; with
    /// --enable-auth, then turn etcd's auth on (user root). Once it is on, add more as root
    /// (--etcd-user root --etcd-password-file PATH).
    EtcdRoles {
        /// A member: NAME=PASSWORD_FILE (its etcd user is NAME, created with the file's first
        /// line as its password); repeat for more.
        #[arg(long = "member", value_name = "NAME=PASSWORD_FILE")]
        members: Vec<String>,
        /// A reader (an operator, a coordinator): USER=PASSWORD_FILE; repeat for more.
        #[arg(long = "reader", value_name = "USER=PASSWORD_FILE")]
        readers: Vec<String>,
        /// Then turn etcd's auth on, user root's password from this file.
        #[arg(long, value_name = "PASSWORD_FILE")]
        enable_auth: Option<PathBuf>,
    },
    /// Show a node's devices, tensors and transfer counters.
    Stat {
        /// HOST:PORT.
        node: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Also print what each device measured at start that it stores bit-exact: every dtype
        /// and quantization scheme family it probed, and why not where it does not.
        #[arg(long)]
        holds: bool,
    },
}

async fn run(cli: &Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::Put {
            file,
            target,
            prefix,
            model,
            overwrite,
            lanes,
        } => {
            let model = model.as_deref();
            commands::put::put(cli, file, target, prefix, model, *overwrite, *lanes).await
        }
        Command::Get {
            source,
            output,
            model,
        } => commands::get::get(cli, source, output, *model).await,
        Command::Cp {
            source,
            targets,
            overwrite,
            model: true,
            ..
        } => commands::model_copy::copy_model(cli, source, targets, *overwrite).await,
        Command::Cp {
            source,
            targets,
            overwrite,
            lanes,
            model: false,
        } => match targets.as_slice() {
            [target] => {
                commands::transfer::transfer(cli, source, target, false, *overwrite, *lanes).await
            }
            several => commands::relay::copy_to_many(cli, source, several, *overwrite).await,
        },
        Command::Mv {
            source,
            target,
            overwrite,
            model: true,
            ..
        } => commands::model_copy::move_model(cli, source, target, *overwrite).await,
        Command::Mv {
            source,
            target,
            overwrite,
            lanes,
            model: false,
        } => commands::transfer::transfer(cli, source, target, true, *overwrite, *lanes).await,
        Command::Ls { location, json } => commands::ls::ls(cli, location, *json).await,
        Command::Rm { tensor } => commands::rm::rm(cli, tensor).await,
        Command::Stat { node, json, holds } => commands::stat::stat(cli, node, *json, *holds).await,
        Command::Certs {
            dir,
            nodes,
            clients,
            days,
        } => commands::certs::certs(dir, nodes, clients, *days),
        Command::EtcdRoles {
            members,
            readers,
            enable_auth,
        } => commands::etcd_roles::etcd_roles(cli, members, readers, enable_auth.as_deref()).await,
        Command::Health { node, timeout } => commands::health::health(cli, node, *timeout).await,
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
                connect: connect::connect_options(cli)?
                    .to(Endpoint::parse(&Address::parse(node)?.node)),
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
            commands::load::load(config, *json).await
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // What the client library logs (retries, TLS, shared memory), on stderr, only when asked:
    // `RUST_LOG=debug ferry cp ...`.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    }
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
