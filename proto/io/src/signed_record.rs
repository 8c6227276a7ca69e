//! Directory records a node signs with its certificate's key ([`RecordSigner`]), and their check
//! against the cluster's CA ([`RecordCheck`]): under TLS a reader takes from etcd only what the
//! member a key names wrote there, whoever else can write etcd.
//!
//! A sealed record (`ferry_proto::cluster::SealedRecord`) carries its signer's certificate chain
//! and a TLS 1.3 signature over the key and the record's bytes. [`RecordCheck::open`] accepts it
//! only where the chain verifies against the CA now (validity period, usage), the leaf is a
//! node's certificate (server usage) whose name is the member the key names, and the signature
//! verifies with the leaf's key. What a valid seal cannot say: that the record is the signer's
//! latest. Someone who can write etcd can put back a record the member sealed earlier, under
//! its key; every claim a reader acts on is confirmed with the node itself (a copy's "already
//! holds" through the node's own grant, an address through the node's certificate at connect).

use std::fmt;
use std::sync::Arc;

use ferry_proto::cluster::{self as keys, MemberRecord, SealedRecord, TensorRecord};
use rustls::SignatureScheme;
use rustls::server::danger::ClientCertVerifier;
use rustls::sign::Signer;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, UnixTime};

use crate::tls::{Identity, Role, TlsError, provider};

/// The schemes a node signs with, by preference; every one is TLS 1.3's, so the CA's and the
/// reader's provider verify it as a handshake signature.
const SCHEMES: &[SignatureScheme] = &[
    SignatureScheme::ED25519,
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::RSA_PSS_SHA256,
];

