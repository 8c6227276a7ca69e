//! An elastic pool's policy: what each of its two threads does next, decided by a pure function
//! ([`next_job`]) from what the thread sees under the pool's lock ([`KeeperView`]); the threads
//! (`keeper.rs`) only carry the [`Plan`] out.

use std::time::Duration;

use super::GRANULE;
use super::readiness::{BOUND_POLL, BUSY_SPELL, Readiness, SPARE_POLL, STEP, SpareCheck};

/// Which of an elastic pool's two threads: each decides from the same targets, and does only
/// its own half.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Keeper {
    /// Touches untouched ranges to make them ready, in the CPU time [`Readiness::touching`]
    /// says.
    Toucher,
    /// Gives ready ranges above the targets back to the kernel, at normal priority: memory the
    /// node does not need goes back even while the machine is too busy for the toucher to run.
    Releaser,
}

/// Everything a keeper reads to decide its next job: its pool's targets, and the pool's state
/// as it finds it under the lock.
#[derive(Debug, Clone, Copy)]
pub(super) struct KeeperView {
    /// Which thread decides.
    pub(super) keeper: Keeper,
    /// The targets, in whole granules within the pool (as [`Pool::elastic`] rounds them).
    ///
    /// [`Pool::elastic`]: super::Pool::elastic
    pub(super) readiness: Readiness,
    /// Whether the machine has memory to spare for the start amount: asked before the lock
    /// (where [`asks_for_spare`] says so) and answered yes, or not asked.
    pub(super) spare: bool,
    /// The bound's room in whole granules ([`whole_granules`]); `None` without a bound.
    pub(super) room: Option<usize>,
    /// How long since the last take or arrival; `None` before the first.
    pub(super) since_take: Option<Duration>,
    /// How long since the pool started.
    pub(super) since_start: Duration,
    /// The bytes ready now (in the ready list).
    pub(super) ready: usize,
}

/// What a keeper does next: take a range for [`work`](Plan::work) out of a free list and work
/// on it, or, where there is no work (or no range for it), wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Plan {
    /// The range to take, if any.
    pub(super) work: Option<Work>,
    /// How long to wait, where it waits (a take, an arrival, a bound set, the other thread's
    /// finished touch or the pool dropped wakes it sooner).
    pub(super) wait: Duration,
    /// Whether to ask the machine for spare memory again after the wait, before deciding again.
    pub(super) ask_again: bool,
}

/// A range a keeper takes out of a free list, at most these bytes (a multiple of [`GRANULE`],
/// at most [`STEP`], never 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Work {
    /// The toucher touches up to `want` bytes from the lowest untouched range.
    Touch {
        /// The bytes short of the target, whole granules, a step at most.
        want: usize,
    },
    /// The releaser gives up to `excess` bytes from the highest ready range back.
    Release {
        /// The whole granules above what is kept, a step at most.
        excess: usize,
    },
}

/// The most ready bytes worth keeping under a bound of `room`: the room, up to a whole granule
/// (a receive that fills the room takes whole granules).
pub(super) fn whole_granules(room: usize) -> usize {
    room.checked_next_multiple_of(GRANULE).unwrap_or(usize::MAX)
}

/// Whether `keeper` must ask the machine if it has memory to spare for the start amount before
/// it decides (a few file reads, so asked before the lock): while the start amount may still be
/// made, within its time and before anything was drawn or arrived (after which the answer is
/// not used). Only the toucher makes anything: the releaser never asks.
pub(super) fn asks_for_spare(
    keeper: Keeper,
    readiness: &Readiness,
    since_start: Duration,
    arrived: bool,
) -> bool {
    keeper == Keeper::Toucher
        && readiness.at_start.spare == SpareCheck::HalfFree
        && since_start < readiness.at_start.kept_for
        && !arrived
}

/// What the keeper `view` is of does next: the toucher tops the ready bytes up to the target,
/// the releaser gives what is above what is kept back, and either waits when it has nothing to
/// do, or no range to do it with.
pub(super) fn next_job(view: &KeeperView) -> Plan {
    let KeeperView {
        keeper,
        readiness,
        spare,
        room: bound,
        since_take: since,
        since_start,
        ready,
    } = *view;
    let room = bound.unwrap_or(usize::MAX);
    // Nothing drawn yet, within the start's time: the start amount.
    let start_left = since
        .is_none()
        .then(|| readiness.at_start.kept_for.checked_sub(since_start))
        .flatten()
        .filter(|left| !left.is_zero());
    let at_rest = match start_left {
        Some(_) => readiness.at_start.bytes,
        None => readiness.idle,
    };
    // Above the idle amount, the start amount is made only with memory to spare (what was made
    // is kept: `keep` below).
    let to_make = if spare {
        at_rest
    } else {
        at_rest.min(readiness.idle)
    };
    // Arriving: only the next ranges; between arrivals: the idle amount (at start, the start
    // amount), in idle time; long idle: nothing above it kept.
    let busy = since.is_some_and(|s| s < BUSY_SPELL);
    let idle = !busy && since.is_none_or(|s| s >= readiness.idle_after);
    // Something left to make that spare memory would allow: ask again after the wait.
    let short_of_spare =
        keeper == Keeper::Toucher && to_make < at_rest && ready < at_rest.min(room);
    // A yes is asked again after a wait too: it may be old by then.
    let ask_again = short_of_spare
        || (keeper == Keeper::Toucher
            && spare
            && start_left.is_some()
            && readiness.at_start.spare == SpareCheck::HalfFree
            && at_rest > readiness.idle);
    let target = if busy { readiness.ahead } else { to_make }.min(room);
    // Kept: the idle amount (at start, the start amount) once idle, and no more than the room
    // once no receive is arriving. (Not while one is: a receive admitted by its budget, whose
    // room no longer counts it, may be about to draw the very range.)
    let keep = if idle {
        at_rest.min(room)
    } else if busy {
        usize::MAX
    } else {
        room
    };
    let work = match keeper {
        Keeper::Toucher => (ready < target).then(|| Work::Touch {
            want: (target - ready).min(STEP).next_multiple_of(GRANULE),
        }),
        // (Never below the target the toucher makes: `keep` is at least it.)
        Keeper::Releaser => {
            let excess = ready.saturating_sub(keep) / GRANULE * GRANULE;
            (excess > 0).then(|| Work::Release {
                excess: excess.min(STEP),
            })
        }
    };
    // Nothing to do until a take, or until the busy spell or the idle wait ends; a pool dropped
    // meanwhile wakes it (its last buffer's drop: within the timeout).
    let wait = match since {
        Some(since) if busy => BUSY_SPELL.saturating_sub(since),
        Some(since) if !idle => readiness.idle_after.saturating_sub(since),
        _ => Duration::from_secs(10),
    }
    .min(if bound.is_some() {
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
    Plan {
        work,
        wait,
        ask_again,
    }
}

#[cfg(test)]
mod tests;
