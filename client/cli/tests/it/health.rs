//! `ferry health`: one `ok` line and exit 0 for a live node; an `error:` line and a failure
//! for an address where nothing answers.

use std::process::Command;

use ferry_server::{NodeConfig, ServiceConfig};
use ferry_testkit::{BackgroundNode, devices};

/// A loopback port nothing listens on (bound, then released).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

#[test]
fn the_health_check_says_ok_for_a_live_node_and_fails_for_a_dead_one() {
    let config = NodeConfig {
        devices: devices(&["flex"]),
        ..NodeConfig::light()
    };
    let node = BackgroundNode::start(config, ServiceConfig::default(), None);
    let out = Command::new(crate::ferry_cli())
        .args(["health", &node.addr])
        .env_remove("FERRY_TOKEN")
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("ok "), "{stdout}");
    let dead = format!("127.0.0.1:{}", free_port());
    let out = Command::new(crate::ferry_cli())
        .args(["health", &dead, "--timeout", "2"])
        .env_remove("FERRY_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("error:"));
}
