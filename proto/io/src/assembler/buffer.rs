//! The receiver's one constructor, and where its buffer comes from ([`BufferFrom`]): new memory
//! aligned for the dtype, a recycled buffer, the receive pool, a new shared-memory region, or the
//! caller's; its size checked first.

use burn_std::{Bytes, DType};

use ferry_proto::{MetaError, TensorMeta};

use ferry_memory::pool::Pool;

use super::{Backing, HashUse, ReceivedChecksums, RunningHash, TensorAssembler};

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

/// Where a receiver's buffer comes from.
pub enum BufferFrom<'a> {
    /// New memory, aligned for the dtype.
    Fresh,
    /// A recycled buffer where the process keeps one of about the size
    /// ([`ferry_memory::host::receive_buffer`]), else new memory. For a receiver whose backend
    /// keeps the buffer as the tensor's memory as it is (Flex): one that wants a `Vec` would copy
    /// it.
    Recycled,
    /// The pool first: a payload the pool cannot hold (too large, or the pool too full) goes to
    /// [`Recycled`](Self::Recycled) memory, with a log line that says so and the pool's miss
    /// counter raised.
    Pool(&'a Pool),
    /// A new shared-memory region, sealed when the tensor is handed out, so that a tensor that
    /// arrived by any link can go on to a same-host peer as is. Where no region can be made (or
    /// off Linux), [`Recycled`](Self::Recycled) memory, with a log line.
    Region,
    /// The caller's (a range of a file being written, say): exactly the payload's length, else
    /// [`MetaError::BufferLength`]. Its bytes are overwritten whole before the tensor is handed
    /// out.
    Provided(Bytes),
}

impl std::fmt::Debug for BufferFrom<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Fresh => f.write_str("Fresh"),
            Self::Recycled => f.write_str("Recycled"),
            Self::Pool(_) => f.write_str("Pool"),
            Self::Region => f.write_str("Region"),
            Self::Provided(buf) => write!(f, "Provided({} bytes)", buf.len()),
        }
    }
}

impl TensorAssembler {
    /// A receiver for `meta`, its buffer from `from`, computing the content hash for
    /// `hash_use` as the bytes arrive ([`HashUse::for_purpose`] says which). A payload over
    /// `max_bytes` is refused before anything is allocated for it.
    ///
    /// A payload of [`TRAILING_HASH_MIN`](super::TRAILING_HASH_MIN) bytes or more is hashed on
    /// another thread while it arrives, so that finishing waits only for the last chunk. A
    /// connection reading into a receiver whose hash is a [`HashUse::Check`] checks no chunk
    /// checksum ([`checks_chunks`](Self::checks_chunks)): the caller must compare the hash with
    /// one it trusts (a pull, with its grant), which catches whatever the checksums would.
    pub fn new(
        meta: TensorMeta,
        max_bytes: u64,
        from: BufferFrom<'_>,
        hash_use: HashUse,
    ) -> Result<Self, MetaError> {
        let len = meta.byte_len();
        if len as u64 > max_bytes {
            return Err(MetaError::TooLarge {
                bytes: len as u64,
                limit: max_bytes,
            });
        }
        let (buf, backing) = match from {
            BufferFrom::Provided(buf) if buf.len() == len => (buf, Backing::Provided),
            BufferFrom::Provided(buf) => {
                return Err(MetaError::BufferLength {
                    len: buf.len() as u64,
                    expected: len as u64,
                });
            }
            BufferFrom::Region => region_or_recycled(&meta)?,
            BufferFrom::Pool(pool) => {
                let pooled = pool.take(len).unwrap_or_else(|miss| {
                    tracing::info!(
                        bytes = miss.wanted,
                        pool_free = miss.free,
                        pool_largest_free = miss.largest_free,
                        "the receive pool cannot hold this payload; it goes to fresh memory"
                    );
                    None
                });
                match pooled {
                    Some(buf) => (buf, Backing::Own),
                    None => (recycled_or_fresh(&meta)?, Backing::Own),
                }
            }
            BufferFrom::Recycled => (recycled_or_fresh(&meta)?, Backing::Own),
            BufferFrom::Fresh => (alloc_for(meta.dtype(), len)?, Backing::Own),
        };
        Ok(Self::with_buffer(meta, buf, backing, hash_use))
    }

    pub(super) fn with_buffer(
        meta: TensorMeta,
        buf: Bytes,
        backing: Backing,
        hash_use: HashUse,
    ) -> Self {
        let hash = RunningHash::for_use(hash_use, &meta, buf.len());
        Self {
            hash,
            hash_use,
            meta,
            buf,
            received: 0,
            slot_end: 0,
            backing,
            checksums: ReceivedChecksums::default(),
        }
    }
}

/// A recycled buffer of the payload's size where the process keeps one, else new memory.
fn recycled_or_fresh(meta: &TensorMeta) -> Result<Bytes, MetaError> {
    let len = meta.byte_len();
    match ferry_memory::host::receive_buffer(len) {
        Some(buf) => Ok(buf),
        None => alloc_for(meta.dtype(), len),
    }
}

/// A new shared-memory region of the payload's size, else (or off Linux) recycled memory.
fn region_or_recycled(meta: &TensorMeta) -> Result<(Bytes, Backing), MetaError> {
    #[cfg(target_os = "linux")]
    match ferry_memory::region::RegionBuffer::new(meta.byte_len()) {
        Ok((region, buf)) => return Ok((buf, Backing::Region(region))),
        Err(error) => {
            tracing::info!(bytes = meta.byte_len(), %error, "no region for this receive; it goes to fresh memory");
        }
    }
    Ok((recycled_or_fresh(meta)?, Backing::Own))
}
