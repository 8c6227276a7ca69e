//! Receiving one tensor: a buffer sized from the validated meta, written in place chunk by
//! chunk (or adopted whole from a region), its content hash computed as the bytes arrive.

use burn_std::{Bytes, DType, TensorData};

use ferry_proto::tensor::{content_hash, content_hasher, from_parts, hash_more};
use ferry_proto::{ContentHash, MetaError, ProtoError, StreamError, TensorMeta};

use ferry_memory::pool::Pool;

/// A zeroed buffer of `len` bytes, allocated with the alignment of `dtype`'s elements so that
/// backends can use it in place (NdArray panics on misaligned buffers; Flex would copy), and from
/// the global allocator, so that a backend that wants a `Vec` takes it over without a copy.
///
/// The allocation is fallible: a size the allocator refuses is an error, not an abort.
fn alloc_for(dtype: DType, len: usize) -> Result<Bytes, MetaError> {
    fn zeroed<T: bytemuck::Zeroable + bytemuck::NoUninit + Send + Sync>(
        n: usize,
        len: usize,
    ) -> Result<Bytes, MetaError> {
        let elems = bytemuck::allocation::try_zeroed_vec::<T>(n)
            .map_err(|()| MetaError::AllocationFailed { bytes: len as u64 })?;
        ferry_memory::host::advise_huge_pages(bytemuck::cast_slice(&elems));
        Ok(Bytes::from_elems(elems))
    }
    match dtype {
        DType::QFloat(_) => zeroed::<u8>(len, len),
        plain => match plain.size() {
            8 => zeroed::<u64>(len / 8, len),
            4 => zeroed::<u32>(len / 4, len),
            2 => zeroed::<u16>(len / 2, len),
            _ => zeroed::<u8>(len, len),
        },
    }
}

/// Receives one tensor's payload in order, into one buffer sized from the validated meta.
///
/// Bytes are written in place ([`slot`](Self::slot), then [`commit`](Self::commit) once their
/// chunk arrived whole, its checksum verified where one is checked), so a receiver never holds
/// a second copy of the tensor.
pub struct TensorAssembler {
    /// The content hash where the receiver wants it ([`hashing`](Self::hashing)). Declared
    /// before `buf`, so that a hashing thread is joined before the buffer it reads is freed.
    hash: HashState,
    /// What the hash is for, where the receiver hashes ([`hashing`](Self::hashing)).
    hash_use: Option<HashUse>,
    meta: TensorMeta,
    buf: Bytes,
    received: usize,
    /// What `buf` is, beyond plain memory of this receiver's.
    backing: Backing,
}

/// What a receiver's buffer is.
enum Backing {
    /// Memory of the receiver's own (new, recycled or from a pool): a payload that comes as a
    /// region replaces it.
    Own,
    /// The caller's ([`into_buffer`](TensorAssembler::into_buffer), a range of a file being
    /// written): the bytes must end up in it, whichever route they came by.
    Provided,
    /// A mapping of this new region ([`new_in_region`](TensorAssembler::new_in_region)), sealed
    /// when the tensor is handed out.
    #[cfg(target_os = "linux")]
    Region(ferry_memory::region::RegionBuffer),
}

/// A receiver without its buffer and hash, while stripes fill the buffer (`crate::striped`).
pub(crate) struct Shell {
    hash_use: Option<HashUse>,
    meta: TensorMeta,
    backing: Backing,
}

impl Shell {
    /// What is being received.
    pub(crate) fn meta(&self) -> &TensorMeta {
        &self.meta
    }
}

/// Where a new receiver's own buffer comes from.
enum Source<'a> {
    /// New memory, aligned for the dtype.
    Fresh,
    /// A recycled buffer where the process keeps one of about the size, else new memory.
    Recycled,
    /// The pool, else as [`Source::Recycled`].
    Pool(&'a Pool),
}

/// Where a tensor was received into a region, that region sealed, to pass the tensor on to a
/// same-host peer without a copy (never off Linux).
pub type Sealed = Option<crate::connection::SealedRegion>;

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
enum HashState {
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

impl std::fmt::Debug for TensorAssembler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorAssembler")
            .field("meta", &self.meta)
            .field("received", &self.received)
            .finish()
    }
}

