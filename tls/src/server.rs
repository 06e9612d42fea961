//! Server side: rustls configs from PEM files, optional required client certificates, and
//! serving (HTTP, HTTPS that reloads the files without a restart, Unix sockets) through
//! the one bounded accept loop of [`crate::accept`].

use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, SystemTime};

use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};

use crate::accept::{self, TlsConfig};
use crate::limits::ListenerLimits;
use crate::{read, Result, TlsError};

/// How often the certificate files are checked for changes.
const RELOAD_POLL: Duration = Duration::from_secs(2);

/// A server's certificate and key, and optionally the CA its clients must present a
/// certificate from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// When set, every client must present a certificate issued by this CA (mutual TLS).
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
}

impl ServerTls {
    fn files(&self) -> Vec<&Path> {
        let mut f = vec![self.cert_file.as_path(), self.key_file.as_path()];
        if let Some(ca) = &self.client_ca_file {
            f.push(ca);
        }
        f
    }
}

fn pem_err(path: &Path, message: impl std::fmt::Display) -> TlsError {
    TlsError::Pem {
        path: path.display().to_string(),
        message: message.to_string(),
    }
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| pem_err(path, e))?;
    if certs.is_empty() {
        return Err(pem_err(path, "no certificate in the file"));
    }
    Ok(certs)
}

/// The rustls config for `tls` (HTTP/1.1 and HTTP/2 by ALPN).
pub fn server_config(tls: &ServerTls) -> Result<Arc<ServerConfig>> {
    crate::install_provider();
    let chain = certs(&tls.cert_file)?;
    let key = PrivateKeyDer::from_pem_slice(&read(&tls.key_file)?)
        .map_err(|e| pem_err(&tls.key_file, e))?;
    let builder = ServerConfig::builder();
    let builder = match &tls.client_ca_file {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in certs(ca)? {
                roots.add(c).map_err(|e| pem_err(ca, e))?;
            }
            let verifier = WebPkiClientVerifier::builder(Arc::new(roots))
                .build()
                .map_err(|e| pem_err(ca, e))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder
        .with_single_cert(chain, key)
        .map_err(|e| pem_err(&tls.cert_file, e))?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

fn mtimes(tls: &ServerTls) -> Vec<Option<SystemTime>> {
    tls.files()
        .iter()
        .map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
        .collect()
}

/// How long in-flight requests may take to finish once a TCP server is told to stop.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Serves `app` on `listener` until `shutdown` resolves, with the default
/// [`ListenerLimits`] (see [`serve_with`]).
pub async fn serve(
    listener: std::net::TcpListener,
    app: axum::Router,
    tls: Option<ServerTls>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    serve_with(listener, app, tls, ListenerLimits::default(), shutdown).await
}

/// Serves `app` on `listener` until `shutdown` resolves: plain HTTP without `tls`, else
/// HTTPS whose certificate, key and client CA are reloaded when a file changes or on
/// SIGHUP (a reload that fails keeps the previous config and logs why). Connections are
/// bounded by `limits` (see [`ListenerLimits`]); on shutdown, requests in flight get 10 s.
pub async fn serve_with(
    listener: std::net::TcpListener,
    app: axum::Router,
    tls: Option<ServerTls>,
    limits: ListenerLimits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    listener.set_nonblocking(true).map_err(TlsError::Serve)?;
    let listener = tokio::net::TcpListener::from_std(listener).map_err(TlsError::Serve)?;
    let config = match tls {
        None => None,
        Some(tls) => {
            let config: TlsConfig = Arc::new(RwLock::new(server_config(&tls)?));
            let reload = tokio::spawn(reload_loop(tls, Arc::clone(&config)));
            Some((config, AbortOnDrop(reload)))
        }
    };
    let tls = config.as_ref().map(|(c, _)| Arc::clone(c));
    accept::run(listener, app, tls, limits, SHUTDOWN_GRACE, shutdown).await;
    Ok(())
}

/// Serves `app` on a Unix socket until `shutdown` resolves (or the future is dropped),
/// with connections bounded by `limits`; what is in flight at shutdown is closed.
pub async fn serve_unix(
    listener: tokio::net::UnixListener,
    app: axum::Router,
    limits: ListenerLimits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    accept::run(listener, app, None, limits, Duration::ZERO, shutdown).await;
}

/// Aborts the task when dropped (the reload loop ends with its server).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn reload_loop(tls: ServerTls, config: TlsConfig) {
    let mut seen = mtimes(&tls);
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    loop {
        let signalled = tokio::select! {
            _ = tokio::time::sleep(RELOAD_POLL) => false,
            _ = async {
                match hup.as_mut() {
                    Some(h) => { h.recv().await; }
                    None => std::future::pending::<()>().await,
                }
            } => true,
        };
        let now = mtimes(&tls);
        if !signalled && now == seen {
            continue;
        }
        seen = now;
        match server_config(&tls) {
            Ok(cfg) => {
                *config.write().unwrap_or_else(PoisonError::into_inner) = cfg;
                tracing::info!(cert = %tls.cert_file.display(), signalled, "tls configuration reloaded");
            }
            Err(e) => {
                tracing::warn!(error = %e, "tls configuration not reloaded; the previous one stays")
            }
        }
    }
}
