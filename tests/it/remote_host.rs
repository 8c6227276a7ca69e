//! An embedded node seen from another host: two network namespaces this test makes (and
//! removes), joined by a veth pair, the node's listener in one and its clients in the other.
//! Built with the defaults, a node does not listen beyond loopback in the open; behind TLS and
//! grants a remote client does what its certificate was granted and no more; a client library
//! holding a token does not send it there in clear; a program that says the network is trusted
//! gets what it asked for.
//!
//! Needs root and `ip` (iproute2); where either is missing it prints why and returns without
//! asserting anything (the test's name then says nothing about the door).

use std::os::fd::AsFd;
use std::process::Command;

use ferry_client::{Client, ClientError};
use ferry_proto::{DType, TensorKey};
use ferry_server::{BindError, Missing, ProcessTuning, ReceiveBuffers, Server, StartError};
use ferry_testkit::TestPki;
use ferry_testkit::samples;

/// The node's host address, and the client host's.
const NODE_IP: &str = "10.233.0.1";
const CLIENT_IP: &str = "10.233.0.2";

/// Two network namespaces joined by a veth pair, removed when dropped.
struct Hosts {
    node: String,
    client: String,
}

impl Hosts {
    /// The two hosts, or why they cannot be made here.
    fn make() -> Result<Hosts, String> {
        if !rustix::process::geteuid().is_root() {
            return Err("not root: network namespaces need it".into());
        }
        let id = std::process::id();
        let hosts = Hosts {
            node: format!("ferry-door-n{id}"),
            client: format!("ferry-door-c{id}"),
        };
        let ip = |args: &[&str]| -> Result<(), String> {
            let out = Command::new("ip")
                .args(args)
                .output()
                .map_err(|e| format!("ip: {e}"))?;
            match out.status.success() {
                true => Ok(()),
                false => Err(format!(
                    "ip {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                )),
            }
        };
        ip(&["netns", "add", &hosts.node])?;
        ip(&["netns", "add", &hosts.client])?;
        // Made inside the namespaces: no interface ever appears on this host.
        ip(&[
            "-n",
            &hosts.node,
            "link",
            "add",
            "door0",
            "type",
            "veth",
            "peer",
            "name",
            "door1",
            "netns",
            &hosts.client,
        ])?;
        ip(&[
            "-n",
            &hosts.node,
            "addr",
            "add",
            &format!("{NODE_IP}/24"),
            "dev",
            "door0",
        ])?;
        ip(&[
            "-n",
            &hosts.client,
            "addr",
            "add",
            &format!("{CLIENT_IP}/24"),
            "dev",
            "door1",
        ])?;
        for (ns, dev) in [(&hosts.node, "door0"), (&hosts.client, "door1")] {
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    /// Runs `work` on a thread of its own inside namespace `ns`: sockets it makes live there.
    fn inside<T: Send>(ns: &str, work: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let handle = std::fs::File::open(format!("/run/netns/{ns}"))
                        .or_else(|_| std::fs::File::open(format!("/var/run/netns/{ns}")))
                        .expect("the namespace's handle");
                    rustix::thread::move_into_link_name_space(
                        handle.as_fd(),
                        Some(rustix::thread::LinkNameSpaceType::Network),
                    )
                    .expect("setns into the namespace");
                    work()
                })
                .join()
                .expect("the thread inside the namespace")
        })
    }
}

