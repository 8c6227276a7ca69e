//! The receive pool: memory a node makes ready (touched) before the tensors arrive, from which
//! large receives draw their buffers and to which a freed tensor's buffer goes back.
//!
//! Why: a tensor that arrives into new memory pays the kernel a page fault and the zeroing of
//! every page, more than the network copy into it (measured in issue 14: 77% of a cold pull's
//! target CPU in `clear_page_erms`). A pool pays that before the tensor arrives, so the first
//! pull of a model to a fresh worker runs as fast as the steady state.
//!
//! The pool is one anonymous mapping carved best-fit in [`GRANULE`] steps (huge pages advised
//! for a fixed pool only: see [`Pool::elastic`]). One mapping, not many blocks, so that a later transport that must
//! register memory with its hardware (RDMA, GPU direct) registers [`Pool::memory`] once and
//! names a buffer by its [`Pool::offset_of`].
//!
//! Two kinds: a fixed pool ([`Pool::reserve`], `--pool SIZE`) touches all of it at once; an
//! elastic pool ([`Pool::elastic`], a node's default) reserves its capacity as address space
//! only, and a background thread keeps [`Readiness::idle`] bytes ready while nothing arrives,
//! and [`Readiness::ahead`] bytes ready beyond what is drawn while tensors do (touching the
//! next untouched range as the ready ones fill, a write per page), then, once nothing was drawn
//! for [`Readiness::idle_after`], gives the ready bytes above the idle amount back to the
//! kernel (`MADV_DONTNEED`). From its start until its first take or arrival it keeps
//! [`Readiness::at_start`] ready instead of the idle amount (a fresh node's model), made once.
//! The thread that touches runs on the CPU time [`Readiness::touching`] says (a node's: idle
//! time only); a second thread gives ready bytes back, at normal priority, so that a machine
//! busy everywhere, where the first may never run, still gets them back.
//! Where the memory the pool serves is bounded (a device budget, [`Pool::bound_ready_by`]), it
//! makes no more ready than that bound has room for, and gives back what is above it once no
//! receive is arriving: no receive could draw it. A payload that finds no ready range big
//! enough is not the elastic pool's to serve: it goes to new memory as without a pool (which
//! gets huge pages where the pool's untouched memory would fault page by page), and is no miss.
//!
//! Invariant: every byte of the mapping is in exactly one place: the ready free list, the
//! untouched free list, one live buffer, or a background thread's hands while it touches or
//! releases it; a buffer goes back to the ready list when its `Bytes` is dropped, whatever path
//! it took (registered tensor, failed receive, deleted tensor). `free_bytes() == capacity()`
//! once nothing drawn from the pool is alive and the threads hold nothing. Resident memory is at
//! most what is drawn plus what is ready (plus the range being touched).
//!
//! Here: the pool and its buffers. Beside it: the free lists (`free_list`), what an elastic
//! pool keeps ready (`readiness`), what its threads decide to do next (`policy`, pure), and the
//! threads that do it (`keeper`).

mod free_list;
mod keeper;
mod policy;
mod readiness;
#[cfg(test)]
mod tests;

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn_std::Bytes;
use memmap2::MmapMut;

use crate::host::{RangeController, RangeOwner};
use free_list::{Free, FreeList};
use keeper::{keep_ready, populate};
use policy::Keeper;
pub use readiness::{AtStart, BUSY_SPELL, Readiness, ReadyBound, SpareCheck, Touching};

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
/// last buffer drawn from it are gone (and an elastic pool's threads have seen it).
pub struct Pool {
    inner: Arc<Inner>,
}

impl Clone for Pool {
    fn clone(&self) -> Self {
        self.inner.handles.fetch_add(1, Ordering::Relaxed);
        Pool {
            inner: self.inner.clone(),
        }
    }
}

struct Inner {
    /// Owns the mapping; every access goes through `base` and the ranges the free lists hand
    /// out, and the background thread's advice on ranges it holds, never otherwise.
    map: MmapMut,
    base: NonNull<u8>,
    len: usize,
    free: Mutex<Free>,
    /// Wakes the background threads of an elastic pool (a take, a pool dropped).
    wake: Condvar,
    /// Pool handles and buffers drawn alive: an elastic pool's threads end once there are none
    /// (they hold the pool themselves meanwhile, so its count of owners cannot tell).
    handles: std::sync::atomic::AtomicUsize,
    misses: AtomicU64,
    /// Whether anything was drawn or arrived yet (once true, [`Pool::note_arrival`] is a load).
    arrived: std::sync::atomic::AtomicBool,
    /// Payloads under this size do not draw.
    min_payload: usize,
    /// An elastic pool (served from ready memory only, no misses).
    elastic: bool,
    /// What bounds its ready memory beyond its own targets, once set.
    bound: std::sync::OnceLock<Arc<dyn ReadyBound>>,
}

