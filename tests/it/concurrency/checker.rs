//! The history checker: whether what the clients saw could have come from a linearizable store
//! of tensors under keys, in the style of Jepsen's register checks (no phantom or stale read, no
//! lost acknowledged write), over a [`history`](super::history) of puts, gets, deletes, and
//! copies and moves in one node and between nodes.
//!
//! An operation takes effect at one instant between its invoke and its completion. An
//! operation of unknown outcome (a connection error) may take effect at any instant after its
//! invoke, or never. A refused one took no effect, except that a move, and any node-to-node
//! transfer, may have registered its target before a later step failed (the in-node move's
//! removal of a source that changed; `copy_keys`'s delete of the source, or its release of
//! a capability after a dedup), so their target write stays possible. A node-to-node move that
//! answers that its source changed and was kept wrote its target and removed nothing.
//!
//! Possible values: a put of `v` into `k` may write `v` into `k`, taking effect no earlier than
//! its invoke. A transfer `C` from `s` to `k` may write into `k` any value `C` could have read
//! from `s`, taking effect no earlier than that value's effect in `s` (or `C`'s invoke). `C`
//! reads at some instant of its interval, so it can read `v` from `s` only through a writer of
//! `v` into `s` whose effect bound lies before `C` completed and which no acknowledged change
//! of `s` definitely superseded before `C` was invoked. This is a fixpoint over the transfers.
//!
//! A writer `W` is definitely superseded before instant `t` in `k` if an acknowledged change of
//! `k` (a put or transfer into it, a delete of it, a move out of it) was invoked after `W`
//! completed and completed before `t`: whatever `k` holds at `t` was written after that change
//! took effect. A transfer into `k` that could itself carry `v` is a writer of `v` of its own.
//!
//! - Rule 1, no phantom or stale read: a get of `k` answering `v` needs a writer of `v` into
//!   `k` whose effect bound is before the get completed and which is not definitely superseded
//!   before the get was invoked. A value no put wrote, or bytes that are no put's, fail at once.
//! - Rule 2, no lost acknowledged write: a get (or delete) of `k` answering `NotFound` fails if
//!   an acknowledged write into `k` completed before it was invoked and no operation that could
//!   remove `k` (an acknowledged or unknown delete of `k`, or move out of `k`) completed after
//!   that write's invoke and was invoked before the get completed.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::ops::Bound;

use ferry_client::ErrorCode;

use super::history::{Key, Op, OpKind, Outcome};

/// The completion of an operation that may take effect at any later time.
const NEVER: u64 = u64::MAX;

/// An observation the history cannot have produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The index of the operation that saw what it could not have.
    pub op: usize,
    /// The key whose history explains it.
    pub key: Key,
    /// Which rule, and why.
    pub what: String,
    /// Operations the explanation names (writers, the change that superseded them).
    pub related: Vec<usize>,
}

/// Every violation in `history`; empty if it could have come from a linearizable store.
pub fn check(history: &[Op]) -> Vec<Violation> {
    let timelines = Timelines::build(history);
    let writers = possible_writers(history, &timelines);
    let put_values: HashSet<u64> = history
        .iter()
        .filter_map(|op| match op.kind {
            OpKind::Put { value, .. } => Some(value),
            _ => None,
        })
        .collect();
    let mut violations = Vec::new();
    for (index, op) in history.iter().enumerate() {
        let found = match (&op.kind, &op.outcome) {
            (OpKind::Get { key }, Outcome::Garbled(why)) => Some(Violation {
                op: index,
                key: *key,
                what: format!("corrupt read: {why}"),
                related: Vec::new(),
            }),
            (OpKind::Get { key }, Outcome::Read(value)) if !put_values.contains(value) => {
                Some(Violation {
                    op: index,
                    key: *key,
                    what: format!("corrupt read: {value:#x} is no put's value"),
                    related: Vec::new(),
                })
            }
            (OpKind::Get { key }, Outcome::Read(value)) => {
                check_read(history, index, *key, *value, &timelines, &writers)
            }
            (
                OpKind::Get { key } | OpKind::Delete { key },
                Outcome::Refused {
                    code: ErrorCode::NotFound,
                    ..
                },
            ) => check_absence(history, index, *key, &timelines),
            _ => None,
        };
        violations.extend(found);
    }
    violations
}

