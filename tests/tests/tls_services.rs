//! The PM's other hops over real TLS, with certificates from a CA made in the test:
//! `cynode-pm serve` over HTTPS (and mutual TLS), an OTLP collector that speaks only
//! HTTPS receiving the spans of both binaries, and a PostgreSQL of the test's own started
//! with `ssl = on` that only accepts TLS, reached with `sslmode=verify-full`.

use std::collections::BTreeSet;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cynode_pm::session::{Budgets, SessionRecord};
use cynode_pm::store::Store;
use cynode_testkit::{output_bounded, OwnedChild, TestCa};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;

use crate::service::start_replica_with;
use cynode_tests::otlp::{otlp_collector, Bodies};
use cynode_tests::{completed, happy_script, model_server, pm_with};

// ---------------------------------------------------------------------------------------
// `cynode-pm serve` over HTTPS
// ---------------------------------------------------------------------------------------

/// An async client trusting `tls`'s CA and presenting its identity, if any.
fn https_client(tls: &cynode_tls::ClientTls) -> reqwest::Client {
    tls.apply(reqwest::Client::builder().timeout(Duration::from_secs(30)))
        .unwrap()
        .build()
        .unwrap()
}

async fn healthz(client: &reqwest::Client, url: &str) -> Result<String, String> {
    match client.get(format!("{url}/healthz")).send().await {
        Ok(r) if r.status().is_success() => Ok(r.text().await.unwrap_or_default()),
        Ok(r) => Err(format!("status {}", r.status())),
        // The whole chain: the cause (certificate, handshake) is in the sources.
        Err(e) => Err(format!("{:?}", anyhow_chain(&e))),
    }
}

