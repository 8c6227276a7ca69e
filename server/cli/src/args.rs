//! `ferry-server`'s command line: its flags, and the [`ServerBuilder`] they describe. Every
//! rule about what may run lives in the library (`ferry_server::Server`); here only the
//! flags' own combinations are read.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::bail;
use clap::Parser;
use ferry_io::{ConnectionLimits, SharedMemory};
use ferry_proto::stripes::StripeLen;
use ferry_server::{
    ClusterJoin, DeviceSpec, NodeLimits, PeerToken, ReadyMemory, ReceiveBuffers, Server,
    ServerBuilder, TransferPolicy,
};

/// A ferry node: hosts Burn devices and moves tensors of every dtype between them and over TCP.
#[derive(Debug, Parser)]
#[command(version, about)]
pub(crate) struct Args {
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
    grants: Vec<ferry_server::CertificateGrant>,
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
    /// Connections served at once per identity (a token of --token-file, a certificate name
    /// under TLS), so that one credential holder cannot take every slot from the others.
    /// Default: three quarters of --max-connections.
    #[arg(long, value_name = "N")]
    max_connections_per_identity: Option<std::num::NonZeroUsize>,
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
    pub(crate) log_format: String,
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

impl Args {
    /// The server these flags describe.
    pub(crate) fn builder(self) -> anyhow::Result<ServerBuilder> {
        let limits = ConnectionLimits {
            idle_timeout: Duration::from_secs(self.idle_timeout),
            chunk_size: usize::try_from(self.chunk_size.as_u64()).unwrap_or(usize::MAX),
            region_min: usize::try_from(self.shm_min.as_u64()).unwrap_or(usize::MAX),
            min_rate: self.min_rate.as_u64(),
            ..ConnectionLimits::default()
        };
        let mut server = Server::builder()
            .listen(self.listen)
            .devices(self.devices)
            .grants(self.grants)
            .peers(self.peers)
            .connection_limits(limits)
            .max_connections(self.max_connections, self.max_connections_per_address)
            .timeouts(
                Duration::from_secs(self.hello_timeout),
                Duration::from_secs(self.keepalive),
                Duration::from_secs(self.shutdown_grace),
            )
            .limits(NodeLimits {
                capability_ttl: Duration::from_secs(self.capability_ttl),
                max_tensor_bytes: self.max_tensor_bytes.as_u64(),
                memory_limit: self.memory_limit.map(|b| b.as_u64()),
                max_tensors: Some(self.max_tensors),
                max_grants_per_client: self.max_grants,
            })
            .transfer_policy(
                self.transfer
                    .parse::<TransferPolicy>()
                    .map_err(anyhow::Error::msg)?,
            )
            .pull_retries(self.pull_retries)
            .striping(striping(self.pull_connections))
            .recycle(usize::try_from(self.recycle.as_u64()).unwrap_or(usize::MAX))
            .receive_buffers(receive_buffers(
                self.pool,
                self.pool_ready,
                self.shareable_receives,
            )?);
        if let Some(path) = self.unix {
            server = server.unix_socket(path);
        }
        if let Some(share) = self.max_connections_per_identity {
            server = server.max_connections_per_identity(share);
        }
        if self.no_shm {
            server = server.shared_memory(SharedMemory::Decline);
        }
        if let Some(token) = self.token {
            server = server.token(token);
        }
        if let Some(path) = self.token_file {
            server = server.token_file(path);
        }
        if let Some(files) = ferry_io::TlsFiles::from_flags(
            self.tls_cert.as_deref(),
            self.tls_key.as_deref(),
            self.tls_ca.as_deref(),
        )? {
            server = server.tls_files(files);
        }
        if let Some(path) = self.peer_token_file {
            server = server.peer_token(PeerToken::File(path));
        } else if let Some(token) = self.peer_token {
            server = server.peer_token(PeerToken::Given(token.into()));
        }
        if let Some(id) = self.node_id {
            server = server.node_id(id);
        }
        if let Some(addr) = self.metrics {
            server = server.metrics(addr);
        }
        if let Some(cluster) = self.cluster {
            let name = self.name.unwrap_or_default();
            server = server.cluster(ClusterJoin {
                advertise: self.advertise,
                ttl: Duration::from_secs(self.cluster_ttl),
                member_ids: self.member_ids,
                etcd_login: self.etcd_user.zip(self.etcd_password_file),
                ..ClusterJoin::new(cluster, name)
            });
        }
        if self.insecure {
            server = server.insecure();
        }
        Ok(server)
    }
}

/// Where receives land, from `--pool`, `--pool-ready` and `--shareable-receives`.
fn receive_buffers(
    pool: PoolSize,
    ready: Option<bytesize::ByteSize>,
    shareable: bool,
) -> anyhow::Result<ReceiveBuffers> {
    if ready.is_some() && pool != PoolSize::Auto {
        bail!(
            "--pool-ready sizes the automatic pool: it goes with --pool auto, not --pool 0 or a fixed size"
        );
    }
    Ok(match (pool, shareable) {
        (PoolSize::Fixed(_), true) => bail!(
            "--pool and --shareable-receives exclude each other: pooled memory is reused, so it cannot be sealed"
        ),
        // Shared-memory receives take the place of the pool (its memory cannot be sealed).
        (_, true) => ReceiveBuffers::Shareable {
            min_bytes: ferry_io::connection::KEEP_REGION_MIN,
        },
        (PoolSize::Off, false) => ReceiveBuffers::Fresh,
        (PoolSize::Fixed(bytes), false) => ReceiveBuffers::Reserved(bytes),
        (PoolSize::Auto, false) => ReceiveBuffers::Elastic(
            ready.map_or(ReadyMemory::ForAModel, |b| ReadyMemory::Kept(b.as_u64())),
        ),
    })
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

    /// `--pool`, `--pool-ready` and `--shareable-receives` -> where receives land, or refused.
    #[test]
    fn the_pool_flags_name_one_kind_of_receive_buffers() {
        let size = |s: &str| Some(s.parse::<bytesize::ByteSize>().unwrap());
        let kind = |pool, ready, shareable| {
            receive_buffers(pool, ready, shareable).map(|b| format!("{b:?}"))
        };
        assert_eq!(
            kind(PoolSize::Auto, None, false).unwrap(),
            "Elastic(ForAModel)"
        );
        assert_eq!(
            kind(PoolSize::Auto, size("1MiB"), false).unwrap(),
            "Elastic(Kept(1048576))"
        );
        assert_eq!(kind(PoolSize::Off, None, false).unwrap(), "Fresh");
        assert_eq!(
            kind(PoolSize::Fixed(7), None, false).unwrap(),
            "Reserved(7)"
        );
        assert!(
            kind(PoolSize::Auto, None, true)
                .unwrap()
                .starts_with("Shareable")
        );
        assert!(
            kind(PoolSize::Off, None, true)
                .unwrap()
                .starts_with("Shareable")
        );
        assert!(kind(PoolSize::Fixed(7), None, true).is_err());
        assert!(kind(PoolSize::Off, size("1MiB"), false).is_err());
        assert!(kind(PoolSize::Fixed(7), size("1MiB"), false).is_err());
    }
}
