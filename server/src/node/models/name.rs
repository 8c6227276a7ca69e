//! Where a model version's tensors live: `PREFIX/.vN/PATH` on the model's device. A name with a
//! `.vN` segment belongs to version `N` of the model `PREFIX`; the node alone decides who may
//! write or delete it ([`super::rules`]). Pure functions, tested by tables.

/// A tensor name inside a model version: `prefix/.v{version}/path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct VersionName<'a> {
    /// The model's prefix (what a collect was asked to write to).
    pub(crate) prefix: &'a str,
    /// The version.
    pub(crate) version: u64,
    /// The tensor's path within the model (`encoder.layers.0.weight`).
    pub(crate) path: &'a str,
}

/// The name of `path` in version `version` of the model `prefix`.
pub(crate) fn version_name(prefix: &str, version: u64, path: &str) -> String {
    format!("{prefix}/.v{version}/{path}")
}

/// The names of version `version` of the model `prefix` all start with this.
pub(crate) fn version_dir(prefix: &str, version: u64) -> String {
    format!("{prefix}/.v{version}/")
}

/// The version a name belongs to, where it has a `.vN` segment (`N` in canonical decimal, not
/// the first segment nor the last): `None` for any other name.
pub(crate) fn parse(name: &str) -> Option<VersionName<'_>> {
    let mut start = 0;
    for segment in name.split('/') {
        let end = start + segment.len();
        let version = segment
            .strip_prefix(".v")
            .filter(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
            .filter(|digits| digits.len() == 1 || !digits.starts_with('0'))
            .and_then(|digits| digits.parse::<u64>().ok());
        if let Some(version) = version
            && start > 0
            && end + 1 < name.len()
        {
            return Some(VersionName {
                prefix: &name[..start - 1],
                version,
                path: &name[end + 1..],
            });
        }
        start = end + 1;
    }
    None
}

/// Whether `prefix` may name a model: a valid tensor name with no `.vN` segment of its own, so
/// that every version name parses back to it.
pub(crate) fn valid_prefix(prefix: &str) -> bool {
    ferry_proto::message::validate_name(prefix).is_ok()
        && !prefix.ends_with('/')
        && parse(&format!("{prefix}/x")).is_none()
        && parse(&version_name(prefix, 0, "x")).is_some_and(|n| n.prefix == prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_table() {
        let v = |prefix, version, path| {
            Some(VersionName {
                prefix,
                version,
                path,
            })
        };
        let table = [
            ("model/.v3/fc.weight", v("model", 3, "fc.weight")),
            ("a/b/.v0/x/y", v("a/b", 0, "x/y")),
            ("m/.v12/.v4/w", v("m", 12, ".v4/w")),
            ("m/.v18446744073709551615/w", v("m", u64::MAX, "w")),
            // Not a version segment.
            ("model/fc.weight", None),
            ("model/.v/w", None),
            ("model/.v03/w", None),
            ("model/.vx/w", None),
            ("model/.v-1/w", None),
            ("model/.v18446744073709551616/w", None),
            // First or last segment: no prefix, or no path.
            (".v3/w", None),
            ("model/.v3", None),
            ("model/.v3/", None),
        ];
        for (name, want) in table {
            assert_eq!(parse(name), want, "{name}");
        }
    }

    #[test]
    fn names_round_trip() {
        for (prefix, version, path) in [("m", 0, "w"), ("a/b", 7, "x.y/z"), ("m", 9, ".v2/w")] {
            let name = version_name(prefix, version, path);
            assert!(name.starts_with(&version_dir(prefix, version)));
            let parsed = parse(&name).unwrap();
            assert_eq!(
                (parsed.prefix, parsed.version, parsed.path),
                (prefix, version, path)
            );
        }
    }

    #[test]
    fn prefix_table() {
        let table = [
            ("model", true),
            ("team/model", true),
            ("", false),
            ("model/", false),
            ("a/.v1/b", false),
            ("a/.v1", false),
        ];
        for (prefix, want) in table {
            assert_eq!(valid_prefix(prefix), want, "{prefix:?}");
        }
    }
}
