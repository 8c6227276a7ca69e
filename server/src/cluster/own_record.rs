//! The node's own member record, kept as the node wrote it: anyone who can write etcd can
//! rewrite `/ferry/members/NAME` (to point `@NAME` at another node, say), and a record nobody
//! put back would stay hijacked. The node watches its own key and, when it finds there anything
//! but what it wrote under its lease (other bytes, its bytes under no lease or another, nothing),
//! writes its record back under its lease and says so. Another writer that keeps rewriting it (a
//! second node started under the same name) ends the session after a few put-backs, rather than
//! two nodes rewriting one key as fast as etcd answers.

use std::time::Duration;

use ferry_etcd::{Etcd, EventKind, KeyValue, LeaseId, Watch, WatchBatch};
use ferry_proto::cluster::{self as keys};

/// Put-backs within [`CONTESTED_WITHIN`] that end the session: someone keeps rewriting the
/// record, and answering each rewrite would only grow etcd's history.
const CONTESTED_AFTER: usize = 5;
/// The window [`CONTESTED_AFTER`] counts in.
const CONTESTED_WITHIN: Duration = Duration::from_secs(10);

use super::ClusterError;

/// Lines about the record rewritten: at most one a second, whoever writes how often.
static REWRITTEN: crate::service::door::refusal_log::RefusalLog =
    crate::service::door::refusal_log::RefusalLog::new(
        "cluster",
        "the node's member record was rewritten by someone else; put back",
    );

/// The node's own record in etcd, and the watch on its key.
pub(super) struct OwnRecord {
    key: Vec<u8>,
    value: Vec<u8>,
    lease: LeaseId,
    stream: Watch,
    /// When the latest put-backs were, newest last (at most [`CONTESTED_AFTER`]).
    put_backs: std::collections::VecDeque<tokio::time::Instant>,
}

impl OwnRecord {
    /// Writes `value` under `key` with `lease`, then watches the key from the revision that
    /// write made; a change between the write and the watch is found by reading the key once
    /// the watch is in place.
    pub(super) async fn register(
        client: &mut Etcd,
        key: Vec<u8>,
        value: Vec<u8>,
        lease: LeaseId,
    ) -> Result<OwnRecord, ClusterError> {
        client.put(&key, &value, Some(lease)).await?;
        let read = client.get(&key).await?;
        let stream = client.watch_prefix(&key, read.revision + 1).await?;
        let mut record = OwnRecord {
            key,
            value,
            lease,
            stream,
            put_backs: Default::default(),
        };
        let found = read.kvs.iter().find(|kv| kv.key == record.key);
        if !found.is_some_and(|kv| record.is_own(kv)) {
            record.put_back(client, found).await?;
        }
        Ok(record)
    }

    /// The next answer of the watch on the key (its end or cancellation ends the session).
    pub(super) async fn next(&mut self) -> Result<Option<WatchBatch>, ferry_etcd::EtcdError> {
        self.stream.next().await
    }

    /// Applies one watch answer: any put of other bytes, or a delete, under the key (the
    /// watch is on the key as a prefix: longer keys are other members') is undone.
    pub(super) async fn apply(
        &mut self,
        client: &mut Etcd,
        answer: Option<WatchBatch>,
    ) -> Result<(), ClusterError> {
        let last = super::events_of(answer, "the node's own record")?
            .into_iter()
            .rev()
            .find(|event| event.kv.key == self.key);
        match last {
            Some(event) if event.kind == EventKind::Put && self.is_own(&event.kv) => Ok(()),
            Some(event) => {
                let found = (event.kind == EventKind::Put).then_some(&event.kv);
                self.put_back(client, found).await
            }
            None => Ok(()),
        }
    }

    /// Whether `kv` is the record as this node wrote it: its bytes, under its lease (the same
    /// bytes under no lease would outlive the node).
    fn is_own(&self, kv: &KeyValue) -> bool {
        kv.value == self.value && kv.lease == self.lease.get()
    }

    /// Writes the record back, then says what was found there; past [`CONTESTED_AFTER`]
    /// put-backs in [`CONTESTED_WITHIN`], ends the session instead.
    async fn put_back(
        &mut self,
        client: &mut Etcd,
        found: Option<&KeyValue>,
    ) -> Result<(), ClusterError> {
        let now = tokio::time::Instant::now();
        self.put_backs
            .retain(|at| now.duration_since(*at) < CONTESTED_WITHIN);
        if self.put_backs.len() >= CONTESTED_AFTER {
            return Err(ClusterError::Contested {
                key: String::from_utf8_lossy(&self.key).into_owned(),
                times: self.put_backs.len(),
                within: CONTESTED_WITHIN,
            });
        }
        self.put_backs.push_back(now);
        // Put back under the lease, as first written: it goes with the node.
        client.put(&self.key, &self.value, Some(self.lease)).await?;
        let what = match found {
            Some(kv) => match keys::member_of(&self.key, &kv.value) {
                // Escaped by the log: whoever wrote it chose these.
                Some(other) if kv.value != self.value => {
                    format!("it named node {} at {}", other.node_id, other.tcp)
                }
                Some(_) => format!("it was under lease {}, not the node's", kv.lease),
                None => "it was no member record".to_string(),
            },
            None => "it was deleted".to_string(),
        };
        REWRITTEN.note(&String::from_utf8_lossy(&self.key), &what);
        Ok(())
    }
}