fn anyhow_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Starts `cynode-pm serve` with `tls_args` (no worker or model is needed for /healthz)
/// and returns it with its https base URL.
fn https_replica(dir: &Path, name: &str, tls_args: &[&str]) -> (crate::service::Replica, String) {
    let db = format!("sqlite://{}", dir.join(format!("{name}.db")).display());
    let replica = start_replica_with(
        dir,
        name,
        &db,
        "http://127.0.0.1:9/v1",
        &["--worker-endpoint", "http://127.0.0.1:9"],
        tls_args,
    );
    let https = replica.base.replacen("http://", "https://", 1);
    (replica, https)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_answers_over_https_and_refuses_plain_http_and_unknown_cas() {
    let dir = cynode_tests::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "pm");
    let cert = ca.server(dir.path(), "pm-server");
    let (replica, https) = https_replica(
        dir.path(),
        "tls",
        &[
            "--tls-cert-file",
            cert.cert_file.to_str().unwrap(),
            "--tls-key-file",
            cert.key_file.to_str().unwrap(),
        ],
    );
    let trusted = https_client(&cynode_tls::ClientTls {
        ca_file: Some(ca.cert_file.clone()),
        ..Default::default()
    });
    assert_eq!(healthz(&trusted, &https).await, Ok("ok".to_string()));

    // Plain http to the TLS port gets no answer.
    let plain = healthz(&reqwest::Client::new(), &replica.base).await;
    assert!(plain.is_err(), "plain http was answered: {plain:?}");

    // A client that trusts only another CA refuses the server, naming the certificate.
    let other_dir = cynode_tests::tempdir().unwrap();
    let other = TestCa::new(other_dir.path(), "other");
    let stranger = https_client(&cynode_tls::ClientTls {
        ca_file: Some(other.cert_file.clone()),
        ..Default::default()
    });
    let refused = healthz(&stranger, &https).await;
    let text = format!("{refused:?}");
    assert!(
        refused.is_err() && (text.contains("certificate") || text.contains("UnknownIssuer")),
        "an unknown CA was not refused for its certificate: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_a_client_ca_requires_a_client_certificate_from_it() {
    let dir = cynode_tests::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "pm");
    let cert = ca.server(dir.path(), "pm-server");
    let clients = TestCa::new(dir.path(), "clients");
    let good = clients.client(dir.path(), "orchestrator");
    let rogue_ca = TestCa::new(dir.path(), "rogue");
    let rogue = rogue_ca.client(dir.path(), "rogue");
    let (_replica, https) = https_replica(
        dir.path(),
        "mtls",
        &[
            "--tls-cert-file",
            cert.cert_file.to_str().unwrap(),
            "--tls-key-file",
            cert.key_file.to_str().unwrap(),
            "--tls-client-ca-file",
            clients.cert_file.to_str().unwrap(),
        ],
    );
    let with = |id: Option<&cynode_testkit::CertFiles>| {
        https_client(&cynode_tls::ClientTls {
            ca_file: Some(ca.cert_file.clone()),
            cert_file: id.map(|c| c.cert_file.clone()),
            key_file: id.map(|c| c.key_file.clone()),
        })
    };
    assert_eq!(
        healthz(&with(Some(&good)), &https).await,
        Ok("ok".to_string())
    );
    let none = healthz(&with(None), &https).await;
    assert!(
        none.is_err(),
        "no client certificate was accepted: {none:?}"
    );
    let wrong = healthz(&with(Some(&rogue)), &https).await;
    assert!(
        wrong.is_err(),
        "a client certificate of another CA was accepted: {wrong:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_picks_up_a_rotated_certificate_without_a_restart() {
    let dir = cynode_tests::tempdir().unwrap();
    let old_ca = TestCa::new(dir.path(), "old");
    let cert = old_ca.server(dir.path(), "pm-server");
    let (_replica, https) = https_replica(
        dir.path(),
        "rotate",
        &[
            "--tls-cert-file",
            cert.cert_file.to_str().unwrap(),
            "--tls-key-file",
            cert.key_file.to_str().unwrap(),
        ],
    );
    let trusting = |ca: &TestCa| {
        https_client(&cynode_tls::ClientTls {
            ca_file: Some(ca.cert_file.clone()),
            ..Default::default()
        })
    };
    assert_eq!(
        healthz(&trusting(&old_ca), &https).await,
        Ok("ok".to_string())
    );
    // A certificate from a new CA is written over the same files (as a Secret update or
    // a renewal does); the running server serves it within a bounded time.
    let new_dir = cynode_tests::tempdir().unwrap();
    let new_ca = TestCa::new(new_dir.path(), "new");
    let renewed = new_ca.server(new_dir.path(), "pm-server");
    std::fs::copy(&renewed.key_file, &cert.key_file).unwrap();
    std::fs::copy(&renewed.cert_file, &cert.cert_file).unwrap();
    let t = Instant::now();
    let new_client = trusting(&new_ca);
    loop {
        // Fresh connections each time: a pooled one would keep the old session.
        match healthz(&new_client, &https).await {
            Ok(_) => break,
            Err(e) => assert!(
                t.elapsed() < Duration::from_secs(60),
                "the renewed certificate was not served within 60 s: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("renewed certificate served after {:?}", t.elapsed());
    let old = healthz(&trusting(&old_ca), &https).await;
    assert!(old.is_err(), "the old certificate is still served: {old:?}");
}

#[test]
fn serve_refuses_to_start_with_a_key_that_is_not_pem() {
    let dir = cynode_tests::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "pm");
    let cert = ca.server(dir.path(), "pm-server");
    std::fs::write(dir.path().join("tokens"), "t0123456789abcdef acme\n").unwrap();
    let bad_key = dir.path().join("bad-key.pem");
    std::fs::write(&bad_key, "not a key\n").unwrap();
    let mut c = Command::new(cynode_tests::bin("cynode-pm"));
    c.args(["serve", "--listen", "127.0.0.1:0", "--api-tokens-file"])
        .arg(dir.path().join("tokens"))
        .args(["--worker-endpoint", "http://127.0.0.1:9"])
        .args(["--model-base-url", "http://127.0.0.1:9/v1"])
        .arg("--datastore-endpoint")
        .arg(format!("sqlite://{}", dir.path().join("pm.db").display()))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--tls-cert-file")
        .arg(&cert.cert_file)
        .arg("--tls-key-file")
        .arg(&bad_key)
        .env("CYNODE_WORKER_TOKEN", cynode_tests::TOKEN)
        .current_dir(cynode_tests::workspace_root());
    let out = output_bounded(c, Duration::from_secs(120));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("bad-key.pem"),
        "status {:?}, stderr: {err}",
        out.status
    );
}

// ---------------------------------------------------------------------------------------
// OTLP over HTTPS
// ---------------------------------------------------------------------------------------

/// An OTLP/HTTP collector that speaks only HTTPS.
fn https_collector(dir: &Path, ca: &TestCa) -> (String, Bodies) {
    let (app, bodies) = otlp_collector();
    let port = cynode_tests::serve_https_in_background(app, ca, dir, "collector").port();
    (format!("https://127.0.0.1:{port}"), bodies)
}

/// (service.name, span name) of every span received.
fn received(bodies: &Bodies) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for (_, body) in bodies.lock().unwrap().iter() {
        let req = ExportTraceServiceRequest::decode(body.as_slice()).expect("OTLP protobuf");
        for rs in req.resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .and_then(
                    |kv| match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                        Some(AnyValue::StringValue(s)) => Some(s.clone()),
                        _ => None,
                    },
                )
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    out.insert((service.clone(), s.name));
                }
            }
        }
    }
    out
}

