//! Shared-memory regions: a tensor payload written once into a sealed `memfd`, passed over a Unix
//! socket, and adopted by the receiver as the tensor's own memory.
//!
//! Lifetime is the kernel's: a region is an anonymous file that exists only while a descriptor or
//! a mapping refers to it. The sender closes its descriptor once `sendmsg` has handed the kernel
//! a reference; a descriptor still in flight is closed when the socket closes (receiver gone);
//! the receiver closes its descriptor once it has mapped the region, or keeps it (a
//! [`SealedRegion`], for a large payload a node registers) to pass the same region on later.
//! What is left is the receiver's private mapping (and that descriptor), which is the received
//! tensor's storage and goes with the tensor. So no region outlives the tensor it carries on any
//! path, a crash included.
//!
//! The receiver trusts nothing it cannot check in constant time: the region must be ordinary
//! shared memory, sealed against writes and resizing (so nobody, its sender included, can change
//! or truncate the bytes once sent), exactly the declared size, and owned by this user or root,
//! before anything reaches Burn. It does not read the bytes to adopt them: the declared crc32c
//! was computed by the same peer that made the region, so it vouches for nothing the seals do not
//! already guarantee, and what the bytes *are* is checked end to end by their content hash
//! (BLAKE3), by whoever registers them. The mapping is lazy: adopting a region of any size is a
//! handful of system calls, and each page is read from the shared pages when first touched.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use burn_std::Bytes;
use ferry_proto::{RegionDescriptor, StreamError};
use rustix::fs::{MemfdFlags, SealFlags};

/// The name regions carry (visible in `/proc/PID/fd` and `/proc/PID/maps` as `memfd:ferry-region`).
pub const REGION_NAME: &str = "ferry-region";

/// Bytes written (and checksummed while hot) at a time.
const WRITE_PIECE: usize = 1 << 20;

/// The seals a receiver requires: nobody can write, shrink or grow the region any more.
fn required_seals() -> SealFlags {
    SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW
}

/// Regions this process made to send ([`OutgoingRegion`]) and has not yet handed to the kernel or
/// dropped (receive buffers in regions are not counted: they become kept regions or go).
static REGIONS_IN_FLIGHT: AtomicU64 = AtomicU64::new(0);

/// Regions this process made to send and still holds a descriptor of.
pub fn regions_in_flight() -> u64 {
    REGIONS_IN_FLIGHT.load(Ordering::Relaxed)
}

/// Regions this process keeps (a descriptor each) to pass tensors on without a copy.
static REGIONS_KEPT: AtomicU64 = AtomicU64::new(0);

/// Regions this process keeps now ([`SealedRegion`]s alive).
pub fn regions_kept() -> u64 {
    REGIONS_KEPT.load(Ordering::Relaxed)
}

/// The most regions a process keeps at once: a quarter of its open-file limit, so that kept
/// regions never starve connections of descriptors. Past it, a region is mapped and its
/// descriptor closed as before (the tensor then goes on by copy).
fn kept_limit() -> u64 {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    limit.current.unwrap_or(u64::MAX) / 4
}

/// A region being filled with a payload, then sealed and sent.
#[derive(Debug)]
pub struct OutgoingRegion {
    fd: Option<OwnedFd>,
    descriptor: RegionDescriptor,
    written: u64,
    sealed: bool,
}

