//! `ferry-server`: runs a ferry node on TCP (and a Unix socket if asked) until Ctrl-C or SIGTERM.

use ferry_server::{NodeLimits, PullConfig};
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use ferry_io::credential::{Credential, parse_token_file, token_from_file};
use ferry_io::{ConnectionLimits, SharedMemory};
use ferry_proto::stripes::StripeLen;
use ferry_server::{
    DeviceSpec, Node, NodeConfig, PeerPolicy, ReceiveBuffers, Service, ServiceConfig,
    TransferPolicy,
};

/// A ferry node: hosts Burn devices and moves tensors of every dtype between them and over TCP.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Address to listen on; port 0 picks a free one.
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Also listen on a Unix domain socket at this path (reached as `unix:PATH`; mode 0600).
    /// Payloads on its connections go through shared memory unless --no-shm.
    #[arg(long, value_name = "PATH")]
    unix: Option<std::path::PathBuf>,
    /// Never move payloads through shared memory (neither for clients nor for pulls).
    #[arg(long)]
    no_shm: bool,
    /// Smallest payload sent through shared memory where it is agreed; smaller ones go as
    /// chunks (suffixes work).
    #[arg(long, default_value = "256KiB")]
    shm_min: bytesize::ByteSize,
    /// A device to host: `flex`, `ndarray`, or a GPU (`wgpu:N` the N-th discrete GPU, `wgpu:cpu`
    /// a software adapter, `wgpu:default`; `vulkan:...` or `gl:...` to pin the graphics API);
    /// repeat for more. Default: two flex devices.
    #[arg(long = "device", value_name = "SPEC")]
    devices: Vec<DeviceSpec>,
    /// Shared token clients must present over TCP in clear (allowing everything); refused beside
    /// TLS, where --grant says who may do what. Prefer --token-file: a command line is visible
    /// to every user of the machine.
    #[arg(long, env = "FERRY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// A file of credentials clients may present, one per line: `SCOPES TOKEN` (scopes `read`,
    /// `write`, `peer`, comma-separated, or `all`) or a bare `TOKEN` (everything); `#` starts a
    /// comment. Keep it readable by the node's user only.
    #[arg(long, value_name = "PATH")]
    token_file: Option<std::path::PathBuf>,
    /// Under TLS, what the certificates named NAME may do: `NAME=SCOPES` (scopes `read`,
    /// `write`, `peer`, comma-separated, or `all`); repeat for more. Every node certificate of
    /// the CA may fetch (`peer`). Under TLS no token is asked or sent: the certificate is the
    /// credential. With no grant, every certificate of the CA may do everything.
    #[arg(long = "grant", value_name = "NAME=SCOPES", requires = "tls_cert")]
    grants: Vec<ferry_io::grant::Grant>,
    /// A node this node may pull from, as clients name it (`HOST:PORT` or `unix:PATH`), or
    /// `NAME=HOST:PORT` for one whose TLS certificate must name NAME (checked before anything
    /// is sent to it); repeat for more. A pull from any other source is refused without
    /// connecting, so the peer token goes nowhere else. With a peer token and no --peer, this
    /// node pulls from no one.
    #[arg(long = "peer", value_name = "[NAME=]ADDR")]
    peers: Vec<ferry_server::Peer>,
    /// Listen beyond loopback without TLS or without a credential, where anyone on the path may
    /// read the tensors and tokens (and, with no credential, overwrite and delete every tensor):
    /// refused without this flag.
    #[arg(long)]
    insecure: bool,
    /// This node's TLS certificate (PEM, leaf first): every TCP link, served and opened to
    /// peers, is then mutual TLS, and the node's id is the certificate's common name. Needs
    /// --tls-key and --tls-ca (`ferry certs` makes all three).
    #[arg(long, value_name = "PATH", env = "FERRY_NODE_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key of --tls-cert (PEM; keep it readable by the node's user only).
    #[arg(
        long,
        value_name = "PATH",
        env = "FERRY_NODE_TLS_KEY",
        requires = "tls_cert"
    )]
    tls_key: Option<std::path::PathBuf>,
    /// The CA certificate(s) (PEM) every client and peer certificate must chain to; the only
    /// roots trusted.
    #[arg(
        long,
        value_name = "PATH",
        env = "FERRY_NODE_TLS_CA",
        requires = "tls_cert"
    )]
    tls_ca: Option<std::path::PathBuf>,
    /// A file holding the token this node presents to the nodes it pulls from (its first line).
    #[arg(long, value_name = "PATH")]
    peer_token_file: Option<std::path::PathBuf>,
    /// Connections served at once; more are refused with an error.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Connections served at once from one IP address, counted from accept (before any hello
    /// or TLS handshake), so that one host cannot take every slot; Unix sockets apart.
    #[arg(long, default_value_t = ferry_server::DEFAULT_MAX_CONNECTIONS_PER_ADDRESS)]
    max_connections_per_address: std::num::NonZeroUsize,
    /// Largest tensor accepted (bytes; suffixes like 512MiB or 4GB work).
    #[arg(long, default_value = "16GiB")]
    max_tensor_bytes: bytesize::ByteSize,
    /// Memory budget per device (bytes; suffixes work): tensors, each with 4 KiB of bookkeeping,
    /// transfers in flight and host copies being sent. Unlimited when absent.
    #[arg(long)]
    memory_limit: Option<bytesize::ByteSize>,
    /// The most tensors one device holds.
    #[arg(long, default_value_t = ferry_server::DEFAULT_MAX_TENSORS)]
    max_tensors: u64,
    /// The most capabilities (for node-to-node copies) one connection may hold outstanding.
    #[arg(long, default_value_t = ferry_server::DEFAULT_MAX_GRANTS)]
    max_grants: usize,
    /// The slowest a whole payload may move, in bytes per second (suffixes work; 0 for no
    /// limit): a payload gets the idle timeout plus its length at this rate, so a peer that
    /// trickles bytes cannot hold a reservation or a buffer for ever.
    #[arg(long, default_value = "1MiB")]
    min_rate: bytesize::ByteSize,
    /// Transfer path policy between devices of this node.
    #[arg(long, default_value = "auto", value_parser = ["auto", "round-trip"])]
    transfer: String,
    /// Seconds a peer may stay silent in the middle of a frame.
    #[arg(long, default_value_t = 30)]
    idle_timeout: u64,
    /// Seconds a new connection may take to say hello before it is closed (a socket that never
    /// speaks holds a connection slot this long at most).
    #[arg(long, default_value_t = ferry_server::DEFAULT_HELLO_TIMEOUT.as_secs())]
    hello_timeout: u64,
    /// Seconds a connection may sit idle between requests before it is closed.
    #[arg(long, default_value_t = 300)]
    keepalive: u64,
    /// Seconds in-flight requests get to finish at shutdown.
    #[arg(long, default_value_t = 30)]
    shutdown_grace: u64,
    /// Payload bytes per chunk frame (suffixes work).
    #[arg(long, default_value = "4MiB")]
    chunk_size: bytesize::ByteSize,
    /// This node's id, which capabilities are bound to. Random when absent; under TLS it is the
    /// certificate's common name, and an id given here must be the same.
    #[arg(long)]
    node_id: Option<String>,
    /// Join a cluster kept in etcd: `etcd://HOST:PORT[,HOST:PORT...]`, or `etcds://` for etcd over
    /// TLS (reached with this node's certificate). The node registers itself
    /// and publishes the tensors it holds under a lease it renews; with --name and --advertise.
    /// It then pulls only from registered members (and --peer entries): under TLS, only from a
    /// member whose certificate shows the node id it registered. Its peer token goes to no
    /// member: in clear etcd's word is not enough, and under TLS (or on a Unix socket) no token
    /// is sent.
    #[arg(long, value_name = "etcd[s]://HOST:PORT[,...]", requires = "name")]
    cluster: Option<String>,
    /// A node id that may be a member (repeat for more): the operator's list. A member record of
    /// any other id, whoever wrote it, is not pulled from. Default: whoever registers.
    #[arg(long = "member-id", value_name = "ID", requires = "cluster")]
    member_ids: Vec<String>,
    /// This node's name in the cluster (`@NAME`): 1 to 63 letters, digits, `-`, `_`, `.`.
    #[arg(long, requires = "cluster")]
    name: Option<String>,
    /// The TCP address other nodes and clients reach this node at. Default: the address it
    /// listens on, where that is not a wildcard.
    #[arg(long, value_name = "HOST:PORT", requires = "cluster")]
    advertise: Option<String>,
    /// Seconds a dead node stays registered at most (its lease's time to live).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    cluster_ttl: u64,
    /// The etcd user this node logs in as, for an etcd with auth on: etcd's roles then keep the
    /// node to its own keys (docs/cluster.md). With --etcd-password-file.
    #[arg(long, env = "FERRY_ETCD_USER", requires_all = ["cluster", "etcd_password_file"])]
    etcd_user: Option<String>,
    /// A file (mode 0600) whose first line that is not blank or a `#` comment is the etcd user's
    /// password. Sent to etcd over TLS (`etcds://`) or to loopback only.
    #[arg(
        long,
        env = "FERRY_ETCD_PASSWORD_FILE",
        value_name = "PATH",
        requires = "etcd_user"
    )]
    etcd_password_file: Option<std::path::PathBuf>,
    /// Token presented to the nodes this node pulls from, over TCP in clear (refused beside TLS,
    /// where the node's certificate is its credential). Default: the node's own --token.
    #[arg(long, env = "FERRY_PEER_TOKEN", hide_env_values = true)]
    peer_token: Option<String>,
    /// Seconds a capability this node issues stays valid.
    #[arg(long, default_value_t = 300)]
    capability_ttl: u64,
    /// Reconnections of a pull after a transient drop.
    #[arg(long, default_value_t = 3)]
    pull_retries: u32,
    /// Connections one pull of a tensor larger than a stripe (16 MiB) spreads over, each
    /// fetching whole stripes (1 to 16; 1 fetches every tensor over one connection). Default: a
    /// connection per four cores, up to 8, so 1 (off) on fewer than 8 cores.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=16))]
    pull_connections: Option<u16>,
    /// Serve Prometheus metrics over HTTP on this address (any path answers). Clear HTTP with no
    /// credential: an address beyond loopback needs --insecure.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// Log format on stderr: `text` for people, `json` (one object per line) for collectors.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    /// Freed receive buffers (16 MiB and up, of tensors on Flex devices) kept for reuse, at most
    /// (suffixes work; 0 keeps none). A new buffer costs the kernel the zeroing of every page,
    /// more than the network copy into it; a node that receives and drops tensors of similar
    /// sizes reuses them instead. Unused ones are freed after 2 seconds.
    #[arg(long, default_value = "512MiB")]
    recycle: bytesize::ByteSize,
    /// Receive memory made ready (touched) before tensors arrive, for receives of 1 MiB and up
    /// on Flex devices (the tensor's memory) and GPU devices (host staging, back in the pool
    /// once the tensor is on the GPU): new memory costs the kernel the zeroing of every page,
    /// more than the network copy into it. `auto` (the default): up to the device's
    /// --memory-limit or half the machine's memory; with a Flex device and no --pool-ready, a
    /// quarter of it made ready at start for the first tensors (a model), until the first
    /// tensor arrives or for 10 minutes, and only while half the machine's memory
    /// (and of its cgroup limits) is free; then --pool-ready of it kept ready (made ready
    /// between receives, in the background at the lowest CPU priority; 64 MiB kept ahead of
    /// what is drawn while tensors arrive), freed buffers above that given back after 30 s
    /// without a receive. A size: that much reserved and touched at
    /// start, kept (huge pages advised). 0: none (every receive into new or recycled memory). A payload
    /// the pool cannot hold goes to new memory, with a log line (`stat`: pool_bytes).
    #[arg(long, default_value = "auto", value_parser = parse_pool)]
    pool: PoolSize,
    /// With `--pool auto`: how much receive memory to keep ready (suffixes work), from the start:
    /// given, no start amount is made. A worker that waits for a model larger than the start
    /// amount makes it that size, and the whole model lands in ready memory; it is resident
    /// while the node is idle.
    /// [default: 256MiB]
    #[arg(long)]
    pool_ready: Option<bytesize::ByteSize>,
    /// Receive every payload of 4 MiB and more on Flex devices into a new shared-memory region,
    /// sealed once complete, so that every such tensor this node holds can go on to a same-host
    /// peer without a copy, whichever link it arrived by. New shared-memory pages cost more to
    /// fault in than heap memory (no huge pages), so TCP receives get slower; no receive pool
    /// then (its memory is reused and so cannot be sealed).
    #[arg(long)]
    shareable_receives: bool,
}

