//! Serving a test's own axum app on 127.0.0.1, over HTTP or HTTPS, from a thread of its
//! own, so synchronous tests can use it.

use std::path::Path;

use axum::Router;

/// Serves `app` over HTTPS only on 127.0.0.1 (any port) from a thread of its own, with a
/// server certificate named `name` from `ca`; returns its address.
pub fn serve_https_in_background(
    app: Router,
    ca: &cynode_testkit::TestCa,
    dir: &Path,
    name: &str,
) -> std::net::SocketAddr {
    let cert = ca.server(dir, name);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let tls = cynode_tls::ServerTls {
        cert_file: cert.cert_file,
        key_file: cert.key_file,
        client_ca_file: None,
    };
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(cynode_tls::serve(
            listener,
            app,
            Some(tls),
            std::future::pending(),
        ))
        .unwrap();
    });
    addr
}

pub use cynode_testkit::scripted_model::serve_in_background;
