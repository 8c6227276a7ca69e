//! The model registry's tests: each transition by table, and random histories of collects,
//! applies, replacements and deletes checked against the registry's invariants.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use rand::{Rng, SeedableRng};

use super::*;
use crate::node::models::name::{parse, version_name};

fn model() -> ModelId {
    ModelId::new(0, "m")
}

fn manifest(version: u64) -> Arc<Manifest> {
    Arc::new(Manifest {
        device: 0,
        prefix: "m".into(),
        version,
        tensors: Vec::new(),
        metadata: BTreeMap::new(),
    })
}

/// Begins, seals and commits a version.
fn collect(r: &mut Registry, replace: Replace) -> Result<(u64, Option<Arc<Manifest>>), ModelError> {
    let v = r.begin(&model(), replace)?;
    assert_eq!(r.seal(&model(), v), Ok(0));
    r.commit(manifest(v)).map(|doomed| (v, doomed))
}

#[test]
fn a_collect_refuses_to_replace_unless_asked() {
    let mut r = Registry::default();
    assert_eq!(collect(&mut r, Replace::Refuse).unwrap(), (0, None));
    assert!(matches!(
        r.begin(&model(), Replace::Refuse),
        Err(ModelError::Exists { version: 0, .. })
    ));
    let (v, doomed) = collect(&mut r, Replace::Allow).unwrap();
    assert_eq!(v, 1);
    assert_eq!(
        doomed.map(|m| m.version),
        Some(0),
        "the old version goes at once"
    );
    // A refusing collect begun before a model existed is refused at its commit if one appeared.
    let mut r = Registry::default();
    let late = r.begin(&model(), Replace::Refuse).unwrap();
    collect(&mut r, Replace::Refuse).unwrap();
    r.seal(&model(), late).unwrap();
    assert!(matches!(
        r.commit(manifest(late)),
        Err(ModelError::Superseded {
            version: 0,
            current: 1,
            ..
        })
    ));
}

#[test]
fn writes_go_only_to_a_version_being_written() {
    let mut r = Registry::default();
    let name = |v| version_name("m", v, "w");
    // Outside every model version: not counted, never refused.
    assert_eq!(r.admit_write(0, "m/w", parse("m/w")), Ok(None));
    let v = r.begin(&model(), Replace::Refuse).unwrap();
    let n = name(v);
    let write = r.admit_write(0, &n, parse(&n)).unwrap().unwrap();
    assert_eq!(r.in_flight(&model(), v), 1);
    // Another version, or another device: refused.
    let other = name(v + 1);
    assert!(r.admit_write(0, &other, parse(&other)).is_err());
    assert!(r.admit_write(1, &n, parse(&n)).is_err());
    // Sealed: the write in flight is counted, no new one admitted.
    assert_eq!(r.seal(&model(), v), Ok(1));
    assert!(matches!(
        r.admit_write(0, &n, parse(&n)),
        Err(ModelError::Sealed {
            state: "is no longer being written",
            ..
        })
    ));
    r.end_write(&write);
    assert_eq!(r.in_flight(&model(), v), 0);
    r.commit(manifest(v)).unwrap();
    // Committed: neither written nor deleted by anyone but the node.
    assert!(matches!(
        r.admit_write(0, &n, parse(&n)),
        Err(ModelError::Sealed {
            state: "is committed",
            ..
        })
    ));
    assert!(r.may_delete(0, &n, parse(&n)).is_err());
    assert!(r.may_delete(0, "m/w", parse("m/w")).is_ok());
}

#[test]
fn a_replaced_version_goes_at_its_last_apply() {
    let mut r = Registry::default();
    collect(&mut r, Replace::Refuse).unwrap();
    let first = r.pin(&model()).unwrap();
    let second = r.pin(&model()).unwrap();
    assert_eq!((first.version, second.version), (0, 0));
    let (_, doomed) = collect(&mut r, Replace::Allow).unwrap();
    assert_eq!(doomed, None, "held by two applies");
    assert_eq!(r.unpin(&model(), 0), None, "still held by one");
    assert_eq!(r.unpin(&model(), 0).map(|m| m.version), Some(0));
    assert_eq!(r.unpin(&model(), 0), None, "handed out once");
    // Deleting the model: at once where unheld.
    assert!(matches!(
        r.delete(&model(), Some(0)),
        Err(ModelError::NotCurrent { current: 1, .. })
    ));
    let (deleted, doomed) = r.delete(&model(), Some(1)).unwrap();
    assert_eq!((deleted.version, doomed.map(|m| m.version)), (1, Some(1)));
    assert!(matches!(r.pin(&model()), Err(ModelError::NoModel { .. })));
    // Version numbers never start over.
    assert_eq!(collect(&mut r, Replace::Refuse).unwrap().0, 2);
}