/// Rule 1 for a get at `index` of `key` that answered `value`.
fn check_read(
    history: &[Op],
    index: usize,
    key: Key,
    value: u64,
    timelines: &Timelines,
    writers: &HashMap<(Key, u64), Vec<Record>>,
) -> Option<Violation> {
    let read = &history[index];
    let candidates = writers.get(&(key, value)).map_or(&[][..], Vec::as_slice);
    let in_time: Vec<&Record> = candidates
        .iter()
        .filter(|w| w.effect < read.complete)
        .collect();
    let last_change = timelines.get(key).changes.before(read.invoke);
    if in_time
        .iter()
        .any(|w| last_change.is_none_or(|(invoked, _)| w.end >= invoked))
    {
        return None;
    }
    // The writers that came too late or were superseded, and the put of the value itself.
    let mut related: Vec<usize> = candidates.iter().map(|w| w.op).collect();
    related.extend(
        (0..history.len())
            .filter(|&i| matches!(history[i].kind, OpKind::Put { value: v, .. } if v == value)),
    );
    related.sort_unstable();
    related.dedup();
    let what = match last_change {
        Some((_, change)) if !in_time.is_empty() => {
            related.push(change);
            related.sort_unstable();
            related.dedup();
            format!(
                "stale read (rule 1): every write of {value:#x} into {key} was superseded before \
                 the get began: #{change} was invoked after they completed and completed before \
                 the get"
            )
        }
        _ => format!(
            "phantom read (rule 1): nothing could have written {value:#x} into {key} before the \
             get completed"
        ),
    };
    Some(Violation {
        op: index,
        key,
        what,
        related,
    })
}

/// Rule 2 for an operation at `index` that found no tensor under `key`.
fn check_absence(
    history: &[Op],
    index: usize,
    key: Key,
    timelines: &Timelines,
) -> Option<Violation> {
    let read = &history[index];
    let timeline = timelines.get(key);
    // Of the acknowledged writes done before the read began, the one invoked last is the
    // hardest to explain away: a removal that covers it covers every earlier one too.
    let (written, writer) = timeline.acked_writes.before(read.invoke)?;
    let removal = timeline.removals.before(read.complete);
    if removal.is_some_and(|(removal_end, _)| removal_end > written) {
        return None;
    }
    let mut related = vec![writer];
    related.extend(removal.map(|(_, op)| op));
    Some(Violation {
        op: index,
        key,
        what: format!(
            "lost write (rule 2): {key} was absent although acknowledged write #{writer} \
             completed before this began and nothing that could remove it ran after it was invoked"
        ),
        related,
    })
}

/// A way a value may have come into a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    /// The put or transfer that may have written it.
    op: usize,
    /// It took effect no earlier than this.
    effect: u64,
    /// The writer's completion ([`NEVER`] if unknown).
    end: u64,
}

