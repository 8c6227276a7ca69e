//! `ferry put --model` and `ferry get` of a model: a `.safetensors` file's own metadata (as a
//! reference writer lays it out) survives the round trip, its tensors come back bit-exact under
//! their own names, a model is not replaced unless asked, and a failed put keeps nothing.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use ferry_files::read_file;
use ferry_server::{NodeConfig, ServiceConfig};
use ferry_testkit::{BackgroundNode, devices};

fn ferry(args: &[&str]) -> Output {
    Command::new(crate::ferry_cli())
        .args(args)
        .env_remove("FERRY_TOKEN")
        .output()
        .expect("ferry runs")
}

/// Runs `ferry`, which must succeed: its stdout and stderr.
fn ok(args: &[&str]) -> (String, String) {
    let out = ferry(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "ferry {args:?} failed: {stderr}");
    (String::from_utf8(out.stdout).unwrap(), stderr)
}

/// Runs `ferry`, which must fail with an `error:` line that mentions `words`.
fn fails(args: &[&str], words: &str) {
    let out = ferry(args);
    assert!(!out.status.success(), "ferry {args:?} should fail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("error:") && l.contains(words)),
        "ferry {args:?}: expected an error line with {words:?} in {stderr}"
    );
}

const NOTE: &str = "fine-tuned; \"quoted\", ünïcode";

/// A safetensors file as the reference writer lays it out (wider dtypes first, the header padded
/// with spaces to 8 bytes), with `{"format": "pt", "note": ...}` as its `__metadata__`: the
/// tensor names and their bytes.
fn reference_file(path: &Path) -> Vec<(String, Vec<u8>)> {
    // f32 NaN payloads, -0.0 and a subnormal: bits a lossy path would change.
    let weight: Vec<u8> = [0x7fc0_beef_u32, 0x7f80_0001, 0x8000_0000, 0x0000_0001]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let bias: Vec<u8> = [-3i16, 0, 32767]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let header = serde_json::json!({
        "__metadata__": {"format": "pt", "note": NOTE},
        "encoder.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "encoder.bias": {"dtype": "I16", "shape": [3], "data_offsets": [16, 22]},
    });
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut file = (json.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&json);
    file.extend_from_slice(&weight);
    file.extend_from_slice(&bias);
    std::fs::write(path, file).unwrap();
    vec![
        ("encoder.bias".to_string(), bias),
        ("encoder.weight".to_string(), weight),
    ]
}

/// A safetensors file's `__metadata__` and each tensor's bytes, read by hand.
type Parsed = (BTreeMap<String, String>, BTreeMap<String, Vec<u8>>);

fn parse_safetensors(path: &Path) -> Parsed {
    let raw = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&raw[8..8 + len]).unwrap();
    let data = &raw[8 + len..];
    let mut metadata = BTreeMap::new();
    let mut tensors = BTreeMap::new();
    for (name, value) in header {
        if name == "__metadata__" {
            for (k, v) in value.as_object().unwrap() {
                metadata.insert(k.clone(), v.as_str().unwrap().to_string());
            }
            continue;
        }
        let offsets = value["data_offsets"].as_array().unwrap();
        let start = offsets[0].as_u64().unwrap() as usize;
        let end = offsets[1].as_u64().unwrap() as usize;
        tensors.insert(name, data[start..end].to_vec());
    }
    (metadata, tensors)
}

#[test]
fn a_safetensors_files_metadata_survives_put_model_and_get() {
    let node = BackgroundNode::start(
        NodeConfig {
            devices: devices(&["flex", "flex"]),
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
        None,
    );
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("llm.safetensors");
    let expected: BTreeMap<String, Vec<u8>> = reference_file(&input).into_iter().collect();
    let dev0 = format!("{}/0", node.addr);
    let input = input.to_str().unwrap();

    let (_, said) = ok(&["put", input, &dev0, "--model", "llm"]);
    assert!(said.contains("put model llm version"), "{said}");
    let (listed, _) = ok(&["ls", &dev0]);
    let line = listed
        .lines()
        .find(|l| l.starts_with("0\tllm\tmodel v"))
        .unwrap_or_else(|| panic!("no model line in {listed}"));
    assert!(line.contains("\t2 tensors\t22\t"), "{line}");

    // Named as a model (--model), and found as one (no tensor is named llm): the same file.
    let out = dir.path().join("out.safetensors");
    let out_str = out.to_str().unwrap();
    for args in [vec!["get", "--model"], vec!["get"]] {
        let source = format!("{dev0}/llm");
        let mut args = args;
        args.extend([source.as_str(), "-o", out_str]);
        ok(&args);
        let (metadata, tensors) = parse_safetensors(&out);
        assert_eq!(metadata.get("format").map(String::as_str), Some("pt"));
        assert_eq!(metadata.get("note").map(String::as_str), Some(NOTE));
        assert_eq!(tensors, expected, "bit-exact, under the file's own names");
        // Ferry's own keys stay out of what ferry reads back as the file's metadata.
        let contents = read_file(&out).unwrap();
        let user: Vec<(&str, &str)> = contents
            .metadata
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(user, [("format", "pt"), ("note", NOTE)]);
    }
    // Into burnpack too, metadata included.
    let bpk = dir.path().join("out.bpk");
    ok(&["get", &format!("{dev0}/llm"), "-o", bpk.to_str().unwrap()]);
    let contents = read_file(&bpk).unwrap();
    assert_eq!(
        contents.metadata.get("note").map(String::as_str),
        Some(NOTE)
    );
    for (name, data) in &contents.tensors {
        assert_eq!(data.as_bytes(), expected[name].as_slice(), "{name}");
    }

    // Not replaced unless asked; then the new version is current.
    fails(
        &["put", input, &dev0, "--model", "llm"],
        "already holds model llm",
    );
    ok(&["put", input, &dev0, "--model", "llm", "--overwrite"]);
    let (listed, _) = ok(&["ls", &dev0]);
    assert!(listed.contains("0\tllm\tmodel v"), "{listed}");
    assert_eq!(
        listed.lines().filter(|l| l.contains("\tmodel v")).count(),
        1,
        "{listed}"
    );
    fails(
        &["get", "--model", &format!("{dev0}/nope"), "-o", out_str],
        "no model nope",
    );
}

#[test]
fn a_model_put_that_fails_keeps_nothing() {
    let node = BackgroundNode::start(
        NodeConfig {
            devices: devices(&["flex"]),
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
        None,
    );
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("bad.safetensors");
    reference_file(&input);
    // A name past the node's limit: that tensor is refused, so the whole version goes.
    let mut tensors = read_file(&input).unwrap().tensors;
    let long = "x".repeat(2000);
    tensors.push((long, tensors[0].1.clone()));
    ferry_files::write_tensors(&input, &tensors).unwrap();
    let dev0 = format!("{}/0", node.addr);
    fails(
        &["put", input.to_str().unwrap(), &dev0, "--model", "half"],
        "nothing of it was kept",
    );
    let (listed, _) = ok(&["ls", &dev0]);
    assert!(!listed.contains("half"), "{listed}");
}