/// What `--pool` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PoolSize {
    /// Elastic, sized from the device budget or the machine.
    Auto,
    /// None.
    Off,
    /// This many bytes, touched at start.
    Fixed(u64),
}

fn parse_pool(text: &str) -> Result<PoolSize, String> {
    match text {
        "auto" => Ok(PoolSize::Auto),
        _ => match text
            .parse::<bytesize::ByteSize>()
            .map_err(|e| format!("{e} (expected auto, 0 or a size such as 2GiB)"))?
            .as_u64()
        {
            0 => Ok(PoolSize::Off),
            bytes => Ok(PoolSize::Fixed(bytes)),
        },
    }
}

/// What an elastic pool keeps ready unless `--pool-ready` says otherwise.
const DEFAULT_POOL_READY: u64 = 256 << 20;
/// What an elastic pool keeps ready ahead of the receives while tensors arrive: enough that a
/// receive rarely waits for a page, little enough that the last tensor leaves little touched
/// for nothing.
const POOL_AHEAD: usize = 64 << 20;
/// How long without a receive before an elastic pool gives its ready memory back to the idle
/// amount.
const POOL_IDLE_AFTER: Duration = Duration::from_secs(30);
/// How long a freshly started node keeps its start amount ready for a first tensor.
const POOL_START_KEPT_FOR: Duration = Duration::from_secs(600);