/// The writers of each value into each key, computed as a fixpoint over the transfers: each
/// transfer is worked out once, and again whenever its source gains writers it could read.
fn possible_writers(history: &[Op], timelines: &Timelines) -> HashMap<(Key, u64), Vec<Record>> {
    // Per key, (writer invoke, writer, value) -> (effect, writer end).
    let mut writers: HashMap<Key, ByDuration<(u64, u64)>> = HashMap::new();
    for (index, op) in history.iter().enumerate() {
        if let OpKind::Put { key, value } = op.kind
            && may_write(op)
        {
            writers
                .entry(key)
                .or_default()
                .of(op)
                .insert((op.invoke, index, value), (op.invoke, end(op)));
        }
    }
    let mut pending: BTreeSet<(u64, usize)> = BTreeSet::new();
    // Per key, the transfers out of it: (invoke, transfer, 0) -> ().
    let mut outgoing: HashMap<Key, ByDuration<()>> = HashMap::new();
    for (index, op) in history.iter().enumerate() {
        if let OpKind::Transfer { src, .. } = op.kind
            && may_write(op)
        {
            pending.insert((op.invoke, index));
            outgoing
                .entry(src)
                .or_default()
                .of(op)
                .insert((op.invoke, index, 0), ());
        }
    }
    // Earliest first: most values flow along a chain of transfers without coming back.
    while let Some((_, index)) = pending.pop_first() {
        let transfer = &history[index];
        let OpKind::Transfer { src, dst, .. } = transfer.kind else {
            continue;
        };
        let transfer_end = end(transfer);
        // A writer of `src` is readable by the transfer if it took effect before the transfer
        // completed, unless a change completed before the transfer began was invoked after
        // the writer completed.
        let cutoff = timelines.get(src).changes.before(transfer.invoke);
        let cutoff = cutoff.map(|(invoked, _)| invoked);
        let readable: Vec<(u64, u64)> = writers.get(&src).map_or_else(Vec::new, |records| {
            records
                .overlapping(cutoff, transfer_end, |_| true)
                .filter(|&(_, &(effect, writer_end))| {
                    effect < transfer_end && cutoff.is_none_or(|c| writer_end >= c)
                })
                .map(|(&(_, _, value), &(effect, _))| (value, effect))
                .collect()
        });
        let target = writers.entry(dst).or_default().of(transfer);
        let mut lowest_changed: Option<u64> = None;
        for (value, effect) in readable {
            let effect = effect.max(transfer.invoke);
            let slot = target
                .entry((transfer.invoke, index, value))
                .or_insert((NEVER, transfer_end));
            if effect < slot.0 {
                slot.0 = effect;
                lowest_changed = Some(lowest_changed.map_or(effect, |e| e.min(effect)));
            }
        }
        // The writers this transfer added to `dst` end with it: the transfers out of `dst` that
        // could read one of them are worked out again.
        if let (Some(effect), Some(transfers)) = (lowest_changed, outgoing.get(&dst)) {
            // Supersession only grows with the invoke: no later transfer reads them either.
            let dst_changes = &timelines.get(dst).changes;
            let readable = |&(invoked, _, _): &(u64, usize, u64)| {
                dst_changes
                    .before(invoked)
                    .is_none_or(|(c, _)| transfer_end >= c)
            };
            for (&(invoked, other, _), ()) in transfers.overlapping(Some(effect), NEVER, readable) {
                if end(&history[other]) > effect {
                    pending.insert((invoked, other));
                }
            }
        }
    }
    let mut by_value: HashMap<(Key, u64), Vec<Record>> = HashMap::new();
    for (key, records) in writers {
        for ((_, op, value), (effect, end)) in records.buckets.into_values().flatten() {
            by_value
                .entry((key, value))
                .or_default()
                .push(Record { op, effect, end });
        }
    }
    by_value
}

/// Entries of operations keyed by (invoke, operation, value), in buckets by the operation's
/// duration (below 2^b nanoseconds in bucket b; unknown completion in the last), so that the
/// entries of the operations overlapping a span are found by one invoke window per bucket.
#[derive(Debug)]
struct ByDuration<V> {
    buckets: BTreeMap<u32, BTreeMap<(u64, usize, u64), V>>,
}

impl<V> Default for ByDuration<V> {
    fn default() -> Self {
        Self {
            buckets: BTreeMap::new(),
        }
    }
}

/// The bucket of operations of unknown completion, which overlap every later span.
const OPEN_BUCKET: u32 = u32::MAX;

impl<V> ByDuration<V> {
    /// The entries of the bucket `op` belongs to.
    fn of(&mut self, op: &Op) -> &mut BTreeMap<(u64, usize, u64), V> {
        let bucket = match end(op) {
            NEVER => OPEN_BUCKET,
            complete => u64::BITS - (complete - op.invoke).leading_zeros(),
        };
        self.buckets.entry(bucket).or_default()
    }

