//! The policy's tables: states a keeper may find, and the plan it must make of each.

use super::*;
use crate::pool::{AtStart, Touching};

const MIB: usize = 1 << 20;
/// What a keeper with nothing to wait for waits (a take or a dropped pool wakes it sooner).
const LONG: Duration = Duration::from_secs(10);

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

fn secs(secs: u64) -> Duration {
    Duration::from_secs(secs)
}

/// The targets of every row unless it says otherwise: 4 MiB idle, 8 MiB ahead, given back after
/// 300 ms without a take, and 40 MiB at start for 10 s, with memory to spare.
fn readiness() -> Readiness {
    Readiness {
        idle: 4 * MIB,
        ahead: 8 * MIB,
        idle_after: ms(300),
        touching: Touching::AlongsideOthers,
        at_start: AtStart {
            bytes: 40 * MIB,
            kept_for: secs(10),
            spare: SpareCheck::HalfFree,
        },
    }
}

/// The toucher's view of an unbounded pool started 1 s ago, nothing drawn nor ready, with
/// memory to spare.
fn toucher() -> KeeperView {
    KeeperView {
        keeper: Keeper::Toucher,
        readiness: readiness(),
        spare: true,
        room: None,
        since_take: None,
        since_start: secs(1),
        ready: 0,
    }
}

/// The releaser's view of the same (it never asks: spare memory counts as there).
fn releaser() -> KeeperView {
    KeeperView {
        keeper: Keeper::Releaser,
        ..toucher()
    }
}

/// The same view, one thing changed.
impl KeeperView {
    fn ready(self, ready: usize) -> Self {
        KeeperView { ready, ..self }
    }

    /// The machine said it has no memory to spare.
    fn no_spare(self) -> Self {
        KeeperView {
            spare: false,
            ..self
        }
    }

    fn room(self, room: usize) -> Self {
        KeeperView {
            room: Some(room),
            ..self
        }
    }

    fn started(self, since_start: Duration) -> Self {
        KeeperView {
            since_start,
            ..self
        }
    }

    /// The last take `since` ago, 1 min after the start.
    fn taken(self, since: Duration) -> Self {
        KeeperView {
            since_take: Some(since),
            since_start: secs(60),
            ..self
        }
    }

    fn targets(self, readiness: Readiness) -> Self {
        KeeperView { readiness, ..self }
    }
}

fn touch(want: usize, wait: Duration, ask_again: bool) -> Plan {
    Plan {
        work: Some(Work::Touch { want }),
        wait,
        ask_again,
    }
}

fn release(excess: usize, wait: Duration) -> Plan {
    Plan {
        work: Some(Work::Release { excess }),
        wait,
        ask_again: false,
    }
}

fn wait(wait: Duration, ask_again: bool) -> Plan {
    Plan {
        work: None,
        wait,
        ask_again,
    }
}

/// Checks each row's plan, naming the row that fails.
fn check(rows: &[(&str, KeeperView, Plan)]) {
    for (what, view, plan) in rows {
        assert_eq!(next_job(view), *plan, "{what}: {view:?}");
    }
}

#[test]
fn a_starting_pool_makes_its_start_amount_with_spare_memory_and_its_idle_amount_without() {
    // 9 s of the start's time left: the longest wait. With a start amount to make, a yes is
    // asked again after the wait too.
    check(&[
        ("a step first", toucher(), touch(32 * MIB, secs(9), true)),
        (
            "the rest of it",
            toucher().ready(32 * MIB),
            touch(8 * MIB, secs(9), true),
        ),
        (
            "made: the start's time waited out",
            toucher().ready(40 * MIB),
            wait(secs(9), true),
        ),
        (
            "no spare memory: the idle amount, asked again within its poll",
            toucher().no_spare(),
            touch(4 * MIB, SPARE_POLL, true),
        ),
        (
            "no spare memory, the idle amount made: asked again within its poll",
            toucher().no_spare().ready(4 * MIB),
            wait(SPARE_POLL, true),
        ),
        (
            "no spare memory now, but made before: kept, not asked for",
            toucher().no_spare().ready(40 * MIB),
            wait(secs(9), false),
        ),
        (
            "the releaser keeps the start amount",
            releaser().ready(40 * MIB),
            wait(secs(9), false),
        ),
        (
            "the releaser gives back what is above it",
            releaser().ready(48 * MIB),
            release(8 * MIB, secs(9)),
        ),
    ]);
}

