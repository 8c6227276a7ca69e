//! What an elastic pool keeps ready and when ([`Readiness`], [`AtStart`], [`SpareCheck`],
//! [`Touching`]), what bounds it ([`ReadyBound`]), and the times and sizes its threads work in.

use std::time::Duration;

/// How much of an elastic pool is kept ready (touched), and when it is given back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Readiness {
    /// Bytes kept ready while nothing arrives (in the background; from start until the first
    /// take, [`Readiness::at_start`] if larger).
    pub idle: usize,
    /// Bytes kept ready beyond those drawn while tensors arrive (a take was made within the
    /// last [`BUSY_SPELL`]): the next ranges, touched beside the receives. Small: what is
    /// touched ahead when the last tensor has come is touched for nothing.
    pub ahead: usize,
    /// How long without a take before ready bytes above `idle` go back to the kernel.
    pub idle_after: Duration,
    /// Which CPU time the pool's thread touches memory in.
    pub touching: Touching,
    /// What is kept ready from the pool's start until its first take or arrival.
    pub at_start: AtStart,
}

/// Memory an elastic pool makes ready at its start for the first tensors it serves: a freshly
/// started node's first tensors are most often a whole model, which then lands in ready memory
/// with no page faulted while it arrives. Drawn once: from the first take (or arrival,
/// [`Pool::note_arrival`]) on, the pool keeps its idle amount again (what is left above it goes
/// back after [`Readiness::idle_after`] without a take), and so it does once
/// [`kept_for`](AtStart::kept_for) has passed without a take.
///
/// [`Pool::note_arrival`]: super::Pool::note_arrival
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtStart {
    /// Bytes kept ready until the first take or arrival (never fewer than [`Readiness::idle`]).
    pub bytes: usize,
    /// How long they are kept without a take.
    pub kept_for: Duration,
    /// Whether the machine must have memory to spare for those above the idle amount.
    pub spare: SpareCheck,
}

impl AtStart {
    /// Nothing beyond the idle amount.
    pub const IDLE: AtStart = AtStart {
        bytes: 0,
        kept_for: Duration::ZERO,
        spare: SpareCheck::Unchecked,
    };
}

/// What an elastic pool asks of the machine before it makes its start amount ready beyond its
/// idle amount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpareCheck {
    /// Each range above the idle amount is made ready only while at least half of the machine's
    /// memory, and of every cgroup limit over the process, is available
    /// ([`crate::spare_memory`]); what was made ready is kept. A node's choice: nodes started
    /// together, or beside other work, stop at half the machine between them.
    HalfFree,
    /// Whatever the machine has (the pool's own tests).
    Unchecked,
}

/// Which CPU time an elastic pool's thread touches memory in (the one that gives memory back runs
/// at normal priority whatever this says).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Touching {
    /// Only time no other thread of the machine wants (Linux `SCHED_IDLE`; elsewhere, or where
    /// the kernel refuses, as any thread): a node's choice. Touching ahead is work a receive
    /// would otherwise do itself, never worth a core taken from a receive, a send or a hash
    /// under way: at normal priority a copy's source node refilled its pool beside the send and
    /// spent 2.03-2.39 s of CPU on a 2.3 GiB copy that took 1.77-1.96 s, against 1.43-1.50 s
    /// and 1.44-1.50 s in idle time (docs/benchmarks.md, `model_load`). On a machine
    /// busy everywhere the thread waits, and a receive that finds nothing ready faults its own
    /// pages, as without a pool.
    InIdleTime,
    /// As any other thread: for a pool whose ready memory is wanted within a bounded time
    /// whatever else runs (the tests of its targets, on a machine their neighbours keep busy).
    AlongsideOthers,
}

/// What bounds the receives an elastic pool serves beyond its own capacity (a device budget):
/// ready memory above [`room`](ReadyBound::room) could never be drawn, so it is not kept.
pub trait ReadyBound: Send + Sync {
    /// The most bytes receives may still draw now. Called by the pool's thread, often, with
    /// the pool's free list locked: cheap, and never calling into the pool.
    fn room(&self) -> usize;
}

/// How often an elastic pool bounded by a [`ReadyBound`] looks at its room while nothing else
/// wakes it (a budget fills as tensors land in new memory too, which the pool does not see).
pub(super) const BOUND_POLL: Duration = Duration::from_millis(200);

/// How often a pool whose start amount the machine had no memory to spare for asks again.
pub(super) const SPARE_POLL: Duration = Duration::from_secs(1);

/// How recent a take must be for tensors to count as arriving.
pub const BUSY_SPELL: Duration = Duration::from_millis(250);

/// The ranges the background thread touches or releases at a time: small enough that a
/// receive finds the next one ready soon, large enough for huge pages and few system calls.
pub(super) const STEP: usize = 32 << 20;
