//! Whether this process's machine has memory to spare: what a receive pool asks before it makes
//! memory ready that no tensor has asked for yet (the readiness of a freshly started node).
//!
//! Measures, each where the kernel gives it: the machine's (`MemAvailable` of `MemTotal` in
//! `/proc/meminfo`, which counts reclaimable caches as available) and each memory limit over
//! this process: in cgroup v2, every `memory.max` from its own cgroup up to the root of the
//! mount (a limit set on a parent, a systemd slice's, binds as well), less `memory.current`;
//! in cgroup v1, `memory.limit_in_bytes` less `memory.usage_in_bytes` of the memory
//! controller's mount. A container's limit is often far below its machine's memory.

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
    let mut measures: Vec<Spare> = machine.into_iter().collect();
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    // cgroup v2: this process's cgroup and every parent up to the mount's root.
    let v2 = std::path::Path::new("/sys/fs/cgroup");
    let v2_path = cgroups.lines().find_map(|l| l.strip_prefix("0::"));
    measures.extend(limits_up_from(
        v2,
        v2_path,
        "memory.max",
        "memory.current",
        "inactive_file",
    ));
    // cgroup v1's memory controller: the same walk in its own mount.
    let v1 = v2.join("memory");
    let v1_path = cgroups.lines().find_map(|l| {
        let mut fields = l.splitn(3, ':');
        let (_, controllers) = (fields.next()?, fields.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then(|| fields.next())?
    });
    measures.extend(limits_up_from(
        &v1,
        v1_path,
        "memory.limit_in_bytes",
        "memory.usage_in_bytes",
        "total_inactive_file",
    ));
    measures
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

/// A cgroup's room under its limit from the text of its limit and its usage; `None` without a
/// limit (v2's `max`, or v1's page-rounded 2^63 - 1 and anything that large) or with one that
/// does not parse.
fn limited(max: &str, current: &str) -> Option<Spare> {
    let total: u64 = max.trim().parse().ok()?;
    if total >= 1 << 62 {
        return None;
    }
    let used: u64 = current.trim().parse().ok()?;
    (total > 0).then_some(Spare {
        available: total.saturating_sub(used),
        total,
    })
}

/// The limits (as [`limited`] reads `limit` and `usage`, less the reclaimable page cache that
/// `memory.stat` counts as `inactive`, as `MemAvailable` does) of the cgroup at `path` under
/// the mount `root` and of every parent up to `root`; where the path is not there (a container
/// that shares its host's cgroup namespace names a path outside its mount), `root`'s own.
fn limits_up_from(
    root: &std::path::Path,
    path: Option<&str>,
    limit: &str,
    usage: &str,
    inactive: &str,
) -> Vec<Spare> {
    let relative = path.map(|p| p.trim().trim_start_matches('/'));
    // A path that climbs out of the mount is nothing this reads.
    if relative.is_some_and(|r| r.split('/').any(|part| part == "..")) {
        return Vec::new();
    }
    let mut dir = relative.map(|r| root.join(r)).filter(|d| d.is_dir());
    if dir.is_none() && root.is_dir() {
        dir = Some(root.to_path_buf());
    }
    let mut found = Vec::new();
    while let Some(d) = dir {
        let read = |name: &str| std::fs::read_to_string(d.join(name)).ok();
        if let (Some(max), Some(used)) = (read(limit), read(usage)) {
            let cache = read("memory.stat").and_then(|stat| stat_field(&stat, inactive));
            let used = used
                .trim()
                .parse::<u64>()
                .map(|u| u.saturating_sub(cache.unwrap_or(0)).to_string())
                .unwrap_or(used);
            found.extend(limited(&max, &used));
        }
        dir = d
            .parent()
            .filter(|p| p.starts_with(root))
            .map(|p| p.to_path_buf());
    }
    found
}

/// The value of `name` in the text of a cgroup's `memory.stat` (`name value` lines).
fn stat_field(stat: &str, name: &str) -> Option<u64> {
    stat.lines().find_map(|line| {
        let (key, value) = line.split_once(' ')?;
        (key == name).then(|| value.trim().parse().ok())?
    })
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
        assert_eq!(limited("9223372036854771712\n", "100\n"), None, "v1's none");
    }

    #[test]
    fn a_cgroup_walk_reads_each_limit_up_to_the_root_less_its_inactive_cache() {
        let root = tempfile::tempdir().unwrap();
        let leaf = root.path().join("a/b");
        std::fs::create_dir_all(&leaf).unwrap();
        let write = |dir: &std::path::Path, max: &str, current: &str, inactive: u64| {
            std::fs::write(dir.join("memory.max"), max).unwrap();
            std::fs::write(dir.join("memory.current"), current).unwrap();
            let stat = format!("anon 1\ninactive_file {inactive}\nactive_file 2\n");
            std::fs::write(dir.join("memory.stat"), stat).unwrap();
        };
        write(&leaf, "max\n", "500\n", 0);
        write(&root.path().join("a"), "1000\n", "900\n", 600);
        write(root.path(), "4000\n", "1000\n", 0);
        let walk = |path| {
            limits_up_from(
                root.path(),
                path,
                "memory.max",
                "memory.current",
                "inactive_file",
            )
        };
        let found = walk(Some("/a/b"));
        let spares: Vec<(u64, u64)> = found.iter().map(|s| (s.available, s.total)).collect();
        assert_eq!(spares, [(700, 1000), (3000, 4000)], "the leaf has no limit");
        assert_eq!(walk(Some("/a/../..")), []);
        let outside: Vec<u64> = walk(Some("/elsewhere")).iter().map(|s| s.total).collect();
        assert_eq!(
            outside,
            [4000],
            "a path not under the mount: the root's own"
        );
        assert_eq!(
            stat_field("total_inactive_file 7\n", "total_inactive_file"),
            Some(7)
        );
        assert_eq!(stat_field("inactive_file x\n", "inactive_file"), None);
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
