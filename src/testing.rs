//! Helpers the integration tests of every package share: in-process nodes on loopback, node
//! processes, a fault-injecting proxy, byte comparisons and polling.
// Test support: a failed unwrap fails the test that called it, and these helpers are read in
// the tests that use them rather than in `cargo doc`.
#![allow(clippy::unwrap_used, missing_docs)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ferry_client::{Client, ClientError, ErrorCode, NodeCopy};
use ferry_io::{Dial, Exchange, ExchangeError, PeerCheck, SharedMemory};
use ferry_proto::{ContentHash, IfExists, Transfer};
use ferry_proto::{NodeStats, TensorData, TensorInfo, TensorKey};
use ferry_server::{DeviceSpec, Node, NodeConfig, Service, ServiceConfig};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A node serving on `127.0.0.1:0` (and a Unix socket in a temporary directory, where asked)
/// inside the test process, through real sockets.
/// Shared-memory region counts are per process, and every test of this binary shares one: a
/// test that counts them, or makes them in this process (a node or client on a Unix socket),
/// holds this, so that no count sees another test's regions.
pub static REGIONS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub struct TestNode {
    pub addr: SocketAddr,
    pub node: Node,
    /// `unix:PATH`, where the node also listens on a Unix socket.
    pub unix: Option<String>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
    _dir: Option<tempfile::TempDir>,
}

impl TestNode {
    /// Stops accepting and waits for the sessions to finish.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.expect("service task").expect("service ran");
        }
    }

    pub async fn client(&self) -> Client {
        Client::connect(self.addr).await.expect("connect")
    }
}

pub fn devices(specs: &[&str]) -> Vec<DeviceSpec> {
    specs
        .iter()
        .map(|s| s.parse().expect("device spec"))
        .collect()
}

pub async fn start(config: NodeConfig, service: ServiceConfig) -> TestNode {
    start_service(config, service, false).await
}

/// A node that also listens on a Unix socket in a fresh temporary directory.
pub async fn start_unix(config: NodeConfig, service: ServiceConfig) -> TestNode {
    start_service(config, service, true).await
}

async fn start_service(config: NodeConfig, service: ServiceConfig, unix: bool) -> TestNode {
    let node = Node::start(config).expect("node starts");
    let mut service = Service::bind(node.clone(), "127.0.0.1:0".parse().unwrap(), service)
        .await
        .expect("bind");
    let mut dir = None;
    let mut unix_addr = None;
    if unix {
        let tmp = tempfile::tempdir().expect("temporary directory");
        let path = tmp.path().join("node.sock");
        service = service.listen_unix(&path).expect("bind the Unix socket");
        unix_addr = Some(format!("unix:{}", path.display()));
        dir = Some(tmp);
    }
    let addr = service.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(service.run(async {
        let _ = stopped.await;
    }));
    TestNode {
        addr,
        node,
        unix: unix_addr,
        stop: Some(stop),
        task: Some(task),
        _dir: dir,
    }
}

