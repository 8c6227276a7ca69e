//! The receive pool: memory a node reserves and touches at start (`--pool`), from which large
//! receives draw their buffers and to which a freed tensor's buffer goes back.
//!
//! Why: a tensor that arrives into new memory pays the kernel a page fault and the zeroing of
//! every page, more than the network copy into it (measured in issue 14: 77% of a cold pull's
//! target CPU in `clear_page_erms`). A pool pays that once, at start, so the first pull of a model
//! to a fresh worker runs as fast as the steady state.
//!
//! The pool is one anonymous mapping (transparent huge pages advised) carved by a best-fit free
//! list in [`GRANULE`] steps. One mapping, not many blocks, so that a later transport that must
//! register memory with its hardware (RDMA, GPU direct) registers [`Pool::memory`] once and
//! names a buffer by its [`Pool::offset_of`].
//!
//! Invariant: every byte of the mapping is in exactly one place, the free list or one live
//! buffer; a buffer goes back to the free list when its `Bytes` is dropped, whatever path it
//! took (registered tensor, failed receive, deleted tensor). `free_bytes() == capacity()` once
//! nothing drawn from the pool is alive.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use burn_std::Bytes;
use memmap2::MmapMut;

use crate::host::{RangeController, RangeOwner};

/// Buffers are carved in steps of this many bytes, so every buffer starts 64 KiB aligned (more
/// than any element type needs) and the free list stays short.
pub const GRANULE: usize = 64 << 10;

/// Payloads under this size do not draw from the pool: the allocator's recycled, already
/// touched memory serves them as well, and they would only fragment it.
pub const POOL_MIN: usize = 1 << 20;

/// Why a pool could not be reserved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// A pool of 0 bytes, or one whose size overflows when rounded to the granule.
    #[error("a receive pool of {0} bytes cannot be reserved: give at least 1 MiB")]
    Size(usize),
    /// The kernel refused the mapping.
    #[error("cannot reserve a receive pool of {bytes} bytes: {source}")]
    Map {
        /// The size asked for.
        bytes: usize,
        /// What the kernel said.
        source: std::io::Error,
    },
}

/// Why a payload could not draw a buffer from the pool (it then goes to fresh memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolMiss {
    /// The bytes asked for.
    pub wanted: usize,
    /// The pool's free bytes at the time.
    pub free: usize,
    /// Its largest free range at the time.
    pub largest_free: usize,
}

/// A node's receive pool. Cheap to clone; the memory is unmapped when the last clone and the
/// last buffer drawn from it are gone.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

struct Inner {
    /// Owns the mapping; every access goes through `base` and the ranges the free list hands
    /// out, never through the map itself after start.
    _map: MmapMut,
    base: NonNull<u8>,
    len: usize,
    free: Mutex<FreeList>,
    misses: AtomicU64,
    /// Payloads under this size do not draw.
    min_payload: usize,
}

// SAFETY: `base` points into `_map`, which `Inner` owns for its whole life; the bytes behind it
// are only reached through disjoint ranges, each owned by one buffer (or by the free list, which
// nobody reads through), so sharing `Inner` between threads shares no byte.
unsafe impl Send for Inner {}
// SAFETY: as above; the free list is behind a mutex.
unsafe impl Sync for Inner {}

/// Free ranges by offset (offset -> length), coalesced: no two touch.
#[derive(Debug, Default)]
struct FreeList {
    ranges: BTreeMap<usize, usize>,
    free: usize,
}

impl FreeList {
    /// The smallest free range that holds `len` bytes, split from its start.
    fn take(&mut self, len: usize) -> Option<usize> {
        let (&offset, &range) = self
            .ranges
            .iter()
            .filter(|(_, r)| **r >= len)
            .min_by_key(|(_, r)| **r)?;
        self.ranges.remove(&offset);
        if range > len {
            self.ranges.insert(offset + len, range - len);
        }
        self.free -= len;
        Some(offset)
    }

    /// Gives `[offset, offset + len)` back, merged with its free neighbours.
    fn give(&mut self, mut offset: usize, mut len: usize) {
        self.free += len;
        if let Some((&before, &before_len)) = self.ranges.range(..offset).next_back()
            && before + before_len == offset
        {
            self.ranges.remove(&before);
            offset = before;
            len += before_len;
        }
        if let Some(after_len) = self.ranges.remove(&(offset + len)) {
            len += after_len;
        }
        self.ranges.insert(offset, len);
    }

    fn largest(&self) -> usize {
        self.ranges.values().copied().max().unwrap_or(0)
    }
}

