//! Certificates made in the test (rcgen): a CA, server certificates for 127.0.0.1 and
//! localhost, and client certificates, written as PEM files for the programs under test.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// A test certificate authority.
pub struct TestCa {
    name: String,
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate's PEM file.
    pub cert_file: PathBuf,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").field("name", &self.name).finish()
    }
}

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

impl TestCa {
    /// A new CA named `name`, its certificate written to `dir/<name>-ca.pem`.
    ///
    /// # Panics
    /// When rcgen or the file system fails: a test cannot go on without it.
    pub fn new(dir: &Path, name: &str) -> TestCa {
        let key = KeyPair::generate().unwrap_or_else(|e| panic!("ca key: {e}"));
        let mut params = CertificateParams::new(Vec::<String>::new())
            .unwrap_or_else(|e| panic!("ca params: {e}"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params
            .self_signed(&key)
            .unwrap_or_else(|e| panic!("ca cert: {e}"));
        let cert_file = dir.join(format!("{name}-ca.pem"));
        write(&cert_file, &cert.pem());
        TestCa {
            name: name.to_string(),
            issuer: Issuer::new(params, key),
            cert_file,
        }
    }

    fn issue(
        &self,
        dir: &Path,
        file: &str,
        sans: Vec<String>,
        purpose: ExtendedKeyUsagePurpose,
    ) -> CertFiles {
        let key = KeyPair::generate().unwrap_or_else(|e| panic!("key: {e}"));
        let mut params = CertificateParams::new(sans).unwrap_or_else(|e| panic!("params: {e}"));
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{file} ({})", self.name));
        params.extended_key_usages = vec![purpose];
        let cert = params
            .signed_by(&key, &self.issuer)
            .unwrap_or_else(|e| panic!("sign: {e}"));
        let files = CertFiles {
            cert_file: dir.join(format!("{file}.pem")),
            key_file: dir.join(format!("{file}-key.pem")),
        };
        write(&files.cert_file, &cert.pem());
        write(&files.key_file, &key.serialize_pem());
        files
    }

    /// A server certificate for 127.0.0.1 and localhost, as `dir/<file>.pem`.
    pub fn server(&self, dir: &Path, file: &str) -> CertFiles {
        self.issue(
            dir,
            file,
            vec!["127.0.0.1".into(), "localhost".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A client certificate, as `dir/<file>.pem`.
    pub fn client(&self, dir: &Path, file: &str) -> CertFiles {
        self.issue(dir, file, Vec::new(), ExtendedKeyUsagePurpose::ClientAuth)
    }
}
