//! A node's place in a cluster: its membership record and its tensor directory in etcd, kept
//! under one lease that the node renews, and written again whenever etcd comes back.
//!
//! Invariants:
//! - Every key the node writes (`ferry_proto::cluster`) is attached to its current lease, so a
//!   node that dies (or loses etcd for longer than the lease's TTL) disappears from the member
//!   list and the directory when the lease expires, without anyone deleting anything.
//! - The directory names what the node's devices hold, each tensor's content hash only once the
//!   node computed it from the bytes it holds: the published set is compared with the node's
//!   listing whenever a device's change counter moves (checked every [`DIRECTORY_TICK`]), so an
//!   entry outlives its tensor by at most that tick plus etcd's answer.
//! - The node's own member record is what it wrote, within a watch's delay: anything else found
//!   under its key (another node's id or address, no record) is put back, and logged at a
//!   bounded rate (`own_record.rs`).
//! - Under TLS every record the node writes is sealed with its certificate's key
//!   (`ferry_io::signed_record`), and its member list takes only records each member sealed
//!   itself: an etcd writer without a member's key adds no member and moves none.
//! - etcd being away never stops the node serving: the session ends, the node logs it, and a new
//!   session (a new lease, everything written again) starts after a backoff.
//! - Where the node's peer policy follows the cluster ([`crate::PeerPolicy::Members`]), its member list
//!   is what etcd holds under `/ferry/members/`: read whole at the start of each session, then
//!   followed by a watch from the revision of that read, so that no change falls between the
//!   two. It is empty until the first read, so nothing unseen is allowed. Between sessions
//!   the last list read counts until one lease TTL after etcd last answered (a member that
//!   left meanwhile would have been listed that long at most), then as empty; leaving empties
//!   it. A member's Unix socket counts only where the member says it runs on this machine.

use std::collections::HashMap;
use std::time::Duration;

pub use ferry_etcd::EtcdUser;
use ferry_etcd::{Etcd, EtcdError, EventKind, LeaseId, TxnOp, Watch, WatchBatch};
use ferry_io::signed_record::Records;
use ferry_proto::cluster::{self as keys, MemberDevice, MemberRecord, TensorRecord};
use ferry_proto::dtype_name;
use tokio::sync::watch;

use crate::node::{ClusterMembers, MAX_PAGE, Node};
use own_record::OwnRecord;

mod own_record;

/// How often the directory is compared with the node's change counters.
pub const DIRECTORY_TICK: Duration = Duration::from_millis(100);

/// The most operations one etcd transaction carries (etcd's default `--max-txn-ops` is 128).
const TXN_OPS: usize = 100;

/// The longest wait between two tries to reach etcd.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// How a node joins a cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// etcd's client endpoints, `http://host:port` (or `https://host:port`, reached with the
    /// node's own certificate, which it then needs).
    pub endpoints: Vec<String>,
    /// The node's name in the cluster (`@NAME`).
    pub name: String,
    /// The TCP address other nodes and clients reach it at.
    pub advertise: String,
    /// The node's Unix socket, `unix:PATH`, for clients on its host.
    pub unix: Option<String>,
    /// The lease's time to live: how long a dead node stays listed at most.
    pub ttl: Duration,
    /// The etcd user the node logs in as, where etcd runs with auth on: etcd's roles then keep
    /// the node to its own keys (docs/cluster.md gives the roles).
    pub etcd_user: Option<EtcdUser>,
}