impl TensorAssembler {
    /// Preallocates for `meta`, refusing a payload over `max_bytes` before allocating.
    pub fn new(meta: TensorMeta, max_bytes: u64) -> Result<Self, MetaError> {
        Self::allocate(meta, max_bytes, Source::Fresh)
    }

    /// [`new`](Self::new), in a recycled buffer where the process keeps one of about the size
    /// ([`ferry_memory::host::receive_buffer`]). For a receiver whose backend keeps the buffer as
    /// the tensor's memory as it is (Flex): one that wants a `Vec` would copy it.
    pub fn new_recycled(meta: TensorMeta, max_bytes: u64) -> Result<Self, MetaError> {
        Self::allocate(meta, max_bytes, Source::Recycled)
    }

    /// Receives into `buf`, which the caller provides (a range of a file being written, say):
    /// `None`, giving the buffer back, unless it is exactly the payload's length. Its bytes are
    /// overwritten whole before the tensor is handed out.
    pub fn into_buffer(meta: TensorMeta, buf: Bytes) -> Result<Self, Bytes> {
        if buf.len() != meta.byte_len() {
            return Err(buf);
        }
        Ok(Self::with_buffer(meta, buf, Backing::Provided))
    }

    fn with_buffer(meta: TensorMeta, buf: Bytes, backing: Backing) -> Self {
        Self {
            hash: HashState::None,
            hash_use: None,
            meta,
            buf,
            received: 0,
            backing,
        }
    }

    /// Refuses a payload over `max_bytes` before anything is allocated for it.
    fn check_size(meta: &TensorMeta, max_bytes: u64) -> Result<usize, MetaError> {
        let len = meta.byte_len();
        if len as u64 > max_bytes {
            return Err(MetaError::TooLarge {
                bytes: len as u64,
                limit: max_bytes,
            });
        }
        Ok(len)
    }

    /// [`new_recycled`](Self::new_recycled), received into a new shared-memory region that is
    /// sealed when the tensor is handed out ([`finish_sealed`](Self::finish_sealed)), so that a
    /// tensor that arrived by any link can go on to a same-host peer as is. Where no region can
    /// be made (or off Linux), fresh or recycled memory, with a log line.
    pub fn new_in_region(meta: TensorMeta, max_bytes: u64) -> Result<Self, MetaError> {
        let len = Self::check_size(&meta, max_bytes)?;
        #[cfg(target_os = "linux")]
        match ferry_memory::region::RegionBuffer::new(len) {
            Ok((region, buf)) => return Ok(Self::with_buffer(meta, buf, Backing::Region(region))),
            Err(error) => {
                tracing::info!(bytes = len, %error, "no region for this receive; it goes to fresh memory");
            }
        }
        Self::new_recycled(meta, max_bytes)
    }

    /// [`new_recycled`](Self::new_recycled), drawing the buffer from `pool` first: a payload the
    /// pool cannot hold (too large, or the pool too full) goes to fresh memory, with a log line
    /// that says so and the pool's miss counter raised.
    pub fn new_pooled(meta: TensorMeta, max_bytes: u64, pool: &Pool) -> Result<Self, MetaError> {
        Self::allocate(meta, max_bytes, Source::Pool(pool))
    }

