//! ferry-testkit: what the integration tests, benchmarks and doc tests of every ferry package
//! share: in-process nodes on loopback, node processes, a fault-injecting proxy, a test PKI and
//! etcd, byte comparisons and polling, the sample matrix ([`samples`]) and a squatted port
//! ([`squatter`]).
//!
//! One concept a file, everything but the samples and the squatter re-exported here: `node`
//! ([`TestNode`], [`start`]), `background` ([`BackgroundNode`]), `process` ([`ServerProcess`],
//! [`LoggedServer`]), `proxy` ([`proxy`], [`Fault`]), `copy` ([`How`], [`copy_keys`]), `checks`
//! ([`assert_same`], [`code_of`]), `poll` ([`eventually`]), `pki` ([`TestPki`]) and `etcd`
//! ([`Etcd`]).
// Test support: a failed unwrap fails the test that called it, and these helpers are read in
// the tests that use them rather than in `cargo doc`.
#![allow(clippy::unwrap_used, missing_docs)]

pub mod samples;
pub mod squatter;

mod background;
mod checks;
mod copy;
mod etcd;
mod node;
mod pki;
mod poll;
mod process;
mod proxy;

pub use background::BackgroundNode;
pub use checks::{assert_same, code_of, on_device, source_code_of};
pub use copy::{How, copy_keys, copy_one, hashes_verified, how, source_connection};
pub use etcd::{Etcd, MEMBER_TTL};
pub use node::{REGIONS, TestNode, devices, start, start_unix, start_with};
pub use pki::{TestPki, tls_client};
pub use poll::{eventually, eventually_async, eventually_blocking};
pub use process::{LoggedServer, ServerProcess, spawn_server};
pub use proxy::{Fault, proxy};
