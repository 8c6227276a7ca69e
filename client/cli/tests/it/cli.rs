//! The `ferry` command line against real nodes (served in this test process, over TCP and Unix
//! sockets): files in, copies, files out, compared tensor by tensor, and every error path giving
//! a non-zero exit and one `error:` line.

use ferry_server::PullConfig;
use std::path::Path;
use std::process::{Command, Output};

use ferry_files::{read_tensors, write_tensors};
use ferry_io::ConnectionLimits;
use ferry_proto::dtype::PLAIN_DTYPES;
use ferry_proto::{BoolStore, DType, TensorData, TensorKey};
use ferry_server::{NodeConfig, ServiceConfig};
use ferry_testkit::samples;
use ferry_testkit::{BackgroundNode, devices};

/// A node with two flex devices, reached by TCP only, requiring no token.
fn server() -> BackgroundNode {
    BackgroundNode::start(node_config(), ServiceConfig::default(), None)
}

/// A node that requires `token`.
fn server_with_token(token: &str) -> BackgroundNode {
    let service = ServiceConfig {
        credentials: vec![ferry_server::Credential::full(token).unwrap()],
        ..ServiceConfig::default()
    };
    BackgroundNode::start(node_config(), service, None)
}

/// A node that also listens on the Unix socket `path` and sends every non-empty payload through
/// shared memory where it is agreed (`--shm-min 1`), to clients and to nodes it pulls from.
fn unix_server(path: &Path) -> BackgroundNode {
    let limits = ConnectionLimits {
        region_min: 1,
        ..ConnectionLimits::default()
    };
    let config = NodeConfig {
        pulls: PullConfig {
            peer_limits: limits,
            ..PullConfig::default()
        },
        ..node_config()
    };
    let service = ServiceConfig {
        limits,
        ..ServiceConfig::default()
    };
    BackgroundNode::start(config, service, Some(path))
}

fn node_config() -> NodeConfig {
    NodeConfig {
        devices: devices(&["flex", "flex"]),
        ..NodeConfig::light()
    }
}

fn ferry(args: &[&str]) -> Output {
    Command::new(crate::ferry_cli())
        .args(args)
        .env_remove("FERRY_TOKEN")
        .output()
        .expect("ferry runs")
}

