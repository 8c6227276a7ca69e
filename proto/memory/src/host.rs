//! Host memory: huge-page advice for large receive buffers, recycled receive buffers, and
//! `Bytes` backed by a memory mapping (a private copy-on-write mapping of a sealed shared-memory
//! region a peer passed over a Unix socket, so the receiver adopts the sender's pages instead of
//! copying them), or by one range of a larger memory (`RangeController`: a range of a mapped
//! file, `crate::mapped_file`, or of the receive pool).

use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn_std::Bytes;
use burn_std::bytes::{AccessError, AccessPolicy, AllocationController, AllocationProperty};
use memmap2::MmapMut;

/// Buffers at least this large get transparent huge pages advised: below it the allocator's
/// recycled, already-touched memory is the common case and the advice buys nothing.
pub const HUGE_PAGES_MIN: usize = 4 << 20;

/// Asks the kernel to back the untouched buffer `buf` with transparent huge pages where it
/// can. A fresh buffer's first-touch page faults (one per 4 KiB) cost more than the network
/// copy into it; with 2 MiB pages they nearly vanish. Advice only: ignored where the kernel
/// does not do it, never needed for correctness.
pub fn advise_huge_pages(buf: &[u8]) {
    const PAGE: usize = 4096;
    if buf.len() < HUGE_PAGES_MIN {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        let start = (buf.as_ptr() as usize).next_multiple_of(PAGE);
        let end = (buf.as_ptr() as usize + buf.len()) / PAGE * PAGE;
        if end > start {
            // SAFETY: the range lies inside `buf`, which the caller owns; MADV_HUGEPAGE changes
            // neither its contents nor its mapping, only how future faults are served.
            let _ = unsafe {
                rustix::mm::madvise(
                    start as *mut std::ffi::c_void,
                    end - start,
                    rustix::mm::Advice::LinuxHugepage,
                )
            };
        }
    }
}

/// Receive buffers at least this large are recycled (where recycling is on).
pub const RECYCLE_MIN: usize = 16 << 20;

/// The alignment of recycled buffers: 16 bytes, more than any element type needs, and no more
/// than `malloc` gives anyway: for a larger alignment the standard allocator zeroes a new buffer
/// with `memset` (touching every page, on the receive path) instead of getting zero pages from
/// `calloc`.
const RECYCLE_ALIGN: usize = 16;

/// A freed receive buffer, kept for the next receive of about its size.
struct Block {
    ptr: NonNull<u8>,
    cap: usize,
    freed: Instant,
}

// SAFETY: a block is plain memory nobody else refers to once it is in the pool.
unsafe impl Send for Block {}

impl Block {
    fn layout(cap: usize) -> Option<std::alloc::Layout> {
        std::alloc::Layout::from_size_align(cap, RECYCLE_ALIGN).ok()
    }

    fn free(self) {
        if let Some(layout) = Self::layout(self.cap) {
            // SAFETY: allocated with this layout in `receive_buffer`, freed once (the block is
            // consumed).
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// The freed receive buffers a process keeps, up to `limit` bytes.
struct Recycler {
    limit: usize,
    held: usize,
    blocks: Vec<Block>,
}

static RECYCLER: Mutex<Recycler> = Mutex::new(Recycler {
    limit: 0,
    held: 0,
    blocks: Vec::new(),
});

fn recycler() -> std::sync::MutexGuard<'static, Recycler> {
    RECYCLER.lock().unwrap_or_else(|e| e.into_inner())
}

/// Lets this process keep up to `bytes` of freed large receive buffers for reuse (0, the
/// default, keeps none). A new tensor's buffer costs the kernel a page fault and the zeroing of
/// every page, more than the network copy into it; a buffer freed by a tensor that was deleted
/// has its pages already, so a node that receives and drops tensors of similar sizes (one
/// activation after another) skips that cost. Kept buffers are resident memory no tensor holds:
/// [`trim_recycled`] gives back those unused for a while.
pub fn set_recycle_limit(bytes: usize) {
    let freed = {
        let mut pool = recycler();
        pool.limit = bytes;
        pool.shrink_to(bytes)
    };
    freed.into_iter().for_each(Block::free);
}

/// Bytes of freed receive buffers kept for reuse now.
pub fn recycled_bytes() -> usize {
    recycler().held
}

/// Frees the kept buffers that nobody took for `idle` or longer; returns the bytes freed.
pub fn trim_recycled(idle: Duration) -> usize {
    let freed: Vec<Block> = {
        let mut pool = recycler();
        let (old, young) = std::mem::take(&mut pool.blocks)
            .into_iter()
            .partition(|b| b.freed.elapsed() >= idle);
        pool.blocks = young;
        pool.held = pool.blocks.iter().map(|b| b.cap).sum();
        old
    };
    let bytes = freed.iter().map(|b| b.cap).sum();
    freed.into_iter().for_each(Block::free);
    bytes
}

impl Recycler {
    /// Takes out the oldest blocks until at most `limit` bytes are kept; the caller frees them
    /// (outside the lock: unmapping a large block takes a while).
    fn shrink_to(&mut self, limit: usize) -> Vec<Block> {
        let mut out = Vec::new();
        while self.held > limit && !self.blocks.is_empty() {
            let block = self.blocks.remove(0);
            self.held -= block.cap;
            out.push(block);
        }
        out
    }

    /// The smallest kept block that holds `len` bytes without wasting more than a quarter.
    fn take(&mut self, len: usize) -> Option<Block> {
        let most = len.saturating_add(len / 4);
        let (index, _) = self
            .blocks
            .iter()
            .enumerate()
            .filter(|(_, b)| b.cap >= len && b.cap <= most)
            .min_by_key(|(_, b)| b.cap)?;
        // `remove`, not `swap_remove`: the blocks stay oldest first for `shrink_to`.
        let block = self.blocks.remove(index);
        self.held -= block.cap;
        Some(block)
    }
}

/// A buffer for a payload of `len` bytes that the caller overwrites whole before reading any
/// of it: a recycled one where the pool has one of about that size, else a new zeroed one,
/// either way given back to the pool when its `Bytes` is dropped. `None` where recycling is off
/// or `len` is under [`RECYCLE_MIN`] (or the allocator refuses): the caller allocates as usual.
///
/// The bytes of a recycled buffer are those of whichever tensor had it before: the caller must
/// never let a byte it did not write be read (a receiver hands the buffer on only once every
/// byte arrived).
pub fn receive_buffer(len: usize) -> Option<Bytes> {
    if len < RECYCLE_MIN {
        return None;
    }
    let block = {
        let mut pool = recycler();
        if pool.limit == 0 {
            return None;
        }
        pool.take(len)
    };
    let block = match block {
        Some(block) => block,
        None => {
            let layout = Block::layout(len)?;
            // SAFETY: `layout` has a non-zero size (len >= RECYCLE_MIN).
            let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
            // SAFETY: just allocated, `len` bytes, zeroed.
            advise_huge_pages(unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) });
            Block {
                ptr,
                cap: len,
                freed: Instant::now(),
            }
        }
    };
    let controller = RecycledController { block: Some(block) };
    // SAFETY: every byte of the block is initialized (zeroed when allocated, written since),
    // and `len` is within it.
    Some(unsafe { Bytes::from_controller(Box::new(controller), len) })
}

