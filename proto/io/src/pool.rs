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

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

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

/// How much of an elastic pool is kept ready (touched), and when it is given back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Readiness {
    /// Bytes kept ready while nothing arrives (in the background; from start until the first
    /// take, [`Readiness::at_start`] if larger).
    pub idle: usize,
    /// Bytes kept ready beyond those drawn while tensors arrive (a take was made within the
    /// last [`BUSY_SPELL`]): the next ranges, touched beside the receives. Small: what is
    /// touched ahead when the last tensor has come is touched for nothing.
    pub ahead: usize,
    /// How long without a take before ready bytes above `idle` go back to the kernel.
    pub idle_after: Duration,
    /// Which CPU time the pool's thread touches memory in.
    pub touching: Touching,
    /// What is kept ready from the pool's start until its first take or arrival.
    pub at_start: AtStart,
}

/// Memory an elastic pool makes ready at its start for the first tensors it serves: a freshly
/// started node's first tensors are most often a whole model, which then lands in ready memory
/// with no page faulted while it arrives. Drawn once: from the first take (or arrival,
/// [`Pool::note_arrival`]) on, the pool keeps its idle amount again (what is left above it goes
/// back after [`Readiness::idle_after`] without a take), and so it does once
/// [`kept_for`](AtStart::kept_for) has passed without a take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtStart {
    /// Bytes kept ready until the first take or arrival (never fewer than [`Readiness::idle`]).
    pub bytes: usize,
    /// How long they are kept without a take.
    pub kept_for: Duration,
    /// Whether the machine must have memory to spare for those above the idle amount.
    pub spare: SpareCheck,
}

impl AtStart {
    /// Nothing beyond the idle amount.
    pub const IDLE: AtStart = AtStart {
        bytes: 0,
        kept_for: Duration::ZERO,
        spare: SpareCheck::Unchecked,
    };
}

/// What an elastic pool asks of the machine before it makes its start amount ready beyond its
/// idle amount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpareCheck {
    /// Each range above the idle amount is made ready only while at least half of the machine's
    /// memory, and of every cgroup limit over the process, is available
    /// ([`crate::spare_memory`]); what was made ready is kept. A node's choice: nodes started
    /// together, or beside other work, stop at half the machine between them.
    HalfFree,
    /// Whatever the machine has (the pool's own tests).
    Unchecked,
}

/// Which CPU time an elastic pool's thread touches memory in (the one that gives memory back runs
/// at normal priority whatever this says).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Touching {
    /// Only time no other thread of the machine wants (Linux `SCHED_IDLE`; elsewhere, or where
    /// the kernel refuses, as any thread): a node's choice. Touching ahead is work a receive
    /// would otherwise do itself, never worth a core taken from a receive, a send or a hash
    /// under way: at normal priority a copy's source node refilled its pool beside the send and
    /// spent 2.03-2.39 s of CPU on a 2.3 GiB copy that took 1.77-1.96 s, against 1.43-1.50 s
    /// and 1.44-1.50 s in idle time (docs/benchmarks.md, `model_load`). On a machine
    /// busy everywhere the thread waits, and a receive that finds nothing ready faults its own
    /// pages, as without a pool.
    InIdleTime,
    /// As any other thread: for a pool whose ready memory is wanted within a bounded time
    /// whatever else runs (the tests of its targets, on a machine their neighbours keep busy).
    AlongsideOthers,
}

/// What bounds the receives an elastic pool serves beyond its own capacity (a device budget):
/// ready memory above [`room`](ReadyBound::room) could never be drawn, so it is not kept.
pub trait ReadyBound: Send + Sync {
    /// The most bytes receives may still draw now. Called by the pool's thread, often, with
    /// the pool's free list locked: cheap, and never calling into the pool.
    fn room(&self) -> usize;
}

/// How often an elastic pool bounded by a [`ReadyBound`] looks at its room while nothing else
/// wakes it (a budget fills as tensors land in new memory too, which the pool does not see).
const BOUND_POLL: Duration = Duration::from_millis(200);

/// How often a pool whose start amount the machine had no memory to spare for asks again.
const SPARE_POLL: Duration = Duration::from_secs(1);

/// How recent a take must be for tensors to count as arriving.
pub const BUSY_SPELL: Duration = Duration::from_millis(250);

