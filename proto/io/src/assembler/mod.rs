//! Receiving one tensor: a buffer sized from the validated meta, written in place chunk by
//! chunk (or adopted whole from a region), its content hash computed as the bytes arrive.
//!
//! Here the receiver and the bytes' way in; `buffer` holds where its buffer comes from (the
//! constructor), `hashing` the content hash computed as the bytes arrive (what it is for is
//! decided in [`crate::hash_plan`]), `finish` the handing out of the tensor.

mod buffer;
mod finish;
mod hashing;
#[cfg(test)]
mod tests;

use burn_std::Bytes;

use ferry_proto::frame::next_chunk_end;
use ferry_proto::tensor::hash_more;
use ferry_proto::{ContentHash, StreamError, TensorMeta};

use crate::connection::ReceivedChecksums;

pub use crate::hash_plan::HashUse;
pub use buffer::BufferFrom;
pub use finish::Assembled;
use hashing::RunningHash;
pub use hashing::TRAILING_HASH_MIN;

/// Receives one tensor's payload in order, into one buffer sized from the validated meta.
///
/// Bytes are written in place ([`slot`](Self::slot), then [`commit`](Self::commit) once their
/// chunk arrived whole, its checksum verified where one is checked), so a receiver never holds
/// a second copy of the tensor.
pub struct TensorAssembler {
    /// The content hash, where the receiver computes one. Declared before `buf`, so that a
    /// hashing thread is joined before the buffer it reads is freed.
    hash: RunningHash,
    /// What the hash is for.
    hash_use: HashUse,
    meta: TensorMeta,
    buf: Bytes,
    /// Bytes committed: arrived whole, their chunk's checksum checked where one is.
    received: usize,
    /// The end of the last place handed out ([`slot`](Self::slot)): at or past `received`,
    /// past it while a chunk arrives piece by piece.
    slot_end: usize,
    /// What `buf` is, beyond plain memory of this receiver's.
    backing: Backing,
    /// The chunk checksums checked so far, handed out with the tensor.
    checksums: ReceivedChecksums,
}

/// What a receiver's buffer is.
enum Backing {
    /// Memory of the receiver's own (new, recycled or from a pool): a payload that comes as a
    /// region replaces it.
    Own,
    /// The caller's ([`BufferFrom::Provided`], a range of a file being written): the bytes must
    /// end up in it, whichever route they came by.
    Provided,
    /// A mapping of this new region ([`BufferFrom::Region`]), sealed when the tensor is handed
    /// out.
    #[cfg(target_os = "linux")]
    Region(ferry_memory::region::RegionBuffer),
}

/// A receiver without its buffer and hash, while stripes fill the buffer (`crate::striped`).
pub(crate) struct Shell {
    hash_use: HashUse,
    meta: TensorMeta,
    backing: Backing,
}

impl Shell {
    /// What is being received.
    pub(crate) fn meta(&self) -> &TensorMeta {
        &self.meta
    }
}

/// Where a tensor was received into a region, that region sealed, to pass the tensor on to a
/// same-host peer without a copy (never off Linux).
pub type Sealed = Option<crate::connection::SealedRegion>;

impl std::fmt::Debug for TensorAssembler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorAssembler")
            .field("meta", &self.meta)
            .field("received", &self.received)
            .finish()
    }
}