    /// The entries of operations that may have run at some instant at or after `from` (from
    /// the start if `None`) and before `until`: invoked before `until`, and, by their bucket's
    /// bound on their duration, not completed before `from`; in each bucket, in invoke order,
    /// only as long as `going` holds. A superset: callers filter.
    fn overlapping(
        &self,
        from: Option<u64>,
        until: u64,
        going: impl Fn(&(u64, usize, u64)) -> bool + Copy,
    ) -> impl Iterator<Item = (&(u64, usize, u64), &V)> {
        self.buckets.iter().flat_map(move |(&bucket, entries)| {
            let earliest = match from {
                Some(from) if bucket != OPEN_BUCKET => {
                    from.saturating_sub(1u64.checked_shl(bucket).unwrap_or(NEVER))
                }
                _ => 0,
            };
            entries
                .range((
                    Bound::Included((earliest, 0, 0)),
                    Bound::Excluded((until, 0, 0)),
                ))
                .take_while(move |(k, _)| going(k))
        })
    }
}

/// When an operation's effect can no longer happen: its completion, or never if unknown.
fn end(op: &Op) -> u64 {
    match op.outcome {
        Outcome::Unknown(_) => NEVER,
        _ => op.complete,
    }
}

/// Whether `op` may have written its target (see the module doc).
fn may_write(op: &Op) -> bool {
    match (&op.kind, &op.outcome) {
        (
            OpKind::Put { .. } | OpKind::Transfer { .. },
            Outcome::Ok | Outcome::SourceKept | Outcome::Unknown(_),
        ) => true,
        (
            OpKind::Transfer {
                src,
                dst,
                remove_source,
            },
            Outcome::Refused { .. },
        ) => *remove_source || src.node != dst.node,
        _ => false,
    }
}

/// The key `kind` writes into, if any.
fn written_key(kind: &OpKind) -> Option<Key> {
    match *kind {
        OpKind::Put { key, .. } => Some(key),
        OpKind::Transfer { dst, .. } => Some(dst),
        _ => None,
    }
}

/// The key `kind` removes, if any.
fn removed_key(kind: &OpKind) -> Option<Key> {
    match *kind {
        OpKind::Delete { key } => Some(key),
        OpKind::Transfer {
            src,
            remove_source: true,
            ..
        } => Some(src),
        _ => None,
    }
}

/// Points in time with a value each, answering "the largest value among the points before
/// `t`" by a binary search over prefix maxima.
#[derive(Debug, Default)]
struct PrefixMax {
    /// (time, value, op), sorted by time; `value` and `op` replaced by the prefix maximum.
    points: Vec<(u64, u64, usize)>,
}

impl PrefixMax {
    fn new(mut points: Vec<(u64, u64, usize)>) -> Self {
        points.sort_unstable();
        let mut best: Option<(u64, usize)> = None;
        for point in &mut points {
            if best.is_none_or(|(value, _)| point.1 > value) {
                best = Some((point.1, point.2));
            }
            if let Some((value, op)) = best {
                point.1 = value;
                point.2 = op;
            }
        }
        Self { points }
    }

    /// The largest value among points strictly before `t`, and its operation.
    fn before(&self, t: u64) -> Option<(u64, usize)> {
        let count = self.points.partition_point(|p| p.0 < t);
        count
            .checked_sub(1)
            .map(|last| (self.points[last].1, self.points[last].2))
    }
}

/// What the rules ask about one key.
#[derive(Debug, Default)]
struct Timeline {
    /// Acknowledged changes of the key by completion; value: their invoke.
    changes: PrefixMax,
    /// Acknowledged writes into the key by completion; value: their invoke.
    acked_writes: PrefixMax,
    /// Operations that may have removed the key (acknowledged or unknown) by invoke; value:
    /// their completion ([`NEVER`] if unknown).
    removals: PrefixMax,
}

#[derive(Debug, Default)]
struct Timelines {
    by_key: HashMap<Key, Timeline>,
    empty: Timeline,
}