/// The ranges the background thread touches or releases at a time: small enough that a
/// receive finds the next one ready soon, large enough for huge pages and few system calls.
const STEP: usize = 32 << 20;

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

/// The free ranges: ready (touched) and untouched, and when a buffer was last drawn.
#[derive(Debug)]
struct Free {
    ready: FreeList,
    untouched: FreeList,
    /// Bytes the touching thread took out of the untouched list, not yet listed ready.
    touching: usize,
    /// Bytes the releasing thread took out of the ready list, not yet listed untouched.
    releasing: usize,
    last_take: Option<Instant>,
}

// SAFETY: `base` points into `map`, which `Inner` owns for its whole life; the bytes behind it
// are only reached through disjoint ranges, each owned by one buffer, or by the free lists
// (which nobody reads through), or by one of the pool's threads while it touches or releases a
// range it took out of them; so sharing `Inner` between threads shares no byte.
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
        // Whole granules only: a range edge inside a page would let advice on a free range
        // (which the kernel applies to whole pages) reach a neighbouring buffer.
        debug_assert!(offset.is_multiple_of(GRANULE) && len.is_multiple_of(GRANULE));
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

    /// Up to `len` bytes (granule multiples) from the start of the lowest free range, or from
    /// the end of the highest: `(offset, bytes)`.
    fn take_piece(&mut self, len: usize, side: Side) -> Option<(usize, usize)> {
        debug_assert_eq!(len % GRANULE, 0);
        if len == 0 {
            return None;
        }
        let (&offset, &range) = match side {
            Side::Lowest => self.ranges.iter().next()?,
            Side::Highest => self.ranges.iter().next_back()?,
        };
        let piece = range.min(len);
        self.ranges.remove(&offset);
        self.free -= piece;
        let (taken, rest) = match side {
            Side::Lowest => (offset, offset + piece),
            Side::Highest => (offset + range - piece, offset),
        };
        if range > piece {
            self.ranges.insert(rest, range - piece);
        }
        Some((taken, piece))
    }
}

/// Which end of a free list the background thread takes a piece from: it touches upward from
/// the lowest untouched range and releases downward from the highest ready one, so that ready
/// memory gathers at the mapping's start.
#[derive(Clone, Copy)]
enum Side {
    Lowest,
    Highest,
}

/// Which of an elastic pool's two threads: each decides from the same targets, and does only
/// its own half.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keeper {
    /// Touches untouched ranges to make them ready, in the CPU time [`Readiness::touching`]
    /// says.
    Toucher,
    /// Gives ready ranges above the targets back to the kernel, at normal priority: memory the
    /// node does not need goes back even while the machine is too busy for the toucher to run.
    Releaser,
}