impl OutgoingRegion {
    /// A new, empty region of `len` bytes.
    pub fn new(len: usize) -> io::Result<Self> {
        let fd =
            rustix::fs::memfd_create(REGION_NAME, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        REGIONS_IN_FLIGHT.fetch_add(1, Ordering::Relaxed);
        let region = Self {
            fd: Some(fd),
            descriptor: RegionDescriptor {
                len: len as u64,
                crc32c: 0,
            },
            written: 0,
            sealed: false,
        };
        rustix::fs::ftruncate(region.fd()?, len as u64)?;
        Ok(region)
    }

    fn fd(&self) -> io::Result<&OwnedFd> {
        self.fd
            .as_ref()
            .ok_or_else(|| io::Error::other("region already handed over"))
    }

    /// Appends the next bytes of the payload, checksumming them while they are hot. Written
    /// through `pwrite` rather than a mapping: the kernel allocates the region's pages as it
    /// copies, without a page fault per page.
    pub fn append(&mut self, bytes: &[u8]) -> io::Result<()> {
        let end = self.written.checked_add(bytes.len() as u64);
        if self.sealed || end.is_none_or(|end| end > self.descriptor.len) {
            return Err(io::Error::other(
                "region written past its length or after sealing",
            ));
        }
        for piece in bytes.chunks(WRITE_PIECE) {
            self.descriptor.crc32c = crc32c::crc32c_append(self.descriptor.crc32c, piece);
            let mut rest = piece;
            while !rest.is_empty() {
                let n = rustix::io::pwrite(self.fd()?, rest, self.written)?;
                if n == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "region write made no progress",
                    ));
                }
                rest = rest.get(n..).unwrap_or_default();
                self.written += n as u64;
            }
        }
        Ok(())
    }

    /// Seals the region against any further change, once every byte is written.
    pub fn seal(&mut self) -> io::Result<RegionDescriptor> {
        if self.written != self.descriptor.len {
            return Err(io::Error::other("region sealed before it was filled"));
        }
        rustix::fs::fcntl_add_seals(self.fd()?, required_seals() | SealFlags::SEAL)?;
        self.sealed = true;
        Ok(self.descriptor)
    }

    /// Writes `payload` into a new sealed region (for callers that need no yielding between
    /// pieces).
    pub fn create(payload: &[u8]) -> io::Result<Self> {
        let mut region = Self::new(payload.len())?;
        region.append(payload)?;
        region.seal()?;
        Ok(region)
    }

    /// What the region frame declares.
    pub fn descriptor(&self) -> RegionDescriptor {
        self.descriptor
    }

    /// The descriptor, to hand to the socket (which sends it and then closes its copy); only
    /// once sealed.
    pub fn into_fd(mut self) -> Option<OwnedFd> {
        if !self.sealed {
            return None;
        }
        self.fd.take().inspect(|_| {
            REGIONS_IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
        })
    }
}

