//! `ferry-server --cluster`: a node process registers itself in a real etcd, and one killed with
//! SIGKILL (no chance to leave) is gone from the member list and the directory within its TTL.

use std::time::{Duration, Instant};

use ferry_client::Client;
use ferry_client::cluster::Directory;
use ferry_proto::{DType, TensorKey};
use ferry_testkit::samples;
use ferry_testkit::{Etcd, eventually_async, spawn_server};

use crate::ferry_server;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_with_sigkill_leaves_the_cluster_within_its_ttl() {
    let etcd = Etcd::start().await;
    let cluster = etcd.cluster();
    let node = spawn_server(
        ferry_server(),
        &[
            "--cluster",
            &cluster,
            "--name",
            "doomed",
            "--cluster-ttl",
            "2",
        ],
        None,
    );
    let mut client = Client::connect(node.addr.as_str()).await.unwrap();
    let data = samples::plain(DType::F32, &[32, 32], 2);
    client.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let registered = |want_member: bool, want_tensor: bool| {
        let cluster = cluster.clone();
        async move {
            let Ok(mut d) = Directory::connect(&cluster).await else {
                return false;
            };
            let member = d.member("doomed").await.ok().flatten();
            let tensors = d.tensors(Some("doomed")).await.unwrap_or_default();
            member.is_some() == want_member
                && tensors
                    .iter()
                    .any(|t| t.name == "w" && t.record.content_hash.is_some())
                    == want_tensor
        }
    };
    eventually_async(
        "registered, with its tensor",
        Duration::from_secs(10),
        || registered(true, true),
    )
    .await;
    let mut d = Directory::connect(&cluster).await.unwrap();
    let member = d.member("doomed").await.unwrap().unwrap();
    assert_eq!(member.tcp, node.addr);
    drop(client);
    // SIGKILL: the node cannot revoke its lease; etcd expires it.
    let status = std::process::Command::new("kill")
        .args(["-KILL", &node.pid().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
    let killed = Instant::now();
    eventually_async("gone with its lease", Duration::from_secs(5), || {
        registered(false, false)
    })
    .await;
    let gone_after = killed.elapsed();
    println!("gone {gone_after:?} after SIGKILL (TTL 2 s)");
    assert!(
        gone_after <= Duration::from_secs(3),
        "gone only after {gone_after:?}, past the 2 s TTL and etcd's 0.5 s expiry tick"
    );
    drop(node);
}

/// `--etcd-user` and `--etcd-password-file`: a node process given its etcd user before the
/// operator turns etcd's auth on registers without a token, and once auth is on logs in (its
/// requests refused for want of a user) and publishes what it then holds; the reader lists it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_logs_in_to_etcd_with_auth_on_as_its_etcd_user() {
    let mut etcd = Etcd::start().await;
    etcd.add_roles(&["worker"], &["ops"]).await;
    let cluster = etcd.cluster();
    let dir = tempfile::tempdir().unwrap();
    let password = dir.path().join("worker.pw");
    std::fs::write(&password, "worker-password\n").unwrap();
    let node = spawn_server(
        ferry_server(),
        &[
            "--cluster",
            &cluster,
            "--name",
            "worker",
            "--etcd-user",
            "worker",
            "--etcd-password-file",
            password.to_str().unwrap(),
        ],
        None,
    );
    let mut client = Client::connect(node.addr.as_str()).await.unwrap();
    let data = samples::plain(DType::F32, &[8, 8], 2);
    client
        .put(&TensorKey::new(0, "before"), &data)
        .await
        .unwrap();
    eventually_async(
        "registered before auth is on",
        Duration::from_secs(10),
        || {
            let cluster = cluster.clone();
            async move {
                let Ok(mut d) = Directory::connect(&cluster).await else {
                    return false;
                };
                let tensors = d.tensors(Some("worker")).await.unwrap_or_default();
                tensors.iter().any(|t| t.name == "before")
            }
        },
    )
    .await;
    etcd.auth_on().await;
    client.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    eventually_async(
        "registered, with its tensor",
        Duration::from_secs(10),
        || {
            let (cluster, addr) = (cluster.clone(), node.addr.clone());
            async move {
                let Ok(mut d) =
                    Directory::connect_as(&cluster, None, Some(Etcd::user("ops"))).await
                else {
                    return false;
                };
                let member = d.member("worker").await.ok().flatten();
                let tensors = d.tensors(Some("worker")).await.unwrap_or_default();
                member.is_some_and(|m| m.tcp == addr) && tensors.iter().any(|t| t.name == "w")
            }
        },
    )
    .await;
}
