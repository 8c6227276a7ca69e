//! Which holder a copy of a tensor named alone reads from ([`choose_source`]): one version,
//! the nearest holder, and among equally near ones a spread over the targets. A pure decision,
//! tested by tables.

use ferry_proto::cluster::MemberRecord;

use super::{Located, address_for};

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

/// Picks the holder a copy of `name` to `target` reads from, among `holders` (the directory's
/// entries for that name) whose member is registered in `members`:
/// - only one version: holders whose verified content hashes differ make the name ambiguous,
///   and unverified holders count only where no holder is verified and there is one;
/// - nearest first: the target node itself (a copy between its devices), then a member on the
///   target's machine (its Unix socket, shared memory), then any;
/// - among holders equally near, the one `spread_rank` ranks first for this target and name:
///   targets spread over the holders (a new worker reads from running replicas as often as from
///   the first holder by name), and a target asked again picks the same one.
pub fn choose_source(
    name: &str,
    holders: &[Located],
    members: &[MemberRecord],
    target: Option<&MemberRecord>,
) -> Result<Source, ChooseError> {
    let registered = |h: &&Located| members.iter().any(|m| m.name == h.member);
    let live: Vec<&Located> = holders.iter().filter(registered).collect();
    let verified: Vec<&Located> = live
        .iter()
        .copied()
        .filter(|h| h.record.content_hash.is_some())
        .collect();
    let ambiguous = || ChooseError::Ambiguous {
        name: name.to_string(),
        holders: live
            .iter()
            .map(|h| {
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
    let candidates = match (verified.first(), live.len()) {
        (_, 0) => return Err(ChooseError::NotHeld(name.to_string())),
        (Some(first), _) => {
            if verified
                .iter()
                .any(|h| h.record.content_hash != first.record.content_hash)
            {
                return Err(ambiguous());
            }
            verified
        }
        (None, 1) => live,
        (None, _) => return Err(ambiguous()),
    };
    let member_of = |h: &Located| members.iter().find(|m| m.name == h.member);
    let nearness = |h: &Located| {
        let member = member_of(h);
        match (target, member) {
            (Some(t), _) if t.name == h.member => 0,
            (Some(t), Some(m)) if !t.host.is_empty() && t.host == m.host => 1,
            _ => 2,
        }
    };
    let holder = candidates
        .into_iter()
        .min_by_key(|h| {
            let rank = spread_rank(name, target, h);
            (nearness(h), rank, h.member.clone(), h.device)
        })
        .ok_or_else(|| ChooseError::NotHeld(name.to_string()))?;
    let member = member_of(holder)
        .cloned()
        .ok_or_else(|| ChooseError::NotHeld(name.to_string()))?;
    let near = nearness(holder);
    let addr = match target {
        Some(t) if near == 1 => address_for(&member, &t.host),
        _ => member.tcp.clone(),
    };
    Ok(Source {
        holder: holder.clone(),
        member,
        addr,
        same_node: near == 0,
    })
}

/// Where equally near holders of `name` rank for `target` (rendezvous hashing): a hash of the
/// target's member name, the tensor's name and the holder, so that each target has an order of
/// its own over the holders, the same every time it asks, and many targets spread evenly.
fn spread_rank(name: &str, target: Option<&MemberRecord>, holder: &Located) -> [u8; 8] {
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
        let chosen = choose_source("w", &holders, &members, Some(&members[1])).unwrap();
        assert_eq!(
            (chosen.holder.member.as_str(), chosen.addr.as_str()),
            ("c", "unix:/run/c.sock")
        );
        assert!(!chosen.same_node);
        // The target itself before anyone.
        let chosen = choose_source("w", &holders, &members, Some(&members[0])).unwrap();
        assert!(chosen.same_node);
        // Nobody near: one of them, over TCP, the same every time.
        let far = member("d", "h3");
        let chosen = choose_source("w", &holders, &members, Some(&far)).unwrap();
        assert!(
            ["a", "c"].contains(&chosen.holder.member.as_str()),
            "{chosen:?}"
        );
        assert_eq!(
            chosen.addr,
            format!("{}.example:7070", chosen.holder.member)
        );
        let again = choose_source("w", &holders, &members, Some(&far)).unwrap();
        assert_eq!(again.holder, chosen.holder);
        // A holder whose member is not registered is never chosen.
        let only_gone = [held("gone", 0, Some("x"))];
        assert!(matches!(
            choose_source("w", &only_gone, &members, None),
            Err(ChooseError::NotHeld(_))
        ));
    }

    #[test]
    fn two_versions_or_two_unverified_holders_are_ambiguous() {
        let members = [member("a", "h1"), member("b", "h2")];
        let differ = [held("a", 0, Some("x")), held("b", 0, Some("y"))];
        assert!(matches!(
            choose_source("w", &differ, &members, None),
            Err(ChooseError::Ambiguous { .. })
        ));
        let unverified = [held("a", 0, None), held("b", 0, None)];
        assert!(matches!(
            choose_source("w", &unverified, &members, None),
            Err(ChooseError::Ambiguous { .. })
        ));
        // One unverified holder alone, or unverified ones beside verified ones, are not.
        let one = [held("b", 0, None)];
        assert_eq!(
            choose_source("w", &one, &members, None)
                .unwrap()
                .holder
                .member,
            "b"
        );
        let mixed = [held("a", 0, None), held("b", 0, Some("x"))];
        assert_eq!(
            choose_source("w", &mixed, &members, None)
                .unwrap()
                .holder
                .member,
            "b"
        );
    }

    /// Many targets, none near any holder: they spread over the holders about evenly, so a new
    /// worker reads from running replicas as often as from the first holder by name.
    #[test]
    fn equally_near_holders_share_the_targets() {
        let holders: Vec<Located> = ["coordinator", "replica1", "replica2", "replica3"]
            .into_iter()
            .map(|m| held(m, 0, Some("x")))
            .collect();
        let mut members: Vec<MemberRecord> =
            holders.iter().map(|h| member(&h.member, "hub")).collect();
        let targets: Vec<MemberRecord> = (0..400)
            .map(|i| member(&format!("worker{i}"), ""))
            .collect();
        members.extend(targets.iter().cloned());
        let mut chosen = std::collections::BTreeMap::<String, usize>::new();
        for target in &targets {
            let source = choose_source("w", &holders, &members, Some(target)).unwrap();
            *chosen.entry(source.holder.member).or_default() += 1;
        }
        assert_eq!(chosen.len(), 4, "{chosen:?}");
        assert!(
            chosen.values().all(|&n| (60..=140).contains(&n)),
            "{chosen:?}"
        );
    }
}
