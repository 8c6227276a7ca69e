//! TLS on TCP links: the certificates, key and CA a node or client loads from PEM files, the
//! rustls configurations each side runs (mutual TLS: both ends present a certificate from the
//! same CA), and the [`Identity`] a verified certificate carries.
//!
//! Only TCP links are encrypted: a Unix socket never leaves the host, and its peer is checked by
//! the kernel (`SO_PEERCRED`) instead. The crypto is rustls with ring; no other provider is built.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::signed_record::{RecordCheck, RecordSigner};
use crate::transport::TlsLink;

/// The longest identity (a certificate's common name) accepted.
pub const MAX_IDENTITY_LEN: usize = 256;

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A certificate, key and CA go together: some were given, not all.
    #[error("a TLS certificate, its key and the CA go together: give all three or none")]
    Incomplete,
    /// A PEM file could not be read or parsed.
    #[error("{what} {}: {source}", .path.display())]
    Pem {
        /// What the file was to hold (certificate, private key, CA certificate).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    /// A PEM file that holds nothing of the kind asked for.
    #[error("{what} {}: no PEM {what} in it", .path.display())]
    Empty {
        /// What the file was to hold.
        what: &'static str,
        /// The file.
        path: PathBuf,
    },
    /// A CA certificate that cannot serve as a trust anchor.
    #[error("CA certificate {}: {source}", .path.display())]
    BadCa {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: rustls::Error,
    },
    /// The holder's own certificate does not verify against the CA it was given (expired, not
    /// yet valid, signed by another CA): nobody would accept it, so it is refused at start.
    #[error("this certificate does not verify against the CA given: {0}")]
    OwnCertificate(#[source] rustls::Error),
    /// rustls refused the configuration (a key that does not match its certificate, say).
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    /// The CA could not serve to verify certificates.
    #[error("TLS CA: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    /// The certificate names no usable identity.
    #[error("certificate identity: {0}")]
    Identity(#[from] IdentityError),
}

/// Why a certificate names no usable identity.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// Not a readable X.509 certificate.
    #[error("unreadable certificate: {0}")]
    Unreadable(#[source] x509_parser::nom::Err<x509_parser::error::X509Error>),
    /// Its extensions could not be read.
    #[error("unreadable certificate extension: {0}")]
    Extension(#[source] x509_parser::error::X509Error),
    /// No common name in its subject.
    #[error("the certificate has no common name")]
    NoCommonName,
    /// Several common names: which one is the holder would be a guess.
    #[error("the certificate has more than one common name")]
    SeveralCommonNames,
    /// A common name that is empty, too long, or not printable ASCII without spaces.
    #[error(
        "the common name must be 1 to {MAX_IDENTITY_LEN} printable ASCII characters without spaces"
    )]
    UnusableCommonName,
}

/// What a certificate's holder may act as: a node's certificate carries the server usage
/// (`serverAuth`, as a node serves), a client's does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Role {
    /// A node: it serves, and it may fetch from other nodes under capabilities granted to it.
    Node,
    /// A client (a user, an application): it connects, and never speaks for a node.
    Client,
}

/// Who a certificate says its holder is: the subject's common name, which `ferry certs` sets to
/// the node's (or client's) name, and whether it is a node's. Capabilities are bound to it. It
/// comes only from a certificate a handshake verified against the CA (with proof that the peer
/// holds its key), never from a claim on the wire: only this crate makes one.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    name: String,
    role: Role,
}

impl Identity {
    /// The identity a DER certificate names: its single, non-empty, printable common name, and
    /// its role by its extended key usage.
    pub(crate) fn of_certificate(der: &[u8]) -> Result<Self, IdentityError> {
        let (_, cert) =
            x509_parser::parse_x509_certificate(der).map_err(IdentityError::Unreadable)?;
        let mut names = cert.subject().iter_common_name();
        let name = names.next().ok_or(IdentityError::NoCommonName)?;
        if names.next().is_some() {
            return Err(IdentityError::SeveralCommonNames);
        }
        let name = name
            .as_str()
            .map_err(|_| IdentityError::UnusableCommonName)?;
        if name.is_empty()
            || name.len() > MAX_IDENTITY_LEN
            || !name.chars().all(|c| c.is_ascii_graphic())
        {
            return Err(IdentityError::UnusableCommonName);
        }
        let serves = cert
            .extended_key_usage()
            .map_err(IdentityError::Extension)?
            .is_some_and(|usage| usage.value.server_auth);
        Ok(Self {
            name: name.to_string(),
            role: if serves { Role::Node } else { Role::Client },
        })
    }

