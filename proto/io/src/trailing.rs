//! A content hash computed on its own thread, trailing a receiver as it commits bytes.
//!
//! A pull is acknowledged only once the bytes that arrived hash to the content hash they were
//! granted under. Hashing on the receiving thread would add a whole pass over the payload to the
//! transfer's critical path; here a second thread hashes each piece as soon as the receiver has
//! written it and handed it on (while the next one is still on the wire), so the answer waits
//! only for the last piece. Behind, it takes everything handed to it at once, in spans that
//! [`hash_more`](ferry_proto::tensor::hash_more) spreads over the free cores.
//!
//! The receive buffer is written by the receiver and read by the hashing thread at the same time,
//! in disjoint ranges: bytes below the committed end are only read (by the hasher), bytes above
//! it only written (by the receiver). While a [`TrailingHash`] lives, every access to the buffer
//! goes through the one raw pointer it was started with, so no reference to the whole buffer
//! ever overlaps the hasher's reads.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

/// Bytes the hashing thread feeds the hasher at a time between two looks at the stop flag.
const PIECE: usize = 4 << 20;

/// The start of a receive buffer, shared by the receiver and its hashing thread.
#[derive(Clone, Copy)]
struct Base(*mut u8);

// SAFETY: the pointer is only dereferenced in the ranges the protocol of `TrailingHash` gives
// each side (committed bytes: read by the hasher; the rest: written by the receiver), and the
// buffer outlives the thread (`TrailingHash` joins it before it is dropped).
unsafe impl Send for Base {}

/// Hashes a buffer on another thread, a committed range at a time.
pub(crate) struct TrailingHash {
    base: Base,
    len: usize,
    /// Bytes `[0, committed)` are handed to the hasher: from then on only read.
    committed: usize,
    /// New committed ends, for the thread; closed to say there are no more.
    ends: Option<mpsc::Sender<usize>>,
    thread: Option<std::thread::JoinHandle<blake3::Hasher>>,
    /// Raised when nobody wants the hash any more (the receive failed).
    abandoned: Arc<AtomicBool>,
}

impl std::fmt::Debug for TrailingHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrailingHash")
            .field("len", &self.len)
            .field("committed", &self.committed)
            .finish()
    }
}

impl TrailingHash {
    /// Starts hashing the `len` bytes at `base` with `hasher`, as they are committed.
    ///
    /// # Safety
    /// `base` points to `len` bytes that stay allocated, and that nothing but this value reads
    /// or writes, for as long as it lives (it joins its thread when finished or dropped).
    pub(crate) unsafe fn start(
        base: *mut u8,
        len: usize,
        hasher: blake3::Hasher,
    ) -> std::io::Result<Self> {
        let (ends, queue) = mpsc::channel::<usize>();
        let abandoned = Arc::new(AtomicBool::new(false));
        let stop = abandoned.clone();
        let shared = Base(base);
        let thread = std::thread::Builder::new()
            .name("ferry-hash".into())
            .spawn(move || {
                let shared = shared;
                let mut hasher = hasher;
                let mut hashed = 0usize;
                while let Ok(mut end) = queue.recv() {
                    // Every end handed on meanwhile: a thread that fell behind hashes large
                    // spans, which go over several cores, rather than a piece at a time.
                    while let Ok(later) = queue.try_recv() {
                        end = later;
                    }
                    while hashed < end {
                        if stop.load(Ordering::Relaxed) {
                            return hasher;
                        }
                        let piece = (end - hashed).min(PIECE);
                        // SAFETY: `[hashed, hashed + piece)` lies below a committed end the
                        // receiver sent after writing those bytes (the channel orders the
                        // writes before this read), so only this thread touches it now, and
                        // the buffer is alive until this thread is joined.
                        let bytes =
                            unsafe { std::slice::from_raw_parts(shared.0.add(hashed), piece) };
                        ferry_proto::tensor::hash_more(&mut hasher, bytes);
                        hashed += piece;
                    }
                }
                hasher
            })?;
        Ok(Self {
            base: Base(base),
            len,
            committed: 0,
            ends: Some(ends),
            thread: Some(thread),
            abandoned,
        })
    }

    /// The place for bytes in `range`, which must lie wholly at or above the committed end and
    /// within the buffer; `None` otherwise.
    pub(crate) fn slot(&mut self, range: Range<usize>) -> Option<&mut [u8]> {
        if range.start < self.committed || range.end > self.len || range.start > range.end {
            return None;
        }
        // SAFETY: the range is inside the buffer and above the committed end, which the hashing
        // thread never reads; the returned borrow of `self` keeps a second slot from overlapping.
        Some(unsafe {
            std::slice::from_raw_parts_mut(self.base.0.add(range.start), range.end - range.start)
        })
    }

    /// The end of the bytes handed to the hasher.
    pub(crate) fn handed(&self) -> usize {
        self.committed
    }

    /// Hands `[committed, end)` to the hasher: from now on those bytes are only read.
    pub(crate) fn commit(&mut self, end: usize) {
        if end <= self.committed || end > self.len {
            return;
        }
        self.committed = end;
        if let Some(ends) = &self.ends {
            // A thread that is gone (it panicked) answers in `finish`.
            let _ = ends.send(end);
        }
    }

    /// Waits for the thread to hash everything committed and returns its hasher; `None` if the
    /// thread died.
    pub(crate) fn finish(mut self) -> Option<blake3::Hasher> {
        self.ends = None;
        self.thread.take()?.join().ok()
    }
}

impl Drop for TrailingHash {
    fn drop(&mut self) {
        // The buffer may be freed right after this: the thread must be done with it first.
        self.abandoned.store(true, Ordering::Relaxed);
        self.ends = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