impl Drop for OutgoingRegion {
    fn drop(&mut self) {
        if self.fd.take().is_some() {
            REGIONS_IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// A receive buffer in a new region (a node's `--shareable-receives`): written through a shared
/// mapping while a payload arrives by any link, then sealed ([`seal`](Self::seal)), so that the
/// tensor it becomes can be passed to a same-host peer as is, like a region that arrived sealed.
#[derive(Debug)]
pub struct RegionBuffer {
    fd: OwnedFd,
    len: usize,
}

impl RegionBuffer {
    /// A new region of `len` bytes (more than 0) and a writable mapping of it, as the buffer to
    /// receive into.
    pub fn new(len: usize) -> io::Result<(RegionBuffer, Bytes)> {
        if len == 0 {
            return Err(io::Error::other("an empty payload needs no region"));
        }
        let fd =
            rustix::fs::memfd_create(REGION_NAME, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        // SAFETY: a region this process just made and nobody else holds; it is never resized
        // (it is sealed against that before anyone else sees it), so the mapping stays whole.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(&fd)? };
        Ok((
            RegionBuffer { fd, len },
            crate::host::bytes_from_mapping(map),
        ))
    }

    /// Seals the region, `written` being the buffer [`new`](Self::new) gave with every byte
    /// written, and hands back a private mapping of it as the tensor's storage, with the
    /// [`SealedRegion`] to pass it on: none where the process keeps as many regions as it may,
    /// or where the seal fails (the tensor then stays in its private mapping, unshared). Only
    /// when no private mapping can be made does the written buffer itself come back.
    pub fn seal(self, written: Bytes) -> Result<(Bytes, Option<SealedRegion>), (io::Error, Bytes)> {
        if written.len() != self.len {
            return Err((
                io::Error::other("a region sealed at another length"),
                written,
            ));
        }
        // What the region frame declares when the region is passed on (informational: receivers
        // check the seals, not the checksum).
        let crc32c = crc32c::crc32c(&written);
        // The private mapping first: it does not stand in the way of a write seal, and once it
        // exists no failure below can lose the bytes.
        // SAFETY: nobody but this process holds the region, and it is never resized; the one
        // writable mapping (`written`) is dropped right below, before anything reads this one,
        // and no byte is written after that: then sealed, or else simply never written again.
        let map = match unsafe { memmap2::MmapOptions::new().len(self.len).map_copy(&self.fd) } {
            Ok(map) => map,
            Err(e) => return Err((e, written)),
        };
        // A write seal needs no writable shared mapping left.
        drop(written);
        let sealed = rustix::fs::fcntl_add_seals(&self.fd, required_seals() | SealFlags::SEAL);
        let kept = match sealed {
            Ok(()) => SealedRegion::try_keep(
                self.fd,
                RegionDescriptor {
                    len: self.len as u64,
                    crc32c,
                },
            ),
            Err(e) => {
                tracing::info!(error = %e, "a received region could not be sealed; kept unshared");
                None
            }
        };
        Ok((crate::host::bytes_from_mapping(map), kept))
    }
}

/// A checked, sealed region kept beside the tensor it stores, so that the tensor can be passed on
/// to another process without being copied again: each send hands over a duplicate descriptor.
/// The seals make that sound: nobody, this process included, can change the region's bytes.
#[derive(Debug)]
pub struct SealedRegion {
    fd: OwnedFd,
    descriptor: RegionDescriptor,
}

impl Drop for SealedRegion {
    fn drop(&mut self) {
        REGIONS_KEPT.fetch_sub(1, Ordering::Relaxed);
    }
}

impl SealedRegion {
    /// Keeps the sealed region `fd` (counted in [`regions_kept`] until dropped), unless the
    /// process keeps as many as it may: then `None`, and the descriptor is closed. The only way
    /// a `SealedRegion` is made, so that the count and the drops always match.
    fn try_keep(fd: OwnedFd, descriptor: RegionDescriptor) -> Option<SealedRegion> {
        REGIONS_KEPT
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < kept_limit()).then_some(n + 1)
            })
            .ok()?;
        Some(SealedRegion { fd, descriptor })
    }

    /// What a region frame for it declares (its length and crc32c, checked when it arrived).
    pub fn descriptor(&self) -> RegionDescriptor {
        self.descriptor
    }

    /// A new descriptor of the region, to send (the socket closes it once handed over).
    pub fn share(&self) -> io::Result<OwnedFd> {
        self.fd.try_clone()
    }
}

/// Checks a region a peer sent against what its frame declared and what the meta allows, and maps
/// it privately (copy-on-write: the receiver may change its tensor, never the sender's pages), in
/// time independent of its size: no pass over the bytes. With `keep`, the descriptor comes back
/// as a [`SealedRegion`] to pass the tensor on later; otherwise it is closed on return, whatever
/// the outcome.
pub fn adopt(
    fd: OwnedFd,
    declared: RegionDescriptor,
    expected_len: usize,
    keep: bool,
) -> Result<(Bytes, Option<SealedRegion>), StreamError> {
    let refuse = |reason: String| StreamError::RegionRefused { reason };
    if declared.len != expected_len as u64 {
        return Err(StreamError::RegionSize {
            len: declared.len,
            total: expected_len as u64,
        });
    }
    let seals = rustix::fs::fcntl_get_seals(fd.as_fd())
        .map_err(|e| refuse(format!("not a sealable shared-memory file ({e})")))?;
    if !seals.contains(required_seals()) {
        return Err(refuse(format!(
            "not sealed against writes and resizing (seals {seals:?})"
        )));
    }
    // Ordinary shared memory only: a sealed file on hugetlbfs would draw on the host's huge-page
    // pool and fail differently when mapped.
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    let fs = rustix::fs::fstatfs(fd.as_fd()).map_err(|e| refuse(format!("fstatfs: {e}")))?;
    if fs.f_type as i64 != TMPFS_MAGIC {
        return Err(refuse(format!(
            "not ordinary shared memory (file system type {:#x})",
            fs.f_type
        )));
    }
    let stat = rustix::fs::fstat(fd.as_fd()).map_err(|e| refuse(format!("fstat: {e}")))?;
    let size = u64::try_from(stat.st_size).unwrap_or(u64::MAX);
    if size != expected_len as u64 {
        return Err(StreamError::RegionSize {
            len: size,
            total: expected_len as u64,
        });
    }
    // Made by a process of this user (or root): the peers a node accepts on its Unix socket.
    let own = rustix::process::geteuid().as_raw();
    if stat.st_uid != own && stat.st_uid != 0 {
        return Err(refuse(format!(
            "owned by user {}, neither this user ({own}) nor root",
            stat.st_uid
        )));
    }
    // SAFETY: the region is sealed against writes and resizing (checked above), so the mapped
    // bytes cannot change or vanish under us (no truncation, hence no SIGBUS on a later touch);
    // the mapping is private, so our writes stay ours. Not populated: pages are mapped as they
    // are first read, by whoever reads them (Burn, the content hash, a socket), not here.
    let map = unsafe {
        memmap2::MmapOptions::new()
            .len(expected_len)
            .map_copy(&fd)
            .map_err(|e| refuse(format!("mmap: {e}")))?
    };
    // Through `try_keep` only: a `SealedRegion` once built eagerly and dropped unkept counted
    // one less kept region than there were, so after any region that was only mapped (a small
    // payload, a client's get) the count wrapped below zero and no region was kept again.
    let kept = if keep {
        SealedRegion::try_keep(fd, declared)
    } else {
        None
    };
    Ok((crate::host::bytes_from_mapping(map), kept))
}

/// Regions of this name the process `pid` still has open or mapped (from `/proc`): what a leak
/// test counts.
pub fn count_regions(pid: u32) -> io::Result<(usize, usize)> {
    let needle = format!("memfd:{REGION_NAME}");
    let mut fds = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(entry) = entry else { continue };
        if let Ok(target) = std::fs::read_link(entry.path())
            && target.to_string_lossy().contains(&needle)
        {
            fds += 1;
        }
    }
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let mapped = maps.lines().filter(|l| l.contains(&needle)).count();
    Ok((fds, mapped))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn a_region_round_trips_and_is_adopted_without_a_copy_of_its_own() {
        let data = payload(256 * 1024 + 5);
        let region = OutgoingRegion::create(&data).unwrap();
        let declared = region.descriptor();
        assert_eq!(declared.crc32c, crc32c::crc32c(&data));
        let fd = region.into_fd().unwrap();
        let (mut bytes, kept) = adopt(fd, declared, data.len(), true).unwrap();
        assert_eq!(&bytes[..], &data[..]);
        // The kept region passes on as it came, and adopts again to the same bytes.
        let kept = kept.unwrap();
        assert_eq!(kept.descriptor(), declared);
        let (again, none) = adopt(kept.share().unwrap(), declared, data.len(), false).unwrap();
        assert!(none.is_none());
        assert_eq!(&again[..], &data[..]);
        // Private: writing changes our copy only.
        bytes[0] ^= 0xff;
        assert_ne!(bytes[0], data[0]);
    }

