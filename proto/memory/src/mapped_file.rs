//! A file mapped whole ([`MappedFile`]), its tensors taken as `Bytes` without a copy: read from a
//! private mapping whose pages the process's populate threads fault in ahead of the sender, or
//! written through a shared one.

use std::ptr::NonNull;
use std::sync::Arc;
#[cfg(target_os = "linux")]
use std::sync::mpsc::{Receiver, Sender};
#[cfg(target_os = "linux")]
use std::sync::{Mutex, OnceLock, PoisonError, Weak};

use burn_std::Bytes;
use memmap2::MmapMut;

use crate::host::{RangeController, RangeOwner};

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
    /// Maps `file` whole, private, its pages faulted in for reading from its start on by one of
    /// the process's populate threads (`populate_ahead`), while the caller goes on: cheap for pages in
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

/// How many threads of the process fault mappings in at once: a program that maps many files
/// (a checkpoint's shards) gets this many, each file taken in the order mapped, rather than a
/// thread per file reading them all at once.
const POPULATE_THREADS: usize = 2;

/// Queues `map` to have its pages faulted in for reading, in file order (the order a put sends
/// them), by the first of the process's populate threads that is free, which holds the mapping
/// only for one step at a time: it goes on to the next mapping once the [`MappedFile`] and
/// every range taken from it are gone, or at an error (a file truncated meanwhile:
/// `MADV_POPULATE_READ` fails rather than raising SIGBUS; a kernel before 5.14, which does not
/// know the advice). Advice only: a page not yet faulted in when it is read faults then (the
/// fault-around of a first read, 64 KiB at a time); where no thread could start, every page
/// does. (No `MAP_POPULATE`: on a writable private mapping it faults for writing, which copies
/// every page.)
fn populate_ahead(map: &Arc<FileMap>) {
    #[cfg(target_os = "linux")]
    {
        static QUEUE: OnceLock<Option<Sender<Weak<FileMap>>>> = OnceLock::new();
        if map.map.is_empty() {
            return;
        }
        if let Some(queue) = QUEUE.get_or_init(start_populate_threads) {
            let _ = queue.send(Arc::downgrade(map));
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = map;
}

/// The process's populate threads, taking mappings from one queue; `None` where none could
/// start. They live as long as the process, idle between mappings.
#[cfg(target_os = "linux")]
fn start_populate_threads() -> Option<Sender<Weak<FileMap>>> {
    let (queue, mappings) = std::sync::mpsc::channel::<Weak<FileMap>>();
    let mappings = Arc::new(Mutex::new(mappings));
    let started = (0..POPULATE_THREADS)
        .filter(|_| {
            let mappings = mappings.clone();
            std::thread::Builder::new()
                .name("ferry-populate".into())
                .spawn(move || populate_in_turn(&mappings))
                .is_ok()
        })
        .count();
    (started > 0).then_some(queue)
}

/// Faults in each mapping queued, one after another.
#[cfg(target_os = "linux")]
fn populate_in_turn(mappings: &Mutex<Receiver<Weak<FileMap>>>) {
    loop {
        // The lock is held only to take the next mapping, not while faulting it in.
        let next = mappings
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .recv();
        match next {
            Ok(map) => populate(&map),
            Err(_) => return,
        }
    }
}

/// Faults `map`'s pages in, a step at a time, while it lives.
#[cfg(target_os = "linux")]
fn populate(map: &Weak<FileMap>) {
    let Some(len) = map.upgrade().map(|m| m.map.len()) else {
        return;
    };
    let mut offset = 0;
    while offset < len {
        let Some(map) = map.upgrade() else {
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
}

impl RangeOwner for Arc<FileMap> {
    fn base(&self) -> NonNull<u8> {
        self.base
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// However many files are mapped, and however large, at most `POPULATE_THREADS` threads of
    /// the process fault them in, and every file reads back exactly.
    #[cfg(target_os = "linux")]
    #[test]
    fn many_files_mapped_at_once_share_the_processs_few_populate_threads() {
        use std::io::Write;
        let files: Vec<_> = (0..8u8)
            .map(|i| {
                let mut file = tempfile::NamedTempFile::new().unwrap();
                file.write_all(&vec![i; 8 << 20]).unwrap();
                file
            })
            .collect();
        let mapped: Vec<MappedFile> = files
            .iter()
            .map(|f| MappedFile::map(f.as_file()).unwrap())
            .collect();
        let populating = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
            .filter(|name| name.trim() == "ferry-populate")
            .count();
        assert!(
            (1..=POPULATE_THREADS).contains(&populating),
            "{populating} populate threads"
        );
        for (i, mut mapped) in mapped.into_iter().enumerate() {
            let len = mapped.len();
            let all = mapped.take(0, len).unwrap();
            assert!(all.iter().all(|&b| usize::from(b) == i), "file {i}");
        }
    }

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
}
