//! Whether this process's machine has memory to spare: what a receive pool asks before it makes
//! memory ready that no tensor has asked for yet (the readiness of a freshly started node).
//!
//! Two measures, each where the kernel gives it: the machine's (`MemAvailable` of `MemTotal` in
//! `/proc/meminfo`, which counts reclaimable caches as available) and, for a process in a cgroup
//! (v2) with a memory limit, that limit's (`memory.max` less `memory.current`, of
//! `memory.max`): a container's limit is often far below its machine's memory.

/// Memory that could still be taken, against the total it is part of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spare {
    /// Bytes that could still be taken.
    pub available: u64,
    /// The bytes they are part of.
    pub total: u64,
}

impl Spare {
    /// At least half of the total is available.
    pub fn half_or_more(&self) -> bool {
        self.available >= self.total / 2
    }
}

/// The machine's and this process's cgroup's spare memory now, each where it can be read.
pub fn now() -> Vec<Spare> {
    let machine = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| machine(&text));
    let cgroup = cgroup_dir().and_then(|dir| {
        let max = std::fs::read_to_string(dir.join("memory.max")).ok()?;
        let current = std::fs::read_to_string(dir.join("memory.current")).ok()?;
        limited(&max, &current)
    });
    machine.into_iter().chain(cgroup).collect()
}

/// At least half of every measure that can be read is available; false where none can (no
/// memory is taken on a guess).
pub fn half_or_more_now() -> bool {
    let measures = now();
    !measures.is_empty() && measures.iter().all(Spare::half_or_more)
}

/// `MemAvailable` of `MemTotal` from the text of `/proc/meminfo` (values in kB).
fn machine(meminfo: &str) -> Option<Spare> {
    let field = |name: &str| -> Option<u64> {
        let line = meminfo.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line
            .strip_prefix(name)?
            .trim()
            .strip_suffix("kB")?
            .trim()
            .parse()
            .ok()?;
        kib.checked_mul(1024)
    };
    let total = field("MemTotal:")?;
    let available = field("MemAvailable:")?.min(total);
    (total > 0).then_some(Spare { available, total })
}

/// A cgroup's room under its limit from the text of its `memory.max` and `memory.current`;
/// `None` without a limit (`max`) or with one that does not parse.
fn limited(max: &str, current: &str) -> Option<Spare> {
    let total: u64 = max.trim().parse().ok()?;
    let used: u64 = current.trim().parse().ok()?;
    (total > 0).then_some(Spare {
        available: total.saturating_sub(used),
        total,
    })
}

/// This process's cgroup (v2) directory, from `/proc/self/cgroup`'s `0::PATH` line.
fn cgroup_dir() -> Option<std::path::PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    // A path that climbs out of the cgroup mount is nothing this reads.
    let relative = path.trim().trim_start_matches('/');
    if relative.split('/').any(|part| part == "..") {
        return None;
    }
    Some(std::path::Path::new("/sys/fs/cgroup").join(relative))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_measure_reads_meminfo_in_kilobytes() {
        let text = "MemTotal:       24570132 kB\nMemFree:        20000000 kB\nMemAvailable:   12285066 kB\n";
        let spare = machine(text).unwrap();
        assert_eq!(spare.total, 24_570_132 * 1024);
        assert_eq!(spare.available, 12_285_066 * 1024);
        assert!(spare.half_or_more());
        let short = "MemTotal:       24570132 kB\nMemAvailable:   12285065 kB\n";
        assert!(!machine(short).unwrap().half_or_more());
        assert_eq!(machine("MemTotal: 1 kB\n"), None, "no MemAvailable");
        assert_eq!(machine("MemTotal: x kB\nMemAvailable: 1 kB\n"), None);
        assert_eq!(
            machine("MemTotal: 99999999999999999999 kB\nMemAvailable: 1 kB\n"),
            None,
            "overflow"
        );
    }

    #[test]
    fn a_cgroup_measure_counts_only_a_limit() {
        assert_eq!(limited("max\n", "100\n"), None);
        let spare = limited("1000\n", "600\n").unwrap();
        assert_eq!((spare.available, spare.total), (400, 1000));
        assert!(!spare.half_or_more());
        assert_eq!(limited("1000\n", "2000\n").unwrap().available, 0);
        assert_eq!(limited("0\n", "0\n"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_machine_has_a_measure() {
        let measures = now();
        assert!(!measures.is_empty());
        assert!(
            measures
                .iter()
                .all(|m| m.available <= m.total && m.total > 0)
        );
    }
}
