//! Host memory: huge-page advice for large receive buffers, recycled receive buffers, and
//! `Bytes` backed by a memory mapping (a private copy-on-write mapping of a sealed shared-memory
//! region a peer passed over a Unix socket, so the receiver adopts the sender's pages instead of
//! copying them; or a range of a file mapped private, so a put sends a file's tensors straight
//! from the page cache).

use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
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

/// A file mapped whole, from which the tensors that lie in it are taken as `Bytes` without a
/// copy: mapped private (copy-on-write) to read, so that `ferry put` sends a file's tensors to
/// the socket straight from the page cache; or shared and writable to write a new file, so that
/// `ferry get` receives tensors straight into the file's pages.
///
/// Ranges are taken in increasing order and never overlap (each `Bytes` is the only owner of its
/// range), which [`take`](Self::take) enforces. The mapping lives until the file handle and every
/// `Bytes` taken from it are gone.
///
/// The contract of every file mapping: the file must not be truncated while mapped (reading a
/// page past the new end raises SIGBUS; so does writing a page of a created file that the file
/// system has no room for, which [`create`](Self::create) prevents by reserving the blocks first
/// where the file system can). A write to the file by another process while it is
/// mapped may show in bytes not yet sent; ferry sends what it reads and the node hashes what it
/// receives, so such a put stores a mix, as a `read` racing the same writer would.
pub struct MappedFile {
    map: Arc<FileMap>,
    /// Everything before this offset was taken (or skipped): no range may start before it.
    taken_to: usize,
}

pub(crate) struct FileMap {
    map: MmapMut,
    base: NonNull<u8>,
}

// SAFETY: `base` points into `map`, which `FileMap` owns for its whole life; its bytes are only
// reached through the disjoint ranges `MappedFile::take` hands to one `Bytes` each.
unsafe impl Send for FileMap {}
// SAFETY: as above; `FileMap` itself is never used to read or write the bytes.
unsafe impl Sync for FileMap {}

impl MappedFile {
    /// Maps `file` whole, private, its pages faulted in for reading from its start on by a
    /// thread of their own (`populate_ahead`), while the caller goes on: cheap for pages in
    /// the page cache (no copy, no zeroing; a page is copied only if written), yet 2.3 GiB of
    /// them cost a core about 0.4 s of page-table work, which the send of the first tensors
    /// now overlaps instead of waiting for.
    pub fn map(file: &std::fs::File) -> std::io::Result<MappedFile> {
        // SAFETY: a private mapping of a file opened for reading; its soundness rests on the file
        // not being truncated while mapped, the contract stated on `MappedFile` (the same every
        // file mapping, safetensors' own included, asks of its caller).
        let mut map = unsafe { memmap2::MmapOptions::new().map_copy(file)? };
        let base = NonNull::new(map.as_mut_ptr()).unwrap_or(NonNull::dangling());
        let map = Arc::new(FileMap { map, base });
        populate_ahead(&map);
        Ok(MappedFile { map, taken_to: 0 })
    }

    /// Sets the length of `file`, a new file this process just created and nobody else writes,
    /// to `len` and maps it shared and writable: what is written to a range taken from it is
    /// written to the file (once the kernel writes the pages back, or the file is read).
    pub fn create(file: &std::fs::File, len: usize) -> std::io::Result<MappedFile> {
        if len == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "an empty file has nothing to map",
            ));
        }
        // Blocks reserved now, where the file system can: a full disk is then this error, not a
        // SIGBUS on the first write to a page it has no block for.
        match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, len as u64) {
            Ok(()) => {}
            Err(rustix::io::Errno::OPNOTSUPP) => file.set_len(len as u64)?,
            Err(e) => return Err(e.into()),
        }
        // SAFETY: a shared mapping of a file this process created and sized; sound as long as
        // nobody truncates it while mapped, the contract stated on `MappedFile`.
        let mut map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(file)? };
        let base = NonNull::new(map.as_mut_ptr()).unwrap_or(NonNull::dangling());
        Ok(MappedFile {
            map: Arc::new(FileMap { map, base }),
            taken_to: 0,
        })
    }

    /// The file's length in bytes.
    pub fn len(&self) -> usize {
        self.map.map.len()
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes `[offset, offset + len)` of the file as `Bytes` that own them, without a copy.
    /// `None` where the range runs past the file's end or starts before the end of a range
    /// taken earlier.
    pub fn take(&mut self, offset: usize, len: usize) -> Option<Bytes> {
        let end = offset.checked_add(len)?;
        if offset < self.taken_to || end > self.len() {
            return None;
        }
        self.taken_to = end;
        let controller = RangeController {
            owner: self.map.clone(),
            offset,
            len,
        };
        // SAFETY: every byte of a file mapping is initialized (the file's contents, zeros past
        // them in the last page), and the range lies inside the mapping.
        Some(unsafe { Bytes::from_controller(Box::new(controller), len) })
    }
}

