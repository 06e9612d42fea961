//! The PM → worker hop over real mutual TLS: a real `cynode-worker serve` (bwrap backend)
//! with a certificate and a required client CA made in the test, and `cynode-pm run`
//! reaching it through a workers file or `--worker-endpoint https://…`. The right CA and
//! client certificate complete the session; a client certificate of another CA, none at
//! all, or a worker certificate no configured CA issued fail it at once, naming the worker
//! and the certificate problem.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use cynode_testkit::{output_bounded, CertFiles, OwnedChild, TestCa};

use cynode_tests::{completed, final_state, happy_script, model_server, pm_with, workspace_root};

const TOKEN: &str = "worker-tls-token-0123456789";

/// A failure must come well before this; `--worker-wait-seconds` is far longer, so a
/// run that waited for the worker (retrying) instead of failing at once fails the test.
const FAIL_FAST: Duration = Duration::from_secs(120);
const WORKER_WAIT: &str = "900";

/// A worker serving HTTPS with `server` and requiring client certificates of `client_ca`.
struct TlsWorker {
    _child: OwnedChild,
    addr: String,
    token_file: PathBuf,
    _dir: cynode_tests::TempDir,
}

fn start_tls_worker(server: &CertFiles, client_ca: &Path) -> TlsWorker {
    use std::os::unix::fs::PermissionsExt;
    let rootfs = cynode_tests::rootfs();
    let dir = cynode_tests::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let cfg = format!(
        "listen: 127.0.0.1:0\nbackend: bwrap\nstate_dir: {}\ntoken_file: {}\ntls:\n  cert_file: {}\n  key_file: {}\n  client_ca_file: {}\nbwrap:\n  rootfs:\n    \"localhost/cynode-sba-test:latest\": {}\n",
        dir.path().join("state").display(),
        token_file.display(),
        server.cert_file.display(),
        server.key_file.display(),
        client_ca.display(),
        rootfs.display()
    );
    std::fs::write(dir.path().join("w.yaml"), cfg).unwrap();
    let (child, addr) = cynode_tests::serve_worker(&dir.path().join("w.yaml"));
    TlsWorker {
        _child: child,
        addr,
        token_file,
        _dir: dir,
    }
}

/// A workers file with the one entry `w-tls` at the worker's https:// address, trusting
/// `ca` and presenting `identity`.
fn workers_file(dir: &Path, w: &TlsWorker, ca: &Path, identity: Option<&CertFiles>) -> PathBuf {
    let mut tls = format!("      ca_file: {}\n", ca.display());
    if let Some(id) = identity {
        tls.push_str(&format!(
            "      cert_file: {}\n      key_file: {}\n",
            id.cert_file.display(),
            id.key_file.display()
        ));
    }
    let text = format!(
        "workers:\n  - id: w-tls\n    endpoint: https://{}\n    token_file: {}\n    tls:\n{tls}    purposes:\n      \"*\": localhost/cynode-sba-test:latest\n",
        w.addr,
        w.token_file.display()
    );
    let path = tempfile::Builder::new()
        .prefix("workers-")
        .suffix(".yaml")
        .tempfile_in(dir)
        .unwrap()
        .into_temp_path()
        .keep()
        .unwrap();
    std::fs::write(&path, text).unwrap();
    path
}

/// `cynode-pm run` of the happy script with `args`; returns its output, the time it took
/// and how many model requests it made.
fn run(args: &[&str]) -> (Output, Duration, usize) {
    let state = cynode_tests::tempdir().unwrap();
    let (url, model) = model_server(happy_script());
    let mut all = vec![
        "run",
        "greet the world",
        "--worker-wait-seconds",
        WORKER_WAIT,
    ];
    all.extend(args);
    let started = Instant::now();
    let out = pm_with(state.path(), &url, &all, &[]);
    (out, started.elapsed(), model.requests().len())
}

