//! The cluster's records in its coordination service (etcd): the key layout and what each key
//! holds, shared by the nodes that write them and the clients that read them.
//!
//! Every key lives under [`PREFIX`]. A node writes, under one lease of its own:
//! - `/ferry/members/NAME`: its [`MemberRecord`] (how to reach it, its devices);
//! - `/ferry/tensors/NAME/DEVICE/TENSOR`: a [`TensorRecord`] per tensor it holds.
//!
//! A node that dies stops renewing its lease, and etcd deletes every key under it. Values are
//! JSON, so that `etcdctl get --prefix /ferry/` is readable. Everything read back is untrusted
//! (another writer may share the etcd): keys are parsed and values decoded with bounds, and
//! what does not parse is skipped by readers.
//!
//! A node under TLS writes each record sealed ([`SealedRecord`]): the record, its certificate
//! chain and its signature over the key and the record's bytes ([`signed_message`]), so that a
//! reader holding the cluster's CA takes from etcd only what the member named by the key wrote
//! (`ferry_io::signed_record` signs and checks). A cluster in clear has no keys to sign with:
//! its records are plain, and its readers take what etcd says.

use serde::{Deserialize, Serialize};

/// The prefix of every key ferry writes.
pub const PREFIX: &str = "/ferry/";

/// The prefix of the member records.
pub const MEMBERS: &str = "/ferry/members/";

/// The prefix of the tensor directory.
pub const TENSORS: &str = "/ferry/tensors/";

/// The longest member name: a DNS label's length.
pub const MAX_NAME: usize = 63;

/// The largest record a reader decodes.
pub const MAX_RECORD: usize = 64 * 1024;

/// Whether `name` can name a member: 1 to [`MAX_NAME`] ASCII letters, digits, `-`, `_` or `.`,
/// not starting with `.` (so that it is one key segment and reads the same everywhere).
pub fn valid_member_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// etcd's client endpoints from `etcd://HOST:PORT[,HOST:PORT...]`, as `http://HOST:PORT`, or
/// from `etcds://...` (etcd over TLS), as `https://HOST:PORT`.
pub fn endpoints(cluster: &str) -> Result<Vec<String>, String> {
    // `etcds://`: etcd over TLS, reached with the caller's certificate.
    let (scheme, hosts) = match cluster.strip_prefix("etcds://") {
        Some(hosts) => ("https", hosts),
        None => (
            "http",
            cluster
                .strip_prefix("etcd://")
                .ok_or("expected etcd://HOST:PORT[,HOST:PORT...] (or etcds:// for TLS)")?,
        ),
    };
    let endpoints: Vec<String> = hosts
        .split(',')
        .map(|host| {
            let ok = !host.is_empty()
                && host.len() <= 255
                && host
                    .rsplit_once(':')
                    .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p != 0))
                && !host.contains(['/', '@', '?', '#', ' ']);
            ok.then(|| format!("{scheme}://{host}"))
                .ok_or_else(|| format!("{host:?} is not HOST:PORT"))
        })
        .collect::<Result<_, _>>()?;
    if endpoints.len() > 16 {
        return Err("at most 16 etcd endpoints".into());
    }
    Ok(endpoints)
}

/// The key of member `name`'s record.
pub fn member_key(name: &str) -> String {
    format!("{MEMBERS}{name}")
}

/// The key of a tensor's directory entry.
pub fn tensor_key(member: &str, device: u32, tensor: &str) -> String {
    format!("{TENSORS}{member}/{device}/{tensor}")
}

/// The prefix of member `name`'s directory entries.
pub fn member_tensors(name: &str) -> String {
    format!("{TENSORS}{name}/")
}

/// How a member is reached, and what it hosts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// Its cluster name (`@NAME`).
    pub name: String,
    /// Its node id (under TLS, its certificate's identity).
    pub node_id: crate::NodeId,
    /// The TCP address it advertises, `host:port`.
    pub tcp: String,
    /// Its Unix socket, `unix:PATH`, where it has one (for clients on its host).
    pub unix: Option<String>,
    /// The name of the machine it runs on (`uname -n`): members that share it share a host, and
    /// a copy prefers a source there. Empty where unknown.
    #[serde(default)]
    pub host: String,
    /// Its devices.
    pub devices: Vec<MemberDevice>,
}

/// One device of a member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberDevice {
    /// Its index on the node.
    pub index: u32,
    /// Its backend (`flex`, `ndarray`, `wgpu`).
    pub backend: String,
    /// Its Burn device, readable.
    pub device: String,
    /// Probes it ran at start, and how many came back bit-exact (PROTOCOL.md §5.5).
    pub holds: (u32, u32),
}

