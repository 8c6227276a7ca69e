//! [`Etcd`]: the calls themselves, on a connection to the first endpoint that answers.

use std::time::Duration;

use serde::Serialize;
use serde::de::{DeserializeOwned, IgnoredAny};
use tokio_rustls::TlsConnector;

use crate::error::EtcdError;
use crate::link::{Endpoint, Link};
use crate::user::EtcdUser;
use crate::watch::Watch;
use crate::wire::{
    self, DeleteRangeRequest, KeyValue, LeaseGrantRequest, LeaseGrantResponse,
    LeaseKeepAliveResponse, LeaseRequest, Member, MemberListResponse, PutRequest, RangeRequest,
    RangeResponse, RequestOp, StreamItem, TxnRequest, WatchCreateRequest, WatchRequest,
};

/// A lease's id, as etcd chose it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId(i64);

impl LeaseId {
    /// The id as etcd writes it.
    pub fn get(self) -> i64 {
        self.0
    }
}

impl std::fmt::Display for LeaseId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// A lease etcd granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Its id.
    pub id: LeaseId,
    /// The time to live etcd granted (whole seconds; it may differ from the one asked for).
    pub ttl: Duration,
}

/// What a range read found.
#[derive(Debug, Clone, Default)]
pub struct Range {
    /// The store's revision the read saw: a watch from `revision + 1` misses no later change.
    pub revision: i64,
    /// The keys found, in key order.
    pub kvs: Vec<KeyValue>,
}

/// One operation of a transaction.
#[derive(Debug, Clone, Copy)]
pub enum TxnOp<'a> {
    /// Writes `value` under `key`, attached to `lease` where given.
    Put {
        /// The key.
        key: &'a [u8],
        /// The value.
        value: &'a [u8],
        /// The lease the key lives under, if any.
        lease: Option<LeaseId>,
    },
    /// Deletes `key`.
    Delete {
        /// The key.
        key: &'a [u8],
    },
}

/// A client of one etcd cluster, connected to one of its endpoints at a time. A call on a
/// connection that closed (or that a failed, timed-out or dropped call left unusable) connects
/// again, trying the endpoints in turn from the one after the endpoint that failed, so that an
/// endpoint that accepts connections but does not answer is not chosen again and again; a call
/// that fails is not retried (the caller decides: a node starts a new session).
pub struct Etcd {
    endpoints: Vec<Endpoint>,
    link: Link,
    /// The index of the link's endpoint in `endpoints`.
    current: usize,
    timeout: Duration,
    /// For `https://` endpoints.
    tls: Option<TlsConnector>,
    /// Who every link logs in as, where etcd runs with auth on.
    user: Option<EtcdUser>,
}

impl Etcd {
    /// Connects to the first of `endpoints` (`http://HOST:PORT`) that accepts, each given
    /// `timeout`; every later call must answer within `timeout` too.
    pub async fn connect(endpoints: &[String], timeout: Duration) -> Result<Etcd, EtcdError> {
        Etcd::connect_with(endpoints, timeout, None).await
    }

    /// [`connect`](Self::connect), with `tls` for `https://` endpoints (etcd's certificate
    /// checked against its CA, the caller's presented): what lets etcd admit only holders of a
    /// certificate of the cluster (`--client-cert-auth`), and no one on the path read or write.
    pub async fn connect_with(
        endpoints: &[String],
        timeout: Duration,
        tls: Option<TlsConnector>,
    ) -> Result<Etcd, EtcdError> {
        Etcd::connect_as(endpoints, timeout, tls, None).await
    }

    /// [`connect_with`](Self::connect_with), logged in as `user` on every connection, for an
    /// etcd with auth on: its roles then decide which keys this client may read and write. The
    /// password is sent over TLS or to loopback only ([`EtcdError::PasswordInClear`]).
    pub async fn connect_as(
        endpoints: &[String],
        timeout: Duration,
        tls: Option<TlsConnector>,
        user: Option<EtcdUser>,
    ) -> Result<Etcd, EtcdError> {
        let endpoints = endpoints
            .iter()
            .map(|e| Endpoint::parse(e))
            .collect::<Result<Vec<_>, _>>()?;
        if endpoints.is_empty() {
            return Err(EtcdError::Unreachable {
                tried: String::new(),
                last: "no endpoint given".into(),
            });
        }
        // Said as what it is, not as an endpoint that did not answer.
        if tls.is_none()
            && let Some(secure) = endpoints.iter().find(|e| e.is_https())
        {
            return Err(EtcdError::NeedsTls(secure.url().to_string()));
        }
        // Refused before anything is sent, rather than at the first endpoint that is in clear.
        if user.is_some() {
            password_route(&endpoints)?;
        }
        let (current, link) =
            open_first(&endpoints, 0, timeout, tls.as_ref(), user.as_ref()).await?;
        Ok(Etcd {
            endpoints,
            link,
            current,
            timeout,
            tls,
            user,
        })
    }