/// Random histories of two collectors' begins, writes, seals, commits and aborts, applies'
/// pins and unpins, and deletes: the current version only increases; every committed version
/// but the current is handed out to delete exactly once, never while an apply holds it; a
/// refused commit leaves the version to its caller; nothing is written to a sealed version.
#[test]
fn random_histories_keep_the_invariants() {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for _ in 0..200 {
        let mut r = Registry::default();
        let mut writing: BTreeMap<u64, (bool, usize)> = BTreeMap::new(); // sealed, in flight
        let mut pins: Vec<u64> = Vec::new();
        let mut committed: BTreeSet<u64> = BTreeSet::new();
        let mut doomed: BTreeSet<u64> = BTreeSet::new();
        let mut last_current: Option<u64> = None;
        let doom = |m: Option<Arc<Manifest>>, pins: &[u64], doomed: &mut BTreeSet<u64>| {
            if let Some(m) = m {
                assert!(
                    !pins.contains(&m.version),
                    "{} doomed while held",
                    m.version
                );
                assert!(doomed.insert(m.version), "{} doomed twice", m.version);
            }
        };
        for _ in 0..60 {
            match rng.random_range(0..8) {
                0 => {
                    let replace = if rng.random_bool(0.7) {
                        Replace::Allow
                    } else {
                        Replace::Refuse
                    };
                    if let Ok(v) = r.begin(&model(), replace) {
                        writing.insert(v, (false, 0));
                    }
                }
                1 => {
                    // A write into a random version, admitted only while it is being written.
                    let v = rng.random_range(0..8);
                    let n = version_name("m", v, "w");
                    let admitted = r.admit_write(0, &n, parse(&n));
                    let open = writing.get(&v).is_some_and(|(sealed, _)| !sealed);
                    assert_eq!(admitted.is_ok(), open, "write into {v}");
                    if admitted.is_ok() {
                        writing.get_mut(&v).unwrap().1 += 1;
                    }
                }
                2 => {
                    // A write in flight ends.
                    if let Some((&v, _)) = writing.iter().find(|(_, (_, n))| *n > 0) {
                        r.end_write(&WriteInto {
                            model: model(),
                            version: v,
                        });
                        writing.get_mut(&v).unwrap().1 -= 1;
                    }
                }
                3 => {
                    // A commit: sealed, waited for, then committed or refused.
                    let Some((&v, &(sealed, n))) = writing.iter().next() else {
                        continue;
                    };
                    if !sealed {
                        assert_eq!(r.seal(&model(), v), Ok(n));
                        writing.get_mut(&v).unwrap().0 = true;
                    }
                    if n > 0 {
                        continue;
                    }
                    writing.remove(&v);
                    match r.commit(manifest(v)) {
                        Ok(old) => {
                            assert!(last_current.is_none_or(|c| c < v), "current went back");
                            last_current = Some(v);
                            committed.insert(v);
                            doom(old, &pins, &mut doomed);
                        }
                        Err(ModelError::Superseded { current, .. }) => {
                            assert!(current > v);
                        }
                        Err(ModelError::Exists { .. }) => {}
                        Err(other) => panic!("commit of {v}: {other}"),
                    }
                }
                4 => {
                    if let Some((&v, &(_, 0))) = writing.iter().last() {
                        r.abort(&model(), v);
                        writing.remove(&v);
                    }
                }
                5 => match r.pin(&model()) {
                    Ok(m) => {
                        assert_eq!(Some(m.version), last_current);
                        assert!(!doomed.contains(&m.version));
                        pins.push(m.version);
                    }
                    Err(_) => assert_eq!(last_current, None),
                },
                6 => {
                    if !pins.is_empty() {
                        let v = pins.swap_remove(rng.random_range(0..pins.len()));
                        let old = r.unpin(&model(), v);
                        doom(old, &pins, &mut doomed);
                    }
                }
                _ => {
                    if rng.random_bool(0.2)
                        && let Ok((deleted, old)) = r.delete(&model(), None)
                    {
                        assert_eq!(Some(deleted.version), last_current);
                        last_current = None;
                        doom(old, &pins, &mut doomed);
                    }
                }
            }
        }
        for v in std::mem::take(&mut pins) {
            let old = r.unpin(&model(), v);
            doom(old, &pins, &mut doomed);
        }
        let mut expected = committed.clone();
        if let Some(current) = last_current {
            expected.remove(&current);
        }
        assert_eq!(doomed, expected, "every version but the current goes, once");
    }
}