#[test]
fn an_https_only_collector_receives_the_pm_spans_trusted_by_ssl_cert_file() {
    let dir = cynode_tests::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "collector");
    let (collector, bodies) = https_collector(dir.path(), &ca);
    let (url, _model) = model_server(happy_script());
    let state = cynode_tests::tempdir().unwrap();
    let ca_file = ca.cert_file.display().to_string();
    let out = pm_with(
        state.path(),
        &url,
        &["run", "greet the world"],
        &[
            ("CYNODE_OTLP_ENDPOINT", collector.as_str()),
            ("SSL_CERT_FILE", ca_file.as_str()),
        ],
    );
    completed(&out);
    // The PM flushes its exporter before it exits: its spans are here now. (The local
    // worker it starts gets a cleared environment without SSL_CERT_FILE; the worker's
    // exporter over https is checked on its own below.)
    let spans = received(&bodies);
    for want in [
        ("cynode-pm", "session"),
        ("cynode-pm", "request_job"),
        ("cynode-pm", "worker_call"),
    ] {
        assert!(
            spans.contains(&(want.0.to_string(), want.1.to_string())),
            "no {want:?} span over https in {spans:?}"
        );
    }
}

#[test]
fn the_worker_exports_its_request_span_to_an_https_only_collector() {
    use std::io::BufRead;
    let dir = cynode_tests::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "collector");
    let (collector, bodies) = https_collector(dir.path(), &ca);
    std::fs::write(dir.path().join("token"), cynode_tests::TOKEN).unwrap();
    std::fs::write(
        dir.path().join("w.yaml"),
        format!(
            "listen: 127.0.0.1:0\nbackend: bwrap\nstate_dir: {}\ntoken_file: {}\n",
            dir.path().join("state").display(),
            dir.path().join("token").display()
        ),
    )
    .unwrap();
    let bin = cynode_tests::bin("cynode-worker");
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--config"])
        .arg(dir.path().join("w.yaml"))
        .env("CYNODE_OTLP_ENDPOINT", &collector)
        .env("SSL_CERT_FILE", &ca.cert_file)
        // Export each batch at once rather than after the default 5 s.
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .stderr(std::process::Stdio::piped());
    let mut child = OwnedChild::spawn(cmd);
    let stderr = child.child_mut().stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let log = Arc::new(Mutex::new(String::new()));
    let log_w = Arc::clone(&log);
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            log_w.lock().unwrap().push_str(&format!("{line}\n"));
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                if v["fields"]["message"] == "cynode-worker listening" {
                    if let (Some(t), Some(a)) = (tx.take(), v["fields"]["addr"].as_str()) {
                        let _ = t.send(a.to_string());
                    }
                }
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(120))
        .unwrap_or_else(|_| panic!("the worker did not listen: {}", log.lock().unwrap()));
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let out = reqwest::blocking::Client::new()
        .get(format!("http://{addr}/healthz"))
        .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
        .send()
        .unwrap();
    assert!(out.status().is_success(), "{}", out.status());
    let t = Instant::now();
    loop {
        let spans = received(&bodies);
        if spans.contains(&("cynode-worker".to_string(), "request".to_string())) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no worker request span over https within 120 s: {spans:?}\n{}",
            log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn an_untrusted_collector_gets_no_spans_and_the_session_still_completes() {
    let dir = cynode_tests::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "collector");
    let (collector, bodies) = https_collector(dir.path(), &ca);
    let (url, _model) = model_server(happy_script());
    let state = cynode_tests::tempdir().unwrap();
    let out = pm_with(
        state.path(),
        &url,
        &["run", "greet the world"],
        &[("CYNODE_OTLP_ENDPOINT", collector.as_str())],
    );
    completed(&out);
    assert!(
        bodies.lock().unwrap().is_empty(),
        "spans reached a collector whose certificate nothing trusts"
    );
}

