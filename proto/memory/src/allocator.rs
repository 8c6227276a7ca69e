//! The process's allocator policy for a node: freed tensor memory goes back to the system, and
//! recycled receive buffers left idle are freed.

use std::time::Duration;

/// Makes freed tensor memory go back to the system. glibc serves allocations under its mmap
/// threshold from per-thread arenas and raises that threshold (up to 32 MiB) each time a large
/// block is freed, so after a burst of mid-sized tensors the arenas keep hundreds of MiB the
/// node no longer holds. A fixed threshold keeps every buffer of 256 KiB or more in its own
/// mapping, returned when freed, and a periodic trim returns what the arenas free. One arena
/// instead of up to eight per core: tensor buffers never come from an arena, and every extra
/// arena kept a few MiB of fragments after a 256-client run (measured after `ferry load
/// --clients 256`: +19% to +44% over the idle node's memory with glibc's default, +1% to +2%
/// with one arena, at the same throughput).
///
/// Call it first thing in `main`, before other threads exist: glibc fixes its arena limit when
/// the second arena is made.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn tune(recycled_idle: Duration) {
    // SAFETY: mallopt and malloc_trim only change and apply glibc's allocation policy.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 4 << 20);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
    std::thread::Builder::new()
        .name("malloc-trim".into())
        .spawn(move || {
            for tick in 1u64.. {
                std::thread::sleep(Duration::from_secs(1));
                crate::host::trim_recycled(recycled_idle);
                if tick % 5 == 0 {
                    // SAFETY: as above.
                    unsafe {
                        libc::malloc_trim(0);
                    }
                }
            }
        })
        .ok();
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn tune(recycled_idle: Duration) {
    std::thread::Builder::new()
        .name("recycle-trim".into())
        .spawn(move || {
            loop {
                std::thread::sleep(Duration::from_secs(1));
                crate::host::trim_recycled(recycled_idle);
            }
        })
        .ok();
}
