//! Where a receiver's buffer comes from: new memory aligned for the dtype, a recycled buffer,
//! the receive pool, a new shared-memory region, or the caller's; its size checked first.

use burn_std::{Bytes, DType};

use ferry_proto::{MetaError, TensorMeta};

use ferry_memory::pool::Pool;

use super::{Backing, RunningHash, TensorAssembler};

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

/// Where a new receiver's own buffer comes from.
enum Source<'a> {
    /// New memory, aligned for the dtype.
    Fresh,
    /// A recycled buffer where the process keeps one of about the size, else new memory.
    Recycled,
    /// The pool, else as [`Source::Recycled`].
    Pool(&'a Pool),
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

    pub(super) fn with_buffer(meta: TensorMeta, buf: Bytes, backing: Backing) -> Self {
        Self {
            hash: RunningHash::None,
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
}
