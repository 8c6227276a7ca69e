//! etcd's v3 messages as its JSON gateway writes them (protobuf's JSON mapping): the requests
//! ferry sends and the answers it reads back, as serde types, with no I/O.
//!
//! The mapping's rules that matter here: bytes are base64, 64-bit integers are strings (numbers
//! are accepted too), fields at their default value are left out, and field names are the
//! .proto's own (`range_end`; the camel-case form is accepted as well).

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde::{Deserialize, Deserializer, Serialize};

/// Bytes as the gateway takes them: base64.
pub(crate) fn base64(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}

/// The end of the range holding every key that starts with `prefix` (etcd's `--prefix`): the
/// prefix with its last byte below 0xff raised by one; `\0` (every key) where none is.
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn from_base64<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let text = <Option<String>>::deserialize(d)?.unwrap_or_default();
    STANDARD
        .decode(text.as_bytes())
        .map_err(serde::de::Error::custom)
}

/// An int64 as protobuf's JSON mapping writes it (a string), or as a plain number.
fn from_int64<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Int64 {
        Number(i64),
        Text(String),
    }
    match <Option<Int64>>::deserialize(d)? {
        None => Ok(0),
        Some(Int64::Number(n)) => Ok(n),
        Some(Int64::Text(t)) => t.parse().map_err(serde::de::Error::custom),
    }
}

/// `RangeRequest`: one key, or every key in `[key, range_end)`.
#[derive(Debug, Serialize)]
pub(crate) struct RangeRequest {
    pub key: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub range_end: Option<String>,
}

/// `PutRequest`, attached to a lease where `lease` is not 0.
#[derive(Debug, Serialize)]
pub(crate) struct PutRequest {
    pub key: String,
    pub value: String,
    #[serde(skip_serializing_if = "is_zero")]
    pub lease: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// `DeleteRangeRequest` of one key.
#[derive(Debug, Serialize)]
pub(crate) struct DeleteRangeRequest {
    pub key: String,
}

/// One operation of a transaction.
#[derive(Debug, Serialize)]
pub(crate) enum RequestOp {
    #[serde(rename = "request_put")]
    Put(PutRequest),
    #[serde(rename = "request_delete_range")]
    Delete(DeleteRangeRequest),
}

/// `TxnRequest` with no comparison: its `success` operations are applied, all or none.
#[derive(Debug, Serialize)]
pub(crate) struct TxnRequest {
    pub success: Vec<RequestOp>,
}

/// `LeaseGrantRequest`: a new lease of `ttl` seconds, its id chosen by etcd.
#[derive(Debug, Serialize)]
pub(crate) struct LeaseGrantRequest {
    #[serde(rename = "TTL")]
    pub ttl: i64,
}

/// `LeaseKeepAliveRequest` and `LeaseRevokeRequest`: a lease by its id.
#[derive(Debug, Serialize)]
pub(crate) struct LeaseRequest {
    #[serde(rename = "ID")]
    pub id: i64,
}

/// `WatchRequest` carrying a `WatchCreateRequest`.
#[derive(Debug, Serialize)]
pub(crate) struct WatchRequest {
    pub create_request: WatchCreateRequest,
}

/// Watch `[key, range_end)` from `start_revision` on.
#[derive(Debug, Serialize)]
pub(crate) struct WatchCreateRequest {
    pub key: String,
    pub range_end: String,
    pub start_revision: i64,
}

/// `AuthenticateRequest`: a user's name and password.
#[derive(Serialize)]
pub(crate) struct AuthenticateRequest<'a> {
    pub name: &'a str,
    pub password: &'a str,
}

/// `AuthenticateResponse`: the token later requests carry (`Authorization`).
#[derive(Deserialize)]
pub(crate) struct AuthenticateResponse {
    #[serde(default)]
    pub token: String,
}

/// `ResponseHeader`: the store's revision when etcd answered.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Header {
    #[serde(default, deserialize_with = "from_int64")]
    pub revision: i64,
}

/// A key and its value, as a range or a watch gives them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct KeyValue {
    /// The key.
    #[serde(default, deserialize_with = "from_base64")]
    pub key: Vec<u8>,
    /// The value (empty in a delete event).
    #[serde(default, deserialize_with = "from_base64")]
    pub value: Vec<u8>,
    /// The revision of the key's last change.
    #[serde(default, alias = "modRevision", deserialize_with = "from_int64")]
    pub mod_revision: i64,
    /// The lease the key is attached to, 0 for none.
    #[serde(default, deserialize_with = "from_int64")]
    pub lease: i64,
}

/// `RangeResponse`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RangeResponse {
    #[serde(default)]
    pub header: Header,
    #[serde(default)]
    pub kvs: Vec<KeyValue>,
}

/// `LeaseGrantResponse`: the id etcd chose and the TTL it granted, or why not.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct LeaseGrantResponse {
    #[serde(default, rename = "ID", deserialize_with = "from_int64")]
    pub id: i64,
    #[serde(default, rename = "TTL", deserialize_with = "from_int64")]
    pub ttl: i64,
    #[serde(default)]
    pub error: String,
}

/// `LeaseKeepAliveResponse`: the lease's TTL now, 0 or less once it expired.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct LeaseKeepAliveResponse {
    #[serde(default, rename = "TTL", deserialize_with = "from_int64")]
    pub ttl: i64,
}

/// What a change to a watched key was.
// Exhaustive on purpose: etcd's two event types, and a watcher must handle each.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EventKind {
    /// The key was written.
    #[default]
    Put,
    /// The key was deleted (or its lease expired).
    Delete,
}

