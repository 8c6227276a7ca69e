//! A collect's version passed on to further workers ([`FerryStore::with_replicas`]): relayed
//! along a chain from the store's node (`ModelCopy::run_relayed`), so the store's node sends
//! each byte about once and every replica commits a whole version of its own, or none.
//!
//! [`FerryStore::with_replicas`]: crate::FerryStore::with_replicas

use ferry_client::{BlockingClient, Client, ClientError, ModelCopy, RelayTarget, Wait};

use crate::StoreError;

/// A worker a collect's version goes on to: its address as the other workers (and the store's
/// node) reach it, a connection that asks it to pull, and one that asks it for capabilities
/// on what it holds (for the worker after it).
#[derive(Debug)]
pub struct Replica {
    /// The worker's address as the store's node and the other replicas reach it.
    pub addr: String,
    /// A connection to the worker that asks it to pull.
    pub pulls: BlockingClient,
    /// A connection to the worker that asks it for capabilities.
    pub grants: BlockingClient,
}

/// A replica that did not commit the version, and why.
#[derive(Debug)]
pub struct NotReplicated {
    /// The replica's address.
    pub addr: String,
    /// Why (a refusal of the model, a tensor it could not take, a failed connection).
    pub cause: ClientError,
}

/// The replicas of a store's node, in chain order, and that node's address as they reach it.
#[derive(Debug)]
pub(crate) struct Replicas {
    pub(crate) from: String,
    pub(crate) chain: Vec<RelayTarget>,
}

impl Replicas {
    pub(crate) fn new(from: String, replicas: Vec<Replica>) -> Self {
        let chain = replicas
            .into_iter()
            .map(|r| RelayTarget {
                addr: r.addr,
                pulls: r.pulls.into_async(),
                grants: r.grants.into_async(),
            })
            .collect();
        Self { from, chain }
    }

    /// The current version of `prefix` on `device` of the store's node (`source`, a connection
    /// to it) relayed to every replica; replaces a replica's model only with `replace`.
    pub(crate) fn relay(
        &mut self,
        source: &mut Client,
        device: u32,
        prefix: &str,
        replace: bool,
    ) -> Result<(), StoreError> {
        if self.chain.is_empty() {
            return Ok(());
        }
        let outcome = ModelCopy::new(self.from.clone(), device, prefix)
            .replace(replace)
            .run_relayed(source, &mut self.chain)
            .wait()?;
        let failed: Vec<NotReplicated> = self
            .chain
            .iter()
            .zip(outcome)
            .filter_map(|(target, outcome)| {
                outcome.err().map(|cause| NotReplicated {
                    addr: target.addr.clone(),
                    cause,
                })
            })
            .collect();
        if failed.is_empty() {
            return Ok(());
        }
        Err(StoreError::NotReplicated {
            prefix: prefix.to_string(),
            device,
            replicas: self.chain.len(),
            failed,
        })
    }
}

/// `ADDR: cause; ADDR: cause` for an error message.
pub(crate) fn describe(failed: &[NotReplicated]) -> String {
    failed
        .iter()
        .map(|f| format!("{}: {}", f.addr, f.cause))
        .collect::<Vec<_>>()
        .join("; ")
}
