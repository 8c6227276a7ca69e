//! The pool's own tests: buffers carved and given back, and elastic pools racing their threads.

use super::readiness::SPARE_POLL;
use super::*;

/// What `keeper::machine_has_spare_memory` answers in these tests (only one test asks it).
pub(super) static MACHINE_HAS_SPARE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(true);

#[test]
fn buffers_are_carved_disjoint_and_all_come_back() {
    let pool = Pool::reserve(8 * POOL_MIN).unwrap();
    assert_eq!(pool.capacity(), 8 * POOL_MIN);
    assert_eq!(pool.free_bytes(), pool.capacity());
    let mut a = pool.take(3 * POOL_MIN).unwrap().unwrap();
    let mut b = pool.take(2 * POOL_MIN + 1).unwrap().unwrap();
    assert_eq!(a.len(), 3 * POOL_MIN);
    assert_eq!(b.len(), 2 * POOL_MIN + 1);
    a.fill(1);
    b.fill(2);
    assert!(a.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2));
    let (oa, ob) = (pool.offset_of(&a).unwrap(), pool.offset_of(&b).unwrap());
    assert!(oa + a.len() <= ob || ob + b.len() <= oa, "disjoint");
    assert_eq!(oa % GRANULE, 0);
    assert_eq!(ob % GRANULE, 0);
    assert_eq!(
        pool.free_bytes(),
        8 * POOL_MIN - 5 * POOL_MIN - GRANULE,
        "b rounds up to a granule"
    );
    // Too large for what is left: a miss that says what was free, counted.
    let miss = pool.take(4 * POOL_MIN).unwrap_err();
    assert_eq!(miss.wanted, 4 * POOL_MIN);
    assert_eq!(miss.largest_free, 3 * POOL_MIN - GRANULE);
    assert_eq!(pool.misses(), 1);
    // Small payloads never draw (and are not misses).
    assert!(matches!(pool.take(POOL_MIN - 1), Ok(None)));
    assert_eq!(pool.misses(), 1);
    drop(a);
    // The freed range and the tail merge with a middle hole only once b goes too.
    drop(b);
    assert_eq!(pool.free_bytes(), pool.capacity());
    let whole = pool.take(8 * POOL_MIN).unwrap().unwrap();
    assert_eq!(
        pool.offset_of(&whole),
        Some(0),
        "coalesced back into one range"
    );
    assert!(pool.offset_of(&[0u8; 16]).is_none());
}

#[test]
fn a_buffer_outlives_the_pool_handle() {
    let pool = Pool::reserve(POOL_MIN).unwrap();
    let mut buf = pool.take(POOL_MIN).unwrap().unwrap();
    drop(pool);
    buf[POOL_MIN - 1] = 7;
    assert_eq!(buf[POOL_MIN - 1], 7);
}

#[test]
fn a_random_history_of_takes_and_drops_keeps_every_byte_in_one_place() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(14);
    let pool = Pool::reserve(64 * POOL_MIN).unwrap();
    let mut live: Vec<(u8, Bytes)> = Vec::new();
    for step in 0..2000u32 {
        if rng.random_bool(0.55) {
            let len = rng.random_range(POOL_MIN..8 * POOL_MIN);
            if let Ok(Some(mut buf)) = pool.take(len) {
                let mark = (step % 251) as u8;
                buf.fill(mark);
                live.push((mark, buf));
            }
        } else if !live.is_empty() {
            let (mark, buf) = live.swap_remove(rng.random_range(0..live.len()));
            assert!(buf.iter().all(|&x| x == mark), "a buffer was overwritten");
        }
        let drawn: usize = live
            .iter()
            .map(|(_, b)| b.len().next_multiple_of(GRANULE))
            .sum();
        assert_eq!(pool.free_bytes() + drawn, pool.capacity());
    }
    live.clear();
    assert_eq!(pool.free_bytes(), pool.capacity());
    assert_eq!(
        pool.take(64 * POOL_MIN).map(|b| b.map(|b| b.len())),
        Ok(Some(64 * POOL_MIN))
    );
}

