//! A small certificate authority for a first ferry cluster: a CA, and node and client
//! certificates signed by it (rcgen, ECDSA P-256), as `ferry certs` writes them and the tests
//! make them.
//!
//! A certificate's common name is its holder's identity (what a node's capabilities are bound
//! to); a node's certificate also names the hosts it is reached at, which a connecting client
//! checks against the address it dialled. A production cluster may bring its own PKI instead:
//! ferry only needs a CA file, and certificates whose common name is the holder's name.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use time::OffsetDateTime;

/// The longest holder name accepted (as the node accepts identities).
pub const MAX_NAME_LEN: usize = 256;

/// The CA's file names in a certificate directory.
pub const CA_CERT: &str = "ca.pem";
/// The CA's private key file in a certificate directory.
pub const CA_KEY: &str = "ca.key";

/// Why a certificate could not be made or stored.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CertsError {
    /// rcgen refused (an unusable host name, say).
    #[error("certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
    /// A holder name that cannot serve as an identity and a file name.
    #[error(
        "{0:?}: a name is 1 to {MAX_NAME_LEN} letters, digits, '.', '_' or '-', not starting \
         with '.', and not \"ca\""
    )]
    InvalidName(String),
    /// A file could not be read or written.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A certificate or key file is there already: nothing is overwritten.
    #[error("{} exists already; remove it to make a new one", .0.display())]
    Exists(PathBuf),
}

/// When a certificate is valid.
#[derive(Debug, Clone, Copy)]
pub struct Validity {
    /// Not before.
    pub not_before: SystemTime,
    /// Not after.
    pub not_after: SystemTime,
}

impl Validity {
    /// From an hour ago (some slack for clocks a little apart) for `days` days.
    pub fn days(days: u32) -> Self {
        let now = SystemTime::now();
        Self {
            not_before: now - Duration::from_secs(3600),
            not_after: now + Duration::from_secs(u64::from(days) * 86_400),
        }
    }

    fn apply(&self, params: &mut CertificateParams) {
        params.not_before = OffsetDateTime::from(self.not_before);
        params.not_after = OffsetDateTime::from(self.not_after);
    }
}

/// What a certificate is for.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Role {
    /// A node: it serves (and must be reachable at one of `hosts`, DNS names or IP addresses)
    /// and connects to its peers as a client.
    Node {
        /// The names and addresses clients and peers dial it at.
        hosts: Vec<String>,
    },
    /// A client (a user's CLI, an application): it only connects.
    Client,
}

/// A PEM certificate and its PEM private key.
#[derive(Clone)]
pub struct Issued {
    /// The certificate.
    pub cert_pem: String,
    /// Its private key (keep it 0600).
    pub key_pem: String,
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issued")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// A CA that signs a cluster's certificates.
pub struct Authority {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority")
            .field("cert_pem", &self.cert_pem)
            .finish_non_exhaustive()
    }
}

/// A name is both the holder's identity and the stem of its files in a [`CertDir`]: letters,
/// digits, `.`, `_` and `-` only (no path separator, no `..` escaping the directory, nothing a
/// DNS name or a log line would choke on), not hidden, and not the CA's own.
fn check_name(name: &str) -> Result<(), CertsError> {
    let usable = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && !name.starts_with('.')
        && name != "ca"
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if !usable {
        return Err(CertsError::InvalidName(name.to_string()));
    }
    Ok(())
}

fn named(common_name: &str) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common_name);
    name
}