fn ok(args: &[&str]) -> String {
    let out = ferry(args);
    assert!(
        out.status.success(),
        "ferry {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// Fails with exactly one `error:` line on stderr that mentions `words`.
fn fails(args: &[&str], words: &str) {
    let out = ferry(args);
    assert!(!out.status.success(), "ferry {args:?} should fail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert!(!errors.is_empty(), "no error line for {args:?}: {stderr}");
    assert!(
        errors.iter().any(|l| l.contains(words)),
        "ferry {args:?}: expected {words:?} in {stderr}"
    );
}

fn assert_same_files(actual: &Path, expected: &[(String, TensorData)]) {
    let mut got = read_tensors(actual).expect("output file reads back");
    got.sort_by(|a, b| a.0.cmp(&b.0));
    let mut want = expected.to_vec();
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        got.iter().map(|t| &t.0).collect::<Vec<_>>(),
        want.iter().map(|t| &t.0).collect::<Vec<_>>()
    );
    for ((name, a), (_, b)) in got.iter().zip(&want) {
        assert_eq!(a.dtype(), b.dtype(), "{name}: dtype");
        assert_eq!(a.shape(), b.shape(), "{name}: shape");
        assert!(a.as_bytes() == b.as_bytes(), "{name}: bytes differ");
    }
}

fn model() -> Vec<(String, TensorData)> {
    let schemes = samples::schemes();
    let mut tensors = vec![
        (
            "embed.weight".to_string(),
            samples::plain(DType::F32, &[64, 33], 1),
        ),
        (
            "embed.bias".to_string(),
            samples::plain(DType::BF16, &[33], 2),
        ),
        ("step".to_string(), samples::plain(DType::I64, &[], 3)),
        (
            "mask".to_string(),
            samples::plain(DType::Bool(BoolStore::Native), &[3, 5, 7], 4),
        ),
        ("ids".to_string(), samples::plain(DType::U16, &[0, 3], 5)),
    ];
    for (label, scheme) in [&schemes[1], &schemes[60], &schemes[schemes.len() - 1]] {
        let name = format!("layer.{label}");
        tensors.push((name, samples::quantized(scheme, &[8, 64], 9)));
    }
    tensors
}

#[test]
fn a_quantized_model_goes_in_moves_between_devices_and_comes_back_identical() {
    let node = server();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("model.bpk");
    let tensors = model();
    write_tensors(&input, &tensors).unwrap();

    let target0 = format!("{}/0", node.addr);
    ok(&["put", input.to_str().unwrap(), &target0]);

    let listing: serde_json::Value =
        serde_json::from_str(&ok(&["ls", &node.addr, "--json"])).expect("ls --json parses");
    let rows = listing.as_array().expect("an array");
    assert_eq!(rows.len(), tensors.len());
    for (name, data) in &tensors {
        let row = rows
            .iter()
            .find(|r| r["name"] == name.as_str())
            .unwrap_or_else(|| panic!("{name} listed"));
        assert_eq!(row["device"], 0);
        assert_eq!(row["bytes"], data.as_bytes().len());
        let shape: Vec<usize> = serde_json::from_value(row["shape"].clone()).unwrap();
        assert_eq!(shape, data.shape().as_slice());
        assert_eq!(
            row["dtype"],
            ferry_proto::dtype_name(&data.dtype()).as_str()
        );
    }

    let target1 = format!("{}/1", node.addr);
    ok(&["cp", &target0, &target1]);
    let output = dir.path().join("back.bpk");
    ok(&["get", &target1, "-o", output.to_str().unwrap()]);
    assert_same_files(&output, &tensors);

    // One tensor: move it, then the source is gone and the target holds it.
    let src = format!("{}/0/embed.weight", node.addr);
    let dst = format!("{}/1/moved", node.addr);
    ok(&["mv", &src, &dst]);
    fails(&["rm", &src], "no tensor");
    let single = dir.path().join("one.bpk");
    ok(&["get", &dst, "-o", single.to_str().unwrap()]);
    assert_same_files(&single, &[("moved".to_string(), tensors[0].1.clone())]);
    ok(&["rm", &dst]);

    let stats: serde_json::Value =
        serde_json::from_str(&ok(&["stat", &node.addr, "--json"])).expect("stat --json parses");
    assert_eq!(stats["devices"].as_array().unwrap().len(), 2);
    assert!(stats["native_transfers"].as_u64().unwrap() >= tensors.len() as u64);
    // Each device's measured table, as JSON and as text.
    let with_holds: serde_json::Value =
        serde_json::from_str(&ok(&["stat", &node.addr, "--json", "--holds"])).unwrap();
    for device in ["0", "1"] {
        let rows = with_holds["holds"][device].as_array().unwrap();
        let exact = rows.iter().filter(|r| r["refused"].is_null()).count();
        let said = &with_holds["devices"][device.parse::<usize>().unwrap()];
        assert_eq!(rows.len() as u64, said["holds_measured"].as_u64().unwrap());
        assert_eq!(exact as u64, said["holds_exact"].as_u64().unwrap());
        assert!(
            rows.iter()
                .any(|r| r["dtype"] == "f32" && r["refused"].is_null())
        );
    }
    let text = ok(&["stat", &node.addr, "--holds"]);
    assert!(text.contains("probes bit-exact"), "{text}");
    assert!(
        text.contains("device 0 holds:") && text.contains("  f32 [3, 5] "),
        "{text}"
    );
}

#[test]
fn unix_socket_addresses_work_everywhere_and_payloads_take_shared_memory() {
    let dir = tempfile::tempdir().unwrap();
    // A socket path with digit-only parts, as under /run/user/1000.
    let sockets = dir.path().join("run/user/1000");
    std::fs::create_dir_all(&sockets).unwrap();
    let a_path = sockets.join("a.sock");
    let b_path = sockets.join("b.sock");
    let a = unix_server(&a_path);
    let b = unix_server(&b_path);
    let (a_unix, b_unix) = (a.unix.clone().unwrap(), b.unix.clone().unwrap());
    let input = dir.path().join("model.bpk");
    let tensors = model();
    write_tensors(&input, &tensors).unwrap();

    ok(&[
        "put",
        "--shm-min",
        "1",
        input.to_str().unwrap(),
        &format!("{a_unix}/0"),
    ]);
    let listing: serde_json::Value =
        serde_json::from_str(&ok(&["ls", &format!("{a_unix}/0"), "--json"])).unwrap();
    assert_eq!(listing.as_array().unwrap().len(), tensors.len());
    // Node to node over the Unix sockets, then back out through the other node.
    ok(&["cp", &format!("{a_unix}/0"), &format!("{b_unix}/1")]);
    let output = dir.path().join("back.bpk");
    ok(&[
        "get",
        &format!("{b_unix}/1"),
        "-o",
        output.to_str().unwrap(),
    ]);
    assert_same_files(&output, &tensors);
    // The same node by TCP and by Unix socket is recognised as one: an in-node copy.
    ok(&[
        "cp",
        &format!("{}/0/embed.weight", a.addr),
        &format!("{a_unix}/1/copied"),
    ]);
    let single = dir.path().join("one.bpk");
    ok(&[
        "get",
        &format!("{a_unix}/1/copied"),
        "-o",
        single.to_str().unwrap(),
    ]);
    assert_same_files(&single, &[("copied".to_string(), tensors[0].1.clone())]);

    let with_bytes = tensors
        .iter()
        .filter(|(_, d)| !d.as_bytes().is_empty())
        .count() as u64;
    let a_stats: serde_json::Value =
        serde_json::from_str(&ok(&["stat", &a_unix, "--json"])).unwrap();
    assert_eq!(a_stats["unix_socket"], a_unix.as_str());
    assert_eq!(a_stats["shm_payloads_received"].as_u64(), Some(with_bytes));
    assert_eq!(a_stats["native_transfers"].as_u64(), Some(1));
    let b_stats: serde_json::Value =
        serde_json::from_str(&ok(&["stat", &b_unix, "--json"])).unwrap();
    assert_eq!(b_stats["pulls"].as_u64(), Some(tensors.len() as u64));
    assert_eq!(b_stats["shm_payloads_received"].as_u64(), Some(with_bytes));
    assert_eq!(b_stats["shm_payloads_sent"].as_u64(), Some(with_bytes));

    // --no-shm keeps payloads in the socket.
    let before = a_stats["shm_payloads_sent"].as_u64().unwrap();
    ok(&[
        "--no-shm",
        "get",
        &format!("{a_unix}/0"),
        "-o",
        output.to_str().unwrap(),
    ]);
    assert_same_files(&output, &tensors);
    let a_stats: serde_json::Value =
        serde_json::from_str(&ok(&["stat", &a_unix, "--json"])).unwrap();
    assert_eq!(a_stats["shm_payloads_sent"].as_u64(), Some(before));

    // Into a .safetensors file the payloads that come as regions are copied into the file's
    // place (the file is written in place): every plain dtype, bit for bit.
    let plain: Vec<(String, TensorData)> = PLAIN_DTYPES
        .iter()
        .enumerate()
        .map(|(i, d)| {
            (
                format!("s{i}"),
                samples::plain(*d, &[64, 33], 50 + i as u64),
            )
        })
        .collect();
    let st_in = dir.path().join("plain.safetensors");
    write_tensors(&st_in, &plain).unwrap();
    ok(&[
        "put",
        "--shm-min",
        "1",
        st_in.to_str().unwrap(),
        &format!("{a_unix}/1"),
    ]);
    let before = a_stats["shm_payloads_sent"].as_u64().unwrap();
    let st_out = dir.path().join("plain-back.safetensors");
    ok(&[
        "get",
        "--shm-min",
        "1",
        &format!("{a_unix}/1"),
        "-o",
        st_out.to_str().unwrap(),
    ]);
    let mut expected = plain.clone();
    expected.push(("copied".to_string(), tensors[0].1.clone()));
    let back: std::collections::HashMap<String, TensorData> =
        read_tensors(&st_out).unwrap().into_iter().collect();
    assert_eq!(back.len(), expected.len());
    for (name, data) in &expected {
        let got = &back[name];
        assert_eq!(got.dtype(), data.dtype(), "{name}");
        assert!(
            got.as_bytes() == data.as_bytes(),
            "{name}: the bytes (not zeros) in the file"
        );
    }
    let a_stats: serde_json::Value =
        serde_json::from_str(&ok(&["stat", &a_unix, "--json"])).unwrap();
    assert!(
        a_stats["shm_payloads_sent"].as_u64().unwrap() > before,
        "the get went through shared memory"
    );

    let missing = format!("unix:{}/0", dir.path().join("nope.sock").display());
    fails(&["ls", &missing], "no Unix socket");
}

#[test]
fn plain_dtypes_round_trip_through_safetensors() {
    let node = server();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("plain.safetensors");
    // Every plain dtype: Flex32 and the wider bool stores are kept by a ferry record in the
    // file's metadata.
    let tensors: Vec<(String, TensorData)> = PLAIN_DTYPES
        .iter()
        .enumerate()
        .map(|(i, d)| (format!("t{i}"), samples::plain(*d, &[3, 5, 7], i as u64)))
        .collect();
    write_tensors(&input, &tensors).unwrap();
    let target = format!("{}/1", node.addr);
    ok(&["put", input.to_str().unwrap(), &target, "--prefix", "p."]);
    let output = dir.path().join("out.safetensors");
    ok(&["get", &target, "-o", output.to_str().unwrap()]);
    let renamed: Vec<(String, TensorData)> = tensors
        .iter()
        .map(|(n, d)| (format!("p.{n}"), d.clone()))
        .collect();
    assert_same_files(&output, &renamed);

    // A quantized tensor cannot go into safetensors: the error says to use .bpk.
    let q = dir.path().join("q.bpk");
    write_tensors(&q, &model()[5..6]).unwrap();
    ok(&["put", q.to_str().unwrap(), &format!("{}/0", node.addr)]);
    let bad = dir.path().join("q.safetensors");
    fails(
        &[
            "get",
            &format!("{}/0", node.addr),
            "-o",
            bad.to_str().unwrap(),
        ],
        ".bpk",
    );
    let mut left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        ["out.safetensors", "plain.safetensors", "q.bpk"],
        "a refused get leaves no file behind"
    );
}

/// A node that asks for the tokens of `token_file` (a token file's text: scopes, then token).
fn serve_with_tokens(token_file: &str) -> BackgroundNode {
    let credentials = ferry_server::parse_token_file(token_file).unwrap();
    BackgroundNode::start(
        node_config(),
        ServiceConfig {
            credentials,
            ..ServiceConfig::default()
        },
        None,
    )
}

#[test]
fn the_token_comes_from_a_file_and_a_read_only_one_cannot_write() {
    let node = serve_with_tokens("read,write t0k\nread r34d\n");
    let dir = tempfile::tempdir().unwrap();
    let writer = dir.path().join("writer");
    std::fs::write(&writer, "# the writer's token\nt0k\n").unwrap();
    let reader = dir.path().join("reader");
    std::fs::write(&reader, "r34d\n").unwrap();
    let file = dir.path().join("m.bpk");
    write_tensors(&file, &model()).unwrap();
    let dev0 = format!("{}/0", node.addr);
    let (writer, reader, file) = (
        writer.to_str().unwrap(),
        reader.to_str().unwrap(),
        file.to_str().unwrap(),
    );
    ok(&["--token-file", writer, "put", file, &dev0]);
    let listed = ok(&["--token-file", reader, "ls", &node.addr]);
    assert_eq!(listed.lines().count(), model().len(), "{listed}");
    fails(&["--token-file", reader, "put", file, &dev0], "needs write");
    fails(&["ls", &node.addr], "authentication refused");
}

/// `ferry put --lanes 3` carries a model bit-exact over three connections; with a token that
/// may write but not read, the node will not say its id, and the put goes over one connection,
/// with a warning that says so, bit-exact all the same.
#[test]
fn a_put_over_lanes_lands_bit_exact_and_falls_back_to_one_connection_where_the_node_is_not_identified()
 {
    let node = serve_with_tokens("read,write t0k\nwrite wr1t\n");
    let dir = tempfile::tempdir().unwrap();
    let tokens = [("full", "t0k"), ("write-only", "wr1t")];
    for (who, token) in tokens {
        std::fs::write(dir.path().join(who), token).unwrap();
    }
    let file = dir.path().join("m.bpk");
    let tensors = model();
    write_tensors(&file, &tensors).unwrap();
    let (full, write_only) = (dir.path().join("full"), dir.path().join("write-only"));
    let (full, write_only, file) = (
        full.to_str().unwrap(),
        write_only.to_str().unwrap(),
        file.to_str().unwrap(),
    );
    for (device, token, warned) in [(0, full, false), (1, write_only, true)] {
        let target = format!("{}/{device}", node.addr);
        let out = ferry(&["--token-file", token, "put", "--lanes", "3", file, &target]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert_eq!(
            stderr.contains("warning: putting over one connection"),
            warned,
            "{stderr}"
        );
        let back = dir.path().join(format!("back{device}.bpk"));
        ok(&[
            "--token-file",
            full,
            "get",
            &target,
            "-o",
            back.to_str().unwrap(),
        ]);
        assert_same_files(&back, &tensors);
    }
}

/// A put whose only connection fails part way (cut after the node answered three tensors):
/// the tensors of the batch under way are reported, each on its own line, and the rest of the
/// file is not tried one tensor at a time but counted in one line; the node holds exactly the
/// three answered tensors.
#[test]
fn a_put_whose_connection_fails_reports_its_batch_and_counts_the_rest_unsent() {
    let node = server();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("m.safetensors");
    let tensors: Vec<(String, TensorData)> = (0..40)
        .map(|i| (format!("w{i:02}"), samples::plain(DType::F32, &[16], i)))
        .collect();
    write_tensors(&file, &tensors).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // `Welcome`, then `Stored` for each of three tensors (each goes eagerly: no `Ready`).
    let frames = 1 + 3;
    let cut = runtime.block_on(ferry_testkit::proxy(
        node.addr.parse().unwrap(),
        ferry_testkit::Fault::CutAfterFrames(frames),
    ));
    let out = ferry(&[
        "--no-shm",
        "put",
        "--lanes",
        "1",
        file.to_str().unwrap(),
        &format!("{cut}/0"),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    // The first batch of 16: three answered, the other thirteen reported; 24 never sent. The
    // proxy forwards three `Stored` and cuts the connection instead of the fourth's: by then
    // the payloads of the fourth and fifth had gone out (two eager uploads await their answers
    // at once), so those two are reported as ones that may have been stored, and may have
    // been; every later one was not.
    let reported: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("error: w"))
        .collect();
    assert_eq!(reported.len(), 13, "{stderr}");
    for (line, name) in reported.iter().zip(["w03", "w04"]) {
        assert!(line.starts_with(&format!("error: {name}")), "{stderr}");
        assert!(line.contains("may have been stored"), "{stderr}");
    }
    assert!(
        reported[2..].iter().all(|l| l.contains("not put")),
        "{stderr}"
    );
    assert!(stderr.contains("24 more tensors not sent"), "{stderr}");
    let listed = ok(&["ls", &format!("{}/0", node.addr)]);
    let names: Vec<&str> = listed
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    let stored = ["w00", "w01", "w02"];
    let in_doubt = ["w03", "w04"];
    assert!(
        stored.iter().all(|n| names.contains(n))
            && names
                .iter()
                .all(|n| stored.contains(n) || in_doubt.contains(n)),
        "{listed}"
    );
}

/// `ferry certs` makes a first cluster's CA and certificates; two nodes serving them move a
/// model over mutual TLS (put, node-to-node copy, get) bit-exact, and a command without the
/// client's certificate is refused.
#[test]
fn certificates_from_ferry_certs_carry_a_model_between_nodes_over_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let certs_dir = certs.to_str().unwrap();
    let made = ok(&[
        "certs",
        "--dir",
        certs_dir,
        "--node",
        "node-a=127.0.0.1",
        "--node",
        "node-b=127.0.0.1,localhost",
        "--client",
        "me",
    ]);
    assert!(made.contains("made a CA"), "{made}");
    // A second run reuses the CA and refuses to overwrite a certificate.
    fails(
        &["certs", "--dir", certs_dir, "--client", "me"],
        "exists already",
    );
    let again = ok(&["certs", "--dir", certs_dir, "--client", "ops"]);
    assert!(again.contains("using the CA"), "{again}");

    let files = |name: &str| ferry_io::TlsFiles {
        cert: certs.join(format!("{name}.pem")),
        key: certs.join(format!("{name}.key")),
        ca: certs.join("ca.pem"),
    };
    let tls_node = |name: &str, peers: ferry_server::PeerPolicy| {
        let config = NodeConfig {
            tls: Some(ferry_io::NodeTls::load(&files(name)).unwrap()),
            pulls: PullConfig {
                peers,
                ..PullConfig::default()
            },
            ..node_config()
        };
        BackgroundNode::start(config, ServiceConfig::default(), None)
    };
    let a = tls_node("node-a", ferry_server::PeerPolicy::Any);
    let b = tls_node(
        "node-b",
        ferry_server::PeerPolicy::Listed(vec![ferry_server::Peer::named("node-a", &a.addr)]),
    );
    let me = files("me");
    let tls = [
        "--tls-ca",
        me.ca.to_str().unwrap(),
        "--tls-cert",
        me.cert.to_str().unwrap(),
        "--tls-key",
        me.key.to_str().unwrap(),
    ];
    let with_tls =
        |args: &[&str]| -> Vec<String> { tls.iter().chain(args).map(|s| s.to_string()).collect() };
    let run = |args: &[&str]| {
        let args = with_tls(args);
        ok(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let input = dir.path().join("model.bpk");
    let tensors = model();
    write_tensors(&input, &tensors).unwrap();
    run(&["put", input.to_str().unwrap(), &format!("{}/0", a.addr)]);
    run(&["cp", &format!("{}/0", a.addr), &format!("{}/1", b.addr)]);
    let output = dir.path().join("back.bpk");
    run(&[
        "get",
        &format!("{}/1", b.addr),
        "-o",
        output.to_str().unwrap(),
    ]);
    assert_same_files(&output, &tensors);
    let health = run(&["health", &b.addr]);
    assert!(health.starts_with("ok node-b "), "{health}");
    // A token given beside TLS is not sent, and the command says so.
    let args = with_tls(&["--token", "t0k", "health", &b.addr]);
    let with_token = ferry(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(with_token.status.success());
    let said = String::from_utf8_lossy(&with_token.stderr);
    assert!(said.contains("the token is not sent under TLS"), "{said}");

    // Without the client's certificate the node does not talk.
    fails(&["health", &b.addr, "--timeout", "2"], "connecting to");
    fails(
        &["--tls-ca", me.ca.to_str().unwrap(), "ls", &a.addr],
        "required arguments",
    );
    // A token never goes in clear beyond loopback (refused before connecting: this address
    // is unroutable), unless told --insecure.
    fails(
        &[
            "--token",
            "t0k",
            "health",
            "192.0.2.1:7070",
            "--timeout",
            "1",
        ],
        "refusing to send a token to 192.0.2.1:7070 in clear",
    );
    let told = ferry(&[
        "--token",
        "t0k",
        "--insecure",
        "health",
        "192.0.2.1:7070",
        "--timeout",
        "1",
    ]);
    let stderr = String::from_utf8_lossy(&told.stderr);
    assert!(
        !told.status.success() && !stderr.contains("refusing"),
        "{stderr}"
    );
}

#[test]
fn every_error_path_exits_non_zero_with_an_error_line() {
    let node = server_with_token("t0k");
    let other = server();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("m.bpk");
    write_tensors(&file, &model()).unwrap();
    let file = file.to_str().unwrap();
    let dev0 = format!("{}/0", node.addr);

    fails(&["ls", &node.addr], "authentication refused");
    fails(
        &["--token", "wrong", "ls", &node.addr],
        "authentication refused",
    );
    let authed = |args: &[&str]| {
        let mut all = vec!["--token", "t0k"];
        all.extend_from_slice(args);
        all.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let run_fails = |args: Vec<String>, words: &str| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        fails(&refs, words);
    };
    run_fails(
        authed(&["get", &format!("{dev0}/nope"), "-o", "x.bpk"]),
        "no tensor",
    );
    run_fails(authed(&["put", "model.onnx", &dev0]), "onnx");
    run_fails(
        authed(&["put", file, &format!("{}/7", node.addr)]),
        "no device 7",
    );
    run_fails(authed(&["ls", "not-an-address"]), "HOST:PORT");
    run_fails(authed(&["ls", "127.0.0.1:1"]), "connecting to 127.0.0.1:1");
    run_fails(
        authed(&["cp", &format!("{dev0}/x"), &format!("{}/0", other.addr)]),
        "no tensor",
    );
    // Putting the same names twice without --overwrite: each refused, and said so.
    let refs: Vec<String> = authed(&["put", file, &dev0]);
    let refs: Vec<&str> = refs.iter().map(String::as_str).collect();
    ok(&refs);
    fails(&refs, "already exists");

    // A corrupt file is refused before anything reaches the node.
    let bytes = std::fs::read(file).unwrap();
    let truncated = dir.path().join("cut.bpk");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    let dev1 = format!("{}/1", node.addr);
    run_fails(
        authed(&["put", truncated.to_str().unwrap(), &dev1]),
        "cut.bpk",
    );
    let listing = authed(&["ls", &dev1, "--json"]);
    let listing: Vec<&str> = listing.iter().map(String::as_str).collect();
    let rows: serde_json::Value = serde_json::from_str(&ok(&listing)).unwrap();
    assert_eq!(
        rows.as_array().unwrap().len(),
        0,
        "nothing reached device 1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ls_at_lists_a_clusters_members_and_where_each_tensor_lives() {
    use ferry_server::cluster::Membership;
    let etcd = ferry_testkit::Etcd::start().await;
    let cluster = etcd.cluster();
    let node = ferry_testkit::start_with(&["flex", "flex"]).await;
    let membership = Membership::join(node.node.clone(), etcd.member("cache", &node));
    let mut client = node.client().await;
    let data = samples::plain(DType::F32, &[4, 8], 1);
    client
        .put(&TensorKey::new(1, "encoder.w"), &data)
        .await
        .unwrap();
    let addr = node.addr.to_string();
    let line = "@cache/1/encoder.w\tf32\t[4, 8]\t128";
    let listed = tokio::task::spawn_blocking({
        let cluster = cluster.clone();
        move || {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                let text = ok(&["--cluster", &cluster, "ls", "@"]);
                if text.contains(line) || std::time::Instant::now() > deadline {
                    return text;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    })
    .await
    .unwrap();
    assert!(listed.contains(line), "{listed}");
    assert!(listed.contains(&format!("@cache\t{addr}")), "{listed}");
    let json: serde_json::Value = serde_json::from_str(
        &tokio::task::spawn_blocking({
            let cluster = cluster.clone();
            move || ok(&["--cluster", &cluster, "ls", "@cache", "--json"])
        })
        .await
        .unwrap(),
    )
    .unwrap();
    assert_eq!(json["members"][0]["tcp"], addr.as_str());
    assert_eq!(json["tensors"][0]["name"], "encoder.w");
    // A member that is not there, and no cluster named, are errors that say so.
    let cluster_for_missing = cluster.clone();
    tokio::task::spawn_blocking(move || {
        fails(
            &["--cluster", &cluster_for_missing, "ls", "@nobody"],
            "no member @nobody",
        );
        fails(&["ls", "@"], "--cluster");
    })
    .await
    .unwrap();
    membership.leave().await;
}

/// `ferry etcd-roles` gives etcd ferry's users and roles and turns auth on: a member joined as
/// its etcd user registers and publishes, `ls @` as the reader lists it, `ls @` with no user or
/// a wrong password is refused by etcd, and a change to the roles asks for root once auth is on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_roles_turns_etcd_auth_on_and_members_and_readers_work_under_it() {
    use ferry_server::cluster::{ClusterConfig, EtcdUser, Membership};
    let etcd = ferry_testkit::Etcd::start().await;
    let cluster = etcd.cluster();
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, password: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, format!("# {name}\n{password}\n")).unwrap();
        path.to_str().unwrap().to_string()
    };
    let (cache_pw, ops_pw, root_pw, wrong_pw) = (
        file("cache.pw", "cache-secret"),
        file("ops.pw", "ops-secret"),
        file("root.pw", "root-secret"),
        file("wrong.pw", "not-it"),
    );
    let set_up = tokio::task::spawn_blocking({
        let cluster = cluster.clone();
        let member = format!("cache={cache_pw}");
        let reader = format!("ops={ops_pw}");
        let root_pw = root_pw.clone();
        move || {
            ok(&[
                "--cluster",
                &cluster,
                "etcd-roles",
                "--member",
                &member,
                "--reader",
                &reader,
                "--enable-auth",
                &root_pw,
            ])
        }
    })
    .await
    .unwrap();
    assert!(set_up.contains("role ferry-member-cache"), "{set_up}");
    assert!(set_up.contains("auth on"), "{set_up}");

    let node = ferry_testkit::start_with(&["flex"]).await;
    let membership = Membership::join(
        node.node.clone(),
        ClusterConfig {
            endpoints: ferry_proto::cluster::endpoints(&cluster).unwrap(),
            name: "cache".into(),
            advertise: node.addr.to_string(),
            unix: None,
            ttl: std::time::Duration::from_secs(2),
            etcd_user: EtcdUser::new("cache", "cache-secret"),
        },
    );
    let mut client = node.client().await;
    let data = samples::plain(DType::F32, &[4, 8], 1);
    client.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    tokio::task::spawn_blocking(move || {
        let as_ops = [
            "--cluster",
            &cluster,
            "--etcd-user",
            "ops",
            "--etcd-password-file",
            &ops_pw,
            "ls",
            "@",
        ];
        listed_within(&as_ops, "@cache/0/w\tf32\t[4, 8]\t128", 1);
        fails(&["--cluster", &cluster, "ls", "@"], "user name is empty");
        fails(
            &[
                "--cluster",
                &cluster,
                "--etcd-user",
                "ops",
                "--etcd-password-file",
                &wrong_pw,
                "ls",
                "@",
            ],
            "authentication failed",
        );
        // Auth is on: only root changes the roles.
        let more = format!("ops2={ops_pw}");
        fails(
            &[
                "--cluster",
                &cluster,
                "--etcd-user",
                "ops",
                "--etcd-password-file",
                &ops_pw,
                "etcd-roles",
                "--reader",
                &more,
            ],
            "permission denied",
        );
        let added = ok(&[
            "--cluster",
            &cluster,
            "--etcd-user",
            "root",
            "--etcd-password-file",
            &root_pw,
            "etcd-roles",
            "--reader",
            &more,
        ]);
        assert!(added.contains("reader ops2"), "{added}");
    })
    .await
    .unwrap();
    membership.leave().await;
}

/// A whole device copied between two nodes goes over several lanes at once (`--lanes 3`): every
/// tensor lands bit-exact under its own name, and a refusal names its own tensor, whichever lane
/// it went over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_copied_over_several_lanes_lands_each_tensor_under_its_own_name() {
    let a = ferry_testkit::start_with(&["flex"]).await;
    let b = ferry_testkit::start_with(&["flex"]).await;
    let mut ca = a.client().await;
    let tensors: Vec<(String, TensorData)> = (0..9)
        .map(|i| {
            let dtype = [DType::F32, DType::BF16, DType::I64][i % 3];
            (
                format!("t{i}"),
                samples::plain(dtype, &[i + 1, 97 * (i + 1)], i as u64),
            )
        })
        .collect();
    for (name, data) in &tensors {
        ca.put(&TensorKey::new(0, name.as_str()), data)
            .await
            .unwrap();
    }
    // t4 is on the target already, with other bytes: refused, and kept.
    let mut cb = b.client().await;
    let other = samples::plain(DType::F32, &[2, 2], 99);
    cb.put(&TensorKey::new(0, "t4"), &other).await.unwrap();
    let (src, dst) = (format!("{}/0", a.addr), format!("{}/0", b.addr));
    let out = tokio::task::spawn_blocking(move || ferry(&["cp", &src, &dst, "--lanes", "3"]))
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let named: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("error: 0/"))
        .collect();
    assert_eq!(named.len(), 1, "{stderr}");
    assert!(named[0].starts_with("error: 0/t4:"), "{stderr}");
    assert!(stderr.contains("1 of 9 tensors failed"), "{stderr}");
    for (name, data) in &tensors {
        let landed = cb.get(&TensorKey::new(0, name.as_str())).await.unwrap();
        let want = if name == "t4" { &other } else { data };
        ferry_testkit::assert_same(&landed, want, name);
    }
}

/// `ferry cp A/0 B/0 C/0 D/0`: one copy to three nodes, relayed: every tensor bit-exact on
/// each, each sent by A once, and a report line per target. Targets naming different devices
/// are refused before anything moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_copied_to_several_nodes_lands_on_each_and_leaves_its_source_once() {
    let nodes = [
        ferry_testkit::start_with(&["flex"]).await,
        ferry_testkit::start_with(&["flex"]).await,
        ferry_testkit::start_with(&["flex"]).await,
        ferry_testkit::start_with(&["flex"]).await,
    ];
    let mut ca = nodes[0].client().await;
    let mut tensors: Vec<(String, TensorData)> = [DType::F32, DType::BF16, DType::I64]
        .into_iter()
        .enumerate()
        .map(|(i, dtype)| (format!("t{i}"), samples::plain(dtype, &[64, 97], i as u64)))
        .collect();
    let (label, scheme) = samples::schemes().into_iter().next().unwrap();
    tensors.push((label, samples::quantized(&scheme, &[64, 64], 5)));
    for (name, data) in &tensors {
        ca.put(&TensorKey::new(0, name.as_str()), data)
            .await
            .unwrap();
    }
    let places: Vec<String> = nodes.iter().map(|n| format!("{}/0", n.addr)).collect();
    let wrong = [
        "cp".to_string(),
        places[0].clone(),
        places[1].clone(),
        format!("{}/1", nodes[2].addr),
    ];
    let args: Vec<String> = ["cp".to_string()].into_iter().chain(places).collect();
    let (out, refused) = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let wrong: Vec<&str> = wrong.iter().map(String::as_str).collect();
        (ferry(&args), ferry(&wrong))
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        stderr.matches("copied 4 of 4 tensors to").count(),
        3,
        "{stderr}"
    );
    for target in &nodes[1..] {
        let mut client = target.client().await;
        for (name, data) in &tensors {
            let landed = client.get(&TensorKey::new(0, name.as_str())).await.unwrap();
            ferry_testkit::assert_same(&landed, data, name);
        }
    }
    assert_eq!(
        ca.stat().await.unwrap().fetches_served,
        4,
        "each tensor left A once"
    );
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("the same DEVICE[/NAME]"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

/// `ferry cp --model A/0/net B/0 C/0`: the model's current version lands whole on both, as a
/// version of their own with the source's metadata; a target that holds the model refuses it
/// unless --overwrite, the other taking it all the same. `ferry mv --model` moves it whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_copied_to_several_nodes_lands_whole_on_each() {
    let nodes = [
        ferry_testkit::start_with(&["flex"]).await,
        ferry_testkit::start_with(&["flex"]).await,
        ferry_testkit::start_with(&["flex"]).await,
    ];
    let mut source = nodes[0].client().await;
    let tensors: Vec<(String, TensorData)> = (0..3)
        .map(|i| {
            let dtype = [DType::F32, DType::BF16, DType::I64][i];
            (
                format!("layer{i}.w"),
                samples::plain(dtype, &[32, 33], i as u64),
            )
        })
        .collect();
    let version = source.begin_model(0, "net", false).await.unwrap();
    for (path, data) in &tensors {
        let key = TensorKey::new(0, format!("net/.v{version}/{path}"));
        source.put(&key, data).await.unwrap();
    }
    let metadata = vec![("format".to_string(), "pt".to_string())];
    let paths = tensors.iter().map(|(p, _)| p.as_str());
    source
        .commit_model(0, "net", version, paths, metadata.clone())
        .await
        .unwrap();
    // C holds a model of that name already.
    let mut on_c = nodes[2].client().await;
    let own = on_c.begin_model(0, "net", false).await.unwrap();
    on_c.commit_model(0, "net", own, [], Vec::new())
        .await
        .unwrap();

    let places: Vec<String> = nodes.iter().map(|n| format!("{}/0", n.addr)).collect();
    let (src, b, c) = (
        format!("{}/net", places[0]),
        places[1].clone(),
        places[2].clone(),
    );
    let (first, forced) = tokio::task::spawn_blocking(move || {
        (
            ferry(&["cp", "--model", &src, &b, &c]),
            ferry(&["cp", "--model", "--overwrite", &src, &b, &c]),
        )
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert!(!first.status.success(), "{stderr}");
    assert!(
        stderr.contains("model net reached 1 of 2 targets"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("error: {}/0", nodes[2].addr)),
        "{stderr}"
    );
    let stderr = String::from_utf8_lossy(&forced.stderr);
    assert!(forced.status.success(), "{stderr}");
    assert_eq!(
        stderr.matches("copied model net (3 tensors)").count(),
        2,
        "{stderr}"
    );
    for target in &nodes[1..] {
        let mut client = target.client().await;
        let manifest = client.open_model(0, "net").await.unwrap();
        assert_eq!(manifest.metadata, metadata);
        for (path, data) in &tensors {
            let key = TensorKey::new(0, manifest.name_of(path));
            ferry_testkit::assert_same(&client.get(&key).await.unwrap(), data, path);
        }
    }
    // `ferry mv --model`: refused onto B's model (the source keeps it), then moved whole to a
    // new name on C, and gone from the source.
    let (src, b, c) = (
        format!("{}/net", places[0]),
        places[1].clone(),
        format!("{}/moved", places[2]),
    );
    tokio::task::spawn_blocking(move || {
        fails(&["mv", "--model", &src, &b], "--overwrite replaces it");
        let moved = ferry(&["mv", "--model", &src, &c]);
        let said = String::from_utf8_lossy(&moved.stderr);
        assert!(moved.status.success(), "{said}");
        assert!(said.contains("moved model net (3 tensors)"), "{said}");
        fails(&["mv", "--model", &src, &c], "NotFound");
    })
    .await
    .unwrap();
    assert!(source.open_model(0, "net").await.is_err(), "moved away");
    let manifest = on_c.open_model(0, "moved").await.unwrap();
    assert_eq!(manifest.metadata, metadata);
    for (path, data) in &tensors {
        let key = TensorKey::new(0, manifest.name_of(path));
        ferry_testkit::assert_same(&on_c.get(&key).await.unwrap(), data, path);
    }
}

/// Runs `args` until its output holds `needle` `count` times (a directory catching up), for
/// 10 s at most.
fn listed_within(args: &[&str], needle: &str, count: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while ok(args).matches(needle).count() < count {
        assert!(
            std::time::Instant::now() < deadline,
            "{args:?} never listed {count} of {needle:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// `@NAME` wherever a node goes, and a copy whose source is a tensor's name alone: the
/// directory picks the holder (the target itself first), refuses a name two members hold in
/// different versions, and a `mv` by name; an etcd that does not answer is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_by_name_and_tensors_by_name_alone() {
    use ferry_server::cluster::{ClusterConfig, Membership};
    let etcd = ferry_testkit::Etcd::start().await;
    let cluster = etcd.cluster();
    let mut nodes = Vec::new();
    let mut joined = Vec::new();
    for name in ["cache", "worker"] {
        let node = ferry_testkit::start_with(&["flex", "flex"]).await;
        joined.push(Membership::join(
            node.node.clone(),
            ClusterConfig {
                // cache registers a Unix socket that is not there: same-machine clients and
                // pulls must fall back to its TCP address.
                unix: (name == "cache").then(|| "unix:/nonexistent-ferry/cache.sock".to_string()),
                ..etcd.member(name, &node)
            },
        ));
        nodes.push(node);
    }
    let (mut cache, mut worker) = (nodes[0].client().await, nodes[1].client().await);
    let data = samples::plain(DType::F32, &[16, 8], 3);
    cache
        .put(&TensorKey::new(0, "encoder.w"), &data)
        .await
        .unwrap();
    cache
        .put(
            &TensorKey::new(0, "other.w"),
            &samples::plain(DType::F32, &[4], 4),
        )
        .await
        .unwrap();
    worker
        .put(
            &TensorKey::new(1, "other.w"),
            &samples::plain(DType::F32, &[6], 5),
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    let out_arg = out.to_str().unwrap().to_string();
    tokio::task::spawn_blocking(move || {
        let c = cluster.as_str();
        // Every tensor listed with its hash before anything is resolved by name.
        listed_within(
            &["--cluster", c, "ls", "@", "--json"],
            "\"content_hash\": \"",
            3,
        );
        let copied = ferry(&["--cluster", c, "cp", "@cache/0/encoder.w", "@worker/1"]);
        let said = String::from_utf8_lossy(&copied.stderr);
        assert!(copied.status.success(), "{said}");
        assert!(
            said.contains("did not serve a pull; pulling over"),
            "the Unix socket fell back: {said}"
        );
        // Held by cache and by worker now (one version): worker copies it between its devices.
        listed_within(&["--cluster", c, "ls", "@worker", "--json"], "encoder.w", 1);
        let copied = ferry(&["--cluster", c, "cp", "encoder.w", "@worker/0/by-name"]);
        assert!(
            copied.status.success(),
            "{}",
            String::from_utf8_lossy(&copied.stderr)
        );
        let said = String::from_utf8_lossy(&copied.stderr);
        assert!(
            said.contains("source: @worker/1/encoder.w"),
            "the target itself first: {said}"
        );
        ok(&["--cluster", c, "get", "@worker/0/by-name", "-o", &out_arg]);
        let listed = ok(&["--cluster", c, "ls", "@worker/0"]);
        assert!(listed.contains("by-name"), "{listed}");
        fails(&["--cluster", c, "cp", "other.w", "@worker/0"], "different");
        fails(
            &["--cluster", c, "mv", "encoder.w", "@worker/0"],
            "mv needs",
        );
        fails(
            &["--cluster", c, "cp", "nothing.w", "@worker/0"],
            "no member of the cluster holds",
        );
        fails(&["--cluster", c, "ls", "@nobody/0"], "no member @nobody");
        fails(&["cp", "@cache/0/encoder.w", "@worker/0"], "--cluster");
        fails(
            &["--cluster", "etcd://127.0.0.1:1", "ls", "@"],
            "etcd at http://127.0.0.1:1",
        );
    })
    .await
    .unwrap();
    let back = read_tensors(&out).unwrap();
    assert_eq!(back.len(), 1);
    ferry_testkit::assert_same(&back[0].1, &data, "copied by name, read back by @NAME");
    for membership in joined {
        membership.leave().await;
    }
}

/// "Already holds" is the target node's word, not the directory's (issue 29, item 4): an entry
/// forged for an empty device makes `cp` fail, saying so; a tensor the target really holds is
/// confirmed, and a copy still succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn already_holds_is_confirmed_with_the_target_node() {
    use ferry_server::cluster::Membership;
    let etcd = ferry_testkit::Etcd::start().await;
    let cluster = etcd.cluster();
    let node = ferry_testkit::start_with(&["flex", "flex"]).await;
    let joined = Membership::join(node.node.clone(), etcd.member("worker", &node));
    let data = samples::plain(DType::F32, &[16, 8], 3);
    // A writer of etcd lists `w` on worker/1, which holds nothing: the only entry for `w`.
    let forged = ferry_proto::cluster::TensorRecord {
        dtype: "f32".into(),
        shape: vec![16, 8],
        bytes: data.as_bytes().len() as u64,
        content_hash: Some(ferry_proto::ContentHash::from_digest([7; 32])),
    };
    etcd.put(
        &ferry_proto::cluster::tensor_key("worker", 1, "w"),
        &ferry_proto::cluster::encode(&forged),
    )
    .await;
    let c = cluster.clone();
    tokio::task::spawn_blocking(move || {
        fails(
            &["--cluster", &c, "cp", "w", "@worker/1"],
            "that node does not hold it",
        );
    })
    .await
    .unwrap();
    // A tensor worker/0 really holds, listed with its verified hash: confirmed, and `cp` says so.
    let mut client = node.client().await;
    client.put(&TensorKey::new(0, "v"), &data).await.unwrap();
    let c = cluster.clone();
    tokio::task::spawn_blocking(move || {
        listed_within(&["--cluster", &c, "ls", "@", "--json"], "\"v\"", 1);
        let confirmed = ferry(&["--cluster", &c, "cp", "v", "@worker/0"]);
        let said = String::from_utf8_lossy(&confirmed.stderr);
        assert!(confirmed.status.success(), "{said}");
        assert!(said.contains("already holds v"), "{said}");
    })
    .await
    .unwrap();
    joined.leave().await;
    node.shutdown().await;
}

/// A copy by name weighs the holders' load (issue 45, item 3): of two holders of one version,
/// equally near, the one serving a fetch now is passed over for the idle one, even where the
/// target's own spread order ranks it first; a holder that is registered but does not answer
/// is passed over for one that does, however busy. To several targets, the chain starts at the
/// holder chosen for the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_by_name_reads_from_the_least_busy_holder_that_answers() {
    use ferry_client::cluster::{Directory, Loads, choose_source};
    use ferry_server::cluster::Membership;
    let etcd = ferry_testkit::Etcd::start().await;
    let cluster = etcd.cluster();
    let mut nodes = Vec::new();
    let mut joined = Vec::new();
    for name in ["busy", "idle", "worker"] {
        let node = ferry_testkit::start_with(&["flex"]).await;
        joined.push(Membership::join(
            node.node.clone(),
            etcd.member(name, &node),
        ));
        nodes.push(node);
    }
    // The same small tensors on busy and idle (one version each), a large one on busy alone.
    let names: Vec<String> = (0..12).map(|i| format!("w{i}")).collect();
    let small = |i: usize| samples::plain(DType::BF16, &[64, 8], i as u64);
    for node in &nodes[..2] {
        let mut client = node.client().await;
        for (i, name) in names.iter().enumerate() {
            client
                .put(&TensorKey::new(0, name), &small(i))
                .await
                .unwrap();
        }
    }
    let big = TensorKey::new(0, "big");
    let mut busy = nodes[0].client().await;
    busy.put(&big, &samples::plain(DType::F32, &[16 << 20], 9))
        .await
        .unwrap();
    let c = cluster.clone();
    let expected = 2 * names.len() + 1;
    tokio::task::spawn_blocking(move || {
        listed_within(
            &["--cluster", &c, "ls", "@", "--json"],
            "\"content_hash\": \"",
            expected,
        );
    })
    .await
    .unwrap();
    // Names the worker's spread order, with no load known, reads from busy and from idle.
    let mut directory = Directory::connect(&cluster).await.unwrap();
    let members = directory.members().await.unwrap();
    let worker = members.iter().find(|m| m.name == "worker").cloned();
    let mut by_rank = std::collections::BTreeMap::<String, Vec<String>>::new();
    for name in &names {
        let holders = directory.holders(name).await.unwrap();
        let unweighed = choose_source(name, &holders, &members, worker.as_ref(), &Loads::new());
        by_rank
            .entry(unweighed.unwrap().holder.member)
            .or_default()
            .push(name.clone());
    }
    let (Some(ranked_busy), Some(ranked_idle)) = (by_rank.get("busy"), by_rank.get("idle")) else {
        panic!("twelve names all rank one holder first: {by_rank:?}");
    };
    // A pull of the large tensor from busy, through a link that stalls: busy serves it on.
    let stalled =
        ferry_testkit::proxy(nodes[0].addr, ferry_testkit::Fault::StallAfter(64 * 1024)).await;
    let puller_node = ferry_testkit::start_with(&["flex"]).await;
    let (puller, busy_again) = (puller_node.client().await, nodes[0].client().await);
    let stuck = tokio::spawn(async move {
        let (mut busy, mut puller) = (busy_again, puller);
        let copy = ferry_client::NodeCopy::new(stalled.to_string()).tensor(big.clone(), big);
        let _ = copy.run(&mut busy, &mut puller).await;
    });
    let busy_node = &nodes[0];
    let within = std::time::Duration::from_secs(10);
    ferry_testkit::eventually_async("busy serves the stalled fetch", within, || async {
        let stats = busy_node.client().await.stat().await.unwrap();
        // A stripe's bytes where the puller stripes (on 8 cores and more), else the tensor's.
        stats.fetches_in_flight == 1 && stats.fetch_bytes_in_flight > 0
    })
    .await;
    let (c, first_busy, first_idle) = (
        cluster.clone(),
        ranked_busy[0].clone(),
        ranked_idle[0].clone(),
    );
    tokio::task::spawn_blocking(move || {
        for (name, dst) in [(&first_busy, "@worker/0/a"), (&first_idle, "@worker/0/b")] {
            let copied = ferry(&["--cluster", &c, "cp", name, dst]);
            let said = String::from_utf8_lossy(&copied.stderr);
            assert!(copied.status.success(), "{said}");
            assert!(
                said.contains(&format!("source: @idle/0/{name}"))
                    && said.contains("serving 0 fetches"),
                "{name}: the idle holder, whatever the spread order: {said}"
            );
        }
    })
    .await
    .unwrap();
    // A member that registered and holds `big` too, but does not answer (its port is closed):
    // busy, serving its stalled fetch, is the one that answers.
    // One that the worker's spread order ranks before busy.
    let busy_record = members.iter().find(|m| m.name == "busy").unwrap().clone();
    let busy_holds = directory.holders("big").await.unwrap();
    let gone = (0..)
        .map(|i| {
            let name = format!("gone{i}");
            let record = ferry_proto::cluster::MemberRecord {
                name: name.clone(),
                node_id: format!("node-{name}").into(),
                ..busy_record.clone()
            };
            let holds = ferry_client::cluster::Located {
                member: name,
                ..busy_holds[0].clone()
            };
            (record, holds)
        })
        .find(|(record, holds)| {
            let members = [busy_record.clone(), record.clone()];
            let holders = [busy_holds[0].clone(), holds.clone()];
            let unweighed =
                choose_source("big", &holders, &members, worker.as_ref(), &Loads::new());
            unweighed.unwrap().holder.member == record.name
        })
        .map(|(record, _)| record)
        .unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gone = ferry_proto::cluster::MemberRecord {
        tcp: closed.local_addr().unwrap().to_string(),
        ..gone
    };
    drop(closed);
    let key = ferry_proto::cluster::member_key(&gone.name);
    etcd.put(&key, &ferry_proto::cluster::encode(&gone)).await;
    let key = ferry_proto::cluster::tensor_key(&gone.name, 0, "big");
    etcd.put(&key, &ferry_proto::cluster::encode(&busy_holds[0].record))
        .await;
    let c = cluster.clone();
    tokio::task::spawn_blocking(move || {
        let copied = ferry(&["--cluster", &c, "cp", "big", "@worker/0/c"]);
        let said = String::from_utf8_lossy(&copied.stderr);
        assert!(copied.status.success(), "{said}");
        assert!(
            said.contains("source: @busy/0/big") && said.contains("serving 1 fetches"),
            "the holder that answers: {said}"
        );
    })
    .await
    .unwrap();
    let mut worker = nodes[2].client().await;
    let index = |name: &str| names.iter().position(|n| n == name).unwrap();
    for (dst, name) in [("a", &ranked_busy[0]), ("b", &ranked_idle[0])] {
        let got = worker.get(&TensorKey::new(0, dst)).await.unwrap();
        ferry_testkit::assert_same(&got, &small(index(name)), dst);
    }
    let got = worker.get(&TensorKey::new(0, "c")).await.unwrap();
    ferry_testkit::assert_same(&got, &samples::plain(DType::F32, &[16 << 20], 9), "c");
    // To two targets, relayed: the chain starts at the idle holder, and the second target
    // (named by address, no member) takes it from the first.
    let served = |node: &ferry_testkit::TestNode| {
        let addr = node.addr;
        async move {
            let mut client = ferry_client::Client::connect(addr).await.unwrap();
            client.stat().await.unwrap().fetches_served
        }
    };
    let before = (served(&nodes[1]).await, served(&nodes[2]).await);
    // A name the worker does not hold yet under any key (it would take it from itself).
    let fresh = names
        .iter()
        .find(|n| **n != ranked_busy[0] && **n != ranked_idle[0])
        .unwrap()
        .clone();
    let (c, name) = (cluster.clone(), fresh.clone());
    let second = format!("{}/0/r", puller_node.addr);
    tokio::task::spawn_blocking(move || {
        let copied = ferry(&["--cluster", &c, "cp", &name, "@worker/0/r", &second]);
        let said = String::from_utf8_lossy(&copied.stderr);
        assert!(copied.status.success(), "{said}");
        assert!(said.contains(&format!("source: @idle/0/{name}")), "{said}");
        assert_eq!(
            said.matches("copied 1 of 1 tensors to").count(),
            2,
            "{said}"
        );
    })
    .await
    .unwrap();
    let after = (served(&nodes[1]).await, served(&nodes[2]).await);
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (1, 1),
        "idle once, worker once"
    );
    let expected = small(index(&fresh));
    let r = TensorKey::new(0, "r");
    ferry_testkit::assert_same(&worker.get(&r).await.unwrap(), &expected, "r on worker");
    let mut puller = puller_node.client().await;
    ferry_testkit::assert_same(&puller.get(&r).await.unwrap(), &expected, "r relayed");
    stuck.abort();
    drop(puller_node);
    for membership in joined {
        membership.leave().await;
    }
}

/// `ferry load`: every transfer of every client checked byte for byte, nothing left behind.
#[test]
fn a_load_run_checks_every_transfer_and_leaves_nothing_behind() {
    let node = server();
    let report: serde_json::Value = serde_json::from_str(&ok(&[
        "load",
        &node.addr,
        "--clients",
        "24",
        "--rounds",
        "3",
        "--min-size",
        "4KiB",
        "--max-size",
        "1MiB",
        "--max-in-flight",
        "64MiB",
        "--seed",
        "9",
        "--warmup-rounds",
        "0",
        "--json",
    ]))
    .expect("load --json parses");
    for clean in ["errors", "mismatches", "tensors_left"] {
        assert_eq!(report[clean].as_u64(), Some(0), "{clean}: {report}");
    }
    assert_eq!(report["rounds"].as_u64(), Some(24 * 3));
    assert_eq!(report["put"]["count"].as_u64(), Some(72));
    assert_eq!(
        report["get"]["count"].as_u64(),
        Some(144),
        "the tensor and its copy, each checked"
    );
    assert!(report["node_resident_peak"].as_u64() >= report["node_resident_before"].as_u64());
    let listed: Vec<serde_json::Value> =
        serde_json::from_str(&ok(&["ls", &node.addr, "--json"])).expect("ls --json parses");
    assert!(listed.is_empty(), "{listed:?}");
}

/// `ferry load --clients N` against a node that takes N connections from one address (the
/// default, 256): the node's memory is read over a client's connection, so no client is
/// refused.
#[test]
fn a_load_run_of_as_many_clients_as_one_address_may_hold_has_no_error() {
    let node = server();
    let clients = ServiceConfig::default()
        .max_connections_per_address
        .to_string();
    let out = ferry(&[
        "load",
        &node.addr,
        "--clients",
        &clients,
        "--seconds",
        "2",
        "--min-size",
        "1KiB",
        "--max-size",
        "16KiB",
        "--seed",
        "11",
        "--warmup-rounds",
        "0",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("errors 0,"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.starts_with(&format!("{clients} clients")),
        "{stdout}"
    );
}