#[test]
fn a_pool_whose_start_time_passed_with_no_take_keeps_its_idle_amount() {
    check(&[
        (
            "the toucher makes the idle amount only",
            toucher().started(secs(10)),
            touch(4 * MIB, LONG, false),
        ),
        (
            "nor asks, short of spare memory or not",
            toucher().started(secs(10)).no_spare().ready(4 * MIB),
            wait(LONG, false),
        ),
        (
            "the releaser gives the start amount back, a step at a time",
            releaser().started(secs(10)).ready(40 * MIB),
            release(32 * MIB, LONG),
        ),
        (
            "and the rest of it",
            releaser().started(secs(11)).ready(8 * MIB),
            release(4 * MIB, LONG),
        ),
    ]);
}

#[test]
fn the_first_take_ends_the_start_amount_and_what_is_left_goes_back_once_idle() {
    // 24 MiB of the 40 drawn at once, 1 s after the start.
    let taken = |view: KeeperView, since| KeeperView {
        since_take: Some(since),
        ..view.ready(16 * MIB)
    };
    check(&[
        (
            "busy: the ahead amount is ready, nothing more made",
            taken(toucher(), ms(0)),
            wait(BUSY_SPELL, false),
        ),
        (
            "busy: nothing given back",
            taken(releaser(), ms(0)),
            wait(BUSY_SPELL, false),
        ),
        (
            "between arrivals: nothing given back until idle",
            taken(releaser(), ms(250)),
            wait(ms(50), false),
        ),
        (
            "idle: what is above the idle amount goes back",
            taken(releaser(), ms(300)),
            release(12 * MIB, LONG),
        ),
        (
            "idle: the start amount is not made again",
            taken(toucher(), ms(300)).ready(0),
            touch(4 * MIB, LONG, false),
        ),
    ]);
}

#[test]
fn a_busy_pool_touches_its_ahead_amount_and_gives_nothing_back() {
    let far_ahead = Readiness {
        ahead: 100 * MIB,
        ..readiness()
    };
    check(&[
        (
            "short of the ahead amount",
            toucher().taken(ms(100)).ready(2 * MIB),
            touch(6 * MIB, ms(150), false),
        ),
        (
            "a step at a time",
            toucher().taken(ms(100)).targets(far_ahead),
            touch(32 * MIB, ms(150), false),
        ),
        (
            "whole granules",
            toucher().taken(ms(100)).ready(8 * MIB - 100),
            touch(GRANULE, ms(150), false),
        ),
        (
            "ahead already",
            toucher().taken(ms(100)).ready(8 * MIB),
            wait(ms(150), false),
        ),
        (
            "above every target, kept while busy",
            releaser().taken(ms(100)).ready(100 * MIB),
            wait(ms(150), false),
        ),
    ]);
}

#[test]
fn an_idle_pool_gives_back_what_is_above_its_idle_amount() {
    let idle = |view: KeeperView, ready| view.taken(secs(1)).ready(ready);
    check(&[
        (
            "a step at a time",
            idle(releaser(), 40 * MIB),
            release(32 * MIB, LONG),
        ),
        (
            "the rest",
            idle(releaser(), 20 * MIB),
            release(16 * MIB, LONG),
        ),
        (
            "a granule above",
            idle(releaser(), 4 * MIB + GRANULE),
            release(GRANULE, LONG),
        ),
        (
            "less than a granule above: kept",
            idle(releaser(), 4 * MIB + GRANULE - 1),
            wait(LONG, false),
        ),
        (
            "the idle amount kept",
            idle(releaser(), 4 * MIB),
            wait(LONG, false),
        ),
        (
            "the toucher makes it again",
            idle(toucher(), 0),
            touch(4 * MIB, LONG, false),
        ),
        (
            "the toucher makes nothing above it",
            idle(toucher(), 40 * MIB),
            wait(LONG, false),
        ),
    ]);
}

