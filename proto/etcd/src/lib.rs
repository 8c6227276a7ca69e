//! The etcd v3 calls a ferry cluster makes (ranges, puts and deletes, transactions, leases, a
//! watch, the member list), over etcd's JSON gateway on its client port.
//!
//! Why not gRPC: the Rust gRPC clients of etcd generate their code from .proto files when they
//! build, which needs protoc and the protobuf headers on every machine that builds ferry, and
//! bring a whole RPC stack (tonic, prost, h2, tower, axum) for a dozen calls. etcd serves the
//! same API as JSON over HTTP/1.1 (the grpc-gateway, under `/v3/` since etcd 3.4), so ferry
//! builds with nothing but a Rust toolchain. The cluster tests run this client against a real
//! etcd.
//!
//! Everything etcd answers is read with bounds ([`MAX_ANSWER`], [`MAX_WATCH_MESSAGE`]): an
//! endpoint is whatever answers at an address.

mod auth;
mod client;
mod error;
mod link;
mod user;
mod watch;
mod wire;

pub use auth::{Access, Keys, Permission};
pub use client::{Etcd, Lease, LeaseId, Range, TxnOp};
pub use error::EtcdError;
pub use link::{MAX_ANSWER, MAX_WATCH_MESSAGE};
pub use user::EtcdUser;
pub use watch::{Watch, WatchBatch};
pub use wire::{Event, EventKind, KeyValue, Member};
