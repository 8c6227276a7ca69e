//! Which holder a copy of a tensor named alone reads from ([`choose_source`]): one version,
//! the nearest holder, spread over the targets by rendezvous hashing, and of the first two in a
//! target's order the less busy. A pure decision, tested by tables; [`worth_asking`] says whose
//! load to ask.

use ferry_proto::cluster::MemberRecord;

use super::load::{Load, Loads};
use super::{Located, address_for};

/// How many holders a copy by name asks for their load: the nearest first, each target in its
/// own spread order, so that a directory of many holders costs a bounded number of asks.
pub const MOST_ASKED: usize = 8;

/// Where equally near holders of `name` rank for a target, before their load.
type SpreadRank = [u8; 8];

/// Where a copy of a tensor named alone is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The holder chosen.
    pub holder: Located,
    /// Its member's record.
    pub member: MemberRecord,
    /// The address the target pulls from: the holder's Unix socket where both share a
    /// machine, else its TCP address.
    pub addr: String,
    /// The holder is the target node itself: a copy between its own devices.
    pub same_node: bool,
    /// Its load when asked; `None`: not asked (the choice was decided without it, or it was
    /// beyond [`MOST_ASKED`]).
    pub load: Option<Load>,
}

/// Why no holder was chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChooseError {
    /// No registered member holds a tensor of that name.
    #[error("no member of the cluster holds a tensor named {0:?}")]
    NotHeld(String),
    /// Members hold different versions (content hashes) under that name, or more than one
    /// holds it before any version is verified: which one is meant is for the user to say.
    #[error(
        "members hold different (or not yet verified) tensors named {name:?}: {holders}; name \
         one as @MEMBER/DEVICE/NAME"
    )]
    Ambiguous {
        /// The tensor's name.
        name: String,
        /// Where it is, for a person.
        holders: String,
    },
}

/// How near a holder is to the target: the nearer, the cheaper the copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Nearness {
    /// The target node itself: a copy between its own devices.
    TargetItself,
    /// A member on the target's machine: its Unix socket, shared memory.
    SameMachine,
    /// Anywhere else: TCP.
    Elsewhere,
}

/// A holder of the one version, with its member and where it ranks for the target.
struct Candidate<'a> {
    holder: &'a Located,
    member: &'a MemberRecord,
    nearness: Nearness,
    rank: SpreadRank,
}