/// The run failed at once (not after waiting for the worker), the session names the worker
/// and the certificate problem (`want`), and no job was dispatched.
fn assert_fails_at_once(what: &str, (out, took, _): (Output, Duration, usize), want: &[&str]) {
    let v = final_state(&out);
    let text = format!("{}\n{}", v, String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        (out.status.code(), v["status"].as_str()),
        (Some(1), Some("failed")),
        "{what}: {text}"
    );
    assert!(
        took < FAIL_FAST,
        "{what}: took {took:?}: retried instead of failing at once: {text}"
    );
    let message = v["failure"]["message"].as_str().unwrap_or_default();
    assert_eq!(v["failure"]["kind"], "worker_unavailable", "{what}: {text}");
    for w in want {
        assert!(
            message.contains(w),
            "{what}: `{w}` missing from the failure: {message}"
        );
    }
    assert_eq!(v["jobs_dispatched"], 0, "{what}: {text}");
}

#[test]
fn a_session_runs_over_mutual_tls_through_a_workers_file_and_worker_endpoint() {
    let dir = cynode_tests::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "nodes");
    let w = start_tls_worker(&ca.server(dir.path(), "worker"), &ca.cert_file);
    let pm_cert = ca.client(dir.path(), "pm");

    let file = workers_file(dir.path(), &w, &ca.cert_file, Some(&pm_cert));
    let file = file.display().to_string();
    let (out, _, requests) = run(&["--workers-file", &file]);
    let v = completed(&out);
    assert_eq!(
        (
            v["jobs_dispatched"].clone(),
            v["worker_id"].clone(),
            requests
        ),
        (serde_json::json!(2), serde_json::json!("w-tls"), 4),
        "{v}"
    );
    let changeset = v["deliverable"]["changeset"].as_str().unwrap_or("");
    assert!(changeset.contains("+hello from the model"), "{changeset}");

    let endpoint = format!("https://{}", w.addr);
    let (ca_file, cert, key, token) = (
        ca.cert_file.display().to_string(),
        pm_cert.cert_file.display().to_string(),
        pm_cert.key_file.display().to_string(),
        w.token_file.display().to_string(),
    );
    let (out, _, _) = run(&[
        "--worker-endpoint",
        &endpoint,
        "--worker-token-file",
        &token,
        "--worker-ca-file",
        &ca_file,
        "--worker-client-cert",
        &cert,
        "--worker-client-key",
        &key,
    ]);
    let v = completed(&out);
    assert_eq!(v["jobs_dispatched"], 2, "{v}");
}

#[test]
fn refused_or_untrusted_certificates_fail_the_session_at_once_naming_the_worker() {
    let dir = cynode_tests::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "nodes");
    let other = TestCa::new(dir.path(), "other");
    let w = start_tls_worker(&ca.server(dir.path(), "worker"), &ca.cert_file);
    let good = ca.client(dir.path(), "pm");
    let foreign = other.client(dir.path(), "intruder");

    let cases = [
        (
            "a client certificate of another CA",
            &ca.cert_file,
            Some(&foreign),
            "refused this PM's client certificate",
        ),
        (
            "no client certificate",
            &ca.cert_file,
            None,
            "client certificate",
        ),
        (
            "a worker certificate of a CA the PM does not trust",
            &other.cert_file,
            Some(&good),
            "not issued by a trusted CA",
        ),
    ];
    for (what, trusted, identity, cause) in cases {
        let file = workers_file(dir.path(), &w, trusted, identity);
        assert_fails_at_once(
            what,
            run(&["--workers-file", &file.display().to_string()]),
            &["w-tls", "tls handshake failed", cause],
        );
    }

    // The same through --worker-endpoint: the single worker is `default`, its address named.
    let endpoint = format!("https://{}", w.addr);
    let token = w.token_file.display().to_string();
    let other_ca = other.cert_file.display().to_string();
    assert_fails_at_once(
        "--worker-endpoint with an untrusted worker certificate",
        run(&[
            "--worker-endpoint",
            &endpoint,
            "--worker-token-file",
            &token,
            "--worker-ca-file",
            &other_ca,
        ]),
        &["default", &endpoint, "not issued by a trusted CA"],
    );
}