// SAFETY: `base` points into `map`, which `Inner` owns for its whole life; the bytes behind it
// are only reached through disjoint ranges, each owned by one buffer, or by the free lists
// (which nobody reads through), or by one of the pool's threads while it touches or releases a
// range it took out of them; so sharing `Inner` between threads shares no byte.
unsafe impl Send for Inner {}
// SAFETY: as above; the free list is behind a mutex.
unsafe impl Sync for Inner {}

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
        Self::map(bytes, min_payload, None)
    }

    /// An elastic pool of at most `capacity` bytes (rounded up to [`GRANULE`]), reserved as
    /// address space only: a background thread keeps `readiness` of it ready (see the module's
    /// description), starting now. Payloads from [`POOL_MIN`] up draw from it.
    pub fn elastic(capacity: usize, readiness: Readiness) -> Result<Pool, PoolError> {
        let pool = Self::map(capacity, POOL_MIN, Some(readiness))?;
        // Whole granules, within the pool: every range the thread takes is one.
        let granules = |bytes: usize| {
            bytes
                .checked_next_multiple_of(GRANULE)
                .unwrap_or(usize::MAX)
                .min(pool.inner.len)
        };
        let readiness = Readiness {
            idle: granules(readiness.idle),
            ahead: granules(readiness.ahead),
            idle_after: readiness.idle_after.max(Duration::from_millis(1)),
            touching: readiness.touching,
            at_start: AtStart {
                bytes: granules(readiness.at_start.bytes.max(readiness.idle)),
                ..readiness.at_start
            },
        };
        let started = Instant::now();
        let toucher = match readiness.touching {
            Touching::InIdleTime => "ferry-pool-idle",
            Touching::AlongsideOthers => "ferry-pool",
        };
        for (keeper, name) in [
            (Keeper::Toucher, toucher),
            (Keeper::Releaser, "ferry-pool-back"),
        ] {
            let weak = Arc::downgrade(&pool.inner);
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || keep_ready(weak, readiness, keeper, started))
                .map_err(|source| PoolError::Map {
                    bytes: capacity,
                    source,
                })?;
        }
        Ok(pool)
    }

    fn map(
        bytes: usize,
        min_payload: usize,
        readiness: Option<Readiness>,
    ) -> Result<Pool, PoolError> {
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
        let mut free = Free {
            ready: FreeList::default(),
            untouched: FreeList::default(),
            touching: 0,
            releasing: 0,
            last_take: None,
        };
        let base = NonNull::new(map.as_mut_ptr()).ok_or(PoolError::Size(bytes))?;
        match readiness {
            // A fixed pool: huge pages advised, every page faulted in now.
            None => {
                #[cfg(target_os = "linux")]
                let _ = map.advise(memmap2::Advice::HugePage);
                // SAFETY: `base` is `map`'s first byte, `[0, len)` is all of it, and the pool is
                // not shared yet.
                unsafe { populate(&map, base, 0, len) };
                free.ready.give(0, len);
            }
            // No huge-page advice: where the kernel defragments only advised memory (a common
            // default), every advised huge page can stall in compaction on a busy machine, and
            // an elastic pool touches while tensors arrive.
            Some(_) => free.untouched.give(0, len),
        }
        Ok(Pool {
            inner: Arc::new(Inner {
                map,
                base,
                len,
                free: Mutex::new(free),
                wake: Condvar::new(),
                handles: std::sync::atomic::AtomicUsize::new(1),
                misses: AtomicU64::new(0),
                arrived: std::sync::atomic::AtomicBool::new(false),
                min_payload,
                elastic: readiness.is_some(),
                bound: std::sync::OnceLock::new(),
            }),
        })
    }

    fn free_list(&self) -> MutexGuard<'_, Free> {
        lock(&self.inner)
    }

    /// The pool's size in bytes.
    pub fn capacity(&self) -> usize {
        self.inner.len
    }

    /// Bytes not drawn now (ready or not, and those the background threads hold).
    pub fn free_bytes(&self) -> usize {
        let free = self.free_list();
        free.ready.free + free.untouched.free + free.touching + free.releasing
    }

    /// Bytes not drawn and ready (touched): what a receive can draw with no page fault.
    pub fn ready_bytes(&self) -> usize {
        self.free_list().ready.free
    }

    /// Bounds an elastic pool's ready memory by `bound`'s room, from now on: its threads make
    /// no more ready than the room, and give ready bytes above it back as soon as no receive
    /// is arriving (within [`BUSY_SPELL`] of the last). Set once: a later call, or one on a
    /// fixed pool (all of it ready for good), does nothing and returns false.
    pub fn bound_ready_by(&self, bound: Arc<dyn ReadyBound>) -> bool {
        let set = self.inner.elastic && self.inner.bound.set(bound).is_ok();
        // Under the lock: the threads either wait already, and wake, or have yet to look.
        let _free = self.free_list();
        self.inner.wake.notify_all();
        set
    }

    /// Counts a tensor that arrived without drawing from the pool (under its minimum, or in
    /// shared memory) as a take: the start amount's time ends with it, as with a take, and what
    /// is left of that amount goes back after [`Readiness::idle_after`] without another. A node
    /// calls it for every tensor it receives; after the first it costs one atomic load.
    pub fn note_arrival(&self) {
        if self.inner.arrived.load(Ordering::Relaxed) {
            return;
        }
        let mut free = self.free_list();
        self.inner.arrived.store(true, Ordering::Relaxed);
        if free.last_take.is_none() {
            free.last_take = Some(Instant::now());
            self.inner.wake.notify_all();
        }
    }

    /// Payloads that could not draw from the pool (too large, or the pool too full) and went to
    /// fresh memory.
    pub fn misses(&self) -> u64 {
        self.inner.misses.load(Ordering::Relaxed)
    }

    /// The whole pool as one range of memory: what a transport that registers memory with its
    /// hardware registers, once. Every buffer drawn from the pool lies inside it. (An elastic
    /// pool gives free ranges back to the kernel: such a transport would pin them, or use a
    /// fixed pool.)
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
    /// otherwise), or one no ready range of an elastic pool holds, which is not the pool's to
    /// serve; a [`PoolMiss`], counted in [`misses`](Self::misses), where no free range of a
    /// fixed pool holds it. Either way the caller allocates as usual.
    pub fn take(&self, len: usize) -> Result<Option<Bytes>, PoolMiss> {
        if len < self.inner.min_payload {
            return Ok(None);
        }
        let (offset, cap) = {
            let mut free = self.free_list();
            free.last_take = Some(Instant::now());
            self.inner.arrived.store(true, Ordering::Relaxed);
            // Ready memory only: a fixed pool is all ready; an elastic pool's untouched memory
            // would fault page by page, slower than new memory.
            let taken = len
                .max(1)
                .checked_next_multiple_of(GRANULE)
                .and_then(|cap| Some((free.ready.take(cap)?, cap)));
            // The background threads top the ready bytes up (a fixed pool has none).
            self.inner.wake.notify_all();
            let Some(taken) = taken else {
                if self.inner.elastic {
                    return Ok(None);
                }
                self.inner.misses.fetch_add(1, Ordering::Relaxed);
                return Err(PoolMiss {
                    wanted: len,
                    free: free.ready.free + free.untouched.free,
                    largest_free: free.ready.largest().max(free.untouched.largest()),
                });
            };
            taken
        };
        self.inner.handles.fetch_add(1, Ordering::Relaxed);
        let controller = RangeController {
            owner: PoolLease {
                pool: self.inner.clone(),
                offset,
                cap,
            },
            offset,
            len: cap,
        };
        // SAFETY: every byte of the pool is initialized: an anonymous mapping reads as zero
        // pages until written, and a range given back to the kernel (`MADV_DONTNEED`) reads as
        // zero pages again; the range `[offset, offset + cap)` lies inside it, was taken out of
        // a free list (no buffer and not the pool's thread holds it), and `len <= cap`.
        Ok(Some(unsafe {
            Bytes::from_controller(Box::new(controller), len)
        }))
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let left = self.inner.handles.fetch_sub(1, Ordering::AcqRel) - 1;
        if left == 0 {
            // An elastic pool's threads end once nothing holds the pool: under the lock, so
            // that a thread about to wait sees the count or is woken.
            let _free = lock(&self.inner);
            self.inner.wake.notify_all();
        }
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

/// One buffer drawn from the pool, `[offset, offset + cap)`: gives it back to the free list when
/// dropped (with the `Bytes` that owns it).
struct PoolLease {
    pool: Arc<Inner>,
    offset: usize,
    cap: usize,
}

impl Drop for PoolLease {
    fn drop(&mut self) {
        // Written by its tensor: ready for the next.
        let mut free = lock(&self.pool);
        free.ready.give(self.offset, self.cap);
        if self.pool.handles.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The pool's last handle went before this buffer: its threads may end now.
            self.pool.wake.notify_all();
        }
    }
}

fn lock(inner: &Inner) -> MutexGuard<'_, Free> {
    inner.free.lock().unwrap_or_else(|e| e.into_inner())
}

impl RangeOwner for PoolLease {
    fn base(&self) -> NonNull<u8> {
        self.pool.base
    }
}
