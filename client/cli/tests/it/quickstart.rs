//! The README's quickstart, run for real: its `sh` block (the one right after the
//! `<!-- quickstart -->` marker) goes to bash in a temporary directory, with the debug `ferry`,
//! `ferry-server` and `make_model` binaries first on PATH, a few lines rewritten as `rewrite`
//! says, and then what it did is checked: `ls` listed every tensor of the model file, `cp`
//! copied them all, and the file `get` wrote back holds the same tensors, bit for bit.
//!
//! `ferry-server` and the `make_model` example are other packages' or kinds of targets than this
//! test, so cargo builds them only when asked: `cargo test --workspace` does, as does `cargo
//! build --workspace --bins --examples`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry_files::read_tensors;

/// The comment in README.md that the quickstart block follows.
const MARKER: &str = "<!-- quickstart -->";

/// How long the whole block may take (two debug nodes, a small model).
const DEADLINE: Duration = Duration::from_secs(120);

/// The quickstart block of README.md, without its fences.
fn quickstart_block() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    let readme = std::fs::read_to_string(&path).unwrap();
    let (_, after) = readme
        .split_once(MARKER)
        .unwrap_or_else(|| panic!("{} has no {MARKER} line", path.display()));
    let block = after
        .trim_start()
        .strip_prefix("```sh\n")
        .unwrap_or_else(|| panic!("no ```sh block right after {MARKER} in README.md"));
    let (block, _) = block.split_once("\n```").expect("the block is closed");
    block.to_string()
}

/// A binary beside the `ferry` under test, which this test does not build itself.
fn built(path: PathBuf) -> PathBuf {
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --workspace --bins --examples` first \
         (`cargo test --workspace` builds it too)",
        path.display()
    );
    path
}

/// Two loopback ports nothing listens on now.
fn free_ports() -> [u16; 2] {
    let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    [
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    ]
}

/// The block as this test runs it. Each rewrite is something a test must do otherwise than a
/// person; every other line runs as written.
fn rewrite(block: &str, bin: &Path, make_model: &Path, ports: [u16; 2]) -> String {
    let mut script = vec![
        // A failing command fails the test, rather than the next one failing for it.
        "set -euo pipefail".to_string(),
        // The nodes started in the background go with the script, however it ends.
        "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT".to_string(),
    ];
    for line in block.lines() {
        // Free ports instead of 7070 and 7071, which another node (or test) may hold.
        let line = line
            .replace("127.0.0.1:7070", &format!("127.0.0.1:{}", ports[0]))
            .replace("127.0.0.1:7071", &format!("127.0.0.1:{}", ports[1]));
        if line.starts_with("cargo build ") {
            // It only makes the binaries exist: this test's are built (target/debug).
        } else if line.starts_with("export PATH=") {
            // This test's binaries rather than release ones.
            script.push(format!("export PATH=\"{}:$PATH\"", bin.display()));
        } else if let Some((_, args)) = line
            .split_once("--example make_model --")
            .filter(|_| line.starts_with("cargo run "))
        {
            // The example as built for this test run rather than a release build of it.
            script.push(format!("\"{}\"{args}", make_model.display()));
        } else {
            assert!(
                !line.starts_with("cargo "),
                "the quickstart has a cargo command this test does not know: {line}"
            );
            script.push(line);
        }
    }
    script.join("\n") + "\n"
}

#[test]
fn the_readme_quickstart_runs_and_moves_the_model_bit_exact() {
    let bin = crate::ferry_cli().parent().unwrap().to_path_buf();
    built(bin.join(format!("ferry-server{}", std::env::consts::EXE_SUFFIX)));
    let make_model = built(
        bin.join("examples")
            .join(format!("make_model{}", std::env::consts::EXE_SUFFIX)),
    );
    let block = quickstart_block();
    for command in [
        "ferry-server ",
        "ferry put ",
        "ferry ls ",
        "ferry cp ",
        "ferry get ",
    ] {
        assert!(block.contains(command), "the quickstart lost `{command}`");
    }
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("quickstart.sh");
    std::fs::write(&script, rewrite(&block, &bin, &make_model, free_ports())).unwrap();

    // Output into files, not pipes: the nodes in the background inherit them, and a pipe would
    // stay open as long as they live.
    let (stdout, stderr) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut bash = Command::new("bash");
    bash.arg(&script)
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(File::create(&stdout).unwrap())
        .stderr(File::create(&stderr).unwrap());
    // A setting of the caller's would change what the commands do.
    for var in [
        "FERRY_TOKEN",
        "FERRY_CLUSTER",
        "FERRY_TLS_CA",
        "FERRY_TLS_CERT",
        "FERRY_TLS_KEY",
    ] {
        bash.env_remove(var);
    }
    // Its own process group, so that on a timeout the nodes are killed with it.
    std::os::unix::process::CommandExt::process_group(&mut bash, 0);
    let mut child = bash.spawn().expect("bash runs");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > DEADLINE {
            let group = format!("-{}", child.id());
            let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = std::fs::read_to_string(&stdout).unwrap();
    let err = std::fs::read_to_string(&stderr).unwrap();
    let transcript = format!(
        "script:\n{}\nstdout:\n{out}\nstderr:\n{err}",
        std::fs::read_to_string(&script).unwrap()
    );
    match status {
        None => panic!("the quickstart did not end within {DEADLINE:?}\n{transcript}"),
        Some(status) => assert!(status.success(), "the quickstart failed\n{transcript}"),
    }

    // `make_model` wrote the model; `ls` listed each of its tensors on device 0 of node A.
    let mut model = read_tensors(&dir.path().join("model.bpk")).unwrap();
    assert!(!model.is_empty(), "an empty model\n{transcript}");
    for (name, _) in &model {
        let row = format!("0\t{name}\t");
        assert!(
            out.lines().any(|line| line.starts_with(&row)),
            "`ferry ls` did not list {name}\n{transcript}"
        );
    }
    // `cp` copied them all to node B, and `get` wrote B's copies: the same tensors, bit-exact.
    assert!(
        err.contains(&format!("copied {} tensors", model.len())),
        "{transcript}"
    );
    let mut back = read_tensors(&dir.path().join("back.bpk")).unwrap();
    model.sort_by(|a, b| a.0.cmp(&b.0));
    back.sort_by(|a, b| a.0.cmp(&b.0));
    let names = |t: &[(String, ferry_proto::TensorData)]| -> Vec<String> {
        t.iter().map(|(n, _)| n.clone()).collect()
    };
    assert_eq!(names(&back), names(&model), "{transcript}");
    for ((name, got), (_, put)) in back.iter().zip(&model) {
        assert_eq!(got.dtype(), put.dtype(), "{name}: dtype");
        assert_eq!(got.shape(), put.shape(), "{name}: shape");
        assert!(got.as_bytes() == put.as_bytes(), "{name}: bytes differ");
    }
}
