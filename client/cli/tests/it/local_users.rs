//! Another Unix user of the host against a node that asks no credential (the default): `ferry ls`
//! and `ferry rm` run as `nobody` over loopback TCP are refused with a word on why, while the
//! node's own user is served; a token is what lets another user in. Running a command as
//! another user needs root, as the tests run in CI.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ferry_files::write_tensors;
use ferry_proto::DType;
use ferry_server::{NodeConfig, ServiceConfig};
use ferry_testkit::samples;
use ferry_testkit::{BackgroundNode, devices};

/// `nobody`'s user and group ids on Debian.
const NOBODY: u32 = 65534;

/// The CLI where `nobody` may run it: a copy in a directory every user may enter (the build's
/// own may be under a home only its owner enters).
struct CliForEveryone {
    dir: tempfile::TempDir,
}

impl CliForEveryone {
    fn new() -> CliForEveryone {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::copy(crate::ferry_cli(), dir.path().join("ferry")).unwrap();
        CliForEveryone { dir }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("ferry")
    }

    /// `ferry ARGS` as `uid` (root may become anyone), with a home of its own.
    fn run_as(&self, uid: u32, args: &[&str], token: Option<&str>) -> Output {
        let mut command = Command::new(self.path());
        command
            .args(args)
            .env_remove("FERRY_TOKEN")
            .env("HOME", self.dir.path())
            .uid(uid)
            .gid(uid);
        if let Some(token) = token {
            command.env("FERRY_TOKEN", token);
        }
        command.output().expect("ferry runs as another user")
    }
}

/// Acting as another local user needs root, as the tests run in CI.
fn needs_root() {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the process's effective user.
    let euid = std::fs::metadata("/proc/self").unwrap().uid();
    assert_eq!(
        euid, 0,
        "acting as another local user needs root (as the tests run in CI)"
    );
}

fn node_config() -> NodeConfig {
    NodeConfig {
        devices: devices(&["flex"]),
        ..NodeConfig::light()
    }
}

fn put_one(node: &BackgroundNode, dir: &Path, cli: &CliForEveryone, token: Option<&str>) {
    let file = dir.join("w.bpk");
    write_tensors(
        &file,
        &[("w".to_string(), samples::plain(DType::F32, &[4, 4], 1))],
    )
    .unwrap();
    let put = cli.run_as(
        0,
        &["put", file.to_str().unwrap(), &format!("{}/0", node.addr)],
        token,
    );
    assert!(
        put.status.success(),
        "{}",
        String::from_utf8_lossy(&put.stderr)
    );
}

fn listed(out: &Output) -> Vec<String> {
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ls --json parses");
    rows.as_array()
        .expect("an array")
        .iter()
        .map(|row| row["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn another_local_user_can_neither_list_nor_delete_on_a_default_node() {
    needs_root();
    let cli = CliForEveryone::new();
    let node = BackgroundNode::start(node_config(), ServiceConfig::default(), None);
    let dir = tempfile::tempdir().unwrap();
    put_one(&node, dir.path(), &cli, None);
    let tensor = format!("{}/0/w", node.addr);

    let listing = cli.run_as(NOBODY, &["ls", &node.addr, "--json"], None);
    assert!(
        !listing.status.success(),
        "nobody listed the node's tensors"
    );
    let said = String::from_utf8_lossy(&listing.stderr);
    assert!(
        said.contains("serves only its own Unix user (0)") && said.contains("you are user 65534"),
        "{said}"
    );
    let removal = cli.run_as(NOBODY, &["rm", &tensor], None);
    assert!(!removal.status.success(), "nobody removed a tensor");

    // The owner is served, and still holds the tensor.
    let own = cli.run_as(0, &["ls", &node.addr, "--json"], None);
    assert!(
        own.status.success(),
        "{}",
        String::from_utf8_lossy(&own.stderr)
    );
    assert_eq!(listed(&own), ["w"]);
}

#[test]
fn a_token_is_what_lets_another_local_user_in() {
    needs_root();
    let cli = CliForEveryone::new();
    let token = "a-token-of-thirty-two-characters-at-least";
    let service = ServiceConfig {
        credentials: vec![ferry_server::Credential::full(token).unwrap()],
        ..ServiceConfig::default()
    };
    let node = BackgroundNode::start(node_config(), service, None);
    let dir = tempfile::tempdir().unwrap();
    put_one(&node, dir.path(), &cli, Some(token));

    let without = cli.run_as(NOBODY, &["ls", &node.addr, "--json"], None);
    assert!(!without.status.success(), "no token, no listing");
    let with = cli.run_as(NOBODY, &["ls", &node.addr, "--json"], Some(token));
    assert!(
        with.status.success(),
        "{}",
        String::from_utf8_lossy(&with.stderr)
    );
    assert_eq!(listed(&with), ["w"]);
}