/// A tensor a member holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRecord {
    /// Its dtype, as `dtype_name` writes it.
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Its payload length in bytes.
    pub bytes: u64,
    /// Its content hash, once the node has computed it from the bytes it holds (never one only
    /// stated by another node).
    pub content_hash: Option<crate::ContentHash>,
}

/// A directory entry's place, parsed from its key: `(member, device, tensor)`.
pub fn parse_tensor_key(key: &str) -> Option<(&str, u32, &str)> {
    let rest = key.strip_prefix(TENSORS)?;
    let (member, rest) = rest.split_once('/')?;
    let (device, tensor) = rest.split_once('/')?;
    let device = device.parse().ok()?;
    (valid_member_name(member) && !tensor.is_empty()).then_some((member, device, tensor))
}

/// A member record read back from etcd under `key`: `None` unless the key is a member's, the
/// value decodes, and the record names the member its key does.
pub fn member_of(key: &[u8], value: &[u8]) -> Option<MemberRecord> {
    let name = std::str::from_utf8(key).ok()?.strip_prefix(MEMBERS)?;
    let record: MemberRecord = decode(value)?;
    (record.name == name && valid_member_name(name)).then_some(record)
}

/// Decodes a record read back from etcd, plain or sealed, without checking a seal (what a
/// reader in clear, or a log line, takes); `None` for one that is too large or does not parse.
pub fn decode<T: for<'de> Deserialize<'de>>(value: &[u8]) -> Option<T> {
    match SealedRecord::parse(value) {
        Some(sealed) => decode_plain(sealed.record.get().as_bytes()),
        None => decode_plain(value),
    }
}

/// Decodes a plain record (or a sealed record's inner one, once its seal was checked).
pub fn decode_plain<T: for<'de> Deserialize<'de>>(value: &[u8]) -> Option<T> {
    (value.len() <= MAX_RECORD)
        .then(|| serde_json::from_slice(value).ok())
        .flatten()
}

/// The most certificates a sealed record's chain carries (the leaf and its intermediates).
pub const MAX_CHAIN: usize = 4;

/// A record as a node under TLS writes it: the record's own JSON, kept byte for byte (what the
/// signature covers), the node's certificate chain and its signature over [`signed_message`].
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SealedRecord<'a> {
    /// The record, exactly as signed.
    #[serde(borrow)]
    pub record: &'a serde_json::value::RawValue,
    /// The signer's certificate chain, leaf first, each DER in standard base64.
    pub certificates: Vec<String>,
    /// The TLS 1.3 signature scheme of the signature (its IANA code point).
    pub scheme: u16,
    /// The signature, standard base64.
    pub signature: String,
}

impl<'a> SealedRecord<'a> {
    /// The sealed record `value` holds; `None` for a plain record, or anything too large or
    /// malformed to be a seal.
    pub fn parse(value: &'a [u8]) -> Option<SealedRecord<'a>> {
        let sealed: SealedRecord = (value.len() <= MAX_RECORD)
            .then(|| serde_json::from_slice(value).ok())
            .flatten()?;
        (sealed.certificates.len() <= MAX_CHAIN).then_some(sealed)
    }

    /// The chain's certificates, DER; `None` where one is not base64 or the chain is empty.
    pub fn chain(&self) -> Option<Vec<Vec<u8>>> {
        use base64::Engine as _;
        let chain: Vec<Vec<u8>> = self
            .certificates
            .iter()
            .map(|c| base64::engine::general_purpose::STANDARD.decode(c).ok())
            .collect::<Option<_>>()?;
        (!chain.is_empty()).then_some(chain)
    }

    /// The signature's bytes; `None` where it is not base64.
    pub fn signature(&self) -> Option<Vec<u8>> {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD
            .decode(&self.signature)
            .ok()
    }
}

/// A plain record's JSON (as [`encode`] makes it) as a sealed record keeps it: the bytes a seal
/// signs are these, so that what is stored is what was signed. `None` for bytes that are not
/// JSON, or JSON with whitespace around it (which the seal would not keep).
pub fn raw_record(record: &[u8]) -> Option<Box<serde_json::value::RawValue>> {
    let text = std::str::from_utf8(record).ok()?;
    let raw = serde_json::value::RawValue::from_string(text.to_string()).ok()?;
    (raw.get().as_bytes() == record).then_some(raw)
}

/// Seals `record` (from [`raw_record`], signed over [`signed_message`]): the stored value;
/// `None` where it would be larger than a reader decodes ([`MAX_RECORD`]).
pub fn seal(
    record: &serde_json::value::RawValue,
    chain: &[&[u8]],
    scheme: u16,
    signature: &[u8],
) -> Option<Vec<u8>> {
    use base64::Engine as _;
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
    #[derive(Serialize)]
    struct Owned<'r> {
        record: &'r serde_json::value::RawValue,
        certificates: Vec<String>,
        scheme: u16,
        signature: String,
    }
    // As `encode`: a plain struct always serializes.
    let sealed = serde_json::to_vec(&Owned {
        record,
        certificates: chain.iter().map(|c| b64(c)).collect(),
        scheme,
        signature: b64(signature),
    })
    .unwrap_or_default();
    (sealed.len() <= MAX_RECORD).then_some(sealed)
}