impl Pool {
    /// Reserves `bytes` (rounded up to [`GRANULE`]) and touches every page now, with huge pages
    /// advised, so no receive that draws from it takes a page fault. Payloads from [`POOL_MIN`]
    /// up draw from it.
    pub fn reserve(bytes: usize) -> Result<Pool, PoolError> {
        Self::reserve_with(bytes, POOL_MIN)
    }

    /// [`reserve`](Self::reserve), with payloads from `min_payload` bytes up drawing from it
    /// (every one takes at least a [`GRANULE`]).
    pub fn reserve_with(bytes: usize, min_payload: usize) -> Result<Pool, PoolError> {
        if bytes < POOL_MIN {
            return Err(PoolError::Size(bytes));
        }
        let len = bytes
            .checked_next_multiple_of(GRANULE)
            .ok_or(PoolError::Size(bytes))?;
        let mut map = memmap2::MmapOptions::new()
            .len(len)
            .map_anon()
            .map_err(|source| PoolError::Map { bytes, source })?;
        prefault(&mut map);
        let base = NonNull::new(map.as_mut_ptr()).ok_or(PoolError::Size(bytes))?;
        let mut free = FreeList::default();
        free.give(0, len);
        Ok(Pool {
            inner: Arc::new(Inner {
                _map: map,
                base,
                len,
                free: Mutex::new(free),
                misses: AtomicU64::new(0),
                min_payload,
            }),
        })
    }

    fn free_list(&self) -> MutexGuard<'_, FreeList> {
        self.inner.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pool's size in bytes.
    pub fn capacity(&self) -> usize {
        self.inner.len
    }

    /// Bytes not drawn now.
    pub fn free_bytes(&self) -> usize {
        self.free_list().free
    }

    /// Payloads that could not draw from the pool (too large, or the pool too full) and went to
    /// fresh memory.
    pub fn misses(&self) -> u64 {
        self.inner.misses.load(Ordering::Relaxed)
    }

    /// The whole pool as one range of memory: what a transport that registers memory with its
    /// hardware registers, once. Every buffer drawn from the pool lies inside it.
    pub fn memory(&self) -> (NonNull<u8>, usize) {
        (self.inner.base, self.inner.len)
    }

    /// Where `bytes` starts inside [`memory`](Self::memory), if it was drawn from this pool.
    pub fn offset_of(&self, bytes: &[u8]) -> Option<usize> {
        let offset = (bytes.as_ptr() as usize).checked_sub(self.inner.base.as_ptr() as usize)?;
        (offset.checked_add(bytes.len())? <= self.inner.len).then_some(offset)
    }

    /// A buffer of `len` bytes that the caller overwrites whole before reading any of it (it
    /// holds whatever the tensor before it left there), given back to the pool when its `Bytes`
    /// is dropped. `None` for a payload under the pool's minimum ([`POOL_MIN`] unless reserved
    /// otherwise), which is not the pool's to serve; a [`PoolMiss`], counted in
    /// [`misses`](Self::misses), where no free range holds it. Either way the caller allocates
    /// as usual.
    pub fn take(&self, len: usize) -> Result<Option<Bytes>, PoolMiss> {
        if len < self.inner.min_payload {
            return Ok(None);
        }
        let (offset, cap) = {
            let mut free = self.free_list();
            let taken = len
                .max(1)
                .checked_next_multiple_of(GRANULE)
                .and_then(|cap| Some((free.take(cap)?, cap)));
            let Some(taken) = taken else {
                self.inner.misses.fetch_add(1, Ordering::Relaxed);
                return Err(PoolMiss {
                    wanted: len,
                    free: free.free,
                    largest_free: free.largest(),
                });
            };
            taken
        };
        let controller = RangeController {
            owner: PoolLease {
                pool: self.inner.clone(),
                offset,
                cap,
            },
            offset,
            len: cap,
        };
        // SAFETY: every byte of the pool was written when it was reserved (zeroed pages) and
        // stays initialized; the range `[offset, offset + cap)` lies inside it, and `len <= cap`.
        Ok(Some(unsafe {
            Bytes::from_controller(Box::new(controller), len)
        }))
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("capacity", &self.capacity())
            .field("free", &self.free_bytes())
            .finish()
    }
}

/// Advises huge pages, then faults in every page for writing (`MADV_POPULATE_WRITE` where the
/// kernel has it, Linux 5.14, else a write per page).
fn prefault(map: &mut MmapMut) {
    #[cfg(target_os = "linux")]
    {
        let _ = map.advise(memmap2::Advice::HugePage);
        if map.advise(memmap2::Advice::PopulateWrite).is_ok() {
            return;
        }
    }
    const PAGE: usize = 4096;
    for offset in (0..map.len()).step_by(PAGE) {
        // A volatile write: the compiler cannot know that the page is already zero and skip it.
        // SAFETY: `offset` is inside the mapping, which is writable and borrowed mutably here.
        unsafe { map.as_mut_ptr().add(offset).write_volatile(0) };
    }
}