/// What a background thread does next, with the range it took out of a free list.
enum Job {
    /// Touch an untouched range, then list it ready.
    Touch(usize, usize),
    /// Nothing: ask the machine for spare memory again before deciding.
    AskAgain,
    /// Give a ready range back to the kernel, then list it untouched.
    Release(usize, usize),
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

/// One of an elastic pool's background threads (`keeper` says which half it does): tops the
/// ready bytes up to the target (touching the lowest untouched range, a [`STEP`] at a time), or
/// gives ready bytes above the idle target back once nothing was drawn for a while (and above
/// the bound's room once nothing arrives); ends when the pool is gone. Both count the start
/// amount's time from `started`.
fn keep_ready(pool: Weak<Inner>, readiness: Readiness, keeper: Keeper, started: Instant) {
    if keeper == Keeper::Toucher && readiness.touching == Touching::InIdleTime {
        run_in_idle_time();
    }
    loop {
        let Some(inner) = pool.upgrade() else {
            return;
        };
        if inner.handles.load(Ordering::Acquire) == 0 {
            return;
        }
        // Whether the machine has memory to spare for the start amount, asked before the lock
        // (a few file reads), while the start amount may still be made: within its time and
        // before anything was drawn or arrived (after which the answer is not used).
        // (Only the toucher makes anything: the releaser never asks.)
        let spare = keeper == Keeper::Releaser
            || readiness.at_start.spare == SpareCheck::Unchecked
            || started.elapsed() >= readiness.at_start.kept_for
            || inner.arrived.load(Ordering::Relaxed)
            || machine_has_spare_memory();
        let job = {
            let mut free = inner.free.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                // The most ready bytes worth keeping: the bound's room, up to a whole granule (a
                // receive that fills the room takes whole granules).
                let room = inner.bound.get().map_or(usize::MAX, |b| {
                    b.room()
                        .checked_next_multiple_of(GRANULE)
                        .unwrap_or(usize::MAX)
                });
                let since = free.last_take.map(|at| at.elapsed());
                // Nothing drawn yet, within the start's time: the start amount.
                let start_left = since
                    .is_none()
                    .then(|| readiness.at_start.kept_for.checked_sub(started.elapsed()))
                    .flatten()
                    .filter(|left| !left.is_zero());
                let at_rest = match start_left {
                    Some(_) => readiness.at_start.bytes,
                    None => readiness.idle,
                };
                // Above the idle amount, the start amount is made only with memory to spare
                // (what was made is kept: `keep` below).
                let to_make = if spare {
                    at_rest
                } else {
                    at_rest.min(readiness.idle)
                };
                // Arriving: only the next ranges; between arrivals: the idle amount (at start,
                // the start amount), in idle time; long idle: nothing above it kept.
                let busy = since.is_some_and(|s| s < BUSY_SPELL);
                let idle = !busy && since.is_none_or(|s| s >= readiness.idle_after);
                // Something left to make that spare memory would allow: ask again after the wait.
                let short_of_spare = keeper == Keeper::Toucher
                    && to_make < at_rest
                    && free.ready.free < at_rest.min(room);
                // A yes is asked again after a wait too: it may be old by then.
                let ask_again = short_of_spare
                    || (keeper == Keeper::Toucher
                        && spare
                        && start_left.is_some()
                        && readiness.at_start.spare == SpareCheck::HalfFree
                        && at_rest > readiness.idle);
                let target = if busy { readiness.ahead } else { to_make }.min(room);
                if keeper == Keeper::Toucher && free.ready.free < target {
                    let want = (target - free.ready.free).min(STEP);
                    let want = want.next_multiple_of(GRANULE);
                    if let Some((offset, len)) = free.untouched.take_piece(want, Side::Lowest) {
                        free.touching = len;
                        break Job::Touch(offset, len);
                    }
                }
                // Kept: the idle amount (at start, the start amount) once idle, and no more than
                // the room once no receive is arriving. (Not while one is: a receive admitted
                // by its budget, whose room no longer counts it, may be about to draw the very
                // range.)
                let keep = if idle {
                    at_rest.min(room)
                } else if busy {
                    usize::MAX
                } else {
                    room
                };
                // (Never below the target the toucher makes: `keep` is at least it.)
                if keeper == Keeper::Releaser && free.ready.free > keep {
                    let excess = (free.ready.free - keep) / GRANULE * GRANULE;
                    if let Some((offset, len)) =
                        free.ready.take_piece(excess.min(STEP), Side::Highest)
                    {
                        free.releasing = len;
                        break Job::Release(offset, len);
                    }
                }
                // Nothing to do until a take, or until the busy spell or the idle wait ends; a
                // pool dropped meanwhile wakes it (its last buffer's drop: within the timeout).
                let wait = match since {
                    Some(since) if busy => BUSY_SPELL.saturating_sub(since),
                    Some(since) if !idle => readiness.idle_after.saturating_sub(since),
                    _ => Duration::from_secs(10),
                }
                .min(if inner.bound.get().is_some() {
                    BOUND_POLL
                } else {
                    Duration::MAX
                })
                .min(start_left.unwrap_or(Duration::MAX))
                .min(if short_of_spare {
                    SPARE_POLL
                } else {
                    Duration::MAX
                })
                .max(Duration::from_millis(1));
                // Under the lock: the last handle's drop either came before (seen here) or
                // notifies after this wait began.
                if inner.handles.load(Ordering::Acquire) == 0 {
                    return;
                }
                free = inner
                    .wake
                    .wait_timeout(free, wait)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                if inner.handles.load(Ordering::Acquire) == 0 {
                    return;
                }
                // Ask the machine again, outside the lock.
                if ask_again {
                    break Job::AskAgain;
                }
            }
        };
        match job {
            Job::AskAgain => {}
            Job::Touch(offset, len) => {
                // SAFETY: `[offset, offset + len)` lies inside the mapping `inner.base` points at
                // (writable, and `base` was taken from it with write access), and this thread
                // took it out of the untouched list: no buffer holds it, nobody reads it.
                unsafe { touch_by_writes(inner.base, offset, len) };
                let mut free = lock(&inner);
                free.ready.give(offset, len);
                free.touching = 0;
                // Things may have changed while it touched (the busy spell, the start amount's
                // time over): the releaser looks again now, not at its next timeout.
                inner.wake.notify_all();
            }
            Job::Release(offset, len) => {
                // SAFETY: `[offset, offset + len)` lies inside the mapping and was taken out of
                // the ready list above: no buffer holds it and nobody reads it until it is
                // listed again. Its bytes become zero pages, still initialized.
                let released = unsafe {
                    inner.map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        offset,
                        len,
                    )
                };
                let mut free = lock(&inner);
                match released {
                    Ok(()) => free.untouched.give(offset, len),
                    Err(_) => free.ready.give(offset, len),
                }
                free.releasing = 0;
            }
        }
    }
}