#[test]
fn plain_http_to_a_non_loopback_worker_is_a_start_up_error() {
    let dir = cynode_tests::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let file = dir.path().join("workers.yaml");
    std::fs::write(
        &file,
        format!(
            "workers:\n  - id: far-away\n    endpoint: http://192.0.2.7:7070\n    token_file: {}\n    purposes:\n      \"*\": localhost/cynode-sba-test:latest\n",
            token.display()
        ),
    )
    .unwrap();
    let started = Instant::now();
    let cases = [
        (
            vec!["--workers-file", file.to_str().unwrap()],
            "far-away: endpoint `http://192.0.2.7:7070`: plain http to the non-loopback host `192.0.2.7`",
        ),
        (
            vec![
                "--worker-endpoint",
                "http://192.0.2.7:7070",
                "--worker-token-file",
                token.to_str().unwrap(),
            ],
            "--worker-endpoint: endpoint `http://192.0.2.7:7070`: plain http to the non-loopback host",
        ),
    ];
    for (args, want) in cases {
        let mut cmd = Command::new(cynode_tests::bin("cynode-pm"));
        cmd.args(["run", "hello", "--state-dir"])
            .arg(dir.path().join("state"))
            .args(&args)
            .current_dir(workspace_root());
        let out = output_bounded(cmd, Duration::from_secs(60));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{err}");
        assert!(err.contains(want), "want `{want}` in: {err}");
    }
    assert!(started.elapsed() < Duration::from_secs(60));
}

/// The classification behind "final, not retried": each certificate problem of a real
/// handshake is recognised as a TLS failure and said in words; a refused connection is not.
#[tokio::test]
async fn each_certificate_problem_is_recognised_as_a_tls_failure() {
    let dir = cynode_tests::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "nodes");
    let other = TestCa::new(dir.path(), "other");
    let cert = ca.server(dir.path(), "srv");
    // Bound before serving: connections queue until the server accepts them.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let tls = cynode_tls::ServerTls {
        cert_file: cert.cert_file,
        key_file: cert.key_file,
        client_ca_file: Some(ca.cert_file.clone()),
    };
    let app = axum::Router::new().route("/x", axum::routing::get(|| async { "ok" }));
    tokio::spawn(cynode_tls::serve(
        listener,
        app,
        Some(tls),
        std::future::pending(),
    ));
    let good = ca.client(dir.path(), "good");
    let cases = [
        (
            "the right CA and certificate",
            &ca,
            Some(good.clone()),
            None,
        ),
        (
            "a client certificate of another CA",
            &ca,
            Some(other.client(dir.path(), "foreign")),
            Some("refused this PM's client certificate"),
        ),
        (
            "no client certificate",
            &ca,
            None,
            Some("requires a client certificate and none was presented"),
        ),
        (
            "a worker certificate of an unknown CA",
            &other,
            Some(good),
            Some("not issued by a trusted CA"),
        ),
    ];
    for (what, trust, id, want) in cases {
        let c = cynode_tls::ClientTls {
            ca_file: Some(trust.cert_file.clone()),
            cert_file: id.as_ref().map(|i| i.cert_file.clone()),
            key_file: id.as_ref().map(|i| i.key_file.clone()),
        }
        .apply(reqwest::Client::builder().timeout(Duration::from_secs(30)))
        .unwrap()
        .build()
        .unwrap();
        let r = c.get(format!("https://{addr}/x")).send().await;
        match (want, r) {
            (None, Ok(r)) => assert_eq!(r.status(), 200, "{what}"),
            (Some(want), Err(e)) => {
                let got = cynode_pm::dispatch::tls_failure(&e);
                assert!(
                    got.as_deref().is_some_and(|g| g.contains(want)),
                    "{what}: {got:?} from {e:?}"
                );
            }
            (want, r) => panic!("{what}: want {want:?}, got {r:?}"),
        }
    }
    // Nothing listens on port 1: unreachable, not a TLS failure (that one may pass).
    let e = reqwest::Client::new()
        .get("https://127.0.0.1:1/x")
        .send()
        .await
        .unwrap_err();
    assert_eq!(cynode_pm::dispatch::tls_failure(&e), None, "{e:?}");
}