/// Upper bounds of the transfer latency histogram, in seconds.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

fn init_logs(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == "json" {
        logs.json()
            .with_current_span(true)
            .with_span_list(false)
            .init();
    } else {
        logs.with_ansi(std::io::stderr().is_terminal()).init();
    }
}

/// How long a recycled receive buffer may wait unused before it is freed.
const RECYCLED_IDLE: Duration = Duration::from_secs(2);

/// Raises the soft limit on open files to the hard one: every connection, peer link and region
/// in flight is a descriptor, and the default soft limit (often 1024) is below what
/// `--max-connections` allows, which would make `accept` fail before the node can say why.
fn raise_fd_limit(max_connections: usize) {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if let Some(hard) = limit.maximum
        && limit.current.is_some_and(|soft| soft < hard)
    {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(hard),
                maximum: Some(hard),
            },
        );
    }
    let soft = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
    // Room for listeners, peer links, regions in flight and the process's own files.
    if (max_connections as u64).saturating_add(64) > soft {
        tracing::warn!(
            soft,
            max_connections,
            "the open-file limit is below --max-connections; connections past it fail in accept"
        );
    }
}

/// Installs the Prometheus exporter on `addr` and keeps the memory gauges fresh.
fn serve_metrics(addr: SocketAddr, pool: Option<ferry_io::Pool>) -> anyhow::Result<()> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            Matcher::Full(ferry_server::metrics::TRANSFER_SECONDS.to_string()),
            LATENCY_BUCKETS,
        )
        .context("latency buckets")?
        .install()
        .with_context(|| format!("serving metrics on {addr}"))?;
    ferry_server::metrics::describe();
    tokio::spawn(async move {
        loop {
            ferry_server::metrics::sample_resident_memory();
            if let Some(pool) = &pool {
                ferry_server::metrics::sample_pool(pool);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    Ok(())
}

fn main() -> anyhow::Result<()> {
    // Before the runtime's threads exist: glibc fixes its arena limit when the second arena is
    // made, and a thread's first allocation makes one.
    ferry_io::allocator::tune(RECYCLED_IDLE);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?
        .block_on(serve())
}

async fn serve() -> anyhow::Result<()> {
    let args = Args::parse();
    init_logs(&args.log_format);
    let joining = Joining {
        cluster: args.cluster.clone(),
        name: args.name.clone(),
        advertise: args.advertise.clone(),
        ttl: args.cluster_ttl,
        etcd_user: etcd_user(&args)?,
    };
    raise_fd_limit(args.max_connections);
    ferry_io::host::set_recycle_limit(usize::try_from(args.recycle.as_u64()).unwrap_or(usize::MAX));
    let pool = reserve_pool(&args)?;
    // Metrics are clear HTTP with no credential: beyond loopback only where the operator says
    // the network is trusted, as for the listener.
    if let Some(addr) = args.metrics
        && !addr.ip().is_loopback()
    {
        if !args.insecure {
            bail!(
                "refusing to serve metrics on {addr}: they are clear HTTP that anyone who reaches \
                 the address can read (the node's traffic, memory and refusals). Serve them on loopback \
                 (and scrape through a tunnel), or pass --insecure on a network you trust"
            );
        }
        tracing::warn!(%addr, "--insecure: serving metrics beyond loopback in clear");
    }
    if let Some(addr) = args.metrics {
        serve_metrics(addr, pool.clone())?;
    }
    // An empty token would silently turn authentication off: refused, so that a variable that
    // expanded to nothing cannot open the node.
    if args.token.as_deref() == Some("") {
        bail!(
            "--token (or FERRY_TOKEN) is empty: give a token, or leave it unset to run without one"
        );
    }
    if args.hello_timeout == 0 {
        bail!("--hello-timeout must be at least 1 second");
    }
    if args.peer_token.as_deref() == Some("") {
        bail!("--peer-token (or FERRY_PEER_TOKEN) is empty: give a token, or leave it unset");
    }
    let mut credentials = Vec::new();
    if let Some(token) = &args.token {
        credentials.push(Credential::full(token)?);
    }
    if let Some(path) = &args.token_file {
        let text = read_secret(path)?;
        let listed = parse_token_file(&text).with_context(|| format!("{}", path.display()))?;
        if listed.is_empty() {
            bail!("{} holds no credential", path.display());
        }
        credentials.extend(listed);
    }
    let files = ferry_io::TlsFiles::from_flags(
        args.tls_cert.as_deref(),
        args.tls_key.as_deref(),
        args.tls_ca.as_deref(),
    )?;
    let tls = match files {
        Some(files) => {
            Some(ferry_io::NodeTls::load(&files).context("loading the node's TLS files")?)
        }
        None => None,
    };
    let under_tls = tls.is_some();
    // etcd over TLS is reached with the node's certificate: none, no cluster (said now, not as
    // a session that fails every few seconds).
    if !under_tls
        && let Some(cluster) = args
            .cluster
            .as_deref()
            .filter(|c| c.starts_with("etcds://"))
    {
        bail!("--cluster {cluster} is etcd over TLS: give the node --tls-cert/--tls-key/--tls-ca");
    }
    // Under TLS a member's name is its certificate's: readers check records against it.
    if let (Some(tls), Some(name)) = (&tls, &args.name)
        && name != tls.identity().as_str()
    {
        bail!(
            "under TLS a member's name is its certificate's name: --name {} (not {name})",
            tls.identity()
        );
    }
    // Under TLS a token would travel to whatever node a client reaches, which could replay it;
    // the certificate is the credential there.
    if tls.is_some()
        && (!credentials.is_empty() || args.peer_token.is_some() || args.peer_token_file.is_some())
    {
        bail!(
            "tokens are not taken under TLS (a token sent to a node can be replayed by it \
             anywhere; a certificate cannot): grant certificate names their scopes with \
             --grant NAME=SCOPES instead of --token/--token-file/--peer-token (every node \
             certificate of the CA may fetch)"
        );
    }
    let credentialed = !credentials.is_empty() || !args.grants.is_empty();
    if !args.listen.ip().is_loopback() {
        let missing = match (!credentialed, tls.is_none()) {
            (true, true) => Some("no TLS and no credential"),
            (true, false) => Some("no credential"),
            (false, true) => Some("no TLS"),
            (false, false) => None,
        };
        if let Some(missing) = missing {
            if !args.insecure {
                if tls.is_some() {
                    bail!(
                        "refusing to listen on {} with {missing}: under TLS with no --grant, \
                         every certificate of the CA may overwrite and delete every tensor. \
                         Grant certificate names their scopes with --grant NAME=SCOPES, listen \
                         on loopback, or pass --insecure on a network you trust",
                        args.listen
                    );
                }
                bail!(
                    "refusing to listen on {} with {missing}: whoever reaches it or sits on the \
                     path could read tensors and tokens, or with no credential overwrite and \
                     delete them. Give --tls-cert/--tls-key/--tls-ca (`ferry certs` makes them) \
                     and --grant, listen on loopback, or pass --insecure on a network you \
                     trust",
                    args.listen
                );
            }
            tracing::warn!(listen = %args.listen, "--insecure: serving beyond loopback with {missing}");
        }
    }
    let peer_token = match &args.peer_token_file {
        Some(path) => {
            let text = read_secret(path)?;
            Some(token_from_file(&text).with_context(|| format!("{}", path.display()))?)
        }
        None => args.peer_token.clone().or_else(|| args.token.clone()),
    };
    let chunk_size = usize::try_from(args.chunk_size.as_u64())
        .ok()
        .filter(|&c| c > 0 && c <= ferry_proto::frame::DEFAULT_MAX_BODY - 64)
        .context("--chunk-size must be between 1 byte and 16 MiB")?;
    let limits = ConnectionLimits {
        idle_timeout: Duration::from_secs(args.idle_timeout),
        chunk_size,
        region_min: usize::try_from(args.shm_min.as_u64()).unwrap_or(usize::MAX),
        min_rate: args.min_rate.as_u64(),
        ..ConnectionLimits::default()
    };
    let mut config = NodeConfig {
        node_id: args.node_id.map(ferry_proto::NodeId::from),
        tls,
        shared_memory: if args.no_shm {
            SharedMemory::Decline
        } else {
            SharedMemory::Offer
        },
        policy: args
            .transfer
            .parse::<TransferPolicy>()
            .map_err(anyhow::Error::msg)?,
        receive_buffers: match pool {
            Some(pool) => ReceiveBuffers::Pool(pool),
            None if args.shareable_receives => ReceiveBuffers::Shareable {
                min_bytes: ferry_io::connection::KEEP_REGION_MIN,
            },
            None => ReceiveBuffers::Fresh,
        },
        limits: NodeLimits {
            capability_ttl: Duration::from_secs(args.capability_ttl),
            max_tensor_bytes: args.max_tensor_bytes.as_u64(),
            memory_limit: args.memory_limit.map(|b| b.as_u64()),
            max_tensors: Some(args.max_tensors),
            max_grants_per_client: args.max_grants,
        },
        pulls: PullConfig {
            peers: {
                let listed: Vec<ferry_server::Peer> = args
                    .peers
                    .iter()
                    .map(|p| ferry_server::Peer {
                        // As a client would name it (a `unix:` path written the one way).
                        addr: ferry_io::Endpoint::parse(&p.addr).to_string(),
                        identity: p.identity.clone(),
                    })
                    .collect();
                if args.cluster.is_some() {
                    // A cluster node pulls from the members etcd lists (and the listed peers).
                    PeerPolicy::Members {
                        members: if args.member_ids.is_empty() {
                            ferry_server::ClusterMembers::new()
                        } else {
                            ferry_server::ClusterMembers::admitting(args.member_ids.clone())
                        },
                        listed,
                    }
                } else if !listed.is_empty() || peer_token.is_some() || under_tls {
                    // Under TLS too: a node with no --peer pulls from no one, rather than
                    // dialling whatever address a client names.
                    PeerPolicy::Listed(listed)
                } else {
                    PeerPolicy::Any
                }
            },
            peer_token: peer_token.map(ferry_proto::Token::from),
            retries: args.pull_retries,
            peer_limits: limits,
            striping: striping(args.pull_connections),
            ..PullConfig::default()
        },
        ..NodeConfig::default()
    };
    if !args.devices.is_empty() {
        config.devices = args.devices;
    }
    let devices: Vec<String> = config.devices.iter().map(|d| d.to_string()).collect();
    let node = Node::start(config).context("starting the node")?;
    let cluster_node = node.clone();
    let node_id = node.node_id().to_string();
    let tls_on = node.config().tls.is_some();
    let service_config = ServiceConfig {
        credentials,
        grants: args.grants,
        max_connections: args.max_connections,
        limits,
        shutdown_grace: Duration::from_secs(args.shutdown_grace),
        keepalive: Duration::from_secs(args.keepalive),
        hello_timeout: Duration::from_secs(args.hello_timeout),
        max_connections_per_address: args.max_connections_per_address,
    };
    let mut service = Service::bind(node, args.listen, service_config)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    if let Some(path) = &args.unix {
        service = service
            .listen_unix(path)
            .with_context(|| format!("binding the Unix socket {}", path.display()))?;
    }
    let addr = service.local_addr()?;
    // Scripts and tests find the port from this exact first line (and the Unix socket, if
    // any, from the second).
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on {addr}")?;
    if let Some(path) = service.unix_path() {
        writeln!(stdout, "listening on unix:{}", path.display())?;
    }
    stdout.flush()?;
    drop(stdout);
    let shm = !args.no_shm && ferry_io::connection::shared_memory_supported();
    tracing::info!(%addr, unix = ?args.unix, shared_memory = shm, tls = tls_on, %node_id, ?devices, "ferry node serving");
    let membership = match &joining.cluster {
        Some(cluster) => Some(ferry_server::cluster::Membership::join(
            cluster_node,
            cluster_config(&joining, cluster, addr, service.unix_path())?,
        )),
        None => None,
    };
    service.run(shutdown_signal()).await?;
    if let Some(membership) = membership {
        membership.leave().await;
    }
    tracing::info!("ferry node stopped");
    Ok(())
}

/// What the command line says of the cluster to join.
struct Joining {
    cluster: Option<String>,
    name: Option<String>,
    advertise: Option<String>,
    ttl: u64,
    etcd_user: Option<ferry_server::cluster::EtcdUser>,
}

/// The etcd user of `--etcd-user` and `--etcd-password-file`.
fn etcd_user(args: &Args) -> anyhow::Result<Option<ferry_server::cluster::EtcdUser>> {
    let (Some(name), Some(path)) = (&args.etcd_user, &args.etcd_password_file) else {
        return Ok(None);
    };
    let password = token_from_file(&read_secret(path)?)
        .with_context(|| format!("--etcd-password-file {}", path.display()))?;
    ferry_server::cluster::EtcdUser::new(name.clone(), password)
        .map(Some)
        .context("--etcd-user is empty")
}

/// The cluster to join, from `--cluster`, `--name`, `--advertise` and `--cluster-ttl`.
fn cluster_config(
    args: &Joining,
    cluster: &str,
    listening: std::net::SocketAddr,
    unix: Option<&std::path::Path>,
) -> anyhow::Result<ferry_server::cluster::ClusterConfig> {
    let endpoints = ferry_proto::cluster::endpoints(cluster)
        .map_err(|e| anyhow::anyhow!("--cluster {cluster:?}: {e}"))?;
    let name = args.name.clone().context("--cluster needs --name")?;
    anyhow::ensure!(
        ferry_proto::cluster::valid_member_name(&name),
        "--name {name:?}: 1 to 63 letters, digits, '-', '_' or '.', not starting with '.'"
    );
    let advertise = match &args.advertise {
        Some(advertise) => advertise.clone(),
        None if !listening.ip().is_unspecified() => listening.to_string(),
        None => anyhow::bail!("--listen {listening} is a wildcard: say --advertise HOST:PORT"),
    };
    Ok(ferry_server::cluster::ClusterConfig {
        endpoints,
        name,
        advertise,
        unix: unix.map(|p| format!("unix:{}", p.display())),
        ttl: Duration::from_secs(args.ttl),
        etcd_user: args.etcd_user.clone(),
    })
}

/// Whether any of `devices` (none: the default, Flex) would draw receive buffers from a pool:
/// Flex devices keep them as their tensors' memory, GPU devices stage through them; NdArray
/// takes only plain allocations over without a copy.
fn draws_from_a_pool(devices: &[DeviceSpec]) -> bool {
    devices.is_empty() || devices.iter().any(|d| !matches!(d, DeviceSpec::NdArray))
}

/// Whether any of `devices` (none: the default, Flex) keeps its tensors in the receive pool's
/// buffers (Flex), rather than staging through them (GPU).
fn holds_tensors_in_the_pool(devices: &[DeviceSpec]) -> bool {
    devices.is_empty() || devices.iter().any(|d| matches!(d, DeviceSpec::Flex))
}

/// Reserves the receive pool `--pool` asks for, logging what it took.
fn reserve_pool(args: &Args) -> anyhow::Result<Option<ferry_io::Pool>> {
    if args.pool_ready.is_some() && args.pool != PoolSize::Auto {
        bail!(
            "--pool-ready sizes the automatic pool: it goes with --pool auto, not --pool 0 or a fixed size"
        );
    }
    let receives_on_host = draws_from_a_pool(&args.devices);
    let size = match args.pool {
        PoolSize::Off => return Ok(None),
        PoolSize::Auto if !receives_on_host => return Ok(None),
        // Shared-memory receives take the place of the pool (its memory cannot be sealed).
        PoolSize::Auto if args.shareable_receives => {
            tracing::info!("--shareable-receives: no receive pool (its memory cannot be sealed)");
            return Ok(None);
        }
        PoolSize::Fixed(_) if args.shareable_receives => {
            bail!(
                "--pool and --shareable-receives exclude each other: pooled memory is reused, so it cannot be sealed"
            )
        }
        size => size,
    };
    let started = std::time::Instant::now();
    let pool = match size {
        PoolSize::Fixed(bytes) => {
            let bytes =
                usize::try_from(bytes).context("--pool is larger than this machine's memory")?;
            let pool = ferry_io::Pool::reserve(bytes).context("--pool")?;
            tracing::info!(
                bytes = pool.capacity(),
                ms = started.elapsed().as_millis() as u64,
                "receive pool reserved and touched"
            );
            pool
        }
        _ => {
            // Address space only: what is resident is what is drawn plus what is kept ready.
            let machine = rustix::system::sysinfo();
            let half = u64::from(machine.mem_unit).saturating_mul(machine.totalram) / 2;
            let limit = args.memory_limit.map_or(half, |m| m.as_u64().min(half));
            let capacity = usize::try_from(limit).unwrap_or(usize::MAX);
            let asked = args.pool_ready.map_or(DEFAULT_POOL_READY, |b| b.as_u64());
            let ready = usize::try_from(asked).unwrap_or(usize::MAX).min(capacity);
            if (ready as u64) < asked {
                tracing::warn!(
                    asked,
                    ready,
                    "--pool-ready is more than the pool may hold (the device's --memory-limit, or half this machine's memory): keeping that much ready"
                );
            }
            // A freshly started node that holds tensors in host memory expects a model: a
            // quarter of the pool made ready for it, unless told how much to keep ready. (A GPU
            // device's staging is reused tensor after tensor: the idle amount serves it.)
            let at_start = match args.pool_ready {
                None if holds_tensors_in_the_pool(&args.devices) => ferry_io::pool::AtStart {
                    bytes: capacity / 4,
                    kept_for: POOL_START_KEPT_FOR,
                    spare: ferry_io::pool::SpareCheck::HalfFree,
                },
                _ => ferry_io::pool::AtStart::IDLE,
            };
            let readiness = ferry_io::pool::Readiness {
                idle: ready,
                ahead: POOL_AHEAD.min(capacity),
                idle_after: POOL_IDLE_AFTER,
                touching: ferry_io::pool::Touching::InIdleTime,
                at_start,
            };
            let pool = ferry_io::Pool::elastic(capacity, readiness).context("--pool auto")?;
            tracing::info!(
                bytes = pool.capacity(),
                ready_at_start = readiness.at_start.bytes.max(readiness.idle),
                ready_idle = readiness.idle,
                ready_ahead = readiness.ahead,
                "elastic receive pool reserved; making memory ready in the background"
            );
            pool
        }
    };
    Ok(Some(pool))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
}

/// A file of secrets, read whole; a warning where other users may read it too.
fn read_secret(path: &std::path::Path) -> anyhow::Result<String> {
    use std::os::unix::fs::PermissionsExt;
    let metadata =
        std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if metadata.permissions().mode() & 0o077 != 0 {
        tracing::warn!(
            path = %path.display(),
            "the file of secrets is readable by other users; chmod 600 it"
        );
    }
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// How a pull spreads over connections: `--pull-connections N` where given, else by the cores
/// this machine has.
fn striping(pull_connections: Option<u16>) -> ferry_server::Striping {
    match pull_connections {
        Some(n) => ferry_server::Striping::new(usize::from(n), StripeLen::DEFAULT),
        None => ferry_server::Striping::for_this_machine(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--pull-connections` takes 1 to 16; 1 turns striping off, more stripes over that many;
    /// without it the machine decides (off below 8 cores).
    #[test]
    fn pull_connections_are_one_to_sixteen_and_default_by_cores() {
        let parse = |n: &str| Args::try_parse_from(["ferry-server", "--pull-connections", n]);
        for refused in ["0", "17", "-1", "many"] {
            assert!(parse(refused).is_err(), "{refused}");
        }
        let four = parse("4").unwrap().pull_connections;
        assert_eq!(striping(four).connections(), 4);
        assert!(!striping(parse("1").unwrap().pull_connections).spreads());
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(striping(None).spreads(), cores >= 8);
        assert_eq!(striping(None).stripe_len(), StripeLen::DEFAULT);
    }

    /// The automatic pool is for nodes with a device that draws from it: Flex (the default) or
    /// a GPU, not NdArray alone.
    #[test]
    fn a_node_gets_a_pool_where_a_device_draws_from_one() {
        let spec = |s: &str| s.parse::<DeviceSpec>().unwrap();
        assert!(draws_from_a_pool(&[]), "the default devices are Flex");
        assert!(draws_from_a_pool(&[spec("flex")]));
        assert!(
            draws_from_a_pool(&[spec("gl:cpu")]),
            "a GPU stages through it"
        );
        assert!(draws_from_a_pool(&[spec("ndarray"), spec("vulkan:0")]));
        assert!(!draws_from_a_pool(&[spec("ndarray"), spec("ndarray")]));
    }

    /// A start amount for a model is made where a device keeps its tensors in the pool (Flex,
    /// the default), not where the pool is only a GPU's staging.
    #[test]
    fn a_start_amount_is_for_nodes_with_a_flex_device() {
        let spec = |s: &str| s.parse::<DeviceSpec>().unwrap();
        assert!(
            holds_tensors_in_the_pool(&[]),
            "the default devices are Flex"
        );
        assert!(holds_tensors_in_the_pool(&[spec("vulkan:0"), spec("flex")]));
        assert!(!holds_tensors_in_the_pool(&[spec("gl:cpu")]));
        assert!(!holds_tensors_in_the_pool(&[
            spec("ndarray"),
            spec("vulkan:0")
        ]));
    }
}