/// Asks the kernel to run the calling thread on otherwise idle CPU time only (`SCHED_IDLE`,
/// [`Touching::InIdleTime`]). The thread's lock holds are a few list operations: a receive
/// blocked on one leaves its core idle, which is where the thread then runs. Best effort:
/// where refused, or off Linux, normal priority.
fn run_in_idle_time() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: a system call given a pointer to an initialized `sched_param` that outlives
        // it; pid 0 names the calling thread, so no other thread's scheduling changes.
        let refused = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0;
        if refused {
            tracing::debug!(
                "the receive pool's thread runs at normal priority: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// Whether the machine has memory to spare for a start amount ([`SpareCheck::HalfFree`]); the
/// pool's own tests set the answer instead.
fn machine_has_spare_memory() -> bool {
    #[cfg(test)]
    return tests::MACHINE_HAS_SPARE.load(Ordering::Relaxed);
    #[cfg(not(test))]
    crate::spare_memory::half_or_more_now()
}

fn lock(inner: &Inner) -> MutexGuard<'_, Free> {
    inner.free.lock().unwrap_or_else(|e| e.into_inner())
}

/// Faults in `[offset, offset + len)` of `map` (whose first byte `base` points at, with write
/// access) for writing, at once: `MADV_POPULATE_WRITE` where the kernel has it (Linux 5.14),
/// else a write per page. For a fixed pool at its reservation only: the kernel holds the
/// process's memory-map lock for the whole range meanwhile (see [`touch_by_writes`]).
///
/// # Safety
/// As [`touch_by_writes`]: `base` is `map`'s first byte, and the range lies inside `map` and
/// is the caller's alone.
unsafe fn populate(map: &MmapMut, base: NonNull<u8>, offset: usize, len: usize) {
    #[cfg(target_os = "linux")]
    if map
        .advise_range(memmap2::Advice::PopulateWrite, offset, len)
        .is_ok()
    {
        return;
    }
    // SAFETY: the caller's promise, passed on.
    unsafe { touch_by_writes(base, offset, len) };
}

/// Faults in `[offset, offset + len)` (inside the mapping `base` points at, with write access)
/// by writing one byte per page: how an elastic pool's thread touches while tensors arrive. Not
/// `MADV_POPULATE_WRITE`: that holds the process's memory-map lock for reading over the whole
/// range, and every `mmap` and `munmap` of the receiving threads (the allocator's large blocks)
/// queues behind it, then every fault behind them. A page fault takes only its mapping's own
/// lock (Linux 6.4 on). Measured: a 2.3 GiB model copied to a node with 256 MiB ready in
/// 6.5-6.7 s populating 32 MiB ranges, 4.2-4.4 s writing (docs/benchmarks.md, `model_load`).
///
/// # Safety
/// `base` points at a writable mapping (and carries write access to it) that holds
/// `[offset, offset + len)`, and nobody else reads or writes that range meanwhile (a range the
/// background thread took out of the untouched list, or a fixed pool's before it is shared).
unsafe fn touch_by_writes(base: NonNull<u8>, offset: usize, len: usize) {
    const PAGE: usize = 4096;
    for at in (offset..offset + len).step_by(PAGE) {
        // SAFETY: `at` is inside the range, which the caller promises lies in a writable
        // mapping `base` may write through and nobody else reaches meanwhile. A volatile write,
        // so that the compiler cannot skip a write of the zero the page already reads as.
        unsafe { base.as_ptr().add(at).write_volatile(0) };
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

    /// What [`machine_has_spare_memory`] answers in these tests (only one test asks it).
    pub(super) static MACHINE_HAS_SPARE: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(true);

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

    /// Waits (up to 10 s) until `done` holds of `pool`.
    fn until(pool: &Pool, what: &str, done: impl Fn(&Pool) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done(pool) {
            assert!(
                Instant::now() < deadline,
                "{what}: {pool:?}, ready {}",
                pool.ready_bytes()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn an_elastic_pool_is_ready_before_the_tensor_grows_as_it_fills_and_gives_back_when_idle() {
        const MIB: usize = 1 << 20;
        let readiness = Readiness {
            idle: 8 * MIB,
            ahead: 24 * MIB,
            idle_after: Duration::from_millis(300),
            touching: Touching::AlongsideOthers,
            at_start: AtStart::IDLE,
        };
        let pool = Pool::elastic(128 * MIB, readiness).unwrap();
        // Ready while nothing arrived: the idle amount, and no more.
        until(&pool, "ready at start", |p| p.ready_bytes() == 8 * MIB);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(pool.ready_bytes(), 8 * MIB);
        assert_eq!(pool.free_bytes(), pool.capacity());
        // A tensor arrives: drawn from ready memory, and more made ready ahead of it.
        let first = pool.take(6 * MIB).unwrap().unwrap();
        until(&pool, "ready ahead", |p| p.ready_bytes() >= 24 * MIB);
        let second = pool.take(20 * MIB).unwrap().unwrap();
        until(&pool, "ready ahead again", |p| p.ready_bytes() >= 24 * MIB);
        assert_eq!(pool.free_bytes() + 26 * MIB, pool.capacity());
        // Idle: given back down to the idle amount, the tensors kept.
        drop(first);
        until(&pool, "given back", |p| p.ready_bytes() == 8 * MIB);
        assert_eq!(pool.free_bytes() + 20 * MIB, pool.capacity());
        assert_eq!(second.len(), 20 * MIB);
        drop(second);
        until(&pool, "all free", |p| p.free_bytes() == p.capacity());
        // What no ready range holds is not the pool's to serve (new memory takes it), and is
        // no miss.
        assert!(matches!(pool.take(100 * MIB), Ok(None)));
        assert_eq!(pool.misses(), 0);
    }

    /// A bound's room caps the ready memory: none is made ready above it, and what is above it
    /// goes back to the kernel once no receive is arriving; as the room grows again, the idle
    /// amount is made ready again.
    #[test]
    fn an_elastic_pool_keeps_no_more_ready_than_its_bound_has_room_for() {
        const MIB: usize = 1 << 20;
        let readiness = Readiness {
            idle: 8 * MIB,
            ahead: 24 * MIB,
            // Never idle within the test: only the bound gives memory back.
            idle_after: Duration::from_secs(600),
            touching: Touching::AlongsideOthers,
            at_start: AtStart::IDLE,
        };
        let pool = Pool::elastic(128 * MIB, readiness).unwrap();
        until(&pool, "ready at start", |p| p.ready_bytes() == 8 * MIB);
        let room = Arc::new(Room((3 * MIB - 100).into()));
        assert!(pool.bound_ready_by(room.clone()));
        assert!(!pool.bound_ready_by(room.clone()), "set once");
        until(&pool, "given back to the room", |p| {
            p.ready_bytes() == 3 * MIB
        });
        // A receive, then none: ahead of it no more than the room, and within the room once the
        // receives stop.
        let drawn = pool.take(2 * MIB).unwrap().unwrap();
        room.0.store(MIB, Ordering::Relaxed);
        until(&pool, "within the room", |p| p.ready_bytes() == MIB);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(pool.ready_bytes(), MIB, "no more made ready than the room");
        // Room again (the tensor deleted): its buffer is ready, and the idle amount again.
        room.0.store(usize::MAX, Ordering::Relaxed);
        drop(drawn);
        until(&pool, "ready again", |p| p.ready_bytes() >= 8 * MIB);
        // A fixed pool is all ready for good: no bound applies.
        let fixed = Pool::reserve(4 * MIB).unwrap();
        assert!(!fixed.bound_ready_by(room));
    }

    /// A bound whose room a test sets.
    struct Room(std::sync::atomic::AtomicUsize);

    impl ReadyBound for Room {
        fn room(&self) -> usize {
            self.0.load(Ordering::Relaxed)
        }
    }

    /// A random history of takes and drops (seeded) racing the pool's thread, which touches and
    /// releases between them; where `room` is given, its room is set anew at every step. Every
    /// byte stays in one place (a buffer's marks survive, and free plus drawn is the capacity),
    /// and everything comes back at the end.
    fn race_against_its_thread(pool: &Pool, seed: u64, room: Option<&Room>) {
        use rand::{Rng, SeedableRng};
        const MIB: usize = 1 << 20;
        const PAGE: usize = 4096;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut live: Vec<(u8, Bytes)> = Vec::new();
        for step in 0..3000u32 {
            if let Some(room) = room {
                room.0
                    .store(rng.random_range(0..48 * MIB), Ordering::Relaxed);
            }
            if rng.random_bool(0.5) {
                let len = rng.random_range(POOL_MIN..6 * POOL_MIN);
                if let Ok(Some(mut buf)) = pool.take(len) {
                    // The first byte of every page: what the thread's touch writes and a
                    // release zeroes (buffers start page-aligned).
                    let mark = (step % 251) as u8 + 1;
                    buf.iter_mut().step_by(PAGE).for_each(|b| *b = mark);
                    live.push((mark, buf));
                }
            } else if !live.is_empty() {
                let (mark, buf) = live.swap_remove(rng.random_range(0..live.len()));
                let kept = buf.iter().step_by(PAGE).all(|&x| x == mark);
                assert!(kept, "a buffer was touched or released");
            }
            if step % 50 == 0 {
                // Let the thread touch and release between takes, as idle spells do.
                std::thread::sleep(Duration::from_millis(3));
            }
            let drawn: usize = live
                .iter()
                .map(|(_, b)| b.len().next_multiple_of(GRANULE))
                .sum();
            assert_eq!(pool.free_bytes() + drawn, pool.capacity());
        }
        for (mark, buf) in &live {
            let kept = buf.iter().step_by(PAGE).all(|x| x == mark);
            assert!(kept, "a buffer was touched or released");
        }
        live.clear();
        until(pool, "everything back", |p| p.free_bytes() == p.capacity());
    }

    fn racing_readiness() -> Readiness {
        const MIB: usize = 1 << 20;
        Readiness {
            idle: 4 * MIB,
            ahead: 16 * MIB,
            idle_after: Duration::from_millis(2),
            touching: Touching::AlongsideOthers,
            at_start: AtStart::IDLE,
        }
    }

    #[test]
    fn an_elastic_pool_racing_its_thread_keeps_every_byte_in_one_place() {
        let pool = Pool::elastic(64 << 20, racing_readiness()).unwrap();
        race_against_its_thread(&pool, 30, None);
        until(&pool, "idle again", |p| p.ready_bytes() == 4 << 20);
    }

    /// The same race with the bound's room shifting at every step (as budgets fill and empty):
    /// no byte is lost or shared, and once the room stays small the ready memory fits it.
    #[test]
    fn an_elastic_pool_racing_its_thread_under_a_shifting_bound_keeps_every_byte_in_one_place() {
        let pool = Pool::elastic(64 << 20, racing_readiness()).unwrap();
        let room = Arc::new(Room(usize::MAX.into()));
        assert!(pool.bound_ready_by(room.clone()));
        race_against_its_thread(&pool, 31, Some(&room));
        room.0.store(2 << 20, Ordering::Relaxed);
        until(&pool, "within the room", |p| p.ready_bytes() <= 2 << 20);
        room.0.store(usize::MAX, Ordering::Relaxed);
        until(&pool, "idle again", |p| p.ready_bytes() == 4 << 20);
    }

    /// A node's pool touches in idle time: its touching thread runs under `SCHED_IDLE`, and
    /// still makes its memory ready on a machine with time to spare; the one that gives memory
    /// back runs at normal priority.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_pool_touching_in_idle_time_runs_its_toucher_at_idle_priority_and_its_releaser_not() {
        let readiness = Readiness {
            idle: 4 << 20,
            ahead: 4 << 20,
            idle_after: Duration::from_secs(600),
            touching: Touching::InIdleTime,
            at_start: AtStart::IDLE,
        };
        let pool = Pool::elastic(16 << 20, readiness).unwrap();
        // The scheduling policy of each of this process's threads named `name` (field 41 of a
        // task's `stat`, counted from its pid; the name in parentheses before it may hold
        // spaces, so fields are counted after its closing one).
        let policies = |name: &str| -> Vec<i32> {
            std::fs::read_dir("/proc/self/task")
                .unwrap()
                .filter_map(|task| {
                    let dir = task.ok()?.path();
                    let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
                    (comm.trim_end() == name).then_some(())?;
                    let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
                    let (_, after_name) = stat.rsplit_once(')')?;
                    after_name.split_whitespace().nth(38)?.parse().ok()
                })
                .collect()
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let seen = policies("ferry-pool-idle");
            if !seen.is_empty() && seen.iter().all(|&p| p == libc::SCHED_IDLE) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "pool threads' policies: {seen:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // Every pool's releaser (this test's and its neighbours') at normal priority, once
        // this one's has named itself.
        loop {
            let releasers = policies("ferry-pool-back");
            assert!(
                releasers.iter().all(|&p| p == libc::SCHED_OTHER),
                "{releasers:?}"
            );
            if !releasers.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "no releaser thread");
            std::thread::sleep(Duration::from_millis(5));
        }
        until(&pool, "ready", |p| p.ready_bytes() == 4 << 20);
    }

    /// An elastic pool's threads work on while any handle or buffer is alive (a clone dropped
    /// ends nothing), and end, its memory unmapped, once the last handle and the last buffer
    /// are gone, whichever goes last.
    #[test]
    fn an_elastic_pool_is_freed_once_its_handles_and_buffers_are_gone() {
        for buffer_last in [false, true] {
            let pool = Pool::elastic(16 << 20, racing_readiness()).unwrap();
            drop(pool.clone());
            let clone = pool.clone();
            until(&pool, "ready", |p| p.ready_bytes() >= 4 << 20);
            let buffer = pool.take(4 << 20).unwrap().unwrap();
            // Still worked on: the toucher makes the idle amount ready again.
            until(&pool, "ready again", |p| p.ready_bytes() >= 4 << 20);
            let inner = Arc::downgrade(&pool.inner);
            if buffer_last {
                drop((pool, clone));
                drop(buffer);
            } else {
                drop(buffer);
                drop((pool, clone));
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while inner.upgrade().is_some() {
                assert!(Instant::now() < deadline, "the pool's threads kept it");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    fn starting(at_start: usize, kept_for: Duration) -> Readiness {
        const MIB: usize = 1 << 20;
        Readiness {
            idle: 4 * MIB,
            ahead: 8 * MIB,
            idle_after: Duration::from_millis(300),
            touching: Touching::AlongsideOthers,
            at_start: AtStart {
                bytes: at_start,
                kept_for,
                spare: SpareCheck::Unchecked,
            },
        }
    }

    /// A start amount that asks the machine makes no more than the idle amount while the
    /// machine has no memory to spare, asks again, and makes the rest once it has.
    #[test]
    fn an_elastic_pool_makes_its_start_amount_only_with_memory_to_spare() {
        const MIB: usize = 1 << 20;
        MACHINE_HAS_SPARE.store(false, Ordering::Relaxed);
        let mut readiness = starting(40 * MIB, Duration::from_secs(600));
        readiness.at_start.spare = SpareCheck::HalfFree;
        let pool = Pool::elastic(128 * MIB, readiness).unwrap();
        until(&pool, "the idle amount ready", |p| {
            p.ready_bytes() == 4 * MIB
        });
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(pool.ready_bytes(), 4 * MIB, "no more without spare memory");
        MACHINE_HAS_SPARE.store(true, Ordering::Relaxed);
        let asked = Instant::now();
        until(&pool, "the start amount ready", |p| {
            p.ready_bytes() == 40 * MIB
        });
        assert!(
            asked.elapsed() < SPARE_POLL * 5,
            "asked again within its poll"
        );
    }

    /// A freshly started pool keeps its start amount ready for the first tensors, draws it
    /// once, and then keeps its idle amount: what the first tensor left above it goes back, and
    /// the start amount is never made ready again.
    #[test]
    fn an_elastic_pool_keeps_its_start_amount_until_the_first_take_and_never_again() {
        const MIB: usize = 1 << 20;
        let pool = Pool::elastic(128 * MIB, starting(40 * MIB, Duration::from_secs(600))).unwrap();
        until(&pool, "the start amount ready", |p| {
            p.ready_bytes() == 40 * MIB
        });
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(pool.ready_bytes(), 40 * MIB, "kept while nothing is drawn");
        // The first tensor draws from it (the ahead amount is ready already: 16 MiB left).
        let first = pool.take(24 * MIB).unwrap().unwrap();
        until(&pool, "back to the idle amount", |p| {
            p.ready_bytes() == 4 * MIB
        });
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(
            pool.ready_bytes(),
            4 * MIB,
            "the start amount is not made again"
        );
        drop(first);
        until(&pool, "the freed tensor given back", |p| {
            p.ready_bytes() == 4 * MIB && p.free_bytes() == p.capacity()
        });
    }

    /// A tensor that arrived without drawing from the pool ends the start amount's time as a
    /// take does: what is left goes back after the idle wait, and is not made again.
    #[test]
    fn an_arrival_that_draws_nothing_ends_the_start_amount_as_a_take_does() {
        const MIB: usize = 1 << 20;
        let pool = Pool::elastic(128 * MIB, starting(40 * MIB, Duration::from_secs(600))).unwrap();
        until(&pool, "the start amount ready", |p| {
            p.ready_bytes() == 40 * MIB
        });
        pool.note_arrival();
        let noted = Instant::now();
        while pool.ready_bytes() != 4 * MIB {
            // Woken by the arrival, not by some later timeout: the idle wait (300 ms) after it.
            assert!(noted.elapsed() < Duration::from_secs(3));
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(
            pool.ready_bytes(),
            4 * MIB,
            "the start amount is not made again"
        );
    }

    /// A start amount nothing draws goes back once its time has passed: the idle amount stays.
    #[test]
    fn an_elastic_pool_gives_its_start_amount_back_when_no_tensor_came_in_time() {
        const MIB: usize = 1 << 20;
        let kept_for = Duration::from_secs(3);
        let pool = Pool::elastic(128 * MIB, starting(40 * MIB, kept_for)).unwrap();
        let started = Instant::now();
        until(&pool, "the start amount ready", |p| {
            p.ready_bytes() == 40 * MIB
        });
        while pool.ready_bytes() != 4 * MIB {
            // Given back when its time is up, not at some later wake-up.
            assert!(started.elapsed() < kept_for + Duration::from_secs(2));
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(pool.ready_bytes(), 4 * MIB);
    }

    #[test]
    fn an_elastic_pool_keeps_whole_granules_ready_whatever_size_it_is_asked() {
        let readiness = Readiness {
            idle: 10_000_000,
            ahead: 3_000_001,
            idle_after: Duration::ZERO,
            touching: Touching::AlongsideOthers,
            at_start: AtStart::IDLE,
        };
        let pool = Pool::elastic(64 << 20, readiness).unwrap();
        let rounded = 10_000_000usize.next_multiple_of(GRANULE);
        until(&pool, "ready", |p| p.ready_bytes() == rounded);
        let buffers: Vec<Bytes> = (0..6)
            .map(|i| pool.take(POOL_MIN + i * 4097).unwrap().unwrap())
            .collect();
        for buf in &buffers {
            assert_eq!(pool.offset_of(buf).unwrap() % GRANULE, 0);
        }
        drop(buffers);
        until(&pool, "back to the idle amount", |p| {
            p.ready_bytes() == rounded
        });
    }

    #[test]
    fn a_pool_under_the_minimum_is_refused() {
        assert!(matches!(Pool::reserve(0), Err(PoolError::Size(0))));
    }
}
