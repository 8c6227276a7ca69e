//! The worker's content-hash index, and the verification of hashes stated or not yet computed.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use burn_backend::Backend;
use ferry_proto::ContentHash;

use super::Worker;
use crate::device::verify::{VerifyJob, note_mismatch};
use crate::device::{HashState, Version};

impl<B: Backend> Worker<B> {
    /// The hash a tensor answers to once `computed` from its bytes: a `stated` one it is not is
    /// counted and logged ([`note_mismatch`]).
    pub(super) fn settle(
        &self,
        name: &str,
        stated: ContentHash,
        computed: ContentHash,
    ) -> ContentHash {
        if computed != stated {
            note_mismatch(&self.hash_mismatches, &self.key(name), stated, computed);
        }
        computed
    }

    /// Records a verifier's answer, if the registration it checked is still there.
    pub(super) fn verified(&mut self, name: &str, version: Version, computed: ContentHash) {
        let key = self.key(name);
        let Some(entry) = self
            .tensors
            .get_mut(name)
            .filter(|e| e.desc.version == version)
        else {
            return;
        };
        let known = std::mem::replace(&mut entry.desc.content_hash, HashState::Verified(computed));
        self.changes.fetch_add(1, Ordering::Release);
        let indexed = match known {
            HashState::Verified(_) => true,
            HashState::Stated(stated) if stated == computed => true,
            HashState::Stated(stated) => {
                note_mismatch(&self.hash_mismatches, &key, stated, computed);
                Self::unindex(&mut self.by_hash, stated, name);
                false
            }
            HashState::Computing => false,
        };
        if !indexed {
            self.by_hash
                .entry(computed)
                .or_default()
                .insert(name.to_string());
        }
        for waiter in entry.waiting.drain(..) {
            let _ = waiter.send(entry.desc.clone());
        }
    }

    pub(super) fn unindex(
        by_hash: &mut HashMap<ContentHash, std::collections::BTreeSet<String>>,
        hash: ContentHash,
        name: &str,
    ) {
        if let Some(names) = by_hash.get_mut(&hash) {
            names.remove(name);
            if names.is_empty() {
                by_hash.remove(&hash);
            }
        }
    }

    /// Hands a just registered tensor whose hash is not verified to the verifier, or, where there is
    /// no verifier to take it, verifies it here and now (so that nobody waiting for the
    /// verification waits forever).
    pub(super) fn verify_later(&mut self, job: VerifyJob) {
        if let Err(job) = self.verifier.push(job) {
            tracing::warn!(key = %self.key(&job.name), "no hash verifier; verifying in line");
            if let Some(computed) = job.hash() {
                self.verified(&job.name, job.version, computed);
            }
        }
    }
}