/// Why a cluster session ended.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// etcd did not answer or refused.
    #[error("etcd: {0}")]
    Etcd(#[from] EtcdError),
    /// The lease expired before the node renewed it (etcd was away too long).
    #[error("the node's lease expired")]
    LeaseExpired,
    /// etcd did not answer a lease renewal in time.
    #[error("etcd did not answer a lease renewal within {0:?}")]
    Silent(Duration),
    /// etcd ended a watch the session keeps.
    #[error("etcd ended the watch on {on}{reason}")]
    WatchEnded {
        /// What was watched.
        on: &'static str,
        /// What etcd said, if anything (`: REASON`).
        reason: String,
    },
    /// Someone keeps rewriting the node's own record (another node under the same name?).
    #[error(
        "{key} was rewritten {times} times within {within:?} after the node put it back: \
         another writer (a second node under this name?) keeps rewriting it"
    )]
    Contested {
        /// The record's key.
        key: String,
        /// Put-backs in the window.
        times: usize,
        /// The window.
        within: Duration,
    },
    /// Under TLS the node's cluster name must be its node id (its certificate's name).
    #[error(
        "under TLS a member's name is its certificate's: this node is {node_id:?}, not {name:?}"
    )]
    NameIsNotIdentity {
        /// The name asked for.
        name: String,
        /// The node's id.
        node_id: String,
    },
    /// The node failed to list its own tensors.
    #[error("listing the node's tensors: {0}")]
    Node(#[from] crate::NodeError),
    /// The node's key could not seal a record.
    #[error("sealing a record: {0}")]
    Seal(#[from] ferry_io::RecordError),
}

/// The cluster task of a running node; stopping it revokes the lease, so that the node leaves the
/// member list and the directory at once instead of after its TTL.
pub struct Membership {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Membership {
    /// Joins the cluster: registers `node` and keeps its records until [`leave`](Self::leave).
    pub fn join(node: Node, config: ClusterConfig) -> Membership {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run(node, config, stopped));
        Membership { stop, task }
    }

    /// Leaves the cluster: the lease is revoked (where etcd answers) and the task ends.
    pub async fn leave(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Sessions, one after another, until told to stop.
async fn run(node: Node, config: ClusterConfig, mut stopped: watch::Receiver<bool>) {
    let mut backoff = Duration::from_millis(200);
    // When etcd last renewed the lease: the member list read before then is as good as etcd's
    // own word until one TTL after it.
    let mut last_contact = tokio::time::Instant::now();
    while !*stopped.borrow() {
        match session(&node, &config, &mut stopped, &mut last_contact).await {
            Ok(()) => {
                // Left: a node out of the cluster pulls from no member.
                if let Some(members) = node.config().pulls.peers.members() {
                    members.replace([]);
                }
                return;
            }
            // Not something another session mends: said once, and the node stays out.
            Err(error @ ClusterError::NameIsNotIdentity { .. }) => {
                tracing::error!(%error, "not joining the cluster");
                return;
            }
            Err(error) => {
                if let Some(members) = node.config().pulls.peers.members() {
                    members.hold_until((last_contact + config.ttl).into_std());
                }
                tracing::warn!(%error, name = %config.name, "cluster session ended; the node keeps serving and registers again");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stopped.changed() => return,
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One lease: register, publish the directory, keep both until etcd fails or the node stops.
async fn session(
    node: &Node,
    config: &ClusterConfig,
    stopped: &mut watch::Receiver<bool>,
    last_contact: &mut tokio::time::Instant,
) -> Result<(), ClusterError> {
    // Under TLS a member's name is its certificate's (what readers check a record against).
    let records = match &node.config().tls {
        Some(_) if config.name != node.node_id().as_str() => {
            return Err(ClusterError::NameIsNotIdentity {
                name: config.name.clone(),
                node_id: node.node_id().to_string(),
            });
        }
        Some(tls) => Records::Sealed(tls.client().record_check().clone()),
        None => Records::Claimed,
    };
    let timeout = (config.ttl / 2).max(Duration::from_millis(500));
    // etcd over TLS (`https://` endpoints) is reached with the node's own certificate.
    let tls = node.config().tls.as_ref().map(|t| t.client().connector());
    let mut client =
        Etcd::connect_as(&config.endpoints, timeout, tls, config.etcd_user.clone()).await?;
    let granted = client.lease_grant(config.ttl).await?;
    let lease = granted.id;
    let own_key = keys::member_key(&config.name);
    let own_value = stored(node, &own_key, keys::encode(&member_record(node, config)))?;
    let mut own = OwnRecord::register(&mut client, own_key.into_bytes(), own_value, lease).await?;
    tracing::info!(name = %config.name, %lease, "registered in the cluster");
    *last_contact = tokio::time::Instant::now();
    let mut members = match node.config().pulls.peers.members() {
        Some(list) => Some(MemberWatch::start(&mut client, list.clone(), records).await?),
        None => None,
    };
    let mut published: HashMap<String, Vec<u8>> = HashMap::new();
    let mut seen = None;
    // Renewed three times per lease: a lease is at least a second (etcd counts whole seconds), so
    // this is never zero, whatever TTL a caller configured.
    let mut renew = tokio::time::interval(granted.ttl / 3);
    let mut directory = tokio::time::interval(DIRECTORY_TICK);
    loop {
        tokio::select! {
            _ = stopped.changed() => {
                // Leaving: the lease's keys go at once.
                let _ = client.lease_revoke(lease).await;
                tracing::info!(name = %config.name, "left the cluster");
                return Ok(());
            }
            _ = renew.tick() => {
                // The whole renewal, a reconnection included, within the timeout: etcd's
                // silence must end the session well before the lease can expire unnoticed.
                let renewed = tokio::time::timeout(timeout, client.lease_keep_alive(lease)).await;
                let left = match renewed {
                    Err(_) | Ok(Err(EtcdError::Timeout { .. })) => {
                        return Err(ClusterError::Silent(timeout));
                    }
                    Ok(answer) => answer?,
                };
                if left.is_none() {
                    return Err(ClusterError::LeaseExpired);
                }
                *last_contact = tokio::time::Instant::now();
            }
            changed = async {
                match members.as_mut() {
                    Some(watch) => watch.stream.next().await,
                    None => std::future::pending().await,
                }
            } => {
                if let Some(watch) = members.as_mut() {
                    watch.apply(changed?)?;
                }
            }
            changed = own.next() => own.apply(&mut client, changed?).await?,
            _ = directory.tick() => {
                let changes = node.changes();
                if seen != Some(changes) {
                    sync_directory(node, config, &mut client, lease, &mut published).await?;
                    seen = Some(changes);
                }
            }
        }
    }
}

/// What the node stores under `key` for the plain record `record`: sealed with its key under
/// TLS, plain in clear.
fn stored(node: &Node, key: &str, record: Vec<u8>) -> Result<Vec<u8>, ClusterError> {
    match &node.config().tls {
        Some(tls) => Ok(tls.record_signer().seal(key.as_bytes(), &record)?),
        None => Ok(record),
    }
}

/// The member list a node's peer policy follows, and the watch that keeps it current.
struct MemberWatch {
    /// Every member's record, by its key.
    records: HashMap<Vec<u8>, MemberRecord>,
    list: ClusterMembers,
    stream: Watch,
    /// Which records count: under TLS only those each member sealed.
    records_taken: Records,
}

impl MemberWatch {
    /// Reads every member record, publishes the list, and watches from the revision read.
    async fn start(
        client: &mut Etcd,
        list: ClusterMembers,
        records_taken: Records,
    ) -> Result<MemberWatch, ClusterError> {
        let answer = client.get_prefix(keys::MEMBERS.as_bytes()).await?;
        let records = answer
            .kvs
            .iter()
            .filter_map(|kv| Some((kv.key.clone(), taken(&records_taken, &kv.key, &kv.value)?)))
            .collect();
        let stream = client
            .watch_prefix(keys::MEMBERS.as_bytes(), answer.revision + 1)
            .await?;
        let watch = MemberWatch {
            records,
            list,
            stream,
            records_taken,
        };
        watch.publish();
        Ok(watch)
    }

    /// Applies one watch answer; the end of the stream (or its cancellation) ends the session.
    fn apply(&mut self, answer: Option<WatchBatch>) -> Result<(), ClusterError> {
        for event in events_of(answer, "the member list")? {
            let kv = event.kv;
            let record = match event.kind {
                EventKind::Put => taken(&self.records_taken, &kv.key, &kv.value),
                EventKind::Delete => None,
            };
            match record {
                Some(record) => self.records.insert(kv.key, record),
                None => self.records.remove(&kv.key),
            };
        }
        self.publish();
        Ok(())
    }

    /// Hands the peer policy every registered address with its member's node id: TCP addresses
    /// of all, Unix sockets only of members on this machine (a socket path names something on
    /// the machine that dials it, whatever the record's writer meant).
    fn publish(&self) {
        let here = ferry_io::machine::name();
        self.list.replace(self.records.values().flat_map(|m| {
            let tcp = (m.tcp.clone(), m.node_id.to_string());
            let unix = m
                .unix
                .clone()
                .filter(|_| !m.host.is_empty() && m.host == here)
                .map(|unix| (unix, m.node_id.to_string()));
            std::iter::once(tcp).chain(unix)
        }));
    }
}

/// Member records refused (under TLS: not sealed by their member), logged at a bounded rate: an
/// etcd writer chooses how many there are, and a member gone from the list (an expired
/// certificate, a node of another version) should say why.
static REFUSED_RECORDS: crate::service::door::refusal_log::RefusalLog =
    crate::service::door::refusal_log::RefusalLog::new("cluster", "a member record was not taken");

/// The member record stored under `key`, if `records` takes it; a refusal is logged.
fn taken(records: &Records, key: &[u8], value: &[u8]) -> Option<MemberRecord> {
    records
        .member(key, value)
        .inspect_err(|why| {
            // The key is the etcd writer's choice: escaped like any peer's word.
            let key = ferry_proto::Untrusted(&String::from_utf8_lossy(key)).to_string();
            REFUSED_RECORDS.note(&key, &why.to_string());
        })
        .ok()
}

/// The changes one answer of a watch on `on` carries; the watch's end (or its cancellation) is
/// the session's.
fn events_of(
    answer: Option<WatchBatch>,
    on: &'static str,
) -> Result<Vec<ferry_etcd::Event>, ClusterError> {
    match answer {
        None => Err(ClusterError::WatchEnded {
            on,
            reason: String::new(),
        }),
        Some(WatchBatch::Canceled { reason, .. }) => Err(ClusterError::WatchEnded {
            on,
            reason: format!(": {reason}"),
        }),
        Some(WatchBatch::Events(events)) => Ok(events),
    }
}

fn member_record(node: &Node, config: &ClusterConfig) -> MemberRecord {
    MemberRecord {
        name: config.name.clone(),
        node_id: node.node_id().clone(),
        tcp: config.advertise.clone(),
        unix: config.unix.clone(),
        host: ferry_io::machine::name(),
        devices: node
            .devices()
            .iter()
            .map(|d| {
                let (measured, exact) = d.holds().counts();
                MemberDevice {
                    index: d.index(),
                    backend: d.kind().name().to_string(),
                    device: d.label().to_string(),
                    holds: (
                        u32::try_from(measured).unwrap_or(u32::MAX),
                        u32::try_from(exact).unwrap_or(u32::MAX),
                    ),
                }
            })
            .collect(),
    }
}

/// Makes the directory say what the node holds now: puts what is new or changed, deletes what
/// went, in transactions of at most [`TXN_OPS`] operations. `published` holds the plain records
/// last put.
async fn sync_directory(
    node: &Node,
    config: &ClusterConfig,
    client: &mut Etcd,
    lease: LeaseId,
    published: &mut HashMap<String, Vec<u8>>,
) -> Result<(), ClusterError> {
    let mut now: HashMap<String, Vec<u8>> = HashMap::new();
    let mut after = None;
    loop {
        let (page, next) = node.list_page(None, after.as_ref(), MAX_PAGE).await?;
        for desc in page {
            let record = TensorRecord {
                dtype: dtype_name(&desc.dtype),
                shape: desc.shape.iter().map(|&d| d as u64).collect(),
                bytes: desc.bytes,
                content_hash: desc.content_hash.verified(),
            };
            let key = keys::tensor_key(&config.name, desc.key.device, &desc.key.name);
            now.insert(key, keys::encode(&record));
        }
        match next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    // Compared plain (a seal differs at each signing); sealed only to be put.
    let mut ops: Vec<(String, Option<Vec<u8>>)> = Vec::new();
    for (key, value) in &now {
        if published.get(key) != Some(value) {
            ops.push((key.clone(), Some(value.clone())));
        }
    }
    for key in published.keys() {
        if !now.contains_key(key) {
            ops.push((key.clone(), None));
        }
    }
    for batch in ops.chunks(TXN_OPS) {
        let values: Vec<Option<Vec<u8>>> = batch
            .iter()
            .map(|(key, value)| {
                value
                    .as_ref()
                    .map(|value| stored(node, key, value.clone()))
                    .transpose()
            })
            .collect::<Result<_, _>>()?;
        let txn_ops: Vec<TxnOp> = batch
            .iter()
            .zip(&values)
            .map(|((key, _), value)| match value {
                Some(value) => TxnOp::Put {
                    key: key.as_bytes(),
                    value,
                    lease: Some(lease),
                },
                None => TxnOp::Delete {
                    key: key.as_bytes(),
                },
            })
            .collect();
        client.txn(&txn_ops).await?;
        for (key, value) in batch {
            match value {
                Some(value) => published.insert(key.clone(), value.clone()),
                None => published.remove(key),
            };
        }
    }
    Ok(())
}