pub async fn start_with(specs: &[&str]) -> TestNode {
    start(
        NodeConfig {
            devices: devices(specs),
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await
}

/// Bit-exact: the same bytes, the same dtype (scheme and scales included), the same shape.
pub fn assert_same(actual: &TensorData, expected: &TensorData, what: &str) {
    assert_eq!(actual.dtype(), expected.dtype(), "{what}: dtype");
    assert_eq!(actual.shape(), expected.shape(), "{what}: shape");
    assert!(
        actual.as_bytes() == expected.as_bytes(),
        "{what}: bytes differ ({} vs {} bytes)",
        actual.as_bytes().len(),
        expected.as_bytes().len()
    );
}

/// The node's error code of a failed call.
pub fn code_of<T: std::fmt::Debug>(result: Result<T, ClientError>) -> ErrorCode {
    match result {
        Err(ClientError::Node { code, .. }) => code,
        other => panic!("expected an error reply from the node, got {other:?}"),
    }
}

/// [`code_of`] for an exchange a node makes with its source.
pub fn source_code_of<T: std::fmt::Debug>(result: Result<T, ExchangeError>) -> ErrorCode {
    match result {
        Err(ExchangeError::Refused(reply)) => reply.code,
        other => panic!("expected an error reply from the source, got {other:?}"),
    }
}

/// A connection to `node` as a pulling node opens one (no token, no shared memory): for tests
/// that fetch and release capabilities as a node would, or as a hostile one might.
pub async fn source_connection(node: &TestNode) -> Exchange {
    let dial = Dial {
        token: None,
        agent: "ferry-tests",
        tls: None,
        check: &PeerCheck::Any,
        clear_tokens: Default::default(),
        shared_memory: SharedMemory::Decline,
        limits: Default::default(),
    };
    dial.open(&node.addr.into())
        .await
        .expect("connect to the source")
}

/// What a [`proxy`] does to the bytes flowing from upstream (the source node) to the client.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// Cuts the first connection after this many bytes; later connections pass.
    CutOnceAfter(usize),
    /// Cuts the first connection after this many bytes and refuses every later one, as a node
    /// that died would.
    DieAfter(usize),
    /// Flips one bit of the byte at this position of the first connection.
    FlipAt(usize),
    /// Flips one bit of the first payload byte of every chunk frame on the first connection and
    /// writes the frame's checksum anew, as an attacker on the path would: every frame checks,
    /// only the end-to-end content hash can tell.
    FlipAndReframe,
    /// Passes this many whole frames from upstream on the first connection (its `Welcome`
    /// first), then cuts it; later connections pass.
    CutAfterFrames(usize),
}

/// A TCP proxy on loopback in front of `upstream` that applies `fault`; returns its address.
pub async fn proxy(upstream: SocketAddr, fault: Fault) -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut first = true;
        loop {
            let Ok((mut down, _)) = listener.accept().await else {
                return;
            };
            let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await else {
                return;
            };
            let fault_now = first;
            first = false;
            if fault_now {
                match fault {
                    Fault::FlipAndReframe => {
                        tokio::spawn(relay_frames(down, up, flip_and_reframe));
                        continue;
                    }
                    Fault::CutAfterFrames(frames) => {
                        tokio::spawn(relay_frames(down, up, move |n, _, _| n < frames));
                        continue;
                    }
                    _ => {}
                }
            }
            let (mut down_r, mut down_w) = down.split();
            let (mut up_r, mut up_w) = up.split();
            let to_upstream = tokio::io::copy(&mut down_r, &mut up_w);
            let from_upstream = async {
                let mut seen = 0usize;
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match up_r.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    let piece = &mut buf[..n];
                    if fault_now {
                        match fault {
                            Fault::CutOnceAfter(at) | Fault::DieAfter(at) if seen + n > at => {
                                let _ = down_w.write_all(&piece[..at - seen]).await;
                                return;
                            }
                            Fault::FlipAt(at) if seen <= at && at < seen + n => {
                                piece[at - seen] ^= 0x10;
                            }
                            _ => {}
                        }
                    }
                    seen += n;
                    if down_w.write_all(piece).await.is_err() {
                        return;
                    }
                }
            };
            // Either direction ending ends the connection (as a cut does).
            tokio::select! {
                _ = to_upstream => {},
                () = from_upstream => {},
            }
            drop(down);
            drop(up);
            if fault_now && matches!(fault, Fault::DieAfter(_)) {
                return;
            }
        }
    });
    addr
}

/// One bit of a chunk frame's first payload byte flipped and the frame's CRC-32C computed again
/// over the altered body: every frame still checks.
fn flip_and_reframe(_: usize, header: &mut [u8; 16], body: &mut [u8]) -> bool {
    // Kind 2 is a chunk: an 8-byte offset, then payload.
    if header[5] == 2 && body.len() > 8 {
        body[8] ^= 0x01;
        header[12..16].copy_from_slice(&crc32c::crc32c(body).to_le_bytes());
    }
    true
}

