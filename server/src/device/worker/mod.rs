//! The device worker: the single owner of one hosted device and its tensors, on its own thread.
//!
//! It answers [`Command`]s one at a time from its queue, over its table of registered tensors
//! (sorted by name, and indexed by content hash).
//!
//! Here: the worker's state, its loop and the dispatch of each command. Starting a worker is in
//! `spawn`, a registered tensor and reading it out in `entry`, registering and removing in
//! `register`, and the content-hash index with its verification in `hash_index`.

mod entry;
mod hash_index;
mod register;
mod spawn;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use burn_backend::Backend;
use ferry_backend::BackendKind;
use ferry_proto::{ContentHash, TensorKey};
use tokio::sync::mpsc;

use crate::device::verify::VerifierHandle;
use crate::device::{Budget, Command, DeviceSummary, Version};
use crate::error::NodeError;
use entry::Entry;

pub(crate) use spawn::spawn;

/// A device's worker: its tensors, and what it needs to register and describe them.
struct Worker<B: Backend> {
    index: u32,
    kind: BackendKind,
    device: B::Device,
    /// Sorted by name, so that a listing is read a page at a time.
    tensors: BTreeMap<String, Entry<B>>,
    /// The names registered under each content hash, so that dedup never scans every tensor.
    by_hash: HashMap<ContentHash, std::collections::BTreeSet<String>>,
    verifier: VerifierHandle,
    next_version: u64,
    hash_mismatches: Arc<AtomicU64>,
    /// Raised on every registration, removal and verified hash (what a cluster's directory
    /// publishes), so that a watcher lists the tensors again only when something changed.
    changes: Arc<AtomicU64>,
    budget: Arc<Budget>,
    /// The payload bytes of every registered tensor, kept as they change (summing them per
    /// insert made a device of many tensors quadratic).
    held_bytes: u64,
}

impl<B: Backend> Worker<B> {
    fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        tracing::debug!(device = self.index, backend = %self.kind, "device worker started");
        while let Some(command) = rx.blocking_recv() {
            self.handle(command);
        }
        tracing::debug!(
            device = self.index,
            tensors = self.tensors.len(),
            "device worker stopped"
        );
    }

    /// Sets the held-tensors gauges after the set changed.
    fn publish_held(&self) {
        crate::metrics::device_held(self.index, self.tensors.len(), self.held_bytes);
    }

    fn key(&self, name: &str) -> TensorKey {
        TensorKey::new(self.index, name)
    }

    fn entry(&self, name: &str) -> Result<&Entry<B>, NodeError> {
        self.tensors
            .get(name)
            .ok_or_else(|| NodeError::NotFound(self.key(name)))
    }

    /// The entry under `name`, if it is the version `pin` asks for (any, without one).
    fn pinned(&self, name: &str, pin: Option<Version>) -> Result<&Entry<B>, NodeError> {
        let entry = self.entry(name)?;
        match pin {
            Some(version) if entry.desc.version != version => {
                Err(NodeError::Changed(self.key(name)))
            }
            _ => Ok(entry),
        }
    }

    // A dropped reply means the asker gave up (its connection closed); nothing to do about it.
    fn handle(&mut self, command: Command) {
        match command {
            Command::Insert {
                name,
                payload,
                path,
                existing,
                reservation,
                reply,
            } => {
                let result = self.insert(name, payload, path, existing, reservation);
                self.publish_held();
                let _ = reply.send(result);
            }
            Command::ReadHost { name, pin, reply } => {
                let result = self
                    .pinned(&name, pin)
                    .and_then(|e| Ok((e.desc.clone(), e.host_bytes(&self.budget)?)));
                let _ = reply.send(result);
            }
            Command::Read { name, reply } => {
                let result = self.entry(&name).and_then(|e| {
                    let (data, held) = e.copy(&self.budget)?;
                    Ok((e.desc.clone(), data, held))
                });
                let _ = reply.send(result);
            }
            Command::Export {
                name,
                pin,
                native,
                reply,
            } => {
                let result = self
                    .pinned(&name, pin)
                    .and_then(|e| e.export(native, &self.budget));
                let _ = reply.send(result);
            }
            Command::Describe { name, reply } => {
                let _ = reply.send(self.entry(&name).map(|e| e.desc.clone()));
            }
            Command::Remove { name, pin, reply } => {
                let result = self.pinned(&name, pin).map(|_| ()).and_then(|()| {
                    self.unregister(&name)
                        .map(|e| e.desc.clone())
                        .ok_or_else(|| NodeError::NotFound(self.key(&name)))
                });
                self.publish_held();
                let _ = reply.send(result);
            }
            Command::List {
                after,
                limit,
                reply,
            } => {
                use std::ops::Bound;
                let from = match &after {
                    Some(name) => Bound::Excluded(name.as_str()),
                    None => Bound::Unbounded,
                };
                let page = self
                    .tensors
                    .range::<str, _>((from, Bound::Unbounded))
                    .take(limit)
                    .map(|(_, e)| e.desc.clone())
                    .collect();
                let _ = reply.send(Ok(page));
            }
            Command::Summary { reply } => {
                let summary = DeviceSummary {
                    tensors: self.tensors.len() as u64,
                    bytes: self.held_bytes,
                    hashes_pending: self.tensors.values().fold(0, |pending, e| {
                        pending + u64::from(!e.desc.content_hash.is_verified())
                    }),
                };
                let _ = reply.send(Ok(summary));
            }
            Command::FindByHash { hash, reply } => {
                let named = self.by_hash.get(&hash).into_iter().flatten();
                let descs = named.filter_map(|name| self.tensors.get(name).map(|e| &e.desc));
                let found = descs
                    .clone()
                    .find(|d| d.content_hash.is_verified())
                    .or_else(|| descs.clone().next())
                    .cloned();
                let _ = reply.send(Ok(found));
            }
            Command::AwaitVerified { name, reply } => {
                if let Some(entry) = self.tensors.get_mut(&name) {
                    if entry.desc.content_hash.is_verified() {
                        let _ = reply.send(entry.desc.clone());
                    } else {
                        entry.waiting.push(reply);
                        // Somebody waits for this hash: it goes before those nobody waits for.
                        let version = entry.desc.version;
                        self.verifier
                            .prioritize(|job| job.name == name && job.version == version);
                    }
                }
            }
            Command::Verified {
                name,
                version,
                computed,
            } => self.verified(&name, version, computed),
        }
    }
}