    #[test]
    fn wrong_size_or_missing_seals_are_refused_and_the_checksum_is_not_read() {
        let data = payload(256 * 1024);
        let region = OutgoingRegion::create(&data).unwrap();
        let declared = region.descriptor();
        let fd = region.into_fd().unwrap();
        let dup = fd.try_clone().unwrap();
        assert!(matches!(
            adopt(dup, declared, data.len() + 1, false),
            Err(StreamError::RegionSize { .. })
        ));
        // The declared crc32c is the sender's word, which the seals make unnecessary: a region
        // is adopted for the bytes it holds (the content hash is what identifies them).
        let wrong = RegionDescriptor {
            crc32c: declared.crc32c ^ 1,
            ..declared
        };
        let (bytes, _) = adopt(fd, wrong, data.len(), false).unwrap();
        assert_eq!(&bytes[..], &data[..]);

        let unsealed = rustix::fs::memfd_create(
            "ferry-test",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .unwrap();
        rustix::fs::ftruncate(&unsealed, data.len() as u64).unwrap();
        assert!(matches!(
            adopt(unsealed, declared, data.len(), false),
            Err(StreamError::RegionRefused { .. })
        ));
        let file = tempfile::tempfile().unwrap();
        assert!(matches!(
            adopt(file.into(), declared, data.len(), false),
            Err(StreamError::RegionRefused { .. })
        ));
    }
}