/// Relays one connection, frame by frame from upstream: `edit` sees each frame (its number
/// from 0, header and body) and may rewrite it, or end the connection before it (false).
async fn relay_frames(
    mut down: tokio::net::TcpStream,
    mut up: tokio::net::TcpStream,
    mut edit: impl FnMut(usize, &mut [u8; 16], &mut [u8]) -> bool,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut down_r, mut down_w) = down.split();
    let (mut up_r, mut up_w) = up.split();
    let to_upstream = tokio::io::copy(&mut down_r, &mut up_w);
    let from_upstream = async {
        for n in 0.. {
            let mut header = [0u8; 16];
            if up_r.read_exact(&mut header).await.is_err() {
                return;
            }
            let len = u32::from_le_bytes(header[8..12].try_into().unwrap()) as usize;
            let mut body = vec![0u8; len];
            if up_r.read_exact(&mut body).await.is_err() || !edit(n, &mut header, &mut body) {
                return;
            }
            if down_w.write_all(&header).await.is_err() || down_w.write_all(&body).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = to_upstream => {},
        () = from_upstream => {},
    }
}

/// A `ferry-server` process on `127.0.0.1:0`, found through its `listening on` line; killed when
/// dropped.
pub struct ServerProcess {
    pub child: std::process::Child,
    pub addr: String,
    /// `unix:PATH`, where it was started with `--unix`.
    pub unix: Option<String>,
}