/// One buffer drawn from the pool, `[offset, offset + cap)`: gives it back to the free list when
/// dropped (with the `Bytes` that owns it).
struct PoolLease {
    pool: Arc<Inner>,
    offset: usize,
    cap: usize,
}

impl Drop for PoolLease {
    fn drop(&mut self) {
        self.pool
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .give(self.offset, self.cap);
    }
}

impl RangeOwner for PoolLease {
    fn base(&self) -> NonNull<u8> {
        self.pool.base
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_carved_disjoint_and_all_come_back() {
        let pool = Pool::reserve(8 * POOL_MIN).unwrap();
        assert_eq!(pool.capacity(), 8 * POOL_MIN);
        assert_eq!(pool.free_bytes(), pool.capacity());
        let mut a = pool.take(3 * POOL_MIN).unwrap().unwrap();
        let mut b = pool.take(2 * POOL_MIN + 1).unwrap().unwrap();
        assert_eq!(a.len(), 3 * POOL_MIN);
        assert_eq!(b.len(), 2 * POOL_MIN + 1);
        a.fill(1);
        b.fill(2);
        assert!(a.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2));
        let (oa, ob) = (pool.offset_of(&a).unwrap(), pool.offset_of(&b).unwrap());
        assert!(oa + a.len() <= ob || ob + b.len() <= oa, "disjoint");
        assert_eq!(oa % GRANULE, 0);
        assert_eq!(ob % GRANULE, 0);
        assert_eq!(
            pool.free_bytes(),
            8 * POOL_MIN - 5 * POOL_MIN - GRANULE,
            "b rounds up to a granule"
        );
        // Too large for what is left: a miss that says what was free, counted.
        let miss = pool.take(4 * POOL_MIN).unwrap_err();
        assert_eq!(miss.wanted, 4 * POOL_MIN);
        assert_eq!(miss.largest_free, 3 * POOL_MIN - GRANULE);
        assert_eq!(pool.misses(), 1);
        // Small payloads never draw (and are not misses).
        assert!(matches!(pool.take(POOL_MIN - 1), Ok(None)));
        assert_eq!(pool.misses(), 1);
        drop(a);
        // The freed range and the tail merge with a middle hole only once b goes too.
        drop(b);
        assert_eq!(pool.free_bytes(), pool.capacity());
        let whole = pool.take(8 * POOL_MIN).unwrap().unwrap();
        assert_eq!(
            pool.offset_of(&whole),
            Some(0),
            "coalesced back into one range"
        );
        assert!(pool.offset_of(&[0u8; 16]).is_none());
    }

    #[test]
    fn a_buffer_outlives_the_pool_handle() {
        let pool = Pool::reserve(POOL_MIN).unwrap();
        let mut buf = pool.take(POOL_MIN).unwrap().unwrap();
        drop(pool);
        buf[POOL_MIN - 1] = 7;
        assert_eq!(buf[POOL_MIN - 1], 7);
    }

    #[test]
    fn a_random_history_of_takes_and_drops_keeps_every_byte_in_one_place() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(14);
        let pool = Pool::reserve(64 * POOL_MIN).unwrap();
        let mut live: Vec<(u8, Bytes)> = Vec::new();
        for step in 0..2000u32 {
            if rng.random_bool(0.55) {
                let len = rng.random_range(POOL_MIN..8 * POOL_MIN);
                if let Ok(Some(mut buf)) = pool.take(len) {
                    let mark = (step % 251) as u8;
                    buf.fill(mark);
                    live.push((mark, buf));
                }
            } else if !live.is_empty() {
                let (mark, buf) = live.swap_remove(rng.random_range(0..live.len()));
                assert!(buf.iter().all(|&x| x == mark), "a buffer was overwritten");
            }
            let drawn: usize = live
                .iter()
                .map(|(_, b)| b.len().next_multiple_of(GRANULE))
                .sum();
            assert_eq!(pool.free_bytes() + drawn, pool.capacity());
        }
        live.clear();
        assert_eq!(pool.free_bytes(), pool.capacity());
        assert_eq!(
            pool.take(64 * POOL_MIN).map(|b| b.map(|b| b.len())),
            Ok(Some(64 * POOL_MIN))
        );
    }

    #[test]
    fn a_pool_under_the_minimum_is_refused() {
        assert!(matches!(Pool::reserve(0), Err(PoolError::Size(0))));
    }
}