    /// The name itself.
    pub fn as_str(&self) -> &str {
        &self.name
    }

    /// What its holder may act as.
    pub fn role(&self) -> Role {
        self.role
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// Where a node's or client's TLS material lies: its certificate (chain), its private key, and
/// the CA that signs every certificate of the cluster.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The holder's certificate, PEM (leaf first, then any intermediates).
    pub cert: PathBuf,
    /// The holder's private key, PEM.
    pub key: PathBuf,
    /// The cluster's CA certificate(s), PEM: the only roots trusted.
    pub ca: PathBuf,
}

impl TlsFiles {
    /// The files a command line named, where it named all three; `None` where it named none
    /// (TCP in clear). Some but not all is an error rather than a silent fall back to clear.
    pub fn from_flags(
        cert: Option<&Path>,
        key: Option<&Path>,
        ca: Option<&Path>,
    ) -> Result<Option<Self>, TlsError> {
        match (cert, key, ca) {
            (Some(cert), Some(key), Some(ca)) => Ok(Some(Self {
                cert: cert.to_path_buf(),
                key: key.to_path_buf(),
                ca: ca.to_path_buf(),
            })),
            (None, None, None) => Ok(None),
            _ => Err(TlsError::Incomplete),
        }
    }
}

/// Loaded TLS material: the holder's chain and key, the CA roots, and the identity the
/// holder's certificate names.
struct Material {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: Arc<RootCertStore>,
    identity: Identity,
}

/// ring, offering TLS 1.3's AES-128-GCM first: tensors are bulk data, and AES-128 takes ten
/// rounds per block where AES-256 takes fourteen (on a CPU with VAES both seal about 6 GB/s per
/// core, measured with ring; without it AES-128 is the faster). AES-256-GCM and
/// ChaCha20-Poly1305 stay on offer.
pub fn provider() -> Arc<CryptoProvider> {
    use rustls::crypto::ring::cipher_suite;
    Arc::new(CryptoProvider {
        cipher_suites: vec![
            cipher_suite::TLS13_AES_128_GCM_SHA256,
            cipher_suite::TLS13_AES_256_GCM_SHA384,
            cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
        ],
        ..rustls::crypto::ring::default_provider()
    })
}

fn read_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let fail = |source| TlsError::Pem {
        what,
        path: path.to_path_buf(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(fail)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(fail)?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            what,
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

fn read_roots(path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs("CA certificate", path)? {
        roots.add(cert).map_err(|source| TlsError::BadCa {
            path: path.to_path_buf(),
            source,
        })?;
    }
    Ok(Arc::new(roots))
}

/// Between ferry peers only TLS 1.3: both ends are ferry, and 1.3 alone leaves no weaker
/// suite or renegotiation to negotiate down to.
const VERSIONS: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];

impl Material {
    fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        let chain = read_certs("certificate", &files.cert)?;
        let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|source| TlsError::Pem {
            what: "private key",
            path: files.key.clone(),
            source,
        })?;
        let identity = Identity::of_certificate(&chain[0])?;
        let roots = read_roots(&files.ca)?;
        // Verified as a peer would verify it (chain, validity period, usage): a certificate
        // nobody would accept is an error at start, not a refusal at every connection.
        let verifier =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider()).build()?;
        verifier
            .verify_client_cert(&chain[0], &chain[1..], UnixTime::now())
            .map_err(TlsError::OwnCertificate)?;
        Ok(Self {
            chain,
            key,
            roots,
            identity,
        })
    }

    /// The connecting side: the CA's roots only, and this holder's certificate when asked; and
    /// the check of the directory's sealed records against the same CA.
    fn client(&self) -> Result<ClientTls, TlsError> {
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(VERSIONS)?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())?;
        let verifier =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider()).build()?;
        Ok(ClientTls {
            connector: TlsConnector::from(Arc::new(config)),
            records: RecordCheck::new(verifier),
        })
    }
}

/// A node's TLS: it serves with its certificate and requires every TCP peer to present one the
/// CA signed (mutual TLS); it presents the same certificate to the peers it pulls from, and
/// its identity is its certificate's.
#[derive(Clone)]
pub struct NodeTls {
    acceptor: TlsAcceptor,
    connector: ClientTls,
    identity: Identity,
    signer: Arc<RecordSigner>,
}