// ---------------------------------------------------------------------------------------
// PostgreSQL over TLS
// ---------------------------------------------------------------------------------------

/// The directory of the newest installed PostgreSQL server binaries.
fn pg_bin() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is installed (deploy/postgres/start.sh)")
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().expect("a PostgreSQL server binary").1
}

/// The uid and gid of the `postgres` account (the server refuses to run as root).
fn postgres_ids() -> (u32, u32) {
    // SAFETY: getpwnam with a NUL-terminated name; the result is read at once.
    unsafe {
        let pw = libc::getpwnam(c"postgres".as_ptr());
        assert!(!pw.is_null(), "no postgres account");
        ((*pw).pw_uid, (*pw).pw_gid)
    }
}

fn chown(path: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
}

/// A PostgreSQL of the test's own, in a temp dir on a free port, with `ssl = on` and a
/// `pg_hba.conf` that accepts only TLS connections (`hostssl`, trust). Stopped (fast
/// shutdown, then killed) on drop.
struct TlsPostgres {
    child: Option<OwnedChild>,
    port: u16,
    log: PathBuf,
    _dir: cynode_tests::TempDir,
}

impl TlsPostgres {
    fn start(ca: &TestCa, certs: &Path) -> TlsPostgres {
        let (uid, gid) = postgres_ids();
        let bin = pg_bin();
        let dir = cynode_tests::tempdir().unwrap();
        chown(dir.path(), uid, gid);
        let data = dir.path().join("data");
        let mut init = Command::new(bin.join("initdb"));
        init.arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"])
            .env("LC_ALL", "C")
            .current_dir(dir.path())
            .uid(uid)
            .gid(gid);
        let out = output_bounded(init, Duration::from_secs(180));
        assert!(
            out.status.success(),
            "initdb: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // Only TLS, from loopback: a plain connection is refused by the server itself.
        std::fs::write(
            data.join("pg_hba.conf"),
            "hostssl all all 127.0.0.1/32 trust\n",
        )
        .unwrap();
        let cert = ca.server(certs, "postgres");
        let (cert_file, key_file) = (dir.path().join("server.crt"), dir.path().join("server.key"));
        std::fs::copy(&cert.cert_file, &cert_file).unwrap();
        std::fs::copy(&cert.key_file, &key_file).unwrap();
        for f in [&cert_file, &key_file] {
            chown(f, uid, gid);
            std::fs::set_permissions(f, std::os::unix::fs::PermissionsExt::from_mode(0o600))
                .unwrap();
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = dir.path().join("postgres.log");
        let mut c = Command::new(bin.join("postgres"));
        c.arg("-D")
            .arg(&data)
            .args(["-c", "ssl=on", "-c"])
            .arg(format!("ssl_cert_file={}", cert_file.display()))
            .arg("-c")
            .arg(format!("ssl_key_file={}", key_file.display()))
            .args(["-c", &format!("port={port}")])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", dir.path().display()))
            .args(["-c", "fsync=off"])
            .env("LC_ALL", "C")
            .current_dir(dir.path())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(&log).unwrap())
            .uid(uid)
            .gid(gid);
        let mut child = OwnedChild::spawn(c);
        let t = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            let log_text = std::fs::read_to_string(&log).unwrap_or_default();
            assert!(
                child.try_wait().is_none(),
                "postgres exited at start: {log_text}"
            );
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "postgres did not listen within 120 s: {log_text}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        TlsPostgres {
            child: Some(child),
            port,
            log,
            _dir: dir,
        }
    }