impl Hosts {
    /// Starts `server` inside the node's namespace, runs `clients` while it serves, then stops
    /// it (also when `clients` panics: the scope would otherwise wait for the server for ever).
    fn serve(&self, server: ferry_server::ServerBuilder, clients: impl FnOnce() + Send) {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let (ready, is_ready) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|scope| {
            scope.spawn(move || {
                Hosts::inside(&self.node, move || {
                    block_on(async move {
                        let server = server.start().await.expect("the worker starts");
                        ready.send(()).unwrap();
                        let stop = tokio::task::spawn_blocking(move || stopped.recv());
                        server
                            .run(async move {
                                let _ = stop.await;
                            })
                            .await
                            .unwrap();
                    })
                })
            });
            let _stop = StopOnDrop(stop);
            is_ready.recv().expect("the worker started");
            clients();
        });
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in [&self.node, &self.client] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// Tells the server thread to stop when dropped, also while a failed assertion unwinds (the
/// scope would otherwise wait for it for ever).
struct StopOnDrop(std::sync::mpsc::Sender<()>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// Runs `future` to completion on a runtime of this thread (so in its namespace).
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(future)
}

/// A server as a worker embeds one, listening on the node host's address.
fn worker() -> ferry_server::ServerBuilder {
    Server::builder()
        .listen(format!("{NODE_IP}:7070").parse().unwrap())
        .process_tuning(ProcessTuning::Untouched)
        .receive_buffers(ReceiveBuffers::Fresh)
}

#[test]
fn a_node_on_another_host_opens_only_to_whom_it_was_told() {
    let hosts = match Hosts::make() {
        Ok(hosts) => hosts,
        Err(why) => {
            eprintln!("skipping: {why}");
            return;
        }
    };
    let pki = TestPki::new();
    pki.issue(
        "worker",
        &ferry_certs::Role::Node {
            hosts: vec![NODE_IP.into()],
        },
        ferry_certs::Validity::days(1),
    );
    let reader = pki.client("reader");
    let coordinator = pki.client("coordinator");
    let stranger = TestPki::new().client("stranger");

    // Built with the defaults (no credential, no TLS), or with a token in clear: refused.
    Hosts::inside(&hosts.node, || {
        for (server, lacks) in [
            (worker(), Missing::TlsAndCredential),
            (worker().token("s3cret"), Missing::Tls),
        ] {
            match block_on(server.start()) {
                Err(StartError::Bind(BindError::Exposed(e))) => assert_eq!(e.missing, lacks),
                Err(other) => panic!("refused for another reason: {other}"),
                Ok(_) => panic!("a worker listening on {NODE_IP} without {lacks} started"),
            }
        }
    });

    // Behind TLS with grants: a reader reads, the coordinator writes, a stranger gets nothing.
    let tls_worker = worker().tls_files(pki.files("worker")).grants([
        "reader=read".parse().unwrap(),
        "coordinator=all".parse().unwrap(),
    ]);
    hosts.serve(tls_worker, || {
        let addr = format!("{NODE_IP}:7070");
        Hosts::inside(&hosts.client, || {
            block_on(async {
                let key = TensorKey::new(0, "batch");
                let data = samples::plain(DType::F32, &[64, 64], 1);
                let mut writer = Client::connect(addr.as_str())
                    .tls(coordinator)
                    .await
                    .unwrap();
                writer.put(&key, &data).await.unwrap();
                let mut reading = Client::connect(addr.as_str()).tls(reader).await.unwrap();
                let back = reading.get(&key).await.unwrap();
                assert_eq!(back.as_bytes(), data.as_bytes(), "bit-exact to the reader");
                let refused = reading.delete(&key).await;
                assert!(refused.is_err(), "a reader deleted: {refused:?}");
                let refused = reading.put(&TensorKey::new(0, "x"), &data).await;
                assert!(refused.is_err(), "a reader wrote: {refused:?}");
                // A certificate of another CA, and no TLS at all: nothing served.
                let other = Client::connect(addr.as_str()).tls(stranger).await;
                assert!(other.is_err(), "another CA's certificate was served");
                let clear = Client::connect(addr.as_str()).await;
                assert!(clear.is_err(), "a client in clear was served");
                // A token goes nowhere in clear beyond loopback: the library keeps it back.
                let token = Client::connect(addr.as_str()).token("s3cret").await;
                assert!(
                    matches!(&token, Err(ClientError::TokenWithheld(_))),
                    "{token:?}"
                );
                let still = writer.get(&key).await.unwrap();
                assert_eq!(still.as_bytes(), data.as_bytes());
            })
        });
    });

    // Told the network is trusted, the program gets an open node: its own explicit choice.
    hosts.serve(worker().insecure(), || {
        Hosts::inside(&hosts.client, || {
            block_on(async {
                let mut client = Client::connect(format!("{NODE_IP}:7070").as_str())
                    .await
                    .unwrap();
                client.stat().await.unwrap();
            })
        });
    });
}