    /// The endpoint this client is connected to.
    pub fn endpoint(&self) -> &str {
        self.link.endpoint().url()
    }

    /// The link, connected again if it closed.
    async fn link(&mut self) -> Result<&mut Link, EtcdError> {
        if self.link.is_closed() {
            let next = (self.current + 1) % self.endpoints.len();
            (self.current, self.link) = open_first(
                &self.endpoints,
                next,
                self.timeout,
                self.tls.as_ref(),
                self.user.as_ref(),
            )
            .await?;
        }
        Ok(&mut self.link)
    }

    /// Posts `request` to `path` and reads the whole answer; where etcd no longer takes the
    /// link's token (it expired, or etcd's users or roles changed since), logs in again and asks
    /// once more.
    pub(crate) async fn call<T: DeserializeOwned>(
        &mut self,
        path: &str,
        request: &impl Serialize,
    ) -> Result<T, EtcdError> {
        let answer = self.link().await?.call(path, request).await;
        match (answer, &self.user) {
            (Err(e), Some(user)) if is_stale_token(&e) => {
                self.link.authenticate(user).await?;
                self.link.call(path, request).await
            }
            (answer, _) => answer,
        }
    }

    /// [`call`](Self::call) for a streaming call: its first message.
    async fn call_once<T: DeserializeOwned>(
        &mut self,
        path: &str,
        request: &impl Serialize,
    ) -> Result<T, EtcdError> {
        let item: StreamItem<T> = self.call(path, request).await?;
        self.link
            .unwrap_item(item)?
            .ok_or_else(|| EtcdError::Malformed {
                endpoint: self.link.endpoint().url().to_string(),
                detail: "a stream answered with no result".into(),
            })
    }

    /// Refuses where any endpoint would get a password in clear beyond loopback: a call that
    /// carries one ([`user_add`](Self::user_add)) may reconnect to any of them.
    pub(crate) fn check_password_route(&self) -> Result<(), EtcdError> {
        password_route(&self.endpoints)
    }

    /// The value of `key`, if any (as a range of at most one key).
    pub async fn get(&mut self, key: &[u8]) -> Result<Range, EtcdError> {
        self.range(key, None).await
    }

    /// Every key that starts with `prefix` (every key, for an empty one).
    pub async fn get_prefix(&mut self, prefix: &[u8]) -> Result<Range, EtcdError> {
        // etcd reads an empty key as no key; `\0` is the first key there is.
        let start: &[u8] = if prefix.is_empty() { b"\0" } else { prefix };
        self.range(start, Some(wire::prefix_end(prefix))).await
    }

    async fn range(&mut self, key: &[u8], end: Option<Vec<u8>>) -> Result<Range, EtcdError> {
        let request = RangeRequest {
            key: wire::base64(key),
            range_end: end.as_deref().map(wire::base64),
        };
        let answer: RangeResponse = self.call("/v3/kv/range", &request).await?;
        Ok(Range {
            revision: answer.header.revision,
            kvs: answer.kvs,
        })
    }

    /// Writes `value` under `key`, attached to `lease` where given.
    pub async fn put(
        &mut self,
        key: &[u8],
        value: &[u8],
        lease: Option<LeaseId>,
    ) -> Result<(), EtcdError> {
        let request = put_request(key, value, lease);
        let _: IgnoredAny = self.call("/v3/kv/put", &request).await?;
        Ok(())
    }

    /// Deletes `key` (nothing happens where there is none).
    pub async fn delete(&mut self, key: &[u8]) -> Result<(), EtcdError> {
        let request = DeleteRangeRequest {
            key: wire::base64(key),
        };
        let _: IgnoredAny = self.call("/v3/kv/deleterange", &request).await?;
        Ok(())
    }