/// Why a stored record was not taken as its member's.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// A plain record (or no record) where the cluster's records are sealed.
    #[error("the record is not sealed: under TLS every member signs what it writes")]
    Unsigned,
    /// A seal whose certificates or signature do not decode.
    #[error("the record's seal is malformed ({0})")]
    Malformed(&'static str),
    /// The signer's chain does not verify against the cluster's CA.
    #[error("the record's certificate does not verify against the cluster's CA: {0}")]
    Certificate(#[source] rustls::Error),
    /// The signer's certificate names no usable identity.
    #[error("the record's certificate names no usable identity: {0}")]
    Identity(#[from] crate::tls::IdentityError),
    /// Signed by a client's certificate: only nodes write the directory.
    #[error("the record is signed by {signer:?}, a client's certificate, not a node's")]
    NotANode {
        /// The signer's name.
        signer: String,
    },
    /// Signed by another node than the member the key names.
    #[error("the record under @{owner} is signed by node {signer:?}")]
    OtherSigner {
        /// The member the key names.
        owner: String,
        /// The node that signed it.
        signer: String,
    },
    /// A scheme this side does not verify.
    #[error("the record is signed with scheme {0:#06x}, which ferry does not verify")]
    Scheme(u16),
    /// The signature does not verify with the signer's key over this key and record.
    #[error("the record's signature does not verify (altered, or moved from another key)")]
    Signature,
    /// This node's key could not sign.
    #[error("signing a record: {0}")]
    Sign(#[source] rustls::Error),
    /// Sealed, the record would be larger than readers decode (64 KiB).
    #[error("the record, sealed, is larger than the 64 KiB a reader decodes")]
    TooLarge,
    /// Not a record of the kind its key holds (a key out of the layout, JSON that does not
    /// decode, a member record naming another member or node than its key).
    #[error("not a {0} record")]
    Unreadable(&'static str),
}

/// What a reader takes from the directory: under TLS only what each member sealed itself, in
/// clear what etcd says (a cluster in clear has no keys to tell writers apart).
#[derive(Debug, Clone)]
pub enum Records {
    /// Sealed records, checked against the cluster's CA; a member's name is its node id.
    Sealed(RecordCheck),
    /// Plain records (a sealed one is read without its seal checked).
    Claimed,
}

impl Records {
    /// Whether only sealed records count (a cluster under TLS).
    pub fn is_sealed(&self) -> bool {
        matches!(self, Records::Sealed(_))
    }

    /// The record of kind `kind` stored under `key`, written by `owner`: under TLS its seal
    /// checked, in clear plain or sealed alike.
    fn decode<T: serde::de::DeserializeOwned>(
        &self,
        key: &[u8],
        value: &[u8],
        owner: &str,
        kind: &'static str,
    ) -> Result<T, RecordError> {
        match self {
            Records::Sealed(check) => keys::decode_plain(check.open(key, value, owner)?),
            Records::Claimed => keys::decode(value),
        }
        .ok_or(RecordError::Unreadable(kind))
    }

    /// The member record stored under `key`, if this reader takes it: under TLS sealed by the
    /// member the key names, naming itself and that node id.
    pub fn member(&self, key: &[u8], value: &[u8]) -> Result<MemberRecord, RecordError> {
        const KIND: &str = "member";
        let name = std::str::from_utf8(key)
            .ok()
            .and_then(|k| k.strip_prefix(keys::MEMBERS))
            .filter(|name| keys::valid_member_name(name))
            .ok_or(RecordError::Unreadable(KIND))?;
        let record: MemberRecord = self.decode(key, value, name, KIND)?;
        let own_id = match self {
            Records::Sealed(_) => record.node_id.as_str() == name,
            Records::Claimed => true,
        };
        (record.name == name && own_id)
            .then_some(record)
            .ok_or(RecordError::Unreadable(KIND))
    }

    /// The directory entry stored under `key`, with its place `(member, device, tensor)`, if
    /// this reader takes it: under TLS sealed by the member the key names.
    pub fn tensor<'k>(
        &self,
        key: &'k [u8],
        value: &[u8],
    ) -> Result<(&'k str, u32, &'k str, TensorRecord), RecordError> {
        const KIND: &str = "tensor directory";
        let (member, device, tensor) = std::str::from_utf8(key)
            .ok()
            .and_then(keys::parse_tensor_key)
            .ok_or(RecordError::Unreadable(KIND))?;
        let record = self.decode(key, value, member, KIND)?;
        Ok((member, device, tensor, record))
    }
}

/// A node's seal on what it writes to the directory: its certificate chain and its key.
pub struct RecordSigner {
    chain: Vec<CertificateDer<'static>>,
    signer: Box<dyn Signer>,
}

impl fmt::Debug for RecordSigner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordSigner")
            .field("scheme", &self.signer.scheme())
            .finish_non_exhaustive()
    }
}

impl RecordSigner {
    /// The signer for `key`, whose certificate chain is `chain`; refused where the key signs
    /// with none of [`SCHEMES`].
    pub(crate) fn new(
        chain: Vec<CertificateDer<'static>>,
        key: &PrivateKeyDer<'static>,
    ) -> Result<Self, TlsError> {
        let key = provider().key_provider.load_private_key(key.clone_key())?;
        let signer = key.choose_scheme(SCHEMES).ok_or_else(|| {
            TlsError::Config(rustls::Error::General(format!(
                "the key ({:?}) signs with none of {SCHEMES:?}",
                key.algorithm()
            )))
        })?;
        Ok(Self { chain, signer })
    }

    /// `record` (a plain record's JSON, as `ferry_proto::cluster::encode` makes it) sealed for
    /// `key`: what this node stores there. The bytes signed are the bytes stored.
    pub fn seal(&self, key: &[u8], record: &[u8]) -> Result<Vec<u8>, RecordError> {
        let raw = keys::raw_record(record).ok_or(RecordError::Unreadable("plain JSON"))?;
        let signature = self
            .signer
            .sign(&keys::signed_message(key, raw.get().as_bytes()))
            .map_err(RecordError::Sign)?;
        let chain: Vec<&[u8]> = self.chain.iter().map(|c| c.as_ref()).collect();
        keys::seal(&raw, &chain, u16::from(self.signer.scheme()), &signature)
            .ok_or(RecordError::TooLarge)
    }
}

/// A reader's check of sealed records: the cluster's CA, as the TLS handshake trusts it.
#[derive(Clone)]
pub struct RecordCheck {
    verifier: Arc<dyn ClientCertVerifier>,
}

impl fmt::Debug for RecordCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordCheck").finish_non_exhaustive()
    }
}

