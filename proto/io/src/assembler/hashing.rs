//! The content hash computed as the bytes arrive (what it is for: [`HashUse`], decided in
//! [`crate::hash_plan`]), and where it runs: in line, or on a thread trailing the receiver
//! ([`TRAILING_HASH_MIN`]).

use ferry_proto::tensor::{content_hash, content_hasher, hash_more};
use ferry_proto::{ContentHash, ProtoError, TensorMeta};

use super::{HashUse, TensorAssembler};

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
    /// On another thread, a piece behind the receiver.
    Trailing(crate::trailing::TrailingHash),
    /// Computed over every byte ([`settle_hash`](TensorAssembler::settle_hash)).
    Done(ContentHash),
}

impl RunningHash {
    /// How a receiver of `len` bytes of `meta` hashes them for `hash_use`: not at all, in line
    /// where a thread costs more than the hash, else on a thread started with the first chunk.
    pub(super) fn for_use(hash_use: HashUse, meta: &TensorMeta, len: usize) -> Self {
        if hash_use == HashUse::Skip {
            return Self::None;
        }
        let hasher = Box::new(content_hasher(meta));
        if len >= TRAILING_HASH_MIN {
            Self::TrailingSoon(hasher)
        } else {
            Self::Inline(hasher)
        }
    }
}

impl TensorAssembler {
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
        // Defensive: every byte is committed through a slot, which starts the thread first; a
        // hasher already fed would be fed again by a thread starting at 0: in line it goes on.
        if self.received != 0 {
            self.hash = RunningHash::Inline(hasher);
            return;
        }
        self.hash = self.trail(*hasher);
    }

    /// The hash starts over from the first byte (a chunk begun again, whose abandoned pieces a
    /// trailing hash may have read): the old one is dropped, its thread joined before a byte is
    /// written again, and a new one takes the committed bytes, on its own thread where it was
    /// on one, so that a resumed receive does not hash its prefix on the caller's thread.
    pub(super) fn restart_hash(&mut self) {
        let trailing = matches!(self.hash, RunningHash::Trailing(_));
        self.hash = RunningHash::None;
        let hasher = content_hasher(&self.meta);
        self.hash = match trailing {
            true => self.trail(hasher),
            false => {
                let mut hasher = hasher;
                hash_more(&mut hasher, &self.buf[..self.received]);
                RunningHash::Inline(Box::new(hasher))
            }
        };
    }

    /// `hasher`, fed nothing yet, continued on a thread of its own over the buffer, with the
    /// committed bytes handed to it at once; in line where no thread is to be had (out of
    /// threads or memory), the committed bytes hashed here. No other hashing thread may be
    /// alive over the buffer (`self.hash` holds none).
    fn trail(&mut self, hasher: blake3::Hasher) -> RunningHash {
        debug_assert!(!matches!(self.hash, RunningHash::Trailing(_)));
        let (base, len) = (self.buf.as_mut_ptr(), self.buf.len());
        // SAFETY: `buf` is `len` bytes that live as long as `self`; `hash` is declared before
        // it (dropped, and its thread joined, first), is finished before `buf` is handed out or
        // replaced (`finish`, `take_hasher`, `adopt`), and while it lives every access to `buf`
        // goes through it (`slot`); no other thread reads `buf` (the caller's promise).
        let started = unsafe { crate::trailing::TrailingHash::start(base, len, hasher.clone()) };
        match started {
            Ok(mut trailing) => {
                trailing.commit(self.received);
                RunningHash::Trailing(trailing)
            }
            Err(_) => {
                let mut hasher = hasher;
                hash_more(&mut hasher, &self.buf[..self.received]);
                RunningHash::Inline(Box::new(hasher))
            }
        }
    }

    /// What the content hash is computed for.
    pub fn hash_use(&self) -> HashUse {
        self.hash_use
    }

    /// Whether the chunks' checksums must be checked as they arrive (on a link that does not
    /// authenticate every byte itself): unless the payload's hash is computed as it arrives to
    /// be checked ([`HashUse::Check`]), which catches whatever they would.
    pub fn checks_chunks(&self) -> bool {
        matches!(self.hash, RunningHash::None) || self.hash_use.checks_chunks()
    }

    /// The content hasher, with every byte committed so far fed to it; `None` where this
    /// receiver does not hash.
    pub(super) fn take_hasher(&mut self) -> Option<blake3::Hasher> {
        match std::mem::take(&mut self.hash) {
            // A settled hash has no hasher left to feed.
            RunningHash::None | RunningHash::Done(_) => None,
            RunningHash::Inline(hasher) | RunningHash::TrailingSoon(hasher) => Some(*hasher),
            // Everything handed to it is fed to it: the committed bytes, as long as no piece of
            // a chunk still arriving was handed (`settle_hash` calls this once every byte is
            // committed). A thread that died leaves the bytes to be hashed again from the start.
            RunningHash::Trailing(trailing) => {
                debug_assert!(trailing.handed() <= self.received);
                trailing.finish().or_else(|| {
                    let mut hasher = content_hasher(&self.meta);
                    hash_more(&mut hasher, &self.buf[..self.received]);
                    Some(hasher)
                })
            }
        }
    }

    /// The content hash of every byte, once all have arrived: the hashing thread finished
    /// (this waits for it: call it off an async runtime), or, where the bytes were not hashed as
    /// they arrived, the bytes hashed now; kept for [`finish`](Self::finish).
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
}