impl ServerProcess {
    /// The process id, for reading its `/proc` entries.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `BINARY --listen 127.0.0.1:0 ARGS...` (a `ferry-server`: a test of the package that
/// owns it passes `env!("CARGO_BIN_EXE_ferry-server")`), with `FERRY_TOKEN` set to `token` if
/// given.
pub fn spawn_server(binary: &std::path::Path, args: &[&str], token: Option<&str>) -> ServerProcess {
    use std::io::BufRead;
    let mut command = std::process::Command::new(binary);
    command
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .env_remove("FERRY_TOKEN")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    if let Some(token) = token {
        command.env("FERRY_TOKEN", token);
    }
    let mut child = command.spawn().expect("ferry-server starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = std::io::BufReader::new(stdout);
    let mut read_address = || {
        let mut line = String::new();
        lines.read_line(&mut line).expect("a line");
        line.trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("expected `listening on ADDR`, got {line:?}"))
            .to_string()
    };
    let addr = read_address();
    let unix = args.contains(&"--unix").then(read_address);
    ServerProcess { child, addr, unix }
}

/// A `ferry-server` whose log (stderr) is kept, to be read once it has stopped.
pub struct LoggedServer {
    child: std::process::Child,
    /// The TCP address it listens on.
    pub addr: String,
}

impl LoggedServer {
    /// Starts `BINARY --listen 127.0.0.1:0 ARGS...` with `RUST_LOG=info` and the environment
    /// `env` (nothing of the caller's `FERRY_TOKEN`).
    pub fn start(binary: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> LoggedServer {
        use std::io::BufRead;
        let mut child = std::process::Command::new(binary)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("FERRY_TOKEN")
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("ferry-server starts");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("a line");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("expected `listening on ADDR`, got {line:?}"))
            .to_string();
        LoggedServer { child, addr }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Stops it cleanly (SIGTERM, then its exit, so that every line it logged is written) and
    /// returns its log.
    pub fn stop(mut self) -> String {
        use std::io::Read;
        let term = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(term.success());
        let _ = self.child.wait();
        let mut log = String::new();
        self.child
            .stderr
            .take()
            .expect("stderr")
            .read_to_string(&mut log)
            .expect("the log");
        log
    }
}

/// Copies the one tensor `key` from `source`'s node to `target`'s, as `how` says: the answer for
/// that tensor (the batch itself must go through).
pub async fn copy_one(
    source: &mut Client,
    target: &mut Client,
    key: &TensorKey,
    how: &How,
) -> Result<TensorInfo, ClientError> {
    copy_keys(source, target, std::slice::from_ref(key), how)
        .await
        .expect("the batch goes through")
        .remove(0)
}

/// Runs the [`NodeCopy`] of `keys` that `how` describes.
pub async fn copy_keys(
    source: &mut Client,
    target: &mut Client,
    keys: &[TensorKey],
    how: &How,
) -> Result<Vec<Result<TensorInfo, ClientError>>, ClientError> {
    how.node_copy(keys).run(source, target).await
}

/// How often the polling helpers look again.
const POLL: Duration = Duration::from_millis(5);

/// Polls `check` until it holds; fails the test, naming `what`, if it does not within `within`.
/// For what becomes true when a node gets round to it (a dropped connection giving its
/// reservation back, a region arriving), so that no test sleeps a fixed time and hopes.
pub async fn eventually(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] for a check that must ask a node (an async call).
pub async fn eventually_async<F: Future<Output = bool>>(
    what: &str,
    within: Duration,
    mut check: impl FnMut() -> F,
) {
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] outside a runtime (a child process's exit, a file appearing).
pub fn eventually_blocking(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        std::thread::sleep(POLL);
    }
}

/// A node in this process, served by a runtime on a thread of its own, for synchronous tests (a
/// command line run against it); stopped when dropped.
pub struct BackgroundNode {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// `unix:PATH`, where it also listens on a Unix socket.
    pub unix: Option<String>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BackgroundNode {
    /// Serves a node of `config` with `service`'s settings on `127.0.0.1:0`, and on the Unix
    /// socket `unix` where given.
    pub fn start(
        config: NodeConfig,
        service: ServiceConfig,
        unix: Option<&std::path::Path>,
    ) -> BackgroundNode {
        let unix = unix.map(std::path::Path::to_path_buf);
        let (ready, addresses) = std::sync::mpsc::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async move {
                let node = Node::start(config).expect("node starts");
                let loopback: SocketAddr = "127.0.0.1:0".parse().expect("an address");
                let mut service = Service::bind(node, loopback, service).await.expect("bind");
                if let Some(path) = &unix {
                    service = service.listen_unix(path).expect("bind the Unix socket");
                }
                let addr = service.local_addr().expect("bound").to_string();
                let unix = unix.map(|p| format!("unix:{}", p.display()));
                ready.send((addr, unix)).expect("the test waits");
                service
                    .run(async {
                        let _ = stopped.await;
                    })
                    .await
                    .expect("service ran");
            });
        });
        let (addr, unix) = addresses.recv().expect("the node started");
        BackgroundNode {
            addr,
            unix,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for BackgroundNode {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Node-to-node copy settings as the tests vary them, for [`copy_keys`] and [`copy_one`].
#[derive(Debug, Clone)]
pub struct How {
    /// The source's address, as the target reaches it.
    pub source_addr: String,
    /// The target device.
    pub dst_device: u32,
    /// The target name (one tensor); the source's name when absent.
    pub dst_name: Option<String>,
    /// Copy or move.
    pub transfer: Transfer,
    /// What becomes of a tensor already under the target key.
    pub if_exists: IfExists,
    /// The version the tensor must be.
    pub version: Option<ContentHash>,
}

impl How {
    /// The copy of `keys` these settings describe.
    pub fn node_copy(&self, keys: &[TensorKey]) -> NodeCopy {
        assert!(
            self.dst_name.is_none() || keys.len() == 1,
            "a target name is for one tensor"
        );
        let copy = NodeCopy::new(self.source_addr.clone())
            .transfer(self.transfer)
            .if_exists(self.if_exists);
        keys.iter().fold(copy, |copy, src| {
            let name = self.dst_name.clone().unwrap_or_else(|| src.name.clone());
            let dst = TensorKey::new(self.dst_device, name);
            match self.version {
                Some(version) => copy.tensor_at(src.clone(), dst, version),
                None => copy.tensor(src.clone(), dst),
            }
        })
    }
}

/// Node-to-node copy settings: to `dst_device` under the source's names, keeping the source, not
/// replacing anything.
pub fn how(source_addr: &str, dst_device: u32) -> How {
    How {
        source_addr: source_addr.to_string(),
        dst_device,
        dst_name: None,
        transfer: Transfer::Copy,
        if_exists: IfExists::Refuse,
        version: None,
    }
}

/// Waits (5 s at most) until the client's node has verified every content hash it was told, and
/// returns its stats then.
pub async fn hashes_verified(client: &mut Client) -> NodeStats {
    for _ in 0..500 {
        let stats = client.stat().await.unwrap();
        if stats.hashes_pending == 0 {
            return stats;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("stated hashes still unverified after 5 s");
}

/// A CA in a temporary directory and the certificates tests ask it for: nodes valid for
/// `127.0.0.1` (where test nodes listen), clients, and whatever else a test issues itself.
pub struct TestPki {
    pub certs: ferry_certs::CertDir,
    pub authority: ferry_certs::Authority,
    /// What each name was issued as, so that asking for it as something else fails loudly.
    issued: std::sync::Mutex<std::collections::HashMap<String, ferry_certs::Role>>,
    _dir: tempfile::TempDir,
}

impl Default for TestPki {
    fn default() -> Self {
        Self::new()
    }
}

impl TestPki {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let certs = ferry_certs::CertDir::open(dir.path()).expect("certificate directory");
        let (authority, _) = certs
            .authority(ferry_certs::Validity::days(30))
            .expect("a CA");
        Self {
            certs,
            authority,
            issued: Default::default(),
            _dir: dir,
        }
    }

    /// Issues `name` in `role` for `validity`, unless it was issued in that role already (in
    /// another role, the test is wrong: this panics).
    pub fn issue(&self, name: &str, role: &ferry_certs::Role, validity: ferry_certs::Validity) {
        let mut issued = self.issued.lock().unwrap();
        match issued.get(name) {
            Some(earlier) => assert_eq!(earlier, role, "{name} was issued in another role"),
            None => {
                self.certs
                    .issue(&self.authority, name, role, validity)
                    .expect("issue a certificate");
                issued.insert(name.to_string(), role.clone());
            }
        }
    }

    /// The files of `name` (issued already) under this CA.
    pub fn files(&self, name: &str) -> ferry_io::TlsFiles {
        ferry_io::TlsFiles {
            cert: self.certs.cert(name),
            key: self.certs.key(name),
            ca: self.certs.path(ferry_certs::CA_CERT),
        }
    }

    /// A node's TLS, its certificate valid for 127.0.0.1 and a day.
    pub fn node(&self, name: &str) -> ferry_io::NodeTls {
        let role = ferry_certs::Role::Node {
            hosts: vec!["127.0.0.1".into()],
        };
        self.issue(name, &role, ferry_certs::Validity::days(1));
        ferry_io::NodeTls::load(&self.files(name)).expect("load a node's TLS")
    }

    /// A client's TLS, its certificate valid for a day.
    pub fn client(&self, name: &str) -> ferry_io::ClientTls {
        self.issue(
            name,
            &ferry_certs::Role::Client,
            ferry_certs::Validity::days(1),
        );
        ferry_io::ClientTls::load(&self.files(name)).expect("load a client's TLS")
    }
}

/// A client of `node` over mutual TLS.
pub async fn tls_client(node: &TestNode, tls: &ferry_io::ClientTls) -> Result<Client, ClientError> {
    Client::connect(node.addr).tls(tls.clone()).await
}

/// A real etcd (Debian's `etcd-server`; `tests/run.sh` installs it) on free loopback ports, with its
/// data in a temporary directory, for the cluster tests. Stopped (killed) when dropped.
pub struct Etcd {
    child: Option<std::process::Child>,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    tls: Option<EtcdTls>,
    /// Who the helper logs in as once auth is on ([`Etcd::enable_auth`]).
    root: Option<ferry_etcd::EtcdUser>,
}

/// A test etcd's TLS: its own certificate (a node certificate of the test CA, for 127.0.0.1),
/// the CA it admits clients of, and the helper's own client side.
struct EtcdTls {
    files: ferry_io::TlsFiles,
    helper: ferry_io::ClientTls,
    /// Whether etcd asks clients for a certificate of the CA (`--client-cert-auth`), or
    /// leaves who may do what to its users and roles.
    clients: EtcdClients,
}

/// Whom a test etcd over TLS admits.
#[derive(Clone, Copy, PartialEq, Eq)]
enum EtcdClients {
    /// Holders of a certificate of the CA (`--client-cert-auth`).
    Certificates,
    /// Holders of a certificate of the CA still (etcd asks every client for one wherever it is
    /// given `--trusted-ca-file`), but not `--client-cert-auth`: its users and roles decide
    /// what each may do once a test turns auth on (with both on, etcd's JSON gateway refuses
    /// every client certificate with a common name).
    Passwords,
}

impl EtcdTls {
    fn of(pki: &TestPki, clients: EtcdClients) -> EtcdTls {
        pki.node("etcd");
        EtcdTls {
            files: pki.files("etcd"),
            helper: pki.client("etcd-helper"),
            clients,
        }
    }
}

impl Etcd {
    /// Starts etcd and waits until it answers. Its ports are drawn where other tests' sockets
    /// are not handed out (`etcd_port`); an etcd that exits at start anyway (another test's
    /// etcd drew the same port) is started again on others, with fresh data.
    pub async fn start() -> Etcd {
        Etcd::start_with(None).await
    }

    /// [`start`](Self::start), serving clients over TLS only (`etcds://`): etcd presents a
    /// certificate of `pki`'s CA and admits only clients that present one
    /// (`--client-cert-auth`).
    pub async fn start_tls(pki: &TestPki) -> Etcd {
        Etcd::start_with(Some(EtcdTls::of(pki, EtcdClients::Certificates))).await
    }

    /// [`start`](Self::start), serving clients over TLS only (`etcds://`) with a certificate of
    /// `pki`'s CA, without `--client-cert-auth`: for a test that turns auth on
    /// ([`enable_auth`](Self::enable_auth)), where etcd's users and roles decide.
    pub async fn start_tls_for_passwords(pki: &TestPki) -> Etcd {
        Etcd::start_with(Some(EtcdTls::of(pki, EtcdClients::Passwords))).await
    }

    async fn start_with(tls: Option<EtcdTls>) -> Etcd {
        let mut etcd = Etcd {
            child: None,
            dir: tempfile::tempdir().unwrap(),
            client_port: etcd_port(),
            peer_port: etcd_port(),
            tls,
            root: None,
        };
        let mut exits = Vec::new();
        for _ in 0..5 {
            match etcd.run().await {
                Ok(()) => return etcd,
                Err(exit) => exits.push(exit),
            }
            let _ = std::fs::remove_dir_all(etcd.dir.path().join("data"));
            etcd.client_port = etcd_port();
            etcd.peer_port = etcd_port();
        }
        panic!("etcd exited at start five times:\n{}", exits.join("\n"));
    }

    /// The cluster address nodes and clients are given: `etcd://127.0.0.1:PORT`, or
    /// `etcds://127.0.0.1:PORT` over TLS.
    pub fn cluster(&self) -> String {
        let scheme = if self.tls.is_some() { "etcds" } else { "etcd" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// A client of this etcd, as the helper is (with its own certificate over TLS).
    async fn helper(&self, timeout: Duration) -> Result<ferry_etcd::Etcd, ferry_etcd::EtcdError> {
        let endpoints = ferry_proto::cluster::endpoints(&self.cluster()).unwrap();
        let tls = self.tls.as_ref().map(|tls| tls.helper.connector());
        ferry_etcd::Etcd::connect_as(&endpoints, timeout, tls, self.root.clone()).await
    }

    /// The etcd user a test gives a member or reader named `name` ([`enable_auth`]).
    ///
    /// [`enable_auth`]: Self::enable_auth
    pub fn user(name: &str) -> ferry_etcd::EtcdUser {
        ferry_etcd::EtcdUser::new(name, Etcd::password(name)).expect("a name")
    }

    fn password(name: &str) -> String {
        format!("{name}-password")
    }

    /// Turns etcd's auth on with ferry's roles ([`add_roles`](Self::add_roles), then
    /// [`auth_on`](Self::auth_on)).
    pub async fn enable_auth(&mut self, members: &[&str], readers: &[&str]) {
        self.add_roles(members, readers).await;
        self.auth_on().await;
    }

    /// Gives etcd ferry's roles ([`ferry_client::etcd_roles`]): each of `members` an etcd user
    /// of its name that reads the directory and writes its own keys, each of `readers` one that
    /// reads it ([`Etcd::user`] gives their passwords).
    pub async fn add_roles(&self, members: &[&str], readers: &[&str]) {
        use ferry_client::etcd_roles;
        let mut client = self.helper(Duration::from_secs(5)).await.expect("etcd");
        for name in members {
            let password = Etcd::password(name);
            etcd_roles::add_member(&mut client, name, name, Some(&password))
                .await
                .expect("add a member");
        }
        for name in readers {
            let password = Etcd::password(name);
            etcd_roles::add_reader(&mut client, name, Some(&password))
                .await
                .expect("add a reader");
        }
    }

    /// Turns etcd's auth on (user root): the helper's own writes ([`put`](Self::put),
    /// [`delete`](Self::delete)) are then root's.
    pub async fn auth_on(&mut self) {
        let mut client = self.helper(Duration::from_secs(5)).await.expect("etcd");
        ferry_client::etcd_roles::enable_auth(&mut client, &Etcd::password("root"))
            .await
            .expect("auth on");
        self.root = Some(Etcd::user("root"));
    }

    /// Writes `value` under `key` as `user` (or as no one), as an etcd writer holding that
    /// user's password could: etcd's answer.
    pub async fn put_as(
        &self,
        user: Option<ferry_etcd::EtcdUser>,
        key: &str,
        value: &[u8],
    ) -> Result<(), ferry_etcd::EtcdError> {
        let endpoints = ferry_proto::cluster::endpoints(&self.cluster()).unwrap();
        let tls = self.tls.as_ref().map(|tls| tls.helper.connector());
        let mut client =
            ferry_etcd::Etcd::connect_as(&endpoints, Duration::from_secs(5), tls, user).await?;
        client.put(key.as_bytes(), value, None).await
    }

    /// Writes `value` under `key` as any client of this etcd could (no lease: it stays until
    /// deleted), for tests of what nodes make of records they did not write.
    pub async fn put(&self, key: &str, value: &[u8]) {
        let mut client = self
            .helper(Duration::from_secs(5))
            .await
            .expect("connect to etcd");
        client.put(key.as_bytes(), value, None).await.expect("put");
    }

    /// Deletes `key`.
    pub async fn delete(&self, key: &str) {
        let mut client = self
            .helper(Duration::from_secs(5))
            .await
            .expect("connect to etcd");
        client.delete(key.as_bytes()).await.expect("delete");
    }

    /// Kills etcd (its data stays).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same ports and data, and waits until it answers.
    pub async fn resume(&mut self) {
        if let Err(exit) = self.run().await {
            panic!("etcd exited at restart: {exit}");
        }
    }

    /// Starts etcd on this helper's ports and data and waits until it answers; `Err` with its
    /// exit status and the last lines it logged if it exited first.
    async fn run(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "etcd is running");
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        // What etcd says of itself goes to a file beside its data, so that a failure can say it.
        let log_path = self.dir.path().join("etcd.log");
        let log = std::fs::File::create(&log_path).expect("create etcd's log");
        let mut command = std::process::Command::new("etcd");
        if let Some(tls) = &self.tls {
            command
                .arg("--cert-file")
                .arg(&tls.files.cert)
                .arg("--key-file")
                .arg(&tls.files.key)
                .arg("--trusted-ca-file")
                .arg(&tls.files.ca);
            if tls.clients == EtcdClients::Certificates {
                command.arg("--client-cert-auth");
            }
        }
        let child = command
            .args(["--name", "ferry-test", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("ferry-test={peer}")])
            // Tokens of users (where a test turns auth on) expire after 2 s unused, so that
            // clients log in again within a test; passwords hashed at bcrypt's least cost, so
            // that a login costs a loaded machine milliseconds.
            .args(["--auth-token-ttl", "2", "--bcrypt-cost", "4"])
            .args(["--log-level", "error"])
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd runs (Debian's etcd-server; tests/run.sh installs it)");
        self.child = Some(child);
        let ours = format!("127.0.0.1:{}", self.peer_port);
        let said = || {
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(5)..].join("\n")
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            // Exited first (its port taken), before anything answering on the client port is
            // believed: that could be another test's etcd.
            if let Some(child) = self.child.as_mut()
                && !matches!(child.try_wait(), Ok(None))
            {
                let _ = child.kill();
                let status = child.wait();
                self.child = None;
                return Err(format!(
                    "etcd on {client} (peers {peer}) exited ({status:?}); it said:\n{}",
                    said()
                ));
            }
            // Ours: the etcd answering lists this helper's peer address.
            if let Ok(mut client) = self.helper(Duration::from_secs(1)).await
                && let Ok(members) = client.member_list().await
                && members
                    .iter()
                    .any(|m| m.peer_urls.iter().any(|u| u.ends_with(&ours)))
            {
                return Ok(());
            }
            assert!(
                Instant::now() < deadline,
                "etcd on {client} did not answer within 30 s; it said:\n{}",
                said()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A loopback port for a test etcd, free when drawn. It is drawn at random below the kernel's
/// ephemeral range, where neither `connect` nor `bind(0)` hands ports out: other tests'
/// connections (thousands a second in the hostile tests) cannot take it between this check and
/// etcd's own bind, nor while a stopped etcd is started again on it. Only other test etcds
/// draw there, and one that finds its port taken exits and is started again.
fn etcd_port() -> u16 {
    use std::hash::BuildHasher;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, high) = (ephemeral_low / 2, ephemeral_low);
    for attempt in 0u32..1000 {
        // A random draw: std's per-instance random hasher, so no dependency for it.
        let draw = std::collections::hash_map::RandomState::new().hash_one(attempt);
        let port = if high > low && low >= 1024 {
            low + (draw % u64::from(high - low)) as u16
        } else {
            // A kernel whose range starts that low: the ephemeral range is all there is.
            0
        };
        if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return listener.local_addr().unwrap().port();
        }
    }
    panic!("no free loopback port below {ephemeral_low}");
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Named tensors as a batch for `device` ([`Client::put_batch`]).
pub fn on_device(device: u32, tensors: &[(String, TensorData)]) -> Vec<(TensorKey, TensorData)> {
    tensors
        .iter()
        .map(|(name, data)| (TensorKey::new(device, name.clone()), data.clone()))
        .collect()
}
