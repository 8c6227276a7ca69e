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
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::refusal_log::RefusalLog;
use crate::transport::TlsLink;

/// The longest identity (a certificate's common name) accepted.
pub const MAX_IDENTITY_LEN: usize = 256;

/// Why TLS could not be set up, or a certificate names no usable identity.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing of the kind asked for.
    #[error("{what} {}: {reason}", .path.display())]
    File {
        /// What the file was to hold (certificate, private key, CA).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it failed.
        reason: String,
    },
    /// rustls refused the configuration (a key that does not match its certificate, say).
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    /// The CA could not serve to verify certificates.
    #[error("TLS CA: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    /// A certificate carries no common name to serve as identity, or one that is not usable.
    #[error("certificate identity: {0}")]
    Identity(String),
}

/// Who a certificate says its holder is: the subject's common name, which `ferry certs` sets to
/// the node's (or client's) name. Capabilities are bound to it; it comes only from a certificate
/// the CA signed and the peer proved it holds the key of, never from a claim on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity(String);

impl Identity {
    /// The identity a DER certificate names: its single, non-empty, printable common name.
    pub fn of_certificate(der: &[u8]) -> Result<Self, TlsError> {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| TlsError::Identity(format!("unreadable certificate: {e}")))?;
        let mut names = cert.subject().iter_common_name();
        let name = names
            .next()
            .ok_or_else(|| TlsError::Identity("the certificate has no common name".into()))?;
        if names.next().is_some() {
            return Err(TlsError::Identity(
                "the certificate has more than one common name".into(),
            ));
        }
        let name = name
            .as_str()
            .map_err(|e| TlsError::Identity(format!("common name is not a string: {e}")))?;
        if name.is_empty()
            || name.len() > MAX_IDENTITY_LEN
            || !name.chars().all(|c| c.is_ascii_graphic())
        {
            return Err(TlsError::Identity(format!(
                "common name must be 1 to {MAX_IDENTITY_LEN} printable ASCII characters without spaces"
            )));
        }
        Ok(Self(name.to_string()))
    }

    /// The name itself.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
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

/// Loaded TLS material: the holder's chain and key, the CA roots, and the identity the
/// holder's certificate names.
struct Material {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: Arc<RootCertStore>,
    identity: Identity,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let fail = |reason: String| TlsError::File {
        what,
        path: path.to_path_buf(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| fail(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| fail(e.to_string()))?;
    if certs.is_empty() {
        return Err(fail("no PEM certificate in it".into()));
    }
    Ok(certs)
}

fn read_roots(path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs("CA certificate", path)? {
        roots.add(cert).map_err(|e| TlsError::File {
            what: "CA certificate",
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    }
    Ok(Arc::new(roots))
}

impl Material {
    fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        let chain = read_certs("certificate", &files.cert)?;
        let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| TlsError::File {
            what: "private key",
            path: files.key.clone(),
            reason: e.to_string(),
        })?;
        let identity = Identity::of_certificate(&chain[0])?;
        Ok(Self {
            chain,
            key,
            roots: read_roots(&files.ca)?,
            identity,
        })
    }

    /// The connecting side: the CA's roots only, and this holder's certificate when asked.
    fn connector(&self) -> Result<TlsConnector, TlsError> {
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())?;
        Ok(TlsConnector::from(Arc::new(config)))
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
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(material.chain.clone(), material.key.clone_key())?;
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            connector: ClientTls {
                connector: material.connector()?,
            },
            identity: material.identity,
        })
    }

    /// Who this node is: its certificate's identity.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// How this node connects to its peers: as a client presenting its own certificate.
    pub fn client(&self) -> &ClientTls {
        &self.connector
    }

    /// Runs the server side of the handshake on a socket accepted from `peer` (as logs name
    /// it); the peer's certificate has been verified against the CA when this returns. Failures
    /// are logged at a bounded rate: anyone can open a socket and fail a handshake.
    pub async fn accept(&self, socket: TcpStream, peer: &str) -> io::Result<TlsLink> {
        let accepted = async {
            let stream = self.acceptor.accept(socket).await?;
            let identity = peer_identity(stream.get_ref().1)?;
            Ok::<_, io::Error>(TlsLink {
                stream: stream.into(),
                peer: identity,
            })
        }
        .await;
        if let Err(error) = &accepted {
            TLS_REFUSALS.note(peer, &error.to_string());
        }
        accepted
    }
}

/// The connecting side's TLS: the CA it trusts and the certificate it presents (a node's, or a
/// client's made by `ferry certs`).
#[derive(Clone)]
pub struct ClientTls {
    connector: TlsConnector,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls").finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Loads a client's certificate, key and CA.
    pub fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        Ok(Self {
            connector: Material::load(files)?.connector()?,
        })
    }

    /// Runs the client side of the handshake to the node at `addr` (`HOST:PORT`): the node's
    /// certificate must be signed by the CA and name `HOST` (a DNS name or an IP address).
    pub async fn connect(&self, socket: TcpStream, addr: &str) -> io::Result<TlsLink> {
        let name = server_name(addr)?;
        let stream = self.connector.connect(name, socket).await?;
        let identity = peer_identity(stream.get_ref().1)?;
        Ok(TlsLink {
            stream: stream.into(),
            peer: identity,
        })
    }
}

/// Failed TLS handshakes, logged at a bounded rate.
static TLS_REFUSALS: RefusalLog = RefusalLog::new("TLS handshake");

/// The identity in the certificate a finished handshake verified.
fn peer_identity(state: &rustls::CommonState) -> io::Result<Identity> {
    let leaf = state
        .peer_certificates()
        .and_then(|chain| chain.first())
        .ok_or_else(|| io::Error::new(io::ErrorKind::PermissionDenied, "no peer certificate"))?;
    Identity::of_certificate(leaf)
        .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e.to_string()))
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