impl Timelines {
    fn build(history: &[Op]) -> Self {
        type Points = Vec<(u64, u64, usize)>;
        let mut raw: HashMap<Key, (Points, Points, Points)> = HashMap::new();
        for (index, op) in history.iter().enumerate() {
            let acknowledged = op.outcome == Outcome::Ok;
            let unknown = matches!(op.outcome, Outcome::Unknown(_));
            // A move that kept its source acknowledged its write all the same.
            if let Some(key) = written_key(&op.kind)
                && (acknowledged || op.outcome == Outcome::SourceKept)
            {
                let (changes, acked_writes, _) = raw.entry(key).or_default();
                changes.push((op.complete, op.invoke, index));
                acked_writes.push((op.complete, op.invoke, index));
            }
            if let Some(key) = removed_key(&op.kind) {
                let (changes, _, removals) = raw.entry(key).or_default();
                if acknowledged {
                    changes.push((op.complete, op.invoke, index));
                }
                if acknowledged || unknown {
                    removals.push((op.invoke, end(op), index));
                }
            }
        }
        let by_key = raw
            .into_iter()
            .map(|(key, (changes, acked_writes, removals))| {
                let timeline = Timeline {
                    changes: PrefixMax::new(changes),
                    acked_writes: PrefixMax::new(acked_writes),
                    removals: PrefixMax::new(removals),
                };
                (key, timeline)
            })
            .collect();
        Self {
            by_key,
            empty: Timeline::default(),
        }
    }

    fn get(&self, key: Key) -> &Timeline {
        self.by_key.get(&key).unwrap_or(&self.empty)
    }
}

/// How many operations on the key around a violation [`explain`] lists at most.
const SLICE_LINES: usize = 80;