#[test]
fn a_bounded_pool_makes_no_more_ready_than_its_room_and_keeps_no_more_once_not_busy() {
    let (busy, between, idle) = (ms(100), ms(250), secs(1));
    check(&[
        (
            "idle: the idle amount, within the room",
            toucher().taken(idle).room(2 * MIB),
            touch(2 * MIB, BOUND_POLL, false),
        ),
        (
            "busy: the ahead amount, within the room",
            toucher().taken(busy).room(2 * MIB),
            touch(2 * MIB, ms(150), false),
        ),
        (
            "busy, the room ready: nothing more",
            toucher().taken(busy).room(2 * MIB).ready(2 * MIB),
            wait(ms(150), false),
        ),
        (
            "at start: the start amount, within the room",
            toucher().room(16 * MIB),
            touch(16 * MIB, BOUND_POLL, true),
        ),
        (
            "at start, no spare memory, the room ready: nothing to ask for",
            toucher().no_spare().room(2 * MIB).ready(2 * MIB),
            wait(BOUND_POLL, false),
        ),
        (
            "busy: above the room kept (a receive may draw it)",
            releaser().taken(busy).room(2 * MIB).ready(6 * MIB),
            wait(ms(150), false),
        ),
        (
            "between arrivals: the room kept, no more",
            releaser().taken(between).room(2 * MIB).ready(6 * MIB),
            release(4 * MIB, ms(50)),
        ),
        (
            "between arrivals: all of a large room kept",
            releaser().taken(between).room(16 * MIB).ready(6 * MIB),
            wait(ms(50), false),
        ),
        (
            "idle: the room kept, where under the idle amount",
            releaser().taken(idle).room(2 * MIB).ready(6 * MIB),
            release(4 * MIB, BOUND_POLL),
        ),
        (
            "idle: the idle amount kept, where under the room",
            releaser().taken(idle).room(16 * MIB).ready(6 * MIB),
            release(2 * MIB, BOUND_POLL),
        ),
    ]);
}

#[test]
fn only_a_toucher_with_a_start_amount_to_make_asks_for_spare_memory_again() {
    let unchecked = Readiness {
        at_start: AtStart {
            spare: SpareCheck::Unchecked,
            ..readiness().at_start
        },
        ..readiness()
    };
    let idle_at_start = Readiness {
        at_start: AtStart {
            bytes: 4 * MIB,
            ..readiness().at_start
        },
        ..readiness()
    };
    check(&[
        ("a yes, to make", toucher(), touch(32 * MIB, secs(9), true)),
        (
            "no, short of it",
            toucher().no_spare(),
            touch(4 * MIB, SPARE_POLL, true),
        ),
        (
            "unchecked",
            toucher().targets(unchecked),
            touch(32 * MIB, secs(9), false),
        ),
        (
            "a start amount no larger than the idle amount",
            toucher().targets(idle_at_start),
            touch(4 * MIB, secs(9), false),
        ),
        ("the releaser", releaser(), wait(secs(9), false)),
        (
            "after the first take",
            toucher().taken(secs(1)),
            touch(4 * MIB, LONG, false),
        ),
    ]);
    // Asked at all (before the lock): only by the toucher, and only while the answer counts.
    let (toucher, r) = (Keeper::Toucher, readiness());
    assert!(asks_for_spare(toucher, &r, secs(1), false), "at start");
    assert!(!asks_for_spare(Keeper::Releaser, &r, secs(1), false));
    assert!(!asks_for_spare(toucher, &unchecked, secs(1), false));
    assert!(!asks_for_spare(toucher, &r, secs(10), false), "time over");
    assert!(!asks_for_spare(toucher, &r, secs(1), true), "arrived");
}

