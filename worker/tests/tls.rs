//! The Worker API over real TLS: HTTPS with required client certificates (mutual TLS),
//! refused clients (no certificate, a certificate of another CA, a client that does not
//! trust the server's CA, plain http), a client CA reloaded without a restart, and the
//! refusal to serve plain http on a non-loopback address.

use std::time::{Duration, Instant};

use cynode_testkit::{CertFiles, TestCa};

use crate::harness::{Server, TOKEN};

fn client(trust: &TestCa, identity: Option<&CertFiles>) -> reqwest::Client {
    let tls = cynode_tls::ClientTls {
        ca_file: Some(trust.cert_file.clone()),
        cert_file: identity.map(|i| i.cert_file.clone()),
        key_file: identity.map(|i| i.key_file.clone()),
    };
    tls.apply(reqwest::Client::builder())
        .unwrap()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// `GET /v1/worker/capacity` over https: the status, or the client error's text.
async fn capacity(c: &reqwest::Client, addr: &str) -> Result<u16, String> {
    c.get(format!("https://{addr}/v1/worker/capacity"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .map(|r| r.status().as_u16())
        .map_err(|e| format!("{e:?}"))
}

fn mtls_worker(dir: &std::path::Path, server_ca: &TestCa, client_ca: &std::path::Path) -> Server {
    let cert = server_ca.server(dir, "worker");
    Server::start(
        "bwrap",
        &format!(
            "tls:\n  cert_file: {}\n  key_file: {}\n  client_ca_file: {}\n",
            cert.cert_file.display(),
            cert.key_file.display(),
            client_ca.display()
        ),
    )
}

#[tokio::test]
async fn mutual_tls_admits_only_clients_of_the_configured_ca() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "nodes");
    let other = TestCa::new(dir.path(), "other");
    let sv = mtls_worker(dir.path(), &ca, &ca.cert_file);
    let good = ca.client(dir.path(), "pm");
    let foreign = other.client(dir.path(), "intruder");

    assert_eq!(capacity(&client(&ca, Some(&good)), &sv.addr).await, Ok(200));
    let refused = [
        (
            "no client certificate",
            capacity(&client(&ca, None), &sv.addr).await,
        ),
        (
            "a client certificate of another CA",
            capacity(&client(&ca, Some(&foreign)), &sv.addr).await,
        ),
        (
            "a client that does not trust the server's CA",
            capacity(&client(&other, Some(&good)), &sv.addr).await,
        ),
    ];
    for (what, r) in refused {
        assert!(r.is_err(), "{what} was admitted: {r:?}");
    }
    // Plain http to the TLS port gets no Worker API answer.
    let plain = reqwest::Client::new()
        .get(format!("http://{}/v1/worker/capacity", sv.addr))
        .bearer_auth(TOKEN)
        .timeout(Duration::from_secs(20))
        .send()
        .await;
    assert!(
        plain.as_ref().map_or(true, |r| r.status() != 200),
        "plain http answered: {plain:?}"
    );
}

#[tokio::test]
async fn a_replaced_client_ca_is_used_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "nodes");
    let next = TestCa::new(dir.path(), "next");
    let client_ca = dir.path().join("client-ca.pem");
    std::fs::copy(&ca.cert_file, &client_ca).unwrap();
    let sv = mtls_worker(dir.path(), &ca, &client_ca);
    let rotated = client(&ca, Some(&next.client(dir.path(), "pm-next")));
    assert!(
        capacity(&rotated, &sv.addr).await.is_err(),
        "admitted before the rotation"
    );

    std::fs::copy(&next.cert_file, &client_ca).unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        // A fresh client: no pooled connection from before the reload.
        let c = client(&ca, Some(&next.client(dir.path(), "pm-next")));
        if capacity(&c, &sv.addr).await == Ok(200) {
            break;
        }
        assert!(
            Instant::now() < until,
            "the new client CA was not picked up within 30 s; log: {:?}",
            sv.log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = sv.log.lock().unwrap().join("\n");
    assert!(log.contains("tls configuration reloaded"), "{log}");
}

#[test]
fn plain_http_on_a_non_loopback_address_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), TOKEN).unwrap();
    let config = dir.path().join("w.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 0.0.0.0:0\nbackend: bwrap\nstate_dir: {}\ntoken_file: {}\n",
            dir.path().join("state").display(),
            dir.path().join("token").display()
        ),
    )
    .unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_cynode-worker"));
    cmd.args(["serve", "--config"]).arg(&config);
    let out = cynode_testkit::output_bounded(cmd, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("refusing to serve the Worker API (and its bearer token) over plain http on the non-loopback address 0.0.0.0:0"),
        "{err}"
    );
}