/// Waits (up to 10 s) until `done` holds of `pool`.
fn until(pool: &Pool, what: &str, done: impl Fn(&Pool) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done(pool) {
        assert!(
            Instant::now() < deadline,
            "{what}: {pool:?}, ready {}",
            pool.ready_bytes()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn an_elastic_pool_is_ready_before_the_tensor_grows_as_it_fills_and_gives_back_when_idle() {
    const MIB: usize = 1 << 20;
    let readiness = Readiness {
        idle: 8 * MIB,
        ahead: 24 * MIB,
        idle_after: Duration::from_millis(300),
        touching: Touching::AlongsideOthers,
        at_start: AtStart::IDLE,
    };
    let pool = Pool::elastic(128 * MIB, readiness).unwrap();
    // Ready while nothing arrived: the idle amount, and no more.
    until(&pool, "ready at start", |p| p.ready_bytes() == 8 * MIB);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(pool.ready_bytes(), 8 * MIB);
    assert_eq!(pool.free_bytes(), pool.capacity());
    // A tensor arrives: drawn from ready memory, and more made ready ahead of it.
    let first = pool.take(6 * MIB).unwrap().unwrap();
    until(&pool, "ready ahead", |p| p.ready_bytes() >= 24 * MIB);
    let second = pool.take(20 * MIB).unwrap().unwrap();
    until(&pool, "ready ahead again", |p| p.ready_bytes() >= 24 * MIB);
    assert_eq!(pool.free_bytes() + 26 * MIB, pool.capacity());
    // Idle: given back down to the idle amount, the tensors kept.
    drop(first);
    until(&pool, "given back", |p| p.ready_bytes() == 8 * MIB);
    assert_eq!(pool.free_bytes() + 20 * MIB, pool.capacity());
    assert_eq!(second.len(), 20 * MIB);
    drop(second);
    until(&pool, "all free", |p| p.free_bytes() == p.capacity());
    // What no ready range holds is not the pool's to serve (new memory takes it), and is
    // no miss.
    assert!(matches!(pool.take(100 * MIB), Ok(None)));
    assert_eq!(pool.misses(), 0);
}

/// A bound's room caps the ready memory: none is made ready above it, and what is above it
/// goes back to the kernel once no receive is arriving; as the room grows again, the idle
/// amount is made ready again.
#[test]
fn an_elastic_pool_keeps_no_more_ready_than_its_bound_has_room_for() {
    const MIB: usize = 1 << 20;
    let readiness = Readiness {
        idle: 8 * MIB,
        ahead: 24 * MIB,
        // Never idle within the test: only the bound gives memory back.
        idle_after: Duration::from_secs(600),
        touching: Touching::AlongsideOthers,
        at_start: AtStart::IDLE,
    };
    let pool = Pool::elastic(128 * MIB, readiness).unwrap();
    until(&pool, "ready at start", |p| p.ready_bytes() == 8 * MIB);
    let room = Arc::new(Room((3 * MIB - 100).into()));
    assert!(pool.bound_ready_by(room.clone()));
    assert!(!pool.bound_ready_by(room.clone()), "set once");
    until(&pool, "given back to the room", |p| {
        p.ready_bytes() == 3 * MIB
    });
    // A receive, then none: ahead of it no more than the room, and within the room once the
    // receives stop.
    let drawn = pool.take(2 * MIB).unwrap().unwrap();
    room.0.store(MIB, Ordering::Relaxed);
    until(&pool, "within the room", |p| p.ready_bytes() == MIB);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(pool.ready_bytes(), MIB, "no more made ready than the room");
    // Room again (the tensor deleted): its buffer is ready, and the idle amount again.
    room.0.store(usize::MAX, Ordering::Relaxed);
    drop(drawn);
    until(&pool, "ready again", |p| p.ready_bytes() >= 8 * MIB);
    // A fixed pool is all ready for good: no bound applies.
    let fixed = Pool::reserve(4 * MIB).unwrap();
    assert!(!fixed.bound_ready_by(room));
}

/// A bound whose room a test sets.
struct Room(std::sync::atomic::AtomicUsize);

impl ReadyBound for Room {
    fn room(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// A random history of takes and drops (seeded) racing the pool's thread, which touches and
/// releases between them; where `room` is given, its room is set anew at every step. Every
/// byte stays in one place (a buffer's marks survive, and free plus drawn is the capacity),
/// and everything comes back at the end.
fn race_against_its_thread(pool: &Pool, seed: u64, room: Option<&Room>) {
    use rand::{Rng, SeedableRng};
    const MIB: usize = 1 << 20;
    const PAGE: usize = 4096;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut live: Vec<(u8, Bytes)> = Vec::new();
    for step in 0..3000u32 {
        if let Some(room) = room {
            room.0
                .store(rng.random_range(0..48 * MIB), Ordering::Relaxed);
        }
        if rng.random_bool(0.5) {
            let len = rng.random_range(POOL_MIN..6 * POOL_MIN);
            if let Ok(Some(mut buf)) = pool.take(len) {
                // The first byte of every page: what the thread's touch writes and a
                // release zeroes (buffers start page-aligned).
                let mark = (step % 251) as u8 + 1;
                buf.iter_mut().step_by(PAGE).for_each(|b| *b = mark);
                live.push((mark, buf));
            }
        } else if !live.is_empty() {
            let (mark, buf) = live.swap_remove(rng.random_range(0..live.len()));
            let kept = buf.iter().step_by(PAGE).all(|&x| x == mark);
            assert!(kept, "a buffer was touched or released");
        }
        if step % 50 == 0 {
            // Let the thread touch and release between takes, as idle spells do.
            std::thread::sleep(Duration::from_millis(3));
        }
        let drawn: usize = live
            .iter()
            .map(|(_, b)| b.len().next_multiple_of(GRANULE))
            .sum();
        assert_eq!(pool.free_bytes() + drawn, pool.capacity());
    }
    for (mark, buf) in &live {
        let kept = buf.iter().step_by(PAGE).all(|x| x == mark);
        assert!(kept, "a buffer was touched or released");
    }
    live.clear();
    until(pool, "everything back", |p| p.free_bytes() == p.capacity());
}

fn racing_readiness() -> Readiness {
    const MIB: usize = 1 << 20;
    Readiness {
        idle: 4 * MIB,
        ahead: 16 * MIB,
        idle_after: Duration::from_millis(2),
        touching: Touching::AlongsideOthers,
        at_start: AtStart::IDLE,
    }
}

#[test]
fn an_elastic_pool_racing_its_thread_keeps_every_byte_in_one_place() {
    let pool = Pool::elastic(64 << 20, racing_readiness()).unwrap();
    race_against_its_thread(&pool, 30, None);
    until(&pool, "idle again", |p| p.ready_bytes() == 4 << 20);
}

/// The same race with the bound's room shifting at every step (as budgets fill and empty):
/// no byte is lost or shared, and once the room stays small the ready memory fits it.
#[test]
fn an_elastic_pool_racing_its_thread_under_a_shifting_bound_keeps_every_byte_in_one_place() {
    let pool = Pool::elastic(64 << 20, racing_readiness()).unwrap();
    let room = Arc::new(Room(usize::MAX.into()));
    assert!(pool.bound_ready_by(room.clone()));
    race_against_its_thread(&pool, 31, Some(&room));
    room.0.store(2 << 20, Ordering::Relaxed);
    until(&pool, "within the room", |p| p.ready_bytes() <= 2 << 20);
    room.0.store(usize::MAX, Ordering::Relaxed);
    until(&pool, "idle again", |p| p.ready_bytes() == 4 << 20);
}

/// A node's pool touches in idle time: its touching thread runs under `SCHED_IDLE`, and
/// still makes its memory ready on a machine with time to spare; the one that gives memory
/// back runs at normal priority.
#[cfg(target_os = "linux")]
#[test]
fn a_pool_touching_in_idle_time_runs_its_toucher_at_idle_priority_and_its_releaser_not() {
    let readiness = Readiness {
        idle: 4 << 20,
        ahead: 4 << 20,
        idle_after: Duration::from_secs(600),
        touching: Touching::InIdleTime,
        at_start: AtStart::IDLE,
    };
    let pool = Pool::elastic(16 << 20, readiness).unwrap();
    // The scheduling policy of each of this process's threads named `name` (field 41 of a
    // task's `stat`, counted from its pid; the name in parentheses before it may hold
    // spaces, so fields are counted after its closing one).
    let policies = |name: &str| -> Vec<i32> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|task| {
                let dir = task.ok()?.path();
                let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
                (comm.trim_end() == name).then_some(())?;
                let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
                let (_, after_name) = stat.rsplit_once(')')?;
                after_name.split_whitespace().nth(38)?.parse().ok()
            })
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let seen = policies("ferry-pool-idle");
        if !seen.is_empty() && seen.iter().all(|&p| p == libc::SCHED_IDLE) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "pool threads' policies: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Every pool's releaser (this test's and its neighbours') at normal priority, once
    // this one's has named itself.
    loop {
        let releasers = policies("ferry-pool-back");
        assert!(
            releasers.iter().all(|&p| p == libc::SCHED_OTHER),
            "{releasers:?}"
        );
        if !releasers.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "no releaser thread");
        std::thread::sleep(Duration::from_millis(5));
    }
    until(&pool, "ready", |p| p.ready_bytes() == 4 << 20);
}

/// An elastic pool's threads work on while any handle or buffer is alive (a clone dropped
/// ends nothing), and end, its memory unmapped, once the last handle and the last buffer
/// are gone, whichever goes last.
#[test]
fn an_elastic_pool_is_freed_once_its_handles_and_buffers_are_gone() {
    for buffer_last in [false, true] {
        let pool = Pool::elastic(16 << 20, racing_readiness()).unwrap();
        drop(pool.clone());
        let clone = pool.clone();
        until(&pool, "ready", |p| p.ready_bytes() >= 4 << 20);
        let buffer = pool.take(4 << 20).unwrap().unwrap();
        // Still worked on: the toucher makes the idle amount ready again.
        until(&pool, "ready again", |p| p.ready_bytes() >= 4 << 20);
        let inner = Arc::downgrade(&pool.inner);
        if buffer_last {
            drop((pool, clone));
            drop(buffer);
        } else {
            drop(buffer);
            drop((pool, clone));
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while inner.upgrade().is_some() {
            assert!(Instant::now() < deadline, "the pool's threads kept it");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn starting(at_start: usize, kept_for: Duration) -> Readiness {
    const MIB: usize = 1 << 20;
    Readiness {
        idle: 4 * MIB,
        ahead: 8 * MIB,
        idle_after: Duration::from_millis(300),
        touching: Touching::AlongsideOthers,
        at_start: AtStart {
            bytes: at_start,
            kept_for,
            spare: SpareCheck::Unchecked,
        },
    }
}

/// A start amount that asks the machine makes no more than the idle amount while the
/// machine has no memory to spare, asks again, and makes the rest once it has.
#[test]
fn an_elastic_pool_makes_its_start_amount_only_with_memory_to_spare() {
    const MIB: usize = 1 << 20;
    MACHINE_HAS_SPARE.store(false, Ordering::Relaxed);
    let mut readiness = starting(40 * MIB, Duration::from_secs(600));
    readiness.at_start.spare = SpareCheck::HalfFree;
    let pool = Pool::elastic(128 * MIB, readiness).unwrap();
    until(&pool, "the idle amount ready", |p| {
        p.ready_bytes() == 4 * MIB
    });
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(pool.ready_bytes(), 4 * MIB, "no more without spare memory");
    MACHINE_HAS_SPARE.store(true, Ordering::Relaxed);
    let asked = Instant::now();
    until(&pool, "the start amount ready", |p| {
        p.ready_bytes() == 40 * MIB
    });
    assert!(
        asked.elapsed() < SPARE_POLL * 5,
        "asked again within its poll"
    );
}

/// A freshly started pool keeps its start amount ready for the first tensors, draws it
/// once, and then keeps its idle amount: what the first tensor left above it goes back, and
/// the start amount is never made ready again.
#[test]
fn an_elastic_pool_keeps_its_start_amount_until_the_first_take_and_never_again() {
    const MIB: usize = 1 << 20;
    let pool = Pool::elastic(128 * MIB, starting(40 * MIB, Duration::from_secs(600))).unwrap();
    until(&pool, "the start amount ready", |p| {
        p.ready_bytes() == 40 * MIB
    });
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(pool.ready_bytes(), 40 * MIB, "kept while nothing is drawn");
    // The first tensor draws from it (the ahead amount is ready already: 16 MiB left).
    let first = pool.take(24 * MIB).unwrap().unwrap();
    until(&pool, "back to the idle amount", |p| {
        p.ready_bytes() == 4 * MIB
    });
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(
        pool.ready_bytes(),
        4 * MIB,
        "the start amount is not made again"
    );
    drop(first);
    until(&pool, "the freed tensor given back", |p| {
        p.ready_bytes() == 4 * MIB && p.free_bytes() == p.capacity()
    });
}

/// A tensor that arrived without drawing from the pool ends the start amount's time as a
/// take does: what is left goes back after the idle wait, and is not made again.
#[test]
fn an_arrival_that_draws_nothing_ends_the_start_amount_as_a_take_does() {
    const MIB: usize = 1 << 20;
    let pool = Pool::elastic(128 * MIB, starting(40 * MIB, Duration::from_secs(600))).unwrap();
    until(&pool, "the start amount ready", |p| {
        p.ready_bytes() == 40 * MIB
    });
    pool.note_arrival();
    let noted = Instant::now();
    while pool.ready_bytes() != 4 * MIB {
        // Woken by the arrival, not by some later timeout: the idle wait (300 ms) after it.
        assert!(noted.elapsed() < Duration::from_secs(3));
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(
        pool.ready_bytes(),
        4 * MIB,
        "the start amount is not made again"
    );
}

/// A start amount nothing draws goes back once its time has passed: the idle amount stays.
#[test]
fn an_elastic_pool_gives_its_start_amount_back_when_no_tensor_came_in_time() {
    const MIB: usize = 1 << 20;
    let kept_for = Duration::from_secs(3);
    let pool = Pool::elastic(128 * MIB, starting(40 * MIB, kept_for)).unwrap();
    let started = Instant::now();
    until(&pool, "the start amount ready", |p| {
        p.ready_bytes() == 40 * MIB
    });
    while pool.ready_bytes() != 4 * MIB {
        // Given back when its time is up, not at some later wake-up.
        assert!(started.elapsed() < kept_for + Duration::from_secs(2));
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(pool.ready_bytes(), 4 * MIB);
}

#[test]
fn an_elastic_pool_keeps_whole_granules_ready_whatever_size_it_is_asked() {
    let readiness = Readiness {
        idle: 10_000_000,
        ahead: 3_000_001,
        idle_after: Duration::ZERO,
        touching: Touching::AlongsideOthers,
        at_start: AtStart::IDLE,
    };
    let pool = Pool::elastic(64 << 20, readiness).unwrap();
    let rounded = 10_000_000usize.next_multiple_of(GRANULE);
    until(&pool, "ready", |p| p.ready_bytes() == rounded);
    let buffers: Vec<Bytes> = (0..6)
        .map(|i| pool.take(POOL_MIN + i * 4097).unwrap().unwrap())
        .collect();
    for buf in &buffers {
        assert_eq!(pool.offset_of(buf).unwrap() % GRANULE, 0);
    }
    drop(buffers);
    until(&pool, "back to the idle amount", |p| {
        p.ready_bytes() == rounded
    });
}

#[test]
fn a_pool_under_the_minimum_is_refused() {
    assert!(matches!(Pool::reserve(0), Err(PoolError::Size(0))));
}
