//! `ferry --token-file T ls 127.0.0.1:P` where another local user bound that port first (while
//! the node was down, say): the command fails saying who holds the port, and the squatter
//! receives nothing, the token least of all. Binding as another user needs root, as the tests
//! run in CI: elsewhere the test says it was skipped.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferry_testkit::squatter::{NOBODY, Squatter};

/// How long a refusal may take: it comes before any byte is sent, so at once. (Without the
/// check, the command would wait on a squatter that never answers.)
const AT_ONCE: Duration = Duration::from_secs(10);

/// Runs `command`, killed if it has not ended within `limit` (its output then says so).
fn within(limit: Duration, command: &mut Command) -> Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            child.kill().unwrap();
            let mut out = child.wait_with_output().unwrap();
            out.stderr
                .extend_from_slice(format!("(killed after {limit:?})").as_bytes());
            return out;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn the_cli_sends_its_token_to_no_loopback_port_another_user_holds() {
    let Some(squatter) =
        Squatter::bind("the_cli_sends_its_token_to_no_loopback_port_another_user_holds")
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "# the node's token\ns3cret-cli-token\n").unwrap();
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let addr = squatter.addr().to_string();
    for insecure in [false, true] {
        let mut command = Command::new(crate::ferry_cli());
        command
            .env_remove("FERRY_TOKEN")
            .arg("--token-file")
            .arg(&token_file);
        if insecure {
            // The opt-in for beyond loopback does not hand a token to another local user.
            command.arg("--insecure");
        }
        let out = within(AT_ONCE, command.args(["ls", &addr]));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "ferry ls {addr} did not fail: {stderr}"
        );
        let error = stderr
            .lines()
            .find(|l| l.starts_with("error:"))
            .unwrap_or_else(|| panic!("no error line: {stderr}"));
        assert!(
            error.contains(&addr)
                && error.contains(&format!("held by user {NOBODY}"))
                && error.contains("nothing was sent"),
            "{error}"
        );
    }
    let got = squatter.received_after(Duration::from_secs(2));
    assert!(squatter.connections() >= 2, "the CLI reached the port");
    let token = b"s3cret-cli-token";
    assert!(
        !got.windows(token.len()).any(|w| w == token),
        "the squatter received the token"
    );
    assert!(got.is_empty(), "the squatter received {} bytes", got.len());
}
