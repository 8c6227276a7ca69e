//! Node-to-node copies as the tests make them ([`How`], [`copy_keys`]), and a source's side of one.

use std::time::Duration;

use ferry_client::{Client, ClientError, NodeCopy};
use ferry_io::{Dial, Exchange, PeerCheck, SharedMemory};
use ferry_proto::{ContentHash, IfExists, Transfer};
use ferry_proto::{NodeStats, TensorInfo, TensorKey};

use crate::TestNode;

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
