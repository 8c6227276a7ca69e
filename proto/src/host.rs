//! Host buffers backed by a memory mapping, handed to Burn as `Bytes` without a copy.
//!
//! Two kinds: an anonymous mapping for a large receive buffer (advised to use transparent huge
//! pages, because first-touch page faults of a fresh buffer cost more than the network copy
//! into it), and a private copy-on-write mapping of a sealed shared-memory region a peer passed
//! over a Unix socket, so the receiver adopts the sender's pages instead of copying them.

use std::mem::MaybeUninit;

use burn_std::Bytes;
use burn_std::bytes::{AccessError, AccessPolicy, AllocationController, AllocationProperty};
use memmap2::MmapMut;

/// Buffers at least this large are mapped (with huge pages advised) rather than taken from the
/// allocator: below it the allocator's recycled, already-touched memory is cheaper.
pub const MAPPED_MIN: usize = 4 << 20;

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

/// A zeroed buffer of `len` bytes in its own anonymous mapping, with transparent huge pages
/// advised (the kernel may ignore the advice; it is a speed hint, never needed for correctness).
pub fn mapped_zeroed(len: usize) -> std::io::Result<Bytes> {
    let map = memmap2::MmapOptions::new().len(len).map_anon()?;
    #[cfg(target_os = "linux")]
    {
        let _ = map.advise(memmap2::Advice::HugePage);
    }
    Ok(bytes_from_mapping(map))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapped_buffer_is_zeroed_writable_and_page_aligned() {
        let mut bytes = mapped_zeroed(MAPPED_MIN).unwrap();
        assert_eq!(bytes.len(), MAPPED_MIN);
        assert!(bytes.iter().all(|&b| b == 0));
        assert_eq!(bytes.as_ptr() as usize % 4096, 0);
        bytes[17] = 3;
        assert_eq!(bytes[17], 3);
        let copy = bytes.clone();
        assert_eq!(&copy[..], &bytes[..]);
    }
}
