//! What can go wrong talking to etcd.

use std::time::Duration;

/// Why an etcd call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// An endpoint is not `http://HOST:PORT` or `https://HOST:PORT`.
    #[error("{0:?} is not an etcd endpoint (http://HOST:PORT or https://HOST:PORT)")]
    Endpoint(String),
    /// An `https://` endpoint, and no TLS to reach it with.
    #[error("{0} is etcd over TLS: it needs the cluster's CA and a certificate (--tls-*)")]
    NeedsTls(String),
    /// A user's password would go to `{0}` in clear, beyond loopback.
    #[error("{0} is etcd in clear beyond loopback: an etcd password goes over TLS only (https://)")]
    PasswordInClear(String),
    /// etcd runs with auth on and `--client-cert-auth`, and its JSON gateway refuses client
    /// certificates with a common name (every ferry certificate has one).
    #[error(
        "etcd at {0} refuses client certificates with a common name while its auth is on: run it without --client-cert-auth (docs/cluster.md, etcd users and roles)"
    )]
    CommonNameRefused(String),
    /// A permission asked for every key (an empty prefix).
    #[error("a role's key prefix is empty: etcd would read it as every key")]
    EmptyPrefix,
    /// No endpoint could be connected to.
    #[error("no etcd endpoint answered (tried {tried}): {last}")]
    Unreachable {
        /// The endpoints tried, in order.
        tried: String,
        /// Why the last one failed.
        last: String,
    },
    /// etcd took longer than the client's timeout to answer.
    #[error("etcd at {endpoint} did not answer within {timeout:?}")]
    Timeout {
        /// The endpoint asked.
        endpoint: String,
        /// The time allowed.
        timeout: Duration,
    },
    /// The HTTP exchange failed (the connection was closed or reset).
    #[error("etcd at {endpoint}: {cause}")]
    Http {
        /// The endpoint asked.
        endpoint: String,
        /// What failed.
        cause: String,
    },
    /// etcd answered with an error.
    #[error("etcd at {endpoint} refused: {message} (code {code})")]
    Refused {
        /// The endpoint asked.
        endpoint: String,
        /// The gRPC status code etcd gave.
        code: i64,
        /// etcd's message.
        message: String,
    },
    /// The answer was not etcd's JSON.
    #[error("etcd at {endpoint} answered what is not etcd's JSON: {detail}")]
    Malformed {
        /// The endpoint asked.
        endpoint: String,
        /// What did not parse.
        detail: String,
    },
    /// The answer was larger than the client reads.
    #[error("etcd at {endpoint} answered more than {limit} bytes")]
    TooLarge {
        /// The endpoint asked.
        endpoint: String,
        /// The most a client reads of one answer.
        limit: usize,
    },
}