impl<'de> Deserialize<'de> for EventKind {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Code {
            Name(String),
            Number(i64),
        }
        match Code::deserialize(d)? {
            Code::Name(n) if n == "PUT" => Ok(EventKind::Put),
            Code::Name(n) if n == "DELETE" => Ok(EventKind::Delete),
            Code::Number(0) => Ok(EventKind::Put),
            Code::Number(1) => Ok(EventKind::Delete),
            Code::Name(n) => Err(serde::de::Error::custom(format!("event type {n:?}"))),
            Code::Number(n) => Err(serde::de::Error::custom(format!("event type {n}"))),
        }
    }
}

/// One change to a watched key.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Event {
    /// A put or a delete.
    #[serde(default, rename = "type")]
    pub kind: EventKind,
    /// The key, and its new value for a put.
    #[serde(default)]
    pub kv: KeyValue,
}

/// `WatchResponse`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct WatchResponse {
    #[serde(default)]
    pub created: bool,
    #[serde(default)]
    pub canceled: bool,
    #[serde(default, alias = "cancelReason")]
    pub cancel_reason: String,
    #[serde(default, alias = "compactRevision", deserialize_with = "from_int64")]
    pub compact_revision: i64,
    #[serde(default)]
    pub events: Vec<Event>,
}

/// A member of the etcd cluster.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Member {
    /// The member's name.
    #[serde(default)]
    pub name: String,
    /// The URLs its peers reach it at.
    #[serde(default, rename = "peerURLs")]
    pub peer_urls: Vec<String>,
    /// The URLs its clients reach it at.
    #[serde(default, rename = "clientURLs")]
    pub client_urls: Vec<String>,
}

/// `MemberListResponse`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct MemberListResponse {
    #[serde(default)]
    pub members: Vec<Member>,
}

/// One message of a streamed answer: a result, or the error that ended the stream.
#[derive(Debug, Deserialize)]
pub(crate) struct StreamItem<T> {
    pub result: Option<T>,
    pub error: Option<GatewayError>,
}

/// The gateway's error body (`google.rpc.Status` as JSON): for a failed call, or as the last
/// message of a stream.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct GatewayError {
    /// The gRPC status code (`grpc_code` in a streamed error of older gateways).
    #[serde(default, alias = "grpc_code")]
    pub code: i64,
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub error: String,
}

impl GatewayError {
    /// What etcd said, whichever of its two fields it filled.
    pub fn text(&self) -> &str {
        if self.message.is_empty() {
            &self.error
        } else {
            &self.message
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"/ferry/"), b"/ferry0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
        assert_eq!(prefix_end(b""), b"\0");
    }

    #[test]
    fn reads_a_range_as_etcd_writes_it() {
        let text = r#"{"header":{"cluster_id":"14841639068965178418","member_id":"10276657743932975437","revision":"7","raft_term":"2"},"kvs":[{"key":"L2ZlcnJ5L2E=","create_revision":"5","mod_revision":"7","version":"2","value":"eyJ4IjoxfQ==","lease":"7587885512311627780"}],"count":"1"}"#;
        let range: RangeResponse = serde_json::from_str(text).unwrap();
        assert_eq!(range.header.revision, 7);
        assert_eq!(range.kvs.len(), 1);
        assert_eq!(range.kvs[0].key, b"/ferry/a");
        assert_eq!(range.kvs[0].value, br#"{"x":1}"#);
        assert_eq!(range.kvs[0].mod_revision, 7);
        assert_eq!(range.kvs[0].lease, 7587885512311627780);
        // An empty range leaves `kvs` out.
        let empty: RangeResponse = serde_json::from_str(r#"{"header":{"revision":"3"}}"#).unwrap();
        assert!(empty.kvs.is_empty());
    }

    #[test]
    fn reads_watch_events_with_the_put_type_left_out() {
        let text = r#"{"header":{"revision":"9"},"events":[{"kv":{"key":"YQ==","value":"MQ==","mod_revision":"8"}},{"type":"DELETE","kv":{"key":"Yg==","mod_revision":"9"}}]}"#;
        let answer: WatchResponse = serde_json::from_str(text).unwrap();
        assert_eq!(answer.events[0].kind, EventKind::Put);
        assert_eq!(answer.events[0].kv.value, b"1");
        assert_eq!(answer.events[1].kind, EventKind::Delete);
        assert_eq!(answer.events[1].kv.key, b"b");
        assert!(serde_json::from_str::<Event>(r#"{"type":"EXPLODE"}"#).is_err());
    }

    #[test]
    fn writes_requests_in_the_gateways_names() {
        let txn = TxnRequest {
            success: vec![
                RequestOp::Put(PutRequest {
                    key: base64(b"k"),
                    value: base64(b"v"),
                    lease: 5,
                }),
                RequestOp::Delete(DeleteRangeRequest { key: base64(b"d") }),
            ],
        };
        assert_eq!(
            serde_json::to_string(&txn).unwrap(),
            r#"{"success":[{"request_put":{"key":"aw==","value":"dg==","lease":5}},{"request_delete_range":{"key":"ZA=="}}]}"#
        );
    }

    #[test]
    fn a_bad_integer_or_base64_is_an_error() {
        assert!(serde_json::from_str::<Header>(r#"{"revision":"seven"}"#).is_err());
        assert!(serde_json::from_str::<KeyValue>(r#"{"key":"***"}"#).is_err());
    }
}