#[test]
fn a_keeper_waits_for_the_first_of_its_ends_and_at_least_a_millisecond() {
    let just_before = |end: Duration| end - Duration::from_micros(100);
    check(&[
        (
            "the busy spell's end",
            releaser().taken(ms(100)),
            wait(ms(150), false),
        ),
        (
            "the idle wait's end",
            releaser().taken(ms(250)),
            wait(ms(50), false),
        ),
        (
            "idle: until woken",
            releaser().taken(ms(300)).ready(40 * MIB),
            release(32 * MIB, LONG),
        ),
        (
            "bounded: the next look at the room",
            releaser().taken(secs(1)).room(usize::MAX),
            wait(BOUND_POLL, false),
        ),
        (
            "bounded and busy: the sooner",
            releaser().taken(ms(200)).room(usize::MAX),
            wait(ms(50), false),
        ),
        (
            "at start: the start's time left",
            toucher().started(ms(9_995)).ready(40 * MIB),
            wait(ms(5), true),
        ),
        (
            "short of spare memory: the next ask",
            toucher().no_spare(),
            touch(4 * MIB, SPARE_POLL, true),
        ),
        (
            "a millisecond at least: at the start's end",
            toucher().started(just_before(secs(10))).ready(40 * MIB),
            wait(ms(1), true),
        ),
        (
            "a millisecond at least: at the busy spell's end",
            releaser().taken(just_before(BUSY_SPELL)),
            wait(ms(1), false),
        ),
    ]);
}

#[test]
fn the_room_of_a_bound_counts_in_whole_granules() {
    assert_eq!(whole_granules(0), 0);
    assert_eq!(whole_granules(3 * MIB - 100), 3 * MIB);
    assert_eq!(whole_granules(3 * MIB), 3 * MIB);
    assert_eq!(whole_granules(usize::MAX), usize::MAX, "no overflow");
}

/// Over a grid of states: the toucher never makes what the releaser would give back, every
/// range asked for is whole granules and a step at most, and every wait a millisecond at least.
#[test]
fn the_two_keepers_never_work_against_each_other() {
    let mut worked = 0;
    for ready in [0, 2, 4, 8, 16, 40, 48, 100].map(|m| m * MIB) {
        for room in [None, Some(2 * MIB), Some(16 * MIB), Some(usize::MAX)] {
            for since_take in [
                None,
                Some(ms(0)),
                Some(ms(100)),
                Some(ms(250)),
                Some(secs(1)),
            ] {
                for (since_start, spare) in [(secs(1), true), (secs(1), false), (secs(11), true)] {
                    let view = KeeperView {
                        room,
                        since_take,
                        since_start,
                        spare,
                        ready,
                        ..toucher()
                    };
                    let made = next_job(&view);
                    let given = next_job(&KeeperView {
                        keeper: Keeper::Releaser,
                        ..view
                    });
                    for plan in [made, given] {
                        assert!(plan.wait >= ms(1), "{view:?}");
                        if let Some(Work::Touch { want: bytes } | Work::Release { excess: bytes }) =
                            plan.work
                        {
                            assert!(bytes > 0 && bytes <= STEP, "{view:?}");
                            assert!(bytes.is_multiple_of(GRANULE), "{view:?}");
                        }
                    }
                    assert!(
                        made.work.is_none() || given.work.is_none(),
                        "{view:?}: {made:?}, {given:?}"
                    );
                    assert!(!given.ask_again, "the releaser never asks");
                    worked += usize::from(made.work.is_some()) + usize::from(given.work.is_some());
                }
            }
        }
    }
    assert!(worked > 0);
}