impl RecordCheck {
    /// The check against the CA `verifier` trusts (a node's certificate serves as a client's
    /// when it pulls, so a node's chain verifies as a client's does).
    pub(crate) fn new(verifier: Arc<dyn ClientCertVerifier>) -> Self {
        Self { verifier }
    }

    /// The record stored under `key` as member `owner` sealed it: its plain JSON, once the seal
    /// verifies (see the module's description); the reason otherwise.
    pub fn open<'v>(
        &self,
        key: &[u8],
        value: &'v [u8],
        owner: &str,
    ) -> Result<&'v [u8], RecordError> {
        if value.len() > keys::MAX_RECORD {
            return Err(RecordError::TooLarge);
        }
        let sealed = SealedRecord::parse(value).ok_or(RecordError::Unsigned)?;
        let chain = sealed
            .chain()
            .ok_or(RecordError::Malformed("certificates"))?;
        let signature = sealed
            .signature()
            .ok_or(RecordError::Malformed("signature"))?;
        let chain: Vec<CertificateDer> = chain.into_iter().map(CertificateDer::from).collect();
        let (leaf, intermediates) = chain
            .split_first()
            .ok_or(RecordError::Malformed("certificates"))?;
        self.verifier
            .verify_client_cert(leaf, intermediates, UnixTime::now())
            .map_err(RecordError::Certificate)?;
        let signer = Identity::of_certificate(leaf)?;
        if signer.role() != Role::Node {
            return Err(RecordError::NotANode {
                signer: signer.as_str().to_string(),
            });
        }
        if signer.as_str() != owner {
            return Err(RecordError::OtherSigner {
                owner: owner.to_string(),
                signer: signer.as_str().to_string(),
            });
        }
        let scheme = SignatureScheme::from(sealed.scheme);
        let algorithm = provider()
            .signature_verification_algorithms
            .mapping
            .iter()
            .find(|(s, _)| *s == scheme && SCHEMES.contains(s))
            .and_then(|(_, algorithms)| algorithms.first().copied())
            .ok_or(RecordError::Scheme(sealed.scheme))?;
        // Borrowed from `value` itself (the seal is parsed in place).
        let record: &'v [u8] = sealed.record.get().as_bytes();
        webpki::EndEntityCert::try_from(leaf)
            .map_err(|_| RecordError::Malformed("certificate"))?
            .verify_signature(algorithm, &keys::signed_message(key, record), &signature)
            .map_err(|_| RecordError::Signature)?;
        Ok(record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::{ClientTls, NodeTls, TlsFiles};
    use ferry_certs::{Authority, Role as CertRole, Validity};
    use ferry_proto::NodeId;
    use rustls_pki_types::pem::PemObject;
    use std::path::Path;
    use std::time::{Duration, SystemTime};

    /// One CA's material in a directory: issue certificates, load them as a node or a client.
    struct Pki {
        ca: Authority,
        dir: tempfile::TempDir,
    }

    impl Pki {
        fn new(name: &str) -> Pki {
            let pki = Pki {
                ca: Authority::create(name, Validity::days(1)).unwrap(),
                dir: tempfile::tempdir().unwrap(),
            };
            std::fs::write(pki.path("ca.pem"), pki.ca.cert_pem()).unwrap();
            pki
        }

        fn path(&self, file: &str) -> std::path::PathBuf {
            self.dir.path().join(file)
        }

        fn issue(&self, name: &str, role: CertRole, validity: Validity) -> TlsFiles {
            let issued = self.ca.issue(name, &role, validity).unwrap();
            std::fs::write(self.path(&format!("{name}.pem")), issued.cert_pem).unwrap();
            std::fs::write(self.path(&format!("{name}.key")), issued.key_pem).unwrap();
            TlsFiles {
                cert: self.path(&format!("{name}.pem")),
                key: self.path(&format!("{name}.key")),
                ca: self.path("ca.pem"),
            }
        }

        fn node(&self, name: &str) -> NodeTls {
            let role = CertRole::Node {
                hosts: vec!["127.0.0.1".into()],
            };
            NodeTls::load(&self.issue(name, role, Validity::days(1))).unwrap()
        }

        fn check(&self) -> RecordCheck {
            let files = self.issue("reader", CertRole::Client, Validity::days(1));
            ClientTls::load(&files).unwrap().record_check().clone()
        }
    }

    /// A signer from certificate and key files as they are, bypassing `NodeTls`'s own checks
    /// (a client's certificate, an expired one).
    fn signer_of(files: &TlsFiles) -> RecordSigner {
        let chain = CertificateDer::pem_file_iter(Path::new(&files.cert))
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_file(&files.key).unwrap();
        RecordSigner::new(chain, &key).unwrap()
    }

    fn member(name: &str) -> MemberRecord {
        MemberRecord {
            name: name.into(),
            node_id: NodeId::new(name),
            tcp: "127.0.0.1:7070".into(),
            unix: None,
            host: "here".into(),
            devices: vec![],
        }
    }

    fn sealed_member(signer: &RecordSigner, name: &str, record: &MemberRecord) -> Vec<u8> {
        let key = keys::member_key(name);
        signer.seal(key.as_bytes(), &keys::encode(record)).unwrap()
    }

    #[test]
    fn a_record_sealed_by_its_member_opens_and_nothing_else_does() {
        let pki = Pki::new("cluster-ca");
        let a = pki.node("a");
        let records = Records::Sealed(pki.check());
        let key_a = keys::member_key("a");

        // The member's own seal: taken, byte for byte.
        let value = sealed_member(a.record_signer(), "a", &member("a"));
        assert_eq!(
            records.member(key_a.as_bytes(), &value).unwrap(),
            member("a")
        );
        assert_eq!(
            pki.check().open(key_a.as_bytes(), &value, "a").unwrap(),
            &keys::encode(&member("a"))[..]
        );

        // Plain: refused where records are sealed, taken in clear.
        let plain = keys::encode(&member("a"));
        assert!(matches!(
            records.member(key_a.as_bytes(), &plain),
            Err(RecordError::Unsigned)
        ));
        assert_eq!(
            Records::Claimed.member(key_a.as_bytes(), &plain).unwrap(),
            member("a")
        );

        // Another node of the same CA, writing a's record (pointing @a at itself).
        let old = pki.node("old");
        let mut hijack = member("a");
        hijack.tcp = "10.9.9.9:7070".into();
        let forged = sealed_member(old.record_signer(), "a", &hijack);
        assert!(matches!(
            records.member(key_a.as_bytes(), &forged),
            Err(RecordError::OtherSigner { owner, signer }) if owner == "a" && signer == "old"
        ));

        // a's own seal, moved under b's key, or under another key of a's.
        let key_b = keys::member_key("b");
        assert!(matches!(
            records.member(key_b.as_bytes(), &value),
            Err(RecordError::OtherSigner { .. })
        ));
        let mut moved = key_a.clone();
        moved.push('x');
        assert!(matches!(
            pki.check().open(moved.as_bytes(), &value, "a"),
            Err(RecordError::Signature)
        ));

        // a's seal with the record's bytes altered (the address changed, the signature kept).
        let altered = String::from_utf8(value.clone())
            .unwrap()
            .replace("127.0.0.1:7070", "127.0.0.1:7071");
        assert!(matches!(
            records.member(key_a.as_bytes(), altered.as_bytes()),
            Err(RecordError::Signature)
        ));

        // A record a sealed naming another node id under its own name: not a's own record.
        let mut other_id = member("a");
        other_id.node_id = NodeId::new("b");
        let value = sealed_member(a.record_signer(), "a", &other_id);
        assert!(matches!(
            records.member(key_a.as_bytes(), &value),
            Err(RecordError::Unreadable(_))
        ));
    }

    #[test]
    fn a_seal_needs_a_node_certificate_of_this_ca_valid_now_and_a_known_scheme() {
        let pki = Pki::new("cluster-ca");
        let records = Records::Sealed(pki.check());
        let key = keys::member_key("a");
        let refused = |value: &[u8]| records.member(key.as_bytes(), value).unwrap_err();

        // Another CA's node named a.
        let stranger = Pki::new("other-ca").node("a");
        let value = sealed_member(stranger.record_signer(), "a", &member("a"));
        assert!(matches!(refused(&value), RecordError::Certificate(_)));

        // A client certificate of this CA named a.
        let client = signer_of(&pki.issue("a", CertRole::Client, Validity::days(1)));
        let value = sealed_member(&client, "a", &member("a"));
        assert!(matches!(refused(&value), RecordError::NotANode { signer } if signer == "a"));

        // A node certificate of this CA named a, expired.
        let now = SystemTime::now();
        let expired = Validity {
            not_before: now - Duration::from_secs(7200),
            not_after: now - Duration::from_secs(3600),
        };
        let role = CertRole::Node {
            hosts: vec!["127.0.0.1".into()],
        };
        let expired = signer_of(&pki.issue("a", role, expired));
        let value = sealed_member(&expired, "a", &member("a"));
        assert!(matches!(refused(&value), RecordError::Certificate(_)));

        // A's own seal, with its fields broken one at a time.
        let a = pki.node("a");
        let good = String::from_utf8(sealed_member(a.record_signer(), "a", &member("a"))).unwrap();
        let sealed = SealedRecord::parse(good.as_bytes()).unwrap();
        let (scheme, signature) = (sealed.scheme, sealed.signature.clone());
        let certificate = sealed.certificates[0].clone();
        let other_scheme = good.replace(
            &format!("\"scheme\":{scheme}"),
            &format!(
                "\"scheme\":{}",
                u16::from(SignatureScheme::RSA_PKCS1_SHA256)
            ),
        );
        assert!(matches!(
            refused(other_scheme.as_bytes()),
            RecordError::Scheme(_)
        ));
        let bad_signature = good.replace(&signature, "!!");
        assert!(matches!(
            refused(bad_signature.as_bytes()),
            RecordError::Malformed("signature")
        ));
        let no_chain = good.replace(&format!("\"{certificate}\""), "");
        assert!(matches!(
            refused(no_chain.as_bytes()),
            RecordError::Malformed("certificates")
        ));
        assert_eq!(
            records.member(key.as_bytes(), good.as_bytes()).unwrap(),
            member("a")
        );
    }

    #[test]
    fn a_tensor_entry_is_its_members_only() {
        let pki = Pki::new("cluster-ca");
        let (a, b) = (pki.node("a"), pki.node("b"));
        let records = Records::Sealed(pki.check());
        let entry = TensorRecord {
            dtype: "f32".into(),
            shape: vec![2],
            bytes: 8,
            content_hash: None,
        };
        let key = keys::tensor_key("a", 0, "w");
        let by_a = a
            .record_signer()
            .seal(key.as_bytes(), &keys::encode(&entry))
            .unwrap();
        let (member, device, name, record) = records.tensor(key.as_bytes(), &by_a).unwrap();
        assert_eq!((member, device, name, record), ("a", 0, "w", entry.clone()));
        let by_b = b
            .record_signer()
            .seal(key.as_bytes(), &keys::encode(&entry))
            .unwrap();
        assert!(matches!(
            records.tensor(key.as_bytes(), &by_b),
            Err(RecordError::OtherSigner { .. })
        ));
        // a's entry for w, replayed as an entry for another tensor of a's.
        let other = keys::tensor_key("a", 0, "v");
        assert!(matches!(
            records.tensor(other.as_bytes(), &by_a),
            Err(RecordError::Signature)
        ));
    }
}
