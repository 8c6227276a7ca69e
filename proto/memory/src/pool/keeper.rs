//! An elastic pool's two background threads ([`keep_ready`]): each reads the pool under its
//! lock, asks the policy what to do ([`next_job`]), takes the range for it out of a free list
//! and touches or releases it outside the lock, or waits; and how memory is touched
//! ([`populate`], [`touch_by_writes`]) and a thread put on idle CPU time.

use std::ptr::NonNull;
use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::Instant;

use memmap2::MmapMut;

use super::free_list::Side;
use super::policy::{Keeper, KeeperView, Work, asks_for_spare, next_job, whole_granules};
use super::readiness::{Readiness, Touching};
use super::{Inner, lock};

/// What a background thread does next, with the range it took out of a free list.
enum Job {
    /// Touch an untouched range, then list it ready.
    Touch(usize, usize),
    /// Nothing: ask the machine for spare memory again before deciding.
    AskAgain,
    /// Give a ready range back to the kernel, then list it untouched.
    Release(usize, usize),
}

/// One of an elastic pool's background threads (`keeper` says which half it does): tops the
/// ready bytes up to the target (touching the lowest untouched range, a
/// [`STEP`](super::readiness::STEP) at a time), or gives ready bytes above the idle target back
/// once nothing was drawn for a while (and above the bound's room once nothing arrives); ends
/// when the pool is gone. Both count the start amount's time from `started`. What to do is the
/// policy's ([`next_job`]); this carries it out.
pub(super) fn keep_ready(
    pool: Weak<Inner>,
    readiness: Readiness,
    keeper: Keeper,
    started: Instant,
) {
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
        // Asked before the lock (a few file reads), where the answer may be used.
        let spare = !asks_for_spare(
            keeper,
            &readiness,
            started.elapsed(),
            inner.arrived.load(Ordering::Relaxed),
        ) || machine_has_spare_memory();
        let job = {
            let mut free = lock(&inner);
            loop {
                let plan = next_job(&KeeperView {
                    keeper,
                    readiness,
                    spare,
                    room: inner.bound.get().map(|bound| whole_granules(bound.room())),
                    since_take: free.last_take.map(|at| at.elapsed()),
                    since_start: started.elapsed(),
                    ready: free.ready.free,
                });
                // The range to work on, if its list has one: where it has none (all drawn, or
                // nothing ready to give back), the thread waits as with nothing to do.
                match plan.work {
                    Some(Work::Touch { want }) => {
                        if let Some((offset, len)) = free.untouched.take_piece(want, Side::Lowest) {
                            free.touching = len;
                            break Job::Touch(offset, len);
                        }
                    }
                    Some(Work::Release { excess }) => {
                        if let Some((offset, len)) = free.ready.take_piece(excess, Side::Highest) {
                            free.releasing = len;
                            break Job::Release(offset, len);
                        }
                    }
                    None => {}
                }
                // Under the lock: the last handle's drop either came before (seen here) or
                // notifies after this wait began.
                if inner.handles.load(Ordering::Acquire) == 0 {
                    return;
                }
                free = inner
                    .wake
                    .wait_timeout(free, plan.wait)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                if inner.handles.load(Ordering::Acquire) == 0 {
                    return;
                }
                // Ask the machine again, outside the lock.
                if plan.ask_again {
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

/// Whether the machine has memory to spare for a start amount
/// ([`SpareCheck::HalfFree`](super::SpareCheck::HalfFree)); the
/// pool's own tests set the answer instead.
fn machine_has_spare_memory() -> bool {
    #[cfg(test)]
    return super::tests::MACHINE_HAS_SPARE.load(Ordering::Relaxed);
    #[cfg(not(test))]
    crate::spare_memory::half_or_more_now()
}

/// Faults in `[offset, offset + len)` of `map` (whose first byte `base` points at, with write
/// access) for writing, at once: `MADV_POPULATE_WRITE` where the kernel has it (Linux 5.14),
/// else a write per page. For a fixed pool at its reservation only: the kernel holds the
/// process's memory-map lock for the whole range meanwhile (see [`touch_by_writes`]).
///
/// # Safety
/// As [`touch_by_writes`]: `base` is `map`'s first byte, and the range lies inside `map` and
/// is the caller's alone.
pub(super) unsafe fn populate(map: &MmapMut, base: NonNull<u8>, offset: usize, len: usize) {
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
