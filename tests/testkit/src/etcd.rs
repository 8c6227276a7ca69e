//! A real etcd for the cluster tests ([`Etcd`]), over plain TCP or TLS.

use std::time::{Duration, Instant};

use crate::TestPki;

/// The lease of a member that joins with [`Etcd::member`]: short, so that a member gone is gone
/// from the directory soon.
pub const MEMBER_TTL: Duration = Duration::from_secs(2);

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

    /// What `node` joins this etcd's cluster with as the member `name`: its TCP address
    /// advertised, no Unix socket, no etcd user, a lease of [`MEMBER_TTL`].
    pub fn member(
        &self,
        name: &str,
        node: &crate::TestNode,
    ) -> ferry_server::cluster::ClusterConfig {
        ferry_server::cluster::ClusterConfig {
            endpoints: ferry_proto::cluster::endpoints(&self.cluster())
                .expect("the test etcd's address parses"),
            name: name.to_string(),
            advertise: node.addr.to_string(),
            unix: None,
            ttl: MEMBER_TTL,
            etcd_user: None,
        }
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
