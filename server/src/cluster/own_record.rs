//! The node's own member record, kept as the node wrote it: anyone who can write etcd can
//! rewrite `/ferry/members/NAME` (to point `@NAME` at another node, say), and a record nobody
//! put back would stay hijacked. The node watches its own key and, when it finds there anything
//! but what it wrote (or nothing), writes its record back under its lease and says so.

use ferry_etcd::{Etcd, EventKind, LeaseId, Watch, WatchBatch};
use ferry_proto::cluster::{self as keys};

use super::ClusterError;

/// Lines about the record rewritten: at most one a second, whoever writes how often.
static REWRITTEN: ferry_io::refusal_log::RefusalLog = ferry_io::refusal_log::RefusalLog::new(
    "cluster",
    "the node's member record was rewritten by someone else; put back",
);

/// The node's own record in etcd, and the watch on its key.
pub(super) struct OwnRecord {
    key: Vec<u8>,
    value: Vec<u8>,
    lease: LeaseId,
    stream: Watch,
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
        let record = OwnRecord {
            key,
            value,
            lease,
            stream,
        };
        let found = read.kvs.iter().find(|kv| kv.key == record.key);
        if found.map(|kv| kv.value.as_slice()) != Some(record.value.as_slice()) {
            record
                .put_back(client, found.map(|kv| kv.value.as_slice()))
                .await?;
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
        &self,
        client: &mut Etcd,
        answer: Option<WatchBatch>,
    ) -> Result<(), ClusterError> {
        let events = match answer {
            None => {
                return Err(ClusterError::WatchEnded {
                    on: "the node's own record",
                    reason: String::new(),
                });
            }
            Some(WatchBatch::Canceled { reason, .. }) => {
                return Err(ClusterError::WatchEnded {
                    on: "the node's own record",
                    reason: format!(": {reason}"),
                });
            }
            Some(WatchBatch::Events(events)) => events,
        };
        let last = events
            .into_iter()
            .rev()
            .find(|event| event.kv.key == self.key);
        match last {
            Some(event) if event.kind == EventKind::Put && event.kv.value == self.value => Ok(()),
            Some(event) => {
                let found = (event.kind == EventKind::Put).then_some(event.kv.value);
                self.put_back(client, found.as_deref()).await
            }
            None => Ok(()),
        }
    }

    /// Writes the record back, saying what was found there.
    async fn put_back(&self, client: &mut Etcd, found: Option<&[u8]>) -> Result<(), ClusterError> {
        let what = match found.and_then(|value| keys::member_of(&self.key, value)) {
            // Escaped by the log: whoever wrote it chose these.
            Some(other) => format!("it named node {} at {}", other.node_id, other.tcp),
            None if found.is_some() => "it was no member record".to_string(),
            None => "it was deleted".to_string(),
        };
        REWRITTEN.note(&String::from_utf8_lossy(&self.key), &what);
        // Put back under the lease, as first written: it goes with the node.
        client.put(&self.key, &self.value, Some(self.lease)).await?;
        Ok(())
    }
}