impl Authority {
    /// A new CA named `name`.
    pub fn create(name: &str, validity: Validity) -> Result<Self, CertsError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = named(name);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        validity.apply(&mut params);
        let cert = params.self_signed(&key)?;
        Ok(Self {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// A CA from its PEM certificate and key.
    pub fn load(cert_pem: &str, key_pem: &str) -> Result<Self, CertsError> {
        let key = KeyPair::from_pem(key_pem)?;
        Ok(Self {
            issuer: Issuer::from_ca_cert_pem(cert_pem, key)?,
            cert_pem: cert_pem.to_string(),
        })
    }

    /// The CA's certificate, PEM: what every node and client is given as `--tls-ca`.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA's private key, PEM.
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// A certificate for `name` in `role`, signed by this CA.
    pub fn issue(&self, name: &str, role: &Role, validity: Validity) -> Result<Issued, CertsError> {
        check_name(name)?;
        let key = KeyPair::generate()?;
        let mut params = match role {
            Role::Node { hosts } => {
                let mut names = vec![name.to_string()];
                names.extend(hosts.iter().filter(|h| *h != name).cloned());
                let mut params = CertificateParams::new(names)?;
                params.extended_key_usages = vec![
                    ExtendedKeyUsagePurpose::ServerAuth,
                    ExtendedKeyUsagePurpose::ClientAuth,
                ];
                params
            }
            Role::Client => {
                let mut params = CertificateParams::default();
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
                params
            }
        };
        params.distinguished_name = named(name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        validity.apply(&mut params);
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// A directory of certificates as `ferry certs` keeps it: `ca.pem` and `ca.key`, and
/// `NAME.pem` and `NAME.key` for each holder. Keys are written 0600; nothing is overwritten.
#[derive(Debug, Clone)]
pub struct CertDir {
    dir: PathBuf,
}

impl CertDir {
    /// The directory at `dir` (made if missing, 0700).
    pub fn open(dir: &Path) -> Result<Self, CertsError> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| CertsError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    /// A file in it.
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// The holder's certificate file.
    pub fn cert(&self, name: &str) -> PathBuf {
        self.path(&format!("{name}.pem"))
    }

    /// The holder's key file.
    pub fn key(&self, name: &str) -> PathBuf {
        self.path(&format!("{name}.key"))
    }

    /// The CA kept here, made (valid for `validity`) when there is none yet; `true` if new.
    pub fn authority(&self, validity: Validity) -> Result<(Authority, bool), CertsError> {
        let (cert, key) = (self.path(CA_CERT), self.path(CA_KEY));
        if cert.exists() || key.exists() {
            let read = |path: &Path| {
                std::fs::read_to_string(path).map_err(|source| CertsError::Io {
                    path: path.to_path_buf(),
                    source,
                })
            };
            return Ok((Authority::load(&read(&cert)?, &read(&key)?)?, false));
        }
        // Named apart from every other CA `ferry certs` makes (its creation time, to the
        // nanosecond), so that a certificate of another cluster's CA is told by its issuer's
        // name, not only by a failed signature.
        let made = OffsetDateTime::now_utc().unix_timestamp_nanos();
        let authority = Authority::create(&format!("ferry CA {made}"), validity)?;
        write_new(&key, &authority.key_pem(), 0o600)?;
        write_new(&cert, authority.cert_pem(), 0o644)?;
        Ok((authority, true))
    }

    /// Issues a certificate for `name` and writes `NAME.pem` and `NAME.key`.
    pub fn issue(
        &self,
        authority: &Authority,
        name: &str,
        role: &Role,
        validity: Validity,
    ) -> Result<(), CertsError> {
        check_name(name)?;
        let (cert, key) = (self.cert(name), self.key(name));
        for path in [&cert, &key] {
            if path.exists() {
                return Err(CertsError::Exists(path.clone()));
            }
        }
        let issued = authority.issue(name, role, validity)?;
        write_new(&key, &issued.key_pem, 0o600)?;
        write_new(&cert, &issued.cert_pem, 0o644)?;
        Ok(())
    }
}

/// Writes a file that must not exist yet, with `mode` from the start (a key is never readable
/// by others, not even for a moment).
fn write_new(path: &Path, contents: &str, mode: u32) -> Result<(), CertsError> {
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| CertsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                CertsError::Exists(path.to_path_buf())
            } else {
                io(e)
            }
        })?;
    file.write_all(contents.as_bytes()).map_err(io)?;
    file.sync_all().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_keeps_its_ca_and_refuses_to_overwrite() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let certs = CertDir::open(dir.path()).unwrap();
        let (ca, new) = certs.authority(Validity::days(10)).unwrap();
        assert!(new);
        let node = Role::Node {
            hosts: vec!["127.0.0.1".into()],
        };
        certs
            .issue(&ca, "node-a", &node, Validity::days(1))
            .unwrap();
        let mode = std::fs::metadata(certs.key("node-a"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "keys are the owner's only");
        assert!(matches!(
            certs.issue(&ca, "node-a", &node, Validity::days(1)),
            Err(CertsError::Exists(_))
        ));
        let (again, new) = certs.authority(Validity::days(10)).unwrap();
        assert!(!new, "the CA kept is reused");
        assert_eq!(again.cert_pem(), ca.cert_pem());
        for bad in ["two words", "../escape", "a/b", ".hidden", "ca", ""] {
            assert!(
                matches!(
                    certs.issue(&again, bad, &Role::Client, Validity::days(1)),
                    Err(CertsError::InvalidName(_))
                ),
                "{bad:?} accepted"
            );
        }
        // The identity a node reads from the certificate is the name it was issued for.
        let files = ferry_io::TlsFiles {
            cert: certs.cert("node-a"),
            key: certs.key("node-a"),
            ca: certs.path(CA_CERT),
        };
        let tls = ferry_io::NodeTls::load(&files).unwrap();
        assert_eq!(tls.identity().as_str(), "node-a");
    }
}
