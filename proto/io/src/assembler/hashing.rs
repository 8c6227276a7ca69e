//! The content hash computed as the bytes arrive: what it is for ([`HashUse`]), and where it
//! runs (in line, or on a thread trailing the receiver: [`TRAILING_HASH_MIN`]).

use burn_std::Bytes;

use ferry_proto::tensor::{content_hash, content_hasher, hash_more};
use ferry_proto::{ContentHash, ProtoError, StreamError};

use super::TensorAssembler;

/// What a receiver computes the content hash for ([`TensorAssembler::hashing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashUse {
    /// Compared with a hash the receiver trusts (a pull's grant) before the bytes are used: it
    /// catches whatever a chunk checksum would, so none is checked, and each byte is read once
    /// after the kernel wrote it, by the hash.
    Check,
    /// Recorded as the tensor's hash (a put, which has none to compare it with): chunk
    /// checksums still catch noise on a link in clear, each checked while its piece is in
    /// cache, and the hash trails a chunk behind, so the bytes are read from memory once. A
    /// payload that comes whole (a shared-memory region) is not hashed at all: its handoff
    /// stays O(1), and whoever registers it hashes it later.
    Record,
}

/// Payloads at least this large are hashed on their own thread while they arrive; smaller ones
/// as each chunk is committed, on the receiving thread (a thread costs more than their hash).
pub const TRAILING_HASH_MIN: usize = 1 << 20;

/// How a receiver computes the content hash of what it receives.
#[derive(Debug, Default)]
pub(super) enum RunningHash {
    /// It does not.
    #[default]
    None,
    /// Fed as bytes are committed, while they are still in cache.
    Inline(Box<blake3::Hasher>),
    /// To trail the receiver on its own thread, started when the first chunk's place is asked
    /// for: a payload that comes whole (a shared-memory region) never starts one, and a
    /// thread's start and join stay off its handoff.
    TrailingSoon(Box<blake3::Hasher>),
    /// On another thread, a chunk behind the receiver.
    Trailing(crate::trailing::TrailingHash),
    /// Computed over every byte ([`settle_hash`](TensorAssembler::settle_hash)).
    Done(ContentHash),
}

impl TensorAssembler {
    /// Also computes the content hash while the payload arrives, for `hash_use` (see
    /// [`finish_hashed`](Self::finish_hashed), [`finish_recorded`](Self::finish_recorded)).
    ///
    /// A payload of [`TRAILING_HASH_MIN`] bytes or more is hashed on another thread while it
    /// arrives, so that finishing waits only for the last chunk.
    ///
    /// A connection reading into a receiver whose hash is a [`HashUse::Check`] checks no chunk
    /// checksum ([`checks_chunks`](Self::checks_chunks)): the caller must compare the hash with
    /// one it trusts (a pull, with its grant), which catches whatever the checksums would.
    pub fn hashing(mut self, hash_use: HashUse) -> Self {
        if self.received != 0 || !matches!(self.hash, RunningHash::None) {
            return self;
        }
        self.hash_use = Some(hash_use);
        let hasher = Box::new(content_hasher(&self.meta));
        self.hash = if self.buf.len() >= TRAILING_HASH_MIN {
            RunningHash::TrailingSoon(hasher)
        } else {
            RunningHash::Inline(hasher)
        };
        self
    }

    /// Starts the trailing hash thread a [`RunningHash::TrailingSoon`] waits for (before any byte
    /// is written: `slot` calls it first).
    pub(super) fn start_trailing(&mut self) {
        let hasher = match std::mem::take(&mut self.hash) {
            RunningHash::TrailingSoon(hasher) => hasher,
            other => {
                self.hash = other;
                return;
            }
        };
        // Bytes committed before (without a slot) are in the hasher already; a thread would
        // start at 0 and hash them again: such a receiver goes on hashing in line.
        if self.received != 0 {
            self.hash = RunningHash::Inline(hasher);
            return;
        }
        let (base, len) = (self.buf.as_mut_ptr(), self.buf.len());
        // SAFETY: `buf` is `len` bytes that live as long as `self`; `hash` is declared before
        // it (dropped, and its thread joined, first), is finished before `buf` is handed out or
        // replaced (`finish*`, `take_hasher`, `adopt`), and while it lives every access to `buf`
        // goes through it (`slot`).
        let started = unsafe { crate::trailing::TrailingHash::start(base, len, (*hasher).clone()) };
        // Without a thread to be had (out of threads or memory), hashed in line instead.
        self.hash = match started {
            Ok(trailing) => RunningHash::Trailing(trailing),
            Err(_) => RunningHash::Inline(hasher),
        };
    }

    /// What the content hash is computed for, where it is ([`hashing`](Self::hashing)).
    pub fn hash_use(&self) -> Option<HashUse> {
        self.hash_use
    }

    /// Whether the chunks' checksums must be checked as they arrive (on a link that does not
    /// authenticate every byte itself): unless the payload's hash is computed as it arrives to
    /// be checked ([`HashUse::Check`]), which catches whatever they would.
    pub fn checks_chunks(&self) -> bool {
        matches!(self.hash, RunningHash::None) || self.hash_use != Some(HashUse::Check)
    }

    /// The content hasher, to feed elsewhere (off an async runtime) and give back with
    /// [`adopt_hashed`](Self::adopt_hashed); `None` where this receiver does not hash.
    pub fn take_hasher(&mut self) -> Option<blake3::Hasher> {
        match std::mem::take(&mut self.hash) {
            // A settled hash has no hasher left to feed.
            RunningHash::None | RunningHash::Done(_) => None,
            RunningHash::Inline(hasher) | RunningHash::TrailingSoon(hasher) => Some(*hasher),
            // Everything committed so far is fed to it; a thread that died leaves the bytes to
            // be hashed again from the start.
            RunningHash::Trailing(trailing) => trailing.finish().or_else(|| {
                let mut hasher = content_hasher(&self.meta);
                hash_more(&mut hasher, &self.buf[..self.received]);
                Some(hasher)
            }),
        }
    }

    /// The content hash of every byte, once all have arrived: the hashing thread finished
    /// (this waits for it: call it off an async runtime), or, for a receiver that does not hash,
    /// the bytes hashed now; kept for [`finish_hashed`](Self::finish_hashed).
    pub fn settle_hash(&mut self) -> Result<ContentHash, ProtoError> {
        self.check_complete()?;
        let hash = match &self.hash {
            RunningHash::Done(hash) => *hash,
            _ => match self.take_hasher() {
                Some(hasher) => hasher.finalize().into(),
                None => content_hash(&self.meta, &self.buf),
            },
        };
        self.hash = RunningHash::Done(hash);
        Ok(hash)
    }

    /// [`adopt`](Self::adopt) for a payload already fed to the hasher taken with
    /// [`take_hasher`](Self::take_hasher).
    pub fn adopt_hashed(
        &mut self,
        payload: Bytes,
        hasher: Option<blake3::Hasher>,
    ) -> Result<(), StreamError> {
        self.hash = RunningHash::None;
        self.adopt(payload)?;
        self.hash = hasher.map_or(RunningHash::None, |h| RunningHash::Inline(Box::new(h)));
        Ok(())
    }
}