/// How much of a file mapping [`populate_ahead`] faults in at a time: small enough that it stops
/// soon after the mapping goes, large enough that its calls cost nothing beside the faults.
const POPULATE_STEP: usize = 16 << 20;

/// Faults `map`'s pages in for reading, in file order (the order a put sends them), on a thread
/// of its own that holds the mapping only for one step at a time: it stops once the
/// [`MappedFile`] and every range taken from it are gone, or at an error (a file truncated
/// meanwhile: `MADV_POPULATE_READ` fails rather than raising SIGBUS; a kernel before 5.14, which
/// does not know the advice). Advice only: a page not yet faulted in when it is read
/// faults then (the fault-around of a first read, 64 KiB at a time); where the thread cannot
/// start, every page does. (No `MAP_POPULATE`: on a writable private mapping it faults for
/// writing, which copies every page.)
fn populate_ahead(map: &Arc<FileMap>) {
    #[cfg(target_os = "linux")]
    {
        let len = map.map.len();
        if len == 0 {
            return;
        }
        let weak = Arc::downgrade(map);
        let _ = std::thread::Builder::new()
            .name("ferry-populate".into())
            .spawn(move || {
                let mut offset = 0;
                while offset < len {
                    let Some(map) = weak.upgrade() else {
                        return;
                    };
                    let step = POPULATE_STEP.min(len - offset);
                    if map
                        .map
                        .advise_range(memmap2::Advice::PopulateRead, offset, step)
                        .is_err()
                    {
                        return;
                    }
                    offset += step;
                }
            });
    }
    #[cfg(not(target_os = "linux"))]
    let _ = map;
}

/// Memory that hands out disjoint ranges of itself, each owned by one `Bytes` through a
/// [`RangeController`] (a file mapping, a receive pool). It stays mapped while the owner value
/// lives, and each owner value stands for exactly one range.
pub(crate) trait RangeOwner {
    /// The start of the whole memory the range lies in.
    fn base(&self) -> NonNull<u8>;
}

impl RangeOwner for Arc<FileMap> {
    fn base(&self) -> NonNull<u8> {
        self.base
    }
}

/// One range `[offset, offset + len)` of an owner's memory, owned by one `Bytes`: the one
/// `AllocationController` behind [`MappedFile::take`] and `Pool::take`.
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
    fn ranges_of_a_mapped_file_are_taken_in_order_once_and_stay_private() {
        use std::io::Write;
        let mut file = tempfile::NamedTempFile::new().unwrap();
        let contents: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        file.write_all(&contents).unwrap();
        let mut mapped = MappedFile::map(file.as_file()).unwrap();
        assert_eq!(mapped.len(), contents.len());
        let mut first = mapped.take(8, 1000).unwrap();
        assert_eq!(&first[..], &contents[8..1008]);
        assert!(mapped.take(1000, 10).is_none(), "overlaps the range taken");
        assert!(mapped.take(9_999, 2).is_none(), "past the end");
        let second = mapped.take(1008, 8992).unwrap();
        assert_eq!(&second[..], &contents[1008..]);
        drop(mapped);
        // The bytes outlive the handle; a write stays in this process.
        first[0] ^= 0xff;
        assert_eq!(std::fs::read(file.path()).unwrap(), contents);
    }

    #[test]
    fn ranges_of_a_created_file_write_through_to_it() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let mut mapped = MappedFile::create(file.as_file(), 4096 + 10).unwrap();
        let mut head = mapped.take(0, 10).unwrap();
        let mut body = mapped.take(10, 4096).unwrap();
        head.copy_from_slice(b"0123456789");
        body.fill(7);
        drop((mapped, head, body));
        let written = std::fs::read(file.path()).unwrap();
        assert_eq!(&written[..10], b"0123456789");
        assert!(written[10..].iter().all(|&b| b == 7));
        assert_eq!(written.len(), 4106);
        assert!(MappedFile::create(file.as_file(), 0).is_err());
    }

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