    /// Applies `ops` as one transaction: all of them, or (on an error) none.
    pub async fn txn(&mut self, ops: &[TxnOp<'_>]) -> Result<(), EtcdError> {
        let request = TxnRequest {
            success: ops
                .iter()
                .map(|op| match *op {
                    TxnOp::Put { key, value, lease } => {
                        RequestOp::Put(put_request(key, value, lease))
                    }
                    TxnOp::Delete { key } => RequestOp::Delete(DeleteRangeRequest {
                        key: wire::base64(key),
                    }),
                })
                .collect(),
        };
        let _: IgnoredAny = self.call("/v3/kv/txn", &request).await?;
        Ok(())
    }

    /// Asks for a lease of `ttl` (rounded up to whole seconds, at least one).
    pub async fn lease_grant(&mut self, ttl: Duration) -> Result<Lease, EtcdError> {
        let seconds = ttl
            .as_secs()
            .saturating_add(u64::from(ttl.subsec_nanos() > 0));
        let request = LeaseGrantRequest {
            ttl: i64::try_from(seconds.max(1)).unwrap_or(i64::MAX),
        };
        let answer: LeaseGrantResponse = self.call("/v3/lease/grant", &request).await?;
        if !answer.error.is_empty() || answer.id == 0 || answer.ttl <= 0 {
            return Err(EtcdError::Refused {
                endpoint: self.endpoint().to_string(),
                code: 0,
                message: format!("lease not granted: {:?}", answer.error),
            });
        }
        Ok(Lease {
            id: LeaseId(answer.id),
            ttl: Duration::from_secs(answer.ttl.unsigned_abs()),
        })
    }

    /// Renews `lease`: the time it has left from now, or `None` where it already expired.
    pub async fn lease_keep_alive(
        &mut self,
        lease: LeaseId,
    ) -> Result<Option<Duration>, EtcdError> {
        let request = LeaseRequest { id: lease.0 };
        let answer: LeaseKeepAliveResponse =
            self.call_once("/v3/lease/keepalive", &request).await?;
        Ok((answer.ttl > 0).then(|| Duration::from_secs(answer.ttl.unsigned_abs())))
    }

    /// Revokes `lease`: every key attached to it is deleted at once.
    pub async fn lease_revoke(&mut self, lease: LeaseId) -> Result<(), EtcdError> {
        let request = LeaseRequest { id: lease.0 };
        let _: IgnoredAny = self.call("/v3/lease/revoke", &request).await?;
        Ok(())
    }

    /// Watches every key starting with `prefix`, from `start_revision` on, on a connection of
    /// its own (a watch holds its connection for as long as it lasts).
    pub async fn watch_prefix(
        &self,
        prefix: &[u8],
        start_revision: i64,
    ) -> Result<Watch, EtcdError> {
        let link = Link::open(
            self.link.endpoint(),
            self.timeout,
            self.tls.as_ref(),
            self.user.as_ref(),
        )
        .await?;
        let request = WatchRequest {
            create_request: WatchCreateRequest {
                key: wire::base64(if prefix.is_empty() { b"\0" } else { prefix }),
                range_end: wire::base64(&wire::prefix_end(prefix)),
                start_revision,
            },
        };
        let (endpoint, body) = link.stream("/v3/watch", &request).await?;
        Watch::start(endpoint, body, self.timeout).await
    }

    /// The etcd cluster's members.
    pub async fn member_list(&mut self) -> Result<Vec<Member>, EtcdError> {
        let answer: MemberListResponse = self
            .call("/v3/cluster/member/list", &serde_json::json!({}))
            .await?;
        Ok(answer.members)
    }
}

fn put_request(key: &[u8], value: &[u8], lease: Option<LeaseId>) -> PutRequest {
    PutRequest {
        key: wire::base64(key),
        value: wire::base64(value),
        lease: lease.map_or(0, |l| l.0),
    }
}

/// A link to the first endpoint that accepts one, trying them in turn from `start`, with that
/// endpoint's index; the error names every endpoint tried.
async fn open_first(
    endpoints: &[Endpoint],
    start: usize,
    timeout: Duration,
    tls: Option<&TlsConnector>,
    user: Option<&EtcdUser>,
) -> Result<(usize, Link), EtcdError> {
    let mut last = None;
    for offset in 0..endpoints.len() {
        let index = (start + offset) % endpoints.len();
        match Link::open(&endpoints[index], timeout, tls, user).await {
            // A wrong name or password is the same at every endpoint: said as what it is. Any
            // other refusal (a learner, a member without quorum) is that endpoint's alone.
            Err(e @ EtcdError::Refused { .. }) if is_bad_login(&e) => return Err(e),
            Ok(link) => return Ok((index, link)),
            Err(e) => last = Some(e),
        }
    }
    Err(EtcdError::Unreachable {
        tried: endpoints
            .iter()
            .map(Endpoint::url)
            .collect::<Vec<_>>()
            .join(", "),
        last: last.map_or_else(|| "no endpoint given".to_string(), |e| e.to_string()),
    })
}

/// Whether etcd refused a request of a client that has a user for its token alone: expired,
/// older than a change to etcd's users and roles, or missing (etcd's auth was turned on after
/// this link logged in, or an earlier login failed). Logging in again mends it.
fn is_stale_token(e: &EtcdError) -> bool {
    matches!(e, EtcdError::Refused { message, .. }
        if message.contains("invalid auth token")
            || message.contains("revision of auth store is old")
            || message.contains("user name is empty"))
}

/// `Ok` where every one of `endpoints` may be sent a password (over TLS, or to loopback).
fn password_route(endpoints: &[Endpoint]) -> Result<(), EtcdError> {
    match endpoints.iter().find(|e| !e.takes_password()) {
        Some(clear) => Err(EtcdError::PasswordInClear(clear.url().to_string())),
        None => Ok(()),
    }
}

/// Whether etcd refused a login for its name or password.
fn is_bad_login(e: &EtcdError) -> bool {
    matches!(e, EtcdError::Refused { message, .. } if message.contains("authentication failed"))
}