/// A receive buffer that goes back to the pool, not to the allocator, when dropped.
struct RecycledController {
    block: Option<Block>,
}

impl Drop for RecycledController {
    fn drop(&mut self) {
        let Some(mut block) = self.block.take() else {
            return;
        };
        block.freed = Instant::now();
        let freed = {
            let mut pool = recycler();
            if block.cap > pool.limit {
                vec![block]
            } else {
                let limit = pool.limit - block.cap;
                let freed = pool.shrink_to(limit);
                pool.held += block.cap;
                pool.blocks.push(block);
                freed
            }
        };
        freed.into_iter().for_each(Block::free);
    }
}

impl RecycledController {
    fn slice(&self) -> &[MaybeUninit<u8>] {
        match &self.block {
            // SAFETY: the block is `cap` bytes this controller owns.
            Some(b) => unsafe { std::slice::from_raw_parts(b.ptr.as_ptr().cast(), b.cap) },
            None => &[],
        }
    }
}

impl AllocationController for RecycledController {
    fn alloc_align(&self) -> usize {
        RECYCLE_ALIGN
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Other
    }

    unsafe fn memory_mut(
        &mut self,
        _policy: AccessPolicy,
    ) -> Result<&mut [MaybeUninit<u8>], AccessError> {
        Ok(match &mut self.block {
            // SAFETY: the block is `cap` bytes this controller owns, borrowed mutably here.
            Some(b) => unsafe { std::slice::from_raw_parts_mut(b.ptr.as_ptr().cast(), b.cap) },
            None => &mut [],
        })
    }

    fn memory(&self, _policy: AccessPolicy) -> Result<&[MaybeUninit<u8>], AccessError> {
        Ok(self.slice())
    }
}

/// A mapping owned by one `Bytes`; unmapped when the `Bytes` (and so the tensor) is dropped.
struct MappedController {
    map: MmapMut,
}

impl AllocationController for MappedController {
    fn alloc_align(&self) -> usize {
        // Mappings start on a page boundary, which satisfies every element type; Burn caps the
        // alignment it asks copies for at that of `u128`, so that is what is reported.
        std::mem::align_of::<u128>()
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Other
    }

    unsafe fn memory_mut(
        &mut self,
        _policy: AccessPolicy,
    ) -> Result<&mut [MaybeUninit<u8>], AccessError> {
        let slice: &mut [u8] = &mut self.map;
        // SAFETY: `u8` and `MaybeUninit<u8>` have the same layout; every byte is initialized.
        Ok(unsafe { &mut *(slice as *mut [u8] as *mut [MaybeUninit<u8>]) })
    }

    fn memory(&self, _policy: AccessPolicy) -> Result<&[MaybeUninit<u8>], AccessError> {
        let slice: &[u8] = &self.map;
        // SAFETY: as above.
        Ok(unsafe { &*(slice as *const [u8] as *const [MaybeUninit<u8>]) })
    }
}