impl TensorAssembler {
    /// What is being received.
    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }

    /// Bytes received and committed so far.
    pub fn received(&self) -> usize {
        self.received
    }

    /// Whether every byte has arrived.
    pub fn is_complete(&self) -> bool {
        self.received == self.meta.byte_len()
    }

    fn check_range(&self, offset: u64, len: usize) -> Result<std::ops::Range<usize>, StreamError> {
        let total = self.meta.byte_len() as u64;
        let end = next_chunk_end(offset, len, self.received as u64, total)?;
        // Within the buffer's length (`total`), so a usize.
        Ok(self.received..end as usize)
    }

    /// The place in the buffer for `len` bytes at `offset`, within the declared length and not
    /// empty: the start of the next chunk expected (at [`received`](Self::received)), or the
    /// next piece of the chunk arriving, right after the last place handed out. Asking for a
    /// piece says the places before it are written for good: a trailing hash reads them while
    /// the piece arrives, rather than after the whole chunk (which, for a tensor of one chunk,
    /// would leave its whole hash to the answer's path). A chunk that fails its checksum fails
    /// the payload, so a hash of its bytes is never used. Nothing counts as received until
    /// [`commit`](Self::commit).
    pub fn slot(&mut self, offset: u64, len: usize) -> Result<&mut [u8], StreamError> {
        let range = self.check_slot(offset, len)?;
        self.start_trailing();
        if range.start == self.received {
            self.restart_chunk();
        }
        if let RunningHash::Trailing(trailing) = &mut self.hash {
            trailing.commit(range.start);
        }
        self.slot_end = range.end;
        match &mut self.hash {
            RunningHash::Trailing(trailing) => {
                trailing.slot(range).ok_or(StreamError::OutOfOrder {
                    offset,
                    expected: self.received as u64,
                })
            }
            _ => Ok(&mut self.buf[range]),
        }
    }

    /// A chunk begun at [`received`](Self::received): one begun there before and not committed
    /// (a resumed transfer writes it again) had its pieces handed to a trailing hash, which
    /// cannot take them back: the hash starts over from the bytes committed.
    fn restart_chunk(&mut self) {
        let handed_past = match &self.hash {
            RunningHash::Trailing(trailing) => trailing.handed() > self.received,
            _ => false,
        };
        if handed_past {
            self.restart_hash();
        }
        self.slot_end = self.received;
    }

    /// Whether a chunk of `len` bytes at `offset` is the next expected, within the declared
    /// length, and not empty.
    pub(crate) fn check_chunk(&self, offset: u64, len: usize) -> Result<(), StreamError> {
        self.check_range(offset, len).map(|_| ())
    }

    /// `len` bytes at `offset` as [`slot`](Self::slot) takes them: the range they fill.
    fn check_slot(&self, offset: u64, len: usize) -> Result<std::ops::Range<usize>, StreamError> {
        let continues = self.slot_end > self.received && offset == self.slot_end as u64;
        if !continues {
            return self.check_range(offset, len);
        }
        if len == 0 {
            return Err(StreamError::EmptyChunk { offset });
        }
        let total = self.meta.byte_len();
        match self.slot_end.checked_add(len).filter(|&end| end <= total) {
            Some(end) => Ok(self.slot_end..end),
            None => Err(StreamError::PastEnd {
                offset,
                len: len as u64,
                total: total as u64,
            }),
        }
    }

    /// Counts the `len` bytes written at `offset` through [`slot`](Self::slot) (in one place
    /// or several) as received.
    pub fn commit(&mut self, offset: u64, len: usize) -> Result<(), StreamError> {
        let range = self.check_range(offset, len)?;
        if range.end > self.slot_end {
            // Bytes never handed out: nothing was written past `slot_end`.
            return Err(StreamError::Incomplete {
                received: self.slot_end as u64,
                total: range.end as u64,
            });
        }
        match &mut self.hash {
            RunningHash::None => {}
            // `slot` started the thread; bytes committed without it are hashed here.
            RunningHash::Inline(hasher) | RunningHash::TrailingSoon(hasher) => {
                hash_more(hasher, &self.buf[range.clone()]);
            }
            RunningHash::Trailing(trailing) => trailing.commit(range.end),
            // Settled only once every byte arrived: nothing is committed after.
            RunningHash::Done(_) => {}
        }
        self.received = range.end;
        Ok(())
    }

    /// Keeps the checksum of the chunk just committed, where it was checked (see
    /// [`ReceivedChecksums`]).
    pub(crate) fn record_checksum(&mut self, offset: u64, len: usize, checked: Option<u32>) {
        self.checksums.record(offset, len, checked);
    }

    /// Copies a verified chunk in.
    pub fn accept(&mut self, offset: u64, data: &[u8]) -> Result<(), StreamError> {
        self.slot(offset, data.len())?.copy_from_slice(data);
        self.commit(offset, data.len())
    }

    /// Takes a whole, already verified payload in place of the preallocated buffer (a
    /// shared-memory region the sender filled), instead of receiving it in chunks. It is not
    /// hashed here, so that its handoff stays O(1) ([`crate::hash_plan`]): whoever needs its hash
    /// settles it ([`settle_hash`](Self::settle_hash)) or has the device verify it.
    pub fn adopt(&mut self, payload: Bytes) -> Result<(), StreamError> {
        let total = self.meta.byte_len();
        if self.received != 0 {
            return Err(StreamError::OutOfOrder {
                offset: 0,
                expected: self.received as u64,
            });
        }
        if payload.len() != total {
            return Err(StreamError::RegionSize {
                len: payload.len() as u64,
                total: total as u64,
            });
        }
        // A hashing thread reads the old buffer: dropping it joins it before the buffer goes.
        self.hash = RunningHash::None;
        match self.backing {
            // The caller's buffer is where the bytes must land (a file being written): copied
            // out of the region, which is then let go.
            Backing::Provided => self.buf.copy_from_slice(&payload),
            // A region that came sealed replaces the buffer (and a region prepared for chunks).
            _ => {
                self.buf = payload;
                self.backing = Backing::Own;
            }
        }
        self.received = total;
        self.slot_end = total;
        Ok(())
    }

    /// Takes the receiver apart for a striped receive (`crate::striped`): its buffer, and the
    /// rest to rebuild it from ([`from_striped`](Self::from_striped)). Only before any byte
    /// arrived; `Err` gives it back otherwise.
    pub(crate) fn take_apart(self) -> Result<(Shell, Bytes), Box<Self>> {
        if self.received != 0 || matches!(self.hash, RunningHash::Trailing(_)) {
            return Err(Box::new(self));
        }
        let Self {
            hash: _,
            hash_use,
            meta,
            buf,
            received: _,
            slot_end: _,
            backing,
            checksums: _,
        } = self;
        Ok((
            Shell {
                hash_use,
                meta,
                backing,
            },
            buf,
        ))
    }

    /// The receiver [`take_apart`](Self::take_apart) took apart, as it was before any byte.
    pub(crate) fn from_shell(shell: Shell, buf: Bytes) -> Self {
        Self::with_buffer(shell.meta, buf, shell.backing, shell.hash_use)
    }

    /// A receiver whose every byte arrived by stripes into `buf`, hashed to `hash` as they did.
    pub(crate) fn from_striped(shell: Shell, buf: Bytes, hash: ContentHash) -> Self {
        let received = buf.len();
        Self {
            hash: RunningHash::Done(hash),
            hash_use: shell.hash_use,
            meta: shell.meta,
            buf,
            received,
            slot_end: received,
            backing: shell.backing,
            checksums: ReceivedChecksums::default(),
        }
    }
}