/// What a sealed record's signature covers: a context of its own (no other signature a node
/// makes, a TLS handshake's included, can be taken for one), the key it is stored under (a
/// record moved to another key no longer verifies) and the record's bytes.
pub fn signed_message(key: &[u8], record: &[u8]) -> Vec<u8> {
    const CONTEXT: &[u8] = b"ferry directory record, v1\0";
    let mut message = Vec::with_capacity(CONTEXT.len() + 8 + key.len() + record.len());
    message.extend_from_slice(CONTEXT);
    message.extend_from_slice(&(key.len() as u64).to_be_bytes());
    message.extend_from_slice(key);
    message.extend_from_slice(record);
    message
}

/// Encodes a record for etcd.
pub fn encode<T: Serialize>(record: &T) -> Vec<u8> {
    // Serializing these plain structs to JSON cannot fail (no maps with non-string keys).
    serde_json::to_vec(record).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_names_are_checked() {
        let key = tensor_key("worker-3", 1, "encoder/layer.0.w");
        assert_eq!(
            parse_tensor_key(&key),
            Some(("worker-3", 1, "encoder/layer.0.w"))
        );
        assert_eq!(parse_tensor_key("/ferry/tensors/a/x/t"), None);
        assert_eq!(parse_tensor_key("/ferry/tensors/a/0/"), None);
        assert_eq!(parse_tensor_key("/other/a/0/t"), None);
        for good in ["a", "worker-3", "cache_1.eu"] {
            assert!(valid_member_name(good), "{good}");
        }
        for bad in ["", ".hidden", "a/b", "a b", &"x".repeat(64)] {
            assert!(!valid_member_name(bad), "{bad}");
        }
        let record = TensorRecord {
            dtype: "f32".into(),
            shape: vec![2, 3],
            bytes: 24,
            content_hash: None,
        };
        assert_eq!(
            decode::<TensorRecord>(&encode(&record)),
            Some(record.clone())
        );
        assert_eq!(decode::<TensorRecord>(b"{"), None);
        // Sealed: the inner record kept byte for byte, the chain and signature round-trip.
        let plain = encode(&record);
        let raw = raw_record(&plain).unwrap();
        assert!(raw_record(b" {}").is_none() && raw_record(b"{").is_none());
        let sealed = seal(&raw, &[b"leaf", b"ca"], 0x0403, b"sig").unwrap();
        let parsed = SealedRecord::parse(&sealed).unwrap();
        assert_eq!(parsed.record.get().as_bytes(), &plain[..]);
        assert_eq!(
            parsed.chain().unwrap(),
            vec![b"leaf".to_vec(), b"ca".to_vec()]
        );
        assert_eq!(parsed.signature().unwrap(), b"sig");
        assert_eq!(parsed.scheme, 0x0403);
        assert_eq!(decode::<TensorRecord>(&sealed), Some(record));
        assert!(SealedRecord::parse(&plain).is_none());
        let too_long = seal(&raw, &[&b"a"[..]; MAX_CHAIN + 1], 0x0403, b"sig").unwrap();
        assert!(seal(&raw, &[&[0u8; MAX_RECORD][..]], 0x0403, b"sig").is_none());
        assert!(SealedRecord::parse(&too_long).is_none());
        assert_ne!(signed_message(b"/k", b"{}"), signed_message(b"/k{", b"}"));
        assert_eq!(
            endpoints("etcd://127.0.0.1:2379,etcd-2:2379"),
            Ok(vec![
                "http://127.0.0.1:2379".to_string(),
                "http://etcd-2:2379".to_string()
            ])
        );
        for bad in [
            "127.0.0.1:2379",
            "etcd://",
            "etcd://h",
            "etcd://h:0",
            "etcd://u@h:1",
        ] {
            assert!(endpoints(bad).is_err(), "{bad}");
        }
    }
}