    fn allocate(meta: TensorMeta, max_bytes: u64, source: Source<'_>) -> Result<Self, MetaError> {
        let len = Self::check_size(&meta, max_bytes)?;
        let pooled = match source {
            Source::Pool(pool) => pool.take(len).unwrap_or_else(|miss| {
                tracing::info!(
                    bytes = miss.wanted,
                    pool_free = miss.free,
                    pool_largest_free = miss.largest_free,
                    "the receive pool cannot hold this payload; it goes to fresh memory"
                );
                None
            }),
            Source::Fresh | Source::Recycled => None,
        };
        let recycled = || match source {
            Source::Fresh => None,
            Source::Recycled | Source::Pool(_) => ferry_memory::host::receive_buffer(len),
        };
        let buf = match pooled.or_else(recycled) {
            Some(buf) => buf,
            None => alloc_for(meta.dtype(), len)?,
        };
        Ok(Self::with_buffer(meta, buf, Backing::Own))
    }

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
        if self.received != 0 || !matches!(self.hash, HashState::None) {
            return self;
        }
        self.hash_use = Some(hash_use);
        let hasher = Box::new(content_hasher(&self.meta));
        self.hash = if self.buf.len() >= TRAILING_HASH_MIN {
            HashState::TrailingSoon(hasher)
        } else {
            HashState::Inline(hasher)
        };
        self
    }

    /// Starts the trailing hash thread a [`HashState::TrailingSoon`] waits for (before any byte
    /// is written: `slot` calls it first).
    fn start_trailing(&mut self) {
        let hasher = match std::mem::take(&mut self.hash) {
            HashState::TrailingSoon(hasher) => hasher,
            other => {
                self.hash = other;
                return;
            }
        };
        // Bytes committed before (without a slot) are in the hasher already; a thread would
        // start at 0 and hash them again: such a receiver goes on hashing in line.
        if self.received != 0 {
            self.hash = HashState::Inline(hasher);
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
            Ok(trailing) => HashState::Trailing(trailing),
            Err(_) => HashState::Inline(hasher),
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
        matches!(self.hash, HashState::None) || self.hash_use != Some(HashUse::Check)
    }

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
        let total = self.meta.byte_len();
        if offset != self.received as u64 {
            return Err(StreamError::OutOfOrder {
                offset,
                expected: self.received as u64,
            });
        }
        if len == 0 {
            return Err(StreamError::EmptyChunk { offset });
        }
        let end = self.received.checked_add(len).filter(|&end| end <= total);
        match end {
            Some(end) => Ok(self.received..end),
            None => Err(StreamError::PastEnd {
                offset,
                len: len as u64,
                total: total as u64,
            }),
        }
    }

    /// The place in the buffer for `len` bytes at `offset`: the next bytes expected, within the
    /// declared length, and not empty. Nothing counts as received until [`commit`](Self::commit).
    pub fn slot(&mut self, offset: u64, len: usize) -> Result<&mut [u8], StreamError> {
        let range = self.check_range(offset, len)?;
        self.start_trailing();
        match &mut self.hash {
            HashState::Trailing(trailing) => trailing.slot(range).ok_or(StreamError::OutOfOrder {
                offset,
                expected: self.received as u64,
            }),
            _ => Ok(&mut self.buf[range]),
        }
    }

    /// Counts the `len` bytes written at `offset` through [`slot`](Self::slot) as received.
    pub fn commit(&mut self, offset: u64, len: usize) -> Result<(), StreamError> {
        let range = self.check_range(offset, len)?;
        match &mut self.hash {
            HashState::None => {}
            // `slot` started the thread; bytes committed without it are hashed here.
            HashState::Inline(hasher) | HashState::TrailingSoon(hasher) => {
                hash_more(hasher, &self.buf[range.clone()]);
            }
            HashState::Trailing(trailing) => trailing.commit(range.end),
            // Settled only once every byte arrived: nothing is committed after.
            HashState::Done(_) => {}
        }
        self.received = range.end;
        Ok(())
    }

    /// The content hasher, to feed elsewhere (off an async runtime) and give back with
    /// [`adopt_hashed`](Self::adopt_hashed); `None` where this receiver does not hash.
    pub fn take_hasher(&mut self) -> Option<blake3::Hasher> {
        match std::mem::take(&mut self.hash) {
            // A settled hash has no hasher left to feed.
            HashState::None | HashState::Done(_) => None,
            HashState::Inline(hasher) | HashState::TrailingSoon(hasher) => Some(*hasher),
            // Everything committed so far is fed to it; a thread that died leaves the bytes to
            // be hashed again from the start.
            HashState::Trailing(trailing) => trailing.finish().or_else(|| {
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
            HashState::Done(hash) => *hash,
            _ => match self.take_hasher() {
                Some(hasher) => hasher.finalize().into(),
                None => content_hash(&self.meta, &self.buf),
            },
        };
        self.hash = HashState::Done(hash);
        Ok(hash)
    }

    /// [`adopt`](Self::adopt) for a payload already fed to the hasher taken with
    /// [`take_hasher`](Self::take_hasher).
    pub fn adopt_hashed(
        &mut self,
        payload: Bytes,
        hasher: Option<blake3::Hasher>,
    ) -> Result<(), StreamError> {
        self.hash = HashState::None;
        self.adopt(payload)?;
        self.hash = hasher.map_or(HashState::None, |h| HashState::Inline(Box::new(h)));
        Ok(())
    }

    /// Takes a whole, already verified payload in place of the preallocated buffer (a
    /// shared-memory region the sender filled), instead of receiving it in chunks.
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
        // A payload that came whole is not hashed only to be recorded: its handoff stays O(1).
        if self.hash_use == Some(HashUse::Record) {
            self.hash = HashState::None;
        }
        // A hashing thread reads the old buffer: it is done with it before the buffer goes.
        if let HashState::Trailing(_) = self.hash {
            self.hash = self
                .take_hasher()
                .map_or(HashState::None, |h| HashState::Inline(Box::new(h)));
        }
        if let HashState::Inline(hasher) | HashState::TrailingSoon(hasher) = &mut self.hash {
            hash_more(hasher, &payload);
        }
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
        Ok(())
    }

    /// Takes the receiver apart for a striped receive (`crate::striped`): its buffer, and the
    /// rest to rebuild it from ([`from_striped`](Self::from_striped)). Only before any byte
    /// arrived; `Err` gives it back otherwise.
    pub(crate) fn take_apart(self) -> Result<(Shell, Bytes), Box<Self>> {
        if self.received != 0 || matches!(self.hash, HashState::Trailing(_)) {
            return Err(Box::new(self));
        }
        let Self {
            hash: _,
            hash_use,
            meta,
            buf,
            received: _,
            backing,
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

    /// The receiver [`take_apart`](Self::take_apart) took apart, as it was, without its hash.
    pub(crate) fn from_shell(shell: Shell, buf: Bytes) -> Self {
        Self::with_buffer(shell.meta, buf, shell.backing)
    }

    /// A receiver whose every byte arrived by stripes into `buf`, hashed to `hash` as they did.
    pub(crate) fn from_striped(shell: Shell, buf: Bytes, hash: ContentHash) -> Self {
        let received = buf.len();
        Self {
            hash: HashState::Done(hash),
            hash_use: shell.hash_use,
            meta: shell.meta,
            buf,
            received,
            backing: shell.backing,
        }
    }

    /// Copies a verified chunk in.
    pub fn accept(&mut self, offset: u64, data: &[u8]) -> Result<(), StreamError> {
        self.slot(offset, data.len())?.copy_from_slice(data);
        self.commit(offset, data.len())
    }

    fn check_complete(&self) -> Result<(), ProtoError> {
        if !self.is_complete() {
            return Err(StreamError::Incomplete {
                received: self.received as u64,
                total: self.meta.byte_len() as u64,
            }
            .into());
        }
        Ok(())
    }

    /// The assembled tensor, once every declared byte has arrived (no content hash computed).
    pub fn finish(self) -> Result<TensorData, ProtoError> {
        self.finish_sealed().map(|(data, _)| data)
    }

    /// [`finish`](Self::finish), with the region the tensor was received into, sealed (see
    /// [`new_in_region`](Self::new_in_region)).
    pub fn finish_sealed(mut self) -> Result<(TensorData, Sealed), ProtoError> {
        self.check_complete()?;
        // Joined (and its thread done with the buffer) before the buffer is handed out.
        self.hash = HashState::None;
        let sealed = self.seal();
        Ok((from_parts(&self.meta, self.buf)?, sealed))
    }

    /// The assembled tensor and its content hash ([`content_hash`]), once every declared byte
    /// has arrived.
    pub fn finish_hashed(self) -> Result<(TensorData, ContentHash), ProtoError> {
        self.finish_hashed_sealed()
            .map(|(data, hash, _)| (data, hash))
    }

    /// [`finish_hashed`](Self::finish_hashed), with the region the tensor was received into,
    /// sealed.
    pub fn finish_hashed_sealed(mut self) -> Result<(TensorData, ContentHash, Sealed), ProtoError> {
        let hash = self.settle_hash()?;
        let sealed = self.seal();
        Ok((from_parts(&self.meta, self.buf)?, hash, sealed))
    }

    /// [`finish_sealed`](Self::finish_sealed), with the content hash where it was computed as
    /// the bytes arrived ([`hashing`](Self::hashing)); `None` where it was not (a receiver that
    /// does not hash, or a payload recorded that came whole: see [`HashUse::Record`]). The
    /// hashing thread is waited for: call it off an async runtime.
    pub fn finish_recorded(
        mut self,
    ) -> Result<(TensorData, Option<ContentHash>, Sealed), ProtoError> {
        self.check_complete()?;
        let hash = match self.hash {
            HashState::None => None,
            _ => Some(self.settle_hash()?),
        };
        self.hash = HashState::None;
        let sealed = self.seal();
        Ok((from_parts(&self.meta, self.buf)?, hash, sealed))
    }

    /// Seals the region the bytes were received into, if any, and makes its sealed mapping the
    /// buffer. A region that cannot be sealed leaves the bytes as they are (not shareable).
    fn seal(&mut self) -> Sealed {
        // The hashing thread, if any, is done with the buffer (both finishes end it first).
        debug_assert!(!matches!(self.hash, HashState::Trailing(_)));
        #[cfg(target_os = "linux")]
        if let Backing::Region(region) = std::mem::replace(&mut self.backing, Backing::Own) {
            let written = std::mem::replace(&mut self.buf, Bytes::from_bytes_vec(Vec::new()));
            let (bytes, kept) = region.seal(written).unwrap_or_else(|(error, written)| {
                tracing::info!(%error, "a received region could not be sealed; kept unshared");
                (written, None)
            });
            self.buf = bytes;
            return kept;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_proto::frame::chunks;
    use ferry_proto::tensor::into_parts;

    #[test]
    fn assembles_in_order_and_refuses_the_rest() {
        let data = TensorData::new((0..10).map(|i| i as f32).collect::<Vec<_>>(), [2, 5]);
        let (meta, payload) = into_parts(data.clone()).unwrap();
        let mut asm = TensorAssembler::new(meta.clone(), 1 << 20).unwrap();
        assert!(matches!(
            asm.accept(4, &payload[4..8]),
            Err(StreamError::OutOfOrder { .. })
        ));
        assert!(matches!(
            asm.accept(0, &[]),
            Err(StreamError::EmptyChunk { .. })
        ));
        for (offset, piece) in chunks(&payload, 12) {
            asm.accept(offset, piece).unwrap();
        }
        assert!(matches!(
            asm.accept(40, &[0]),
            Err(StreamError::PastEnd { .. })
        ));
        let (back, hash) = asm.finish_hashed().unwrap();
        assert_eq!(hash, content_hash(&meta, data.as_bytes()));
        assert_eq!(back.as_bytes(), data.as_bytes());
        assert_eq!(back.dtype(), data.dtype());
        assert_eq!(back.shape(), data.shape());
    }

    #[test]
    fn a_large_payload_hashed_on_its_own_thread_hashes_as_in_line() {
        let n = TRAILING_HASH_MIN; // 4 MiB of f32
        let data = TensorData::new((0..n).map(|i| i as f32).collect::<Vec<_>>(), [n]);
        let (meta, payload) = into_parts(data.clone()).unwrap();
        let mut asm = TensorAssembler::new(meta.clone(), u64::MAX)
            .unwrap()
            .hashing(HashUse::Check);
        assert!(matches!(asm.hash, HashState::TrailingSoon(_)));
        for (offset, piece) in chunks(&payload, 300_001) {
            asm.accept(offset, piece).unwrap();
            assert!(matches!(asm.hash, HashState::Trailing(_)));
        }
        let (back, hash) = asm.finish_hashed().unwrap();
        assert_eq!(hash, content_hash(&meta, data.as_bytes()));
        assert_eq!(back.as_bytes(), data.as_bytes());
    }

    #[test]
    fn a_payload_that_comes_whole_starts_no_hashing_thread() {
        let n = TRAILING_HASH_MIN;
        let data = TensorData::new((0..n).map(|i| (i % 253) as u8).collect::<Vec<_>>(), [n]);
        let (meta, payload) = into_parts(data.clone()).unwrap();
        let mut asm = TensorAssembler::new(meta.clone(), u64::MAX)
            .unwrap()
            .hashing(HashUse::Check);
        assert!(matches!(asm.hash, HashState::TrailingSoon(_)));
        asm.adopt(payload).unwrap();
        assert!(!matches!(asm.hash, HashState::Trailing(_)));
        let (back, hash) = asm.finish_hashed().unwrap();
        assert_eq!(hash, content_hash(&meta, data.as_bytes()));
        assert_eq!(back.as_bytes(), data.as_bytes());
    }

    /// A put's receiver records the hash of chunks as they arrive (in line and on a trailing
    /// thread), and none for a payload that comes whole, which its registration hashes later.
    #[test]
    fn a_recorded_hash_comes_with_chunks_but_not_with_a_payload_that_came_whole() {
        for n in [3000, 2 * TRAILING_HASH_MIN] {
            let data = TensorData::new((0..n).map(|i| (i % 241) as u8).collect::<Vec<_>>(), [n]);
            let (meta, payload) = into_parts(data.clone()).unwrap();
            let truth = content_hash(&meta, data.as_bytes());
            let recording = || {
                TensorAssembler::new(meta.clone(), u64::MAX)
                    .unwrap()
                    .hashing(HashUse::Record)
            };
            let mut asm = recording();
            for (offset, piece) in chunks(&payload, 200_003) {
                asm.accept(offset, piece).unwrap();
            }
            let (back, hash, _) = asm.finish_recorded().unwrap();
            assert_eq!(hash, Some(truth), "{n}");
            assert_eq!(back.as_bytes(), data.as_bytes());

            let mut whole = recording();
            whole.adopt(payload.clone()).unwrap();
            let (back, hash, _) = whole.finish_recorded().unwrap();
            assert_eq!(hash, None, "{n}: not hashed at its handoff");
            assert_eq!(back.as_bytes(), data.as_bytes());

            // A receiver that hashes to check does hash what came whole.
            let mut checked = TensorAssembler::new(meta.clone(), u64::MAX)
                .unwrap()
                .hashing(HashUse::Check);
            checked.adopt(payload).unwrap();
            assert_eq!(checked.finish_recorded().unwrap().1, Some(truth));
        }
    }

    #[test]
    fn a_receive_dropped_half_way_stops_its_hashing_thread() {
        let n = TRAILING_HASH_MIN;
        let data = TensorData::new(vec![7u8; n], [n]);
        let (meta, payload) = into_parts(data).unwrap();
        let mut asm = TensorAssembler::new(meta, u64::MAX)
            .unwrap()
            .hashing(HashUse::Check);
        asm.accept(0, &payload[..n / 2]).unwrap();
        // Out of order is still refused through the hashing thread's view of the buffer.
        assert!(asm.accept(0, &payload[..8]).is_err());
        drop(asm); // joins the thread; a hang here fails the test by timing out
    }

    #[test]
    fn a_hasher_taken_mid_way_carries_the_committed_bytes() {
        let n = 2 * TRAILING_HASH_MIN;
        let data = TensorData::new((0..n).map(|i| (i % 251) as u8).collect::<Vec<_>>(), [n]);
        let (meta, payload) = into_parts(data.clone()).unwrap();
        let mut asm = TensorAssembler::new(meta.clone(), u64::MAX)
            .unwrap()
            .hashing(HashUse::Check);
        asm.accept(0, &payload[..n / 3]).unwrap();
        let mut hasher = asm.take_hasher().unwrap();
        hasher.update(&payload[n / 3..]);
        assert_eq!(
            ContentHash::from(hasher.finalize()),
            content_hash(&meta, data.as_bytes())
        );
    }

    #[test]
    fn an_early_end_is_an_error() {
        let data = TensorData::new(vec![1u8, 2, 3], [3]);
        let (meta, payload) = into_parts(data).unwrap();
        let mut asm = TensorAssembler::new(meta, 100).unwrap();
        asm.accept(0, &payload[..2]).unwrap();
        assert!(asm.finish().is_err());
    }

    #[test]
    fn too_large_is_refused_before_allocating() {
        let meta = TensorMeta::new(vec![1 << 40], DType::F32).unwrap();
        assert!(matches!(
            TensorAssembler::new(meta, 1 << 30),
            Err(MetaError::TooLarge { .. })
        ));
    }
}