impl fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeTls")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl NodeTls {
    /// Loads a node's certificate, key and CA.
    pub fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        let material = Material::load(files)?;
        let verifier =
            WebPkiClientVerifier::builder_with_provider(material.roots.clone(), provider())
                .build()?;
        let config = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(VERSIONS)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(material.chain.clone(), material.key.clone_key())?;
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            connector: material.client()?,
            signer: Arc::new(RecordSigner::new(material.chain.clone(), &material.key)?),
            identity: material.identity,
        })
    }

    /// How this node seals what it writes to the cluster's directory.
    pub fn record_signer(&self) -> &RecordSigner {
        &self.signer
    }

    /// Who this node is: its certificate's identity.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// How this node connects to its peers: as a client presenting its own certificate.
    pub fn client(&self) -> &ClientTls {
        &self.connector
    }

    /// Runs the server side of the handshake on an accepted socket; the peer's certificate has
    /// been verified against the CA when this returns. Anyone can open a socket and fail a
    /// handshake: the node logs failures at a bounded rate.
    pub async fn accept(&self, socket: TcpStream) -> io::Result<TlsLink> {
        let stream = self.acceptor.accept(socket).await?;
        let identity = peer_identity(stream.get_ref().1)?;
        Ok(TlsLink::new(stream.into(), identity))
    }
}

/// The connecting side's TLS: the CA it trusts and the certificate it presents (a node's, or a
/// client's made by `ferry certs`).
#[derive(Clone)]
pub struct ClientTls {
    connector: TlsConnector,
    records: RecordCheck,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls").finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Loads a client's certificate, key and CA.
    pub fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        Material::load(files)?.client()
    }

    /// How this side checks the directory's sealed records: against the same CA.
    pub fn record_check(&self) -> &RecordCheck {
        &self.records
    }

    /// The rustls connector itself (the cluster's CA, this side's certificate), for other TLS
    /// clients of the cluster's services (etcd over `https://`).
    pub fn connector(&self) -> tokio_rustls::TlsConnector {
        self.connector.clone()
    }

    /// Runs the client side of the handshake to the node at `addr` (`HOST:PORT`): the node's
    /// certificate must be signed by the CA and name `HOST` (a DNS name or an IP address).
    ///
    /// A handshake the node's certificate (or this side's) fails comes back as
    /// [`io::ErrorKind::PermissionDenied`]: no retry can change it.
    pub async fn connect(&self, socket: TcpStream, addr: &str) -> io::Result<TlsLink> {
        let name = server_name(addr)?;
        let stream = self.connector.connect(name, socket).await.map_err(|e| {
            if e.get_ref().is_some_and(|inner| inner.is::<rustls::Error>()) {
                io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("TLS handshake with {addr}: {e}"),
                )
            } else {
                e
            }
        })?;
        let identity = peer_identity(stream.get_ref().1)?;
        Ok(TlsLink::new(stream.into(), identity))
    }
}

/// The identity in the certificate a finished handshake verified.
fn peer_identity(state: &rustls::CommonState) -> io::Result<Identity> {
    let leaf = state
        .peer_certificates()
        .and_then(|chain| chain.first())
        .ok_or_else(|| io::Error::new(io::ErrorKind::PermissionDenied, "no peer certificate"))?;
    Identity::of_certificate(leaf).map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e))
}

/// The name a node's certificate must carry to be the node at `addr`: the host of `HOST:PORT`
/// (`[v6]:PORT` included), a DNS name or an IP address.
fn server_name(addr: &str) -> io::Result<ServerName<'static>> {
    let invalid = |why: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("{addr}: {why}"));
    let (host, _port) = addr
        .rsplit_once(':')
        .ok_or_else(|| invalid("expected HOST:PORT"))?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    ServerName::try_from(host.to_string()).map_err(|e| invalid(&e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_flags_are_all_three_or_none() {
        let p = Some(Path::new("x.pem"));
        assert!(TlsFiles::from_flags(None, None, None).unwrap().is_none());
        assert!(TlsFiles::from_flags(p, p, p).unwrap().is_some());
        for partial in [(p, None, None), (p, p, None), (None, None, p)] {
            assert!(matches!(
                TlsFiles::from_flags(partial.0, partial.1, partial.2),
                Err(TlsError::Incomplete)
            ));
        }
    }

    #[test]
    fn server_names_are_the_host_of_the_address() {
        assert_eq!(
            server_name("node-a.example:7070").unwrap(),
            ServerName::try_from("node-a.example").unwrap()
        );
        assert_eq!(
            server_name("127.0.0.1:7070").unwrap(),
            ServerName::try_from("127.0.0.1").unwrap()
        );
        assert_eq!(
            server_name("[::1]:7070").unwrap(),
            ServerName::try_from("::1").unwrap()
        );
        assert!(server_name("no-port").is_err());
    }
}
