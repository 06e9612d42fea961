//! Client side: extra roots and a client identity for reqwest clients.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{read, Result, TlsError};

/// What a client trusts and presents, beyond the system's roots.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientTls {
    /// PEM file of extra CA certificates to trust (the system's roots stay trusted).
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate (chain) presented to servers that require one.
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file`.
    pub key_file: Option<PathBuf>,
}

impl ClientTls {
    /// True when nothing beyond the system's roots is configured.
    pub fn is_default(&self) -> bool {
        self == &ClientTls::default()
    }

    /// `builder` trusting the extra CA and presenting the identity, if configured.
    pub fn apply(&self, mut builder: reqwest::ClientBuilder) -> Result<reqwest::ClientBuilder> {
        crate::install_provider();
        builder = builder.use_rustls_tls();
        if let Some(ca) = &self.ca_file {
            let pem = read(ca)?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| TlsError::Pem {
                path: ca.display().to_string(),
                message: e.to_string(),
            })?;
            if certs.is_empty() {
                return Err(TlsError::Pem {
                    path: ca.display().to_string(),
                    message: "no certificate in the file".into(),
                });
            }
            for c in certs {
                builder = builder.add_root_certificate(c);
            }
        }
        match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => {
                let mut pem = read(cert)?;
                pem.push(b'\n');
                pem.extend(read(key)?);
                let id = reqwest::Identity::from_pem(&pem).map_err(|e| TlsError::Pem {
                    path: cert.display().to_string(),
                    message: format!("client identity: {e}"),
                })?;
                builder = builder.identity(id);
            }
            (None, None) => {}
            _ => {
                return Err(TlsError::Config(
                    "a client certificate needs both cert_file and key_file".into(),
                ))
            }
        }
        Ok(builder)
    }
}