    fn url(&self, query: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?{query}",
            self.port
        )
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // Fast shutdown (the server removes its shared memory), then the group is
            // killed when `c` drops.
            c.signal(libc::SIGINT);
            let _ = c.wait_timeout(Duration::from_secs(30));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_reaches_a_tls_only_postgres_with_verify_full_and_refuses_a_wrong_ca() {
    let certs = cynode_tests::tempdir().unwrap();
    let ca = TestCa::new(certs.path(), "db");
    let pg = TlsPostgres::start(&ca, certs.path());
    let verify = |ca_file: &Path| {
        pg.url(&format!(
            "sslmode=verify-full&sslrootcert={}",
            ca_file.display()
        ))
    };

    // The PM's store: connects (and migrates), and a session round-trips.
    let store = Store::connect(&verify(&ca.cert_file))
        .await
        .unwrap_or_else(|e| panic!("verify-full connect: {e}\n{}", pg.log()));
    let id = format!("tls-{}", uuid::Uuid::new_v4());
    let rec = SessionRecord::new(&id, "tenant-a", "over tls", Budgets::default());
    assert!(store.create(&rec).await.unwrap());
    let (loaded, version) = store.load(&id).await.unwrap().unwrap();
    assert_eq!((loaded, version), (rec, 1));

    // The connection is encrypted (as the server sees it), and plain is refused there.
    sqlx::any::install_default_drivers();
    let pool = sqlx::AnyPool::connect(&verify(&ca.cert_file))
        .await
        .unwrap();
    let ssl: bool = sqlx::Row::get(
        &sqlx::query("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .unwrap(),
        0,
    );
    assert!(ssl, "the server does not see TLS on the connection");
    let plain = Store::connect(&pg.url("sslmode=disable")).await;
    assert!(
        plain.is_err(),
        "the TLS-only server took a plain connection"
    );

    // verify-full with another CA: refused, naming the certificate.
    let other = TestCa::new(certs.path(), "other");
    let err = Store::connect(&verify(&other.cert_file))
        .await
        .err()
        .unwrap_or_else(|| panic!("verify-full accepted a certificate of an unknown CA"));
    let text = anyhow_chain(&err);
    eprintln!("verify-full with another CA: {text}");
    assert!(
        text.contains("certificate") || text.contains("UnknownIssuer"),
        "the refusal does not name the certificate: {text}"
    );
    // `require` encrypts without verifying: the same wrong CA is not consulted.
    let required = Store::connect(&pg.url(&format!(
        "sslmode=require&sslrootcert={}",
        other.cert_file.display()
    )))
    .await;
    assert!(required.is_ok(), "sslmode=require: {:?}", required.err());
    // A missing root certificate file is named.
    let missing = certs.path().join("no-such-ca.pem");
    let err = Store::connect(&verify(&missing)).await.err();
    let text = err.as_ref().map(|e| anyhow_chain(e)).unwrap_or_default();
    eprintln!("a missing sslrootcert: {text}");
    assert!(
        text.contains("sslrootcert") && text.contains("no-such-ca.pem"),
        "a missing sslrootcert is not named: {text:?}"
    );
}
