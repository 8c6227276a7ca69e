//! Host memory: huge-page advice for large receive buffers, and `Bytes` backed by a memory
//! mapping (a private copy-on-write mapping of a sealed shared-memory region a peer passed over
//! a Unix socket, so the receiver adopts the sender's pages instead of copying them).

use std::mem::MaybeUninit;

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
    fn huge_page_advice_leaves_the_bytes_alone() {
        let mut buf = vec![0u8; HUGE_PAGES_MIN * 2];
        buf[5] = 1;
        advise_huge_pages(&buf);
        buf[HUGE_PAGES_MIN] = 2;
        assert_eq!((buf[5], buf[HUGE_PAGES_MIN]), (1, 2));
    }
}