/// Wraps a whole mapping as `Bytes`.
pub fn bytes_from_mapping(map: MmapMut) -> Bytes {
    let len = map.len();
    // SAFETY: every byte of a mapping is initialized (zero pages or the file's contents), and the
    // controller reports exactly the mapping.
    unsafe { Bytes::from_controller(Box::new(MappedController { map }), len) }
}

/// Memory that hands out disjoint ranges of itself, each owned by one `Bytes` through a
/// [`RangeController`] (a file mapping, a receive pool). It stays mapped while the owner value
/// lives, and each owner value stands for exactly one range.
pub(crate) trait RangeOwner {
    /// The start of the whole memory the range lies in.
    fn base(&self) -> NonNull<u8>;
}

/// One range `[offset, offset + len)` of an owner's memory, owned by one `Bytes`: the one
/// `AllocationController` behind [`MappedFile::take`](crate::mapped_file::MappedFile::take) and
/// `Pool::take`.
pub(crate) struct RangeController<O: RangeOwner> {
    /// Keeps the memory alive (and, for a pool, gives the range back when dropped).
    pub(crate) owner: O,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl<O: RangeOwner> RangeController<O> {
    fn start(&self) -> *mut u8 {
        // In bounds: the owner handed out this range inside its memory.
        self.owner.base().as_ptr().wrapping_add(self.offset)
    }
}

impl<O: RangeOwner> AllocationController for RangeController<O> {
    fn alloc_align(&self) -> usize {
        // Where the range happens to start (a file's tensors sit at whatever offsets it gives),
        // capped at `u128`'s, the most Burn asks copies for.
        let address = self.start() as usize;
        1 << address
            .trailing_zeros()
            .min(std::mem::align_of::<u128>().trailing_zeros())
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Other
    }

    unsafe fn memory_mut(
        &mut self,
        _policy: AccessPolicy,
    ) -> Result<&mut [MaybeUninit<u8>], AccessError> {
        // SAFETY: the range lies inside the owner's memory, which `self.owner` keeps mapped;
        // this controller is the range's only owner (owners never hand a range out twice), and
        // it is borrowed mutably through `&mut self`. Every byte is initialized (mapped memory:
        // zero pages or a file's contents).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.start().cast(), self.len) })
    }

    fn memory(&self, _policy: AccessPolicy) -> Result<&[MaybeUninit<u8>], AccessError> {
        // SAFETY: as above, borrowed shared through `&self`.
        Ok(unsafe { std::slice::from_raw_parts(self.start().cast(), self.len) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapped_buffer_is_writable_and_clones() {
        let map = memmap2::MmapOptions::new().len(1 << 16).map_anon().unwrap();
        let mut bytes = bytes_from_mapping(map);
        assert_eq!(bytes.len(), 1 << 16);
        assert!(bytes.iter().all(|&b| b == 0));
        bytes[17] = 3;
        assert_eq!(bytes[17], 3);
        let copy = bytes.clone();
        assert_eq!(&copy[..], &bytes[..]);
    }

    #[test]
    fn a_freed_receive_buffer_is_reused_within_the_limit_and_trimmed() {
        // The pool is the process's: this test is the only one in this binary that turns it on.
        const R: usize = RECYCLE_MIN;
        assert!(receive_buffer(R).is_none(), "off by default");
        set_recycle_limit(4 * R);
        assert!(
            receive_buffer(R - 1).is_none(),
            "small buffers are not recycled"
        );
        let mut first = receive_buffer(R + 1000).unwrap();
        assert!(first.iter().all(|&b| b == 0), "a new buffer is zeroed");
        first[7] = 9;
        let address = first.as_ptr();
        drop(first);
        assert_eq!(recycled_bytes(), R + 1000);
        // A slightly smaller payload takes it (old bytes and all: the receiver overwrites them).
        let again = receive_buffer(R + 900).unwrap();
        assert_eq!(again.as_ptr(), address);
        assert_eq!(again.len(), R + 900);
        assert_eq!(again[7], 9);
        assert_eq!(recycled_bytes(), 0);
        // One much larger does not.
        let large = receive_buffer(2 * R).unwrap();
        assert_ne!(large.as_ptr(), address);
        drop(again);
        drop(large);
        assert_eq!(recycled_bytes(), 3 * R + 1000);
        // Over the limit, the oldest goes.
        drop(receive_buffer(3 * R / 2).unwrap());
        assert_eq!(recycled_bytes(), 2 * R + 3 * R / 2);
        let held = recycled_bytes();
        assert_eq!(trim_recycled(Duration::ZERO), held);
        assert_eq!(recycled_bytes(), 0);
        set_recycle_limit(0);
        assert!(receive_buffer(R).is_none());
    }

    #[test]
    fn huge_page_advice_leaves_the_bytes_alone() {
        let mut buf = vec![0u8; HUGE_PAGES_MIN * 2];
        buf[5] = 1;
        advise_huge_pages(&buf);
        buf[HUGE_PAGES_MIN] = 2;
        assert_eq!((buf[5], buf[HUGE_PAGES_MIN]), (1, 2));
    }
}