/// A report of `violation` for a person: the seed, the operation, the operations the
/// explanation names, and the history of the key around it.
pub fn explain(history: &[Op], violation: &Violation, seed: u64) -> String {
    let op = &history[violation.op];
    let mut out = String::new();
    let _ = writeln!(out, "history violation (seed {seed}): {}", violation.what);
    let _ = writeln!(out, "  #{} {op}", violation.op);
    if !violation.related.is_empty() {
        let _ = writeln!(out, "operations the explanation names:");
        for &related in &violation.related {
            let _ = writeln!(out, "  #{related} {}", history[related]);
        }
    }
    let from = violation
        .related
        .iter()
        .map(|&i| history[i].invoke)
        .chain([op.invoke.saturating_sub(5_000_000)])
        .min()
        .unwrap_or(0);
    let mut slice: Vec<usize> = (0..history.len())
        .filter(|&i| {
            let other = &history[i];
            other.kind.touches(violation.key)
                && other.complete >= from
                && other.invoke <= op.complete
        })
        .collect();
    slice.sort_by_key(|&i| (history[i].invoke, i));
    let _ = writeln!(
        out,
        "operations on {} from {:.3} ms to the violation:",
        violation.key,
        from as f64 / 1e6
    );
    if slice.len() > SLICE_LINES {
        let _ = writeln!(
            out,
            "  ... {} earlier ones left out",
            slice.len() - SLICE_LINES
        );
        slice.drain(..slice.len() - SLICE_LINES);
    }
    for i in slice {
        let _ = writeln!(out, "  #{i} {}", history[i]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: Key = Key {
        node: 0,
        device: 0,
        name: 0,
    };
    const K2: Key = Key {
        node: 0,
        device: 1,
        name: 0,
    };
    const REMOTE: Key = Key {
        node: 1,
        device: 0,
        name: 0,
    };

    fn op(kind: OpKind, invoke: u64, complete: u64, outcome: Outcome) -> Op {
        Op {
            client: 0,
            kind,
            invoke,
            complete,
            outcome,
        }
    }

    fn put(key: Key, value: u64, invoke: u64, complete: u64) -> Op {
        op(OpKind::Put { key, value }, invoke, complete, Outcome::Ok)
    }

    fn get(key: Key, invoke: u64, complete: u64, outcome: Outcome) -> Op {
        op(OpKind::Get { key }, invoke, complete, outcome)
    }

    fn transfer(src: Key, dst: Key, remove_source: bool, invoke: u64, complete: u64) -> Op {
        let kind = OpKind::Transfer {
            src,
            dst,
            remove_source,
        };
        op(kind, invoke, complete, Outcome::Ok)
    }

    fn not_found() -> Outcome {
        Outcome::Refused {
            code: ErrorCode::NotFound,
            message: "no tensor".into(),
        }
    }

    /// The indices of the violating operations.
    fn violating(history: &[Op]) -> Vec<usize> {
        check(history).iter().map(|v| v.op).collect()
    }

    #[test]
    fn a_history_of_puts_copies_moves_and_overlaps_passes() {
        let history = vec![
            put(K, 1, 0, 10),
            get(K, 20, 30, Outcome::Read(1)),
            transfer(K, K2, false, 40, 50),
            transfer(K2, REMOTE, true, 60, 70),
            get(REMOTE, 80, 90, Outcome::Read(1)),
            get(K2, 80, 90, not_found()),
            // A put overlapping a get: the get may see either value.
            put(K, 2, 100, 200),
            get(K, 110, 120, Outcome::Read(1)),
            get(K, 150, 250, Outcome::Read(2)),
            op(OpKind::Delete { key: K }, 300, 310, Outcome::Ok),
            get(K, 320, 330, not_found()),
            // A copy back from the remote key brings the old value again.
            transfer(REMOTE, K, false, 340, 350),
            get(K, 360, 370, Outcome::Read(1)),
        ];
        assert_eq!(check(&history), Vec::new());
    }

    #[test]
    fn a_stale_read_after_an_acknowledged_overwrite_is_caught() {
        let history = vec![
            put(K, 1, 0, 10),
            put(K, 2, 20, 30),
            get(K, 40, 50, Outcome::Read(1)),
        ];
        assert_eq!(violating(&history), vec![2]);
        // The same through a copy: the copy began after the overwrite, so it cannot carry 1.
        let history = vec![
            put(K, 1, 0, 10),
            put(K, 2, 20, 30),
            transfer(K, K2, false, 40, 50),
            get(K2, 60, 70, Outcome::Read(1)),
        ];
        assert_eq!(violating(&history), vec![3]);
    }

    #[test]
    fn a_copy_cannot_carry_a_value_written_after_it_completed() {
        let history = vec![
            transfer(K, REMOTE, false, 0, 10),
            put(K, 1, 20, 30),
            get(REMOTE, 40, 50, Outcome::Read(1)),
        ];
        assert_eq!(violating(&history), vec![2]);
    }

    #[test]
    fn a_lost_acknowledged_write_is_caught_unless_a_removal_may_explain_it() {
        let history = vec![put(K, 1, 0, 10), get(K, 20, 30, not_found())];
        assert_eq!(violating(&history), vec![1]);
        // A move out of the key overlapping the read explains it; one that failed does not.
        let mut moved = vec![
            put(K, 1, 0, 10),
            transfer(K, K2, true, 25, 40),
            get(K, 20, 30, not_found()),
        ];
        assert_eq!(violating(&moved), Vec::<usize>::new());
        moved[1].outcome = Outcome::Refused {
            code: ErrorCode::PeerFailed,
            message: "changed".into(),
        };
        assert_eq!(violating(&moved), vec![2]);
        // A removal that ended before the write began does not either.
        let history = vec![
            op(OpKind::Delete { key: K }, 0, 5, Outcome::Ok),
            put(K, 1, 6, 10),
            get(K, 20, 30, not_found()),
        ];
        assert_eq!(violating(&history), vec![2]);
    }

    #[test]
    fn unknown_outcomes_may_take_effect_late_but_corrupt_reads_never_pass() {
        let history = vec![
            op(
                OpKind::Put { key: K, value: 1 },
                0,
                10,
                Outcome::Unknown("reset".into()),
            ),
            op(OpKind::Delete { key: K }, 20, 30, Outcome::Ok),
            get(K, 40, 50, Outcome::Read(1)),
            get(K, 60, 70, Outcome::Read(7)),
            get(K, 60, 70, Outcome::Garbled("shape [3]".into())),
        ];
        assert_eq!(violating(&history), vec![3, 4]);
    }

    /// The possible writers by the definition itself: every transfer against every writer of
    /// its source, again and again until nothing changes.
    fn possible_writers_plainly(history: &[Op]) -> BTreeMap<(Key, u64, usize), u64> {
        let timelines = Timelines::build(history);
        let mut records: BTreeMap<(Key, u64, usize), u64> = BTreeMap::new();
        for (index, op) in history.iter().enumerate() {
            if let OpKind::Put { key, value } = op.kind
                && may_write(op)
            {
                records.insert((key, value, index), op.invoke);
            }
        }
        loop {
            let mut changed = false;
            for (index, op) in history.iter().enumerate() {
                let OpKind::Transfer { src, dst, .. } = op.kind else {
                    continue;
                };
                if !may_write(op) {
                    continue;
                }
                let cutoff = timelines.get(src).changes.before(op.invoke);
                let carried: Vec<(u64, u64)> = records
                    .iter()
                    .filter(|&(&(key, _, writer), &effect)| {
                        key == src
                            && effect < end(op)
                            && cutoff.is_none_or(|(c, _)| end(&history[writer]) >= c)
                    })
                    .map(|(&(_, value, _), &effect)| (value, effect))
                    .collect();
                for (value, effect) in carried {
                    let effect = effect.max(op.invoke);
                    let slot = records.entry((dst, value, index)).or_insert(NEVER);
                    if effect < *slot {
                        *slot = effect;
                        changed = true;
                    }
                }
            }
            if !changed {
                return records;
            }
        }
    }

    /// A random history over three keys: random kinds, times, durations (a few long) and
    /// outcomes (a few unknown).
    fn random_history(seed: u64) -> Vec<Op> {
        let mut state = seed;
        let mut next = move |n: u64| {
            // SplitMix64.
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (z ^ (z >> 31)) % n
        };
        let keys = [K, K2, REMOTE];
        (0..80u64)
            .map(|i| {
                let key = keys[next(3) as usize];
                let other = keys[next(3) as usize];
                let kind = match next(4) {
                    0 => OpKind::Put { key, value: i },
                    1 => OpKind::Delete { key },
                    _ if key == other => OpKind::Get { key },
                    _ => OpKind::Transfer {
                        src: key,
                        dst: other,
                        remove_source: next(2) == 0,
                    },
                };
                let invoke = next(2_000);
                let duration = if next(10) == 0 { next(1_000) } else { next(50) };
                let outcome = match next(12) {
                    0 => Outcome::Unknown("reset".into()),
                    1 | 2 => not_found(),
                    3 => Outcome::SourceKept,
                    _ => Outcome::Ok,
                };
                op(kind, invoke, invoke + duration + 1, outcome)
            })
            .collect()
    }

    #[test]
    fn the_indexed_fixpoint_finds_exactly_the_plain_one() {
        let mut carried = 0;
        for seed in 0..300 {
            let history = random_history(seed);
            let timelines = Timelines::build(&history);
            let mut indexed = BTreeMap::new();
            for ((key, value), records) in possible_writers(&history, &timelines) {
                for record in records {
                    indexed.insert((key, value, record.op), record.effect);
                    assert_eq!(record.end, end(&history[record.op]), "seed {seed}");
                }
            }
            let plain = possible_writers_plainly(&history);
            assert_eq!(indexed, plain, "seed {seed}: {history:#?}");
            carried += plain
                .keys()
                .filter(|&&(_, _, writer)| matches!(history[writer].kind, OpKind::Transfer { .. }))
                .count();
        }
        // The histories exercise what is compared: values carried along chains of transfers.
        assert!(
            carried > 1_000,
            "only {carried} values carried by transfers"
        );
    }
}
