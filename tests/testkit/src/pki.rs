//! A test PKI ([`TestPki`]) and clients over mutual TLS.

use ferry_client::{Client, ClientError};

use crate::TestNode;

/// A CA in a temporary directory and the certificates tests ask it for: nodes valid for
/// `127.0.0.1` (where test nodes listen), clients, and whatever else a test issues itself.
pub struct TestPki {
    pub certs: ferry_certs::CertDir,
    pub authority: ferry_certs::Authority,
    /// What each name was issued as, so that asking for it as something else fails loudly.
    issued: std::sync::Mutex<std::collections::HashMap<String, ferry_certs::Role>>,
    _dir: tempfile::TempDir,
}

impl Default for TestPki {
    fn default() -> Self {
        Self::new()
    }
}

impl TestPki {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let certs = ferry_certs::CertDir::open(dir.path()).expect("certificate directory");
        let (authority, _) = certs
            .authority(ferry_certs::Validity::days(30))
            .expect("a CA");
        Self {
            certs,
            authority,
            issued: Default::default(),
            _dir: dir,
        }
    }

    /// Issues `name` in `role` for `validity`, unless it was issued in that role already (in
    /// another role, the test is wrong: this panics).
    pub fn issue(&self, name: &str, role: &ferry_certs::Role, validity: ferry_certs::Validity) {
        let mut issued = self.issued.lock().unwrap();
        match issued.get(name) {
            Some(earlier) => assert_eq!(earlier, role, "{name} was issued in another role"),
            None => {
                self.certs
                    .issue(&self.authority, name, role, validity)
                    .expect("issue a certificate");
                issued.insert(name.to_string(), role.clone());
            }
        }
    }

    /// The files of `name` (issued already) under this CA.
    pub fn files(&self, name: &str) -> ferry_io::TlsFiles {
        ferry_io::TlsFiles {
            cert: self.certs.cert(name),
            key: self.certs.key(name),
            ca: self.certs.path(ferry_certs::CA_CERT),
        }
    }

    /// A node's TLS, its certificate valid for 127.0.0.1 and a day.
    pub fn node(&self, name: &str) -> ferry_io::NodeTls {
        let role = ferry_certs::Role::Node {
            hosts: vec!["127.0.0.1".into()],
        };
        self.issue(name, &role, ferry_certs::Validity::days(1));
        ferry_io::NodeTls::load(&self.files(name)).expect("load a node's TLS")
    }

    /// A client's TLS, its certificate valid for a day.
    pub fn client(&self, name: &str) -> ferry_io::ClientTls {
        self.issue(
            name,
            &ferry_certs::Role::Client,
            ferry_certs::Validity::days(1),
        );
        ferry_io::ClientTls::load(&self.files(name)).expect("load a client's TLS")
    }
}

/// A client of `node` over mutual TLS.
pub async fn tls_client(node: &TestNode, tls: &ferry_io::ClientTls) -> Result<Client, ClientError> {
    Client::connect(node.addr).tls(tls.clone()).await
}