/// The holders of the one version of `name` whose member is registered, nearest first and in
/// the target's spread order among equally near ones:
/// - only one version: holders whose verified content hashes differ make the name ambiguous,
///   and unverified holders count only where no holder is verified and there is one;
/// - nearest first: the target node itself, then a member on the target's machine, then any;
/// - among holders equally near, `spread_rank`'s order for this target and name.
fn candidates<'a>(
    name: &str,
    holders: &'a [Located],
    members: &'a [MemberRecord],
    target: Option<&MemberRecord>,
) -> Result<Vec<Candidate<'a>>, ChooseError> {
    let member_of = |h: &Located| members.iter().find(|m| m.name == h.member);
    let live: Vec<(&Located, &MemberRecord)> = holders
        .iter()
        .filter_map(|h| member_of(h).map(|m| (h, m)))
        .collect();
    let verified: Vec<(&Located, &MemberRecord)> = live
        .iter()
        .copied()
        .filter(|(h, _)| h.record.content_hash.is_some())
        .collect();
    let ambiguous = || ChooseError::Ambiguous {
        name: name.to_string(),
        holders: live
            .iter()
            .map(|(h, _)| {
                let hash = h
                    .record
                    .content_hash
                    .map_or_else(|| "unverified".to_string(), |hash| hash.to_string());
                format!(
                    "@{}/{} ({})",
                    h.member,
                    h.device,
                    hash.chars().take(16).collect::<String>()
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
    };
    let chosen = match (verified.first(), live.len()) {
        (_, 0) => return Err(ChooseError::NotHeld(name.to_string())),
        (Some((first, _)), _) => {
            if verified
                .iter()
                .any(|(h, _)| h.record.content_hash != first.record.content_hash)
            {
                return Err(ambiguous());
            }
            verified
        }
        (None, 1) => live,
        (None, _) => return Err(ambiguous()),
    };
    let nearness = |h: &Located, m: &MemberRecord| match target {
        Some(t) if t.name == h.member => Nearness::TargetItself,
        Some(t) if !t.host.is_empty() && t.host == m.host => Nearness::SameMachine,
        _ => Nearness::Elsewhere,
    };
    let mut candidates: Vec<Candidate> = chosen
        .into_iter()
        .map(|(holder, member)| Candidate {
            holder,
            member,
            nearness: nearness(holder, member),
            rank: spread_rank(name, target, holder),
        })
        .collect();
    candidates.sort_by(|a, b| {
        (a.nearness, a.rank, &a.holder.member, a.holder.device).cmp(&(
            b.nearness,
            b.rank,
            &b.holder.member,
            b.holder.device,
        ))
    });
    Ok(candidates)
}

/// The members a copy of `name` to `target` asks for their load before [`choose_source`]: the
/// holders' members nearest first, each once, at most [`MOST_ASKED`]; none where the answer is
/// decided without them (the target itself holds it, or one member does), or where the name
/// resolves to no one version (`choose_source` says why).
pub fn worth_asking(
    name: &str,
    holders: &[Located],
    members: &[MemberRecord],
    target: Option<&MemberRecord>,
) -> Vec<MemberRecord> {
    let Ok(candidates) = candidates(name, holders, members, target) else {
        return Vec::new();
    };
    let target_holds_it = candidates
        .first()
        .is_some_and(|nearest| nearest.nearness == Nearness::TargetItself);
    if target_holds_it {
        return Vec::new();
    }
    let mut asked: Vec<MemberRecord> = Vec::new();
    for candidate in candidates {
        if asked.iter().any(|m| m.name == candidate.member.name) {
            continue;
        }
        if asked.len() == MOST_ASKED {
            break;
        }
        asked.push(candidate.member.clone());
    }
    // One member: nothing to choose between.
    if asked.len() < 2 {
        asked.clear();
    }
    asked
}

/// How busy a holder is, coarsely, for comparing two: answered before not known, then the
/// bytes it serves by powers of two (so that small differences do not all send new targets
/// the same way), then its fetches.
fn busyness(load: Option<&Load>) -> (u8, u32, u64) {
    match load {
        Some(Load::Serving { fetches, bytes }) => (0, u64::BITS - bytes.leading_zeros(), *fetches),
        Some(Load::Unknown | Load::Unreachable(_)) | None => (1, 0, 0),
    }
}

/// Picks the holder a copy of `name` to `target` reads from, among `holders` (the directory's
/// entries for that name) whose member is registered in `members`, weighing `loads` (what the
/// members [`worth_asking`] said):
/// - one version, nearest first, and among equally near holders the target's own spread order
///   (see `candidates`): targets spread over the holders (a new worker reads from running
///   replicas as often as from the first holder by name), and a target asked again picks the
///   same one;
/// - a holder that did not answer is passed over;
/// - of the first two answering holders in the nearest tier, the less busy (`busyness`), the
///   first where they are as busy ("the power of two choices": a busy holder loses the targets
///   that would have read from it, the others keep their spread);
/// - where no holder answered, the first in order all the same: its pull says what is wrong.
pub fn choose_source(
    name: &str,
    holders: &[Located],
    members: &[MemberRecord],
    target: Option<&MemberRecord>,
    loads: &Loads,
) -> Result<Source, ChooseError> {
    let candidates = candidates(name, holders, members, target)?;
    let load = |c: &Candidate| loads.get(&c.member.name);
    let answering: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| !matches!(load(c), Some(Load::Unreachable(_))))
        .collect();
    let chosen = match answering.first() {
        // `min_by_key` keeps the first of equals: the spread order decides a tie.
        Some(first) => answering
            .iter()
            .filter(|c| c.nearness == first.nearness)
            .take(2)
            .min_by_key(|c| busyness(load(c)))
            .copied(),
        None => candidates.first(),
    }
    .ok_or_else(|| ChooseError::NotHeld(name.to_string()))?;
    let addr = match target {
        Some(t) if chosen.nearness == Nearness::SameMachine => address_for(chosen.member, &t.host),
        _ => chosen.member.tcp.clone(),
    };
    Ok(Source {
        holder: chosen.holder.clone(),
        member: chosen.member.clone(),
        addr,
        same_node: chosen.nearness == Nearness::TargetItself,
        load: load(chosen).cloned(),
    })
}

/// Where equally near holders of `name` rank for `target` (rendezvous hashing): a hash of the
/// target's member name, the tensor's name and the holder, so that each target has an order of
/// its own over the holders, the same every time it asks, and many targets spread evenly.
fn spread_rank(name: &str, target: Option<&MemberRecord>, holder: &Located) -> SpreadRank {
    let mut hasher = blake3::Hasher::new();
    for part in [
        target.map_or("", |t| t.name.as_str()).as_bytes(),
        name.as_bytes(),
        holder.member.as_bytes(),
        &holder.device.to_le_bytes(),
    ] {
        // Each part's length first, so that no two lists of parts hash alike.
        hasher.update(&(part.len() as u64).to_le_bytes());
        hasher.update(part);
    }
    let mut rank = [0; 8];
    rank.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    rank
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_proto::ContentHash;
    use ferry_proto::cluster::TensorRecord;

    fn member(name: &str, host: &str) -> MemberRecord {
        MemberRecord {
            name: name.into(),
            node_id: format!("id-{name}").into(),
            tcp: format!("{name}.example:7070"),
            unix: Some(format!("unix:/run/{name}.sock")),
            host: host.into(),
            devices: Vec::new(),
        }
    }

    fn held(member: &str, device: u32, hash: Option<&str>) -> Located {
        Located {
            member: member.into(),
            device,
            name: "w".into(),
            record: TensorRecord {
                dtype: "f32".into(),
                shape: vec![2],
                bytes: 8,
                // A version per letter.
                content_hash: hash.map(|h| ContentHash::from_digest([h.as_bytes()[0]; 32])),
            },
        }
    }

    #[test]
    fn the_nearest_holder_of_the_one_version_is_chosen() {
        let members = [member("a", "h1"), member("b", "h2"), member("c", "h2")];
        let holders = [
            held("a", 0, Some("x")),
            held("c", 1, Some("x")),
            held("gone", 0, Some("x")),
        ];
        // A holder on the target's machine first, through its Unix socket.
        let chosen =
            choose_source("w", &holders, &members, Some(&members[1]), &Loads::new()).unwrap();
        assert_eq!(
            (chosen.holder.member.as_str(), chosen.addr.as_str()),
            ("c", "unix:/run/c.sock")
        );
        assert!(!chosen.same_node);
        // The target itself before anyone.
        let chosen =
            choose_source("w", &holders, &members, Some(&members[0]), &Loads::new()).unwrap();
        assert!(chosen.same_node);
        // Nobody near: one of them, over TCP, the same every time.
        let far = member("d", "h3");
        let chosen = choose_source("w", &holders, &members, Some(&far), &Loads::new()).unwrap();
        assert!(
            ["a", "c"].contains(&chosen.holder.member.as_str()),
            "{chosen:?}"
        );
        assert_eq!(
            chosen.addr,
            format!("{}.example:7070", chosen.holder.member)
        );
        let again = choose_source("w", &holders, &members, Some(&far), &Loads::new()).unwrap();
        assert_eq!(again.holder, chosen.holder);
        // A holder whose member is not registered is never chosen.
        let only_gone = [held("gone", 0, Some("x"))];
        assert!(matches!(
            choose_source("w", &only_gone, &members, None, &Loads::new()),
            Err(ChooseError::NotHeld(_))
        ));
    }

    #[test]
    fn two_versions_or_two_unverified_holders_are_ambiguous() {
        let members = [member("a", "h1"), member("b", "h2")];
        let differ = [held("a", 0, Some("x")), held("b", 0, Some("y"))];
        assert!(matches!(
            choose_source("w", &differ, &members, None, &Loads::new()),
            Err(ChooseError::Ambiguous { .. })
        ));
        let unverified = [held("a", 0, None), held("b", 0, None)];
        assert!(matches!(
            choose_source("w", &unverified, &members, None, &Loads::new()),
            Err(ChooseError::Ambiguous { .. })
        ));
        // One unverified holder alone, or unverified ones beside verified ones, are not.
        let one = [held("b", 0, None)];
        assert_eq!(
            choose_source("w", &one, &members, None, &Loads::new())
                .unwrap()
                .holder
                .member,
            "b"
        );
        let mixed = [held("a", 0, None), held("b", 0, Some("x"))];
        assert_eq!(
            choose_source("w", &mixed, &members, None, &Loads::new())
                .unwrap()
                .holder
                .member,
            "b"
        );
    }

    /// How many of 400 targets, none near any of the four holders `names`, choose each holder
    /// under `loads`.
    fn spread_over(names: [&str; 4], loads: &Loads) -> std::collections::BTreeMap<String, usize> {
        let holders: Vec<Located> = names.into_iter().map(|m| held(m, 0, Some("x"))).collect();
        let mut members: Vec<MemberRecord> =
            holders.iter().map(|h| member(&h.member, "hub")).collect();
        let targets: Vec<MemberRecord> = (0..400)
            .map(|i| member(&format!("worker{i}"), ""))
            .collect();
        members.extend(targets.iter().cloned());
        let mut chosen = std::collections::BTreeMap::<String, usize>::new();
        for target in &targets {
            let source = choose_source("w", &holders, &members, Some(target), loads).unwrap();
            *chosen.entry(source.holder.member).or_default() += 1;
        }
        chosen
    }

    /// Many targets, none near any holder: they spread over the holders about evenly, so a new
    /// worker reads from running replicas as often as from the first holder by name.
    #[test]
    fn equally_near_holders_share_the_targets() {
        let names = ["coordinator", "replica1", "replica2", "replica3"];
        let chosen = spread_over(names, &Loads::new());
        assert_eq!(chosen.len(), 4, "{chosen:?}");
        assert!(
            chosen.values().all(|&n| (60..=140).contains(&n)),
            "{chosen:?}"
        );
    }

    /// A busy holder among four equally near ones loses the targets whose first two in their
    /// spread order include it; the others keep theirs, spread as before. Loads that differ
    /// within a power of two spread as equal ones do.
    #[test]
    fn a_busy_holder_loses_only_the_targets_that_had_a_choice() {
        let names = ["h0", "h1", "h2", "h3"];
        let serving = |bytes| Load::Serving { fetches: 1, bytes };
        let mut loads: Loads = names
            .into_iter()
            .enumerate()
            .map(|(i, m)| (m.to_string(), serving(1000 + i as u64)))
            .collect();
        let even = spread_over(names, &loads);
        assert_eq!(even.len(), 4, "{even:?}");
        assert!(even.values().all(|&n| (60..=140).contains(&n)), "{even:?}");
        loads.insert("h0".into(), serving(1 << 30));
        let busy = spread_over(names, &loads);
        assert_eq!(busy.get("h0"), None, "{busy:?}");
        assert!(busy.values().all(|&n| (90..=180).contains(&n)), "{busy:?}");
    }

    /// Loads, in a table: holders b (on the target's machine), c and d (elsewhere), each row
    /// the loads their members said and the holder chosen.
    #[test]
    fn the_less_busy_of_the_nearest_answering_holders_is_chosen() {
        let members = [
            member("t", "h1"),
            member("b", "h1"),
            member("c", "h2"),
            member("d", "h3"),
        ];
        let holders = [
            held("b", 0, Some("x")),
            held("c", 0, Some("x")),
            held("d", 0, Some("x")),
        ];
        let serving = |fetches, bytes| Load::Serving { fetches, bytes };
        let down = || Load::Unreachable("connection refused".into());
        // Each row: what the members said, and who is chosen.
        type Row<'a> = (Vec<(&'a str, Load)>, &'a str);
        let table: Vec<Row> = vec![
            // Nearness before load: b shares the target's machine, and is chosen however busy.
            (
                vec![
                    ("b", serving(4, 1 << 30)),
                    ("c", serving(0, 0)),
                    ("d", serving(0, 0)),
                ],
                "b",
            ),
            // b did not answer: the less busy of the other two, by bytes.
            (
                vec![("b", down()), ("c", serving(1, 5)), ("d", serving(1, 1))],
                "d",
            ),
            (
                vec![("b", down()), ("c", serving(0, 0)), ("d", serving(1, 1))],
                "c",
            ),
            // As many bytes, to a power of two: the fewer fetches.
            (
                vec![("b", down()), ("c", serving(3, 10)), ("d", serving(2, 12))],
                "d",
            ),
            // One that answered, however busy, before one not asked or too old to say.
            (vec![("b", down()), ("d", serving(9, 1 << 30))], "d"),
            (
                vec![
                    ("b", down()),
                    ("c", Load::Unknown),
                    ("d", serving(9, 1 << 30)),
                ],
                "d",
            ),
            // Only one not asked left: it is chosen.
            (vec![("b", down()), ("d", down())], "c"),
            // None answered: the nearest all the same, its load saying so.
            (vec![("b", down()), ("c", down()), ("d", down())], "b"),
        ];
        for (said, expected) in table {
            let loads: Loads = said
                .iter()
                .map(|(m, load)| (m.to_string(), load.clone()))
                .collect();
            let chosen = choose_source("w", &holders, &members, Some(&members[0]), &loads).unwrap();
            assert_eq!(chosen.holder.member, expected, "{said:?}");
            assert_eq!(chosen.load, loads.get(expected).cloned());
        }
    }

    /// Whose load is asked: nearest first, each member once, at most MOST_ASKED; nobody where
    /// the target itself or a single member holds it, or where the name resolves to no one
    /// version.
    #[test]
    fn the_nearest_holders_are_asked_each_once() {
        let mut members = vec![member("t", "h1"), member("b", "h1")];
        let mut holders = vec![held("b", 0, Some("x")), held("b", 1, Some("x"))];
        assert!(
            worth_asking("w", &holders, &members, Some(&members[0])).is_empty(),
            "one member holds it"
        );
        for i in 0..20 {
            let name = format!("far{i}");
            holders.push(held(&name, 0, Some("x")));
            members.push(member(&name, "elsewhere"));
        }
        let asked = worth_asking("w", &holders, &members, Some(&members[0]));
        assert_eq!(asked.len(), MOST_ASKED);
        assert_eq!(asked[0].name, "b");
        let mut names: Vec<&str> = asked.iter().map(|m| m.name.as_str()).collect();
        names.dedup();
        assert_eq!(names.len(), MOST_ASKED);
        // The same far ones each time for this target.
        assert_eq!(
            asked,
            worth_asking("w", &holders, &members, Some(&members[0]))
        );
        let mut with_target = holders.clone();
        with_target.push(held("t", 0, Some("x")));
        assert!(worth_asking("w", &with_target, &members, Some(&members[0])).is_empty());
        holders.push(held("c", 0, Some("y")));
        members.push(member("c", "elsewhere"));
        assert!(worth_asking("w", &holders, &members, Some(&members[0])).is_empty());
    }
}
