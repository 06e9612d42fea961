//! The gateway's `web.fetch`, `api.call` and `web.search` end to end, with real processes: `cynode-pm
//! run` hosting its gateway over HTTPS (`--gateway-tls-cert`, a CA made in the test that
//! its local bwrap worker trusts through `SSL_CERT_FILE`), a sandbox job calling the tools
//! over `/job/gateway.sock` (the test's static Unix-socket client), a plain HTTP origin
//! an HTTPS API upstream and a SearxNG-compatible search API on 127.0.0.1. The fetched body reaches the sandbox; the
//! route's secret reaches the upstream and nowhere else: not the sandbox (its env and every
//! file of /job and /workspace, with the replies), not run's output or log, not its state
//! directory (the session, the store, the worker's files).

use std::sync::{Arc, Mutex};

use axum::http::HeaderMap;
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};

use crate::gateway::{calls_of, gateway_skill, history, http_call, of_kind, only_job, unc_base64};
use cynode_tests::model_server;

const SECRET: &str = "h5-e2e-route-secret-77c2d1";

fn serve(rt: &tokio::runtime::Runtime, app: Router, tls: Option<cynode_tls::ServerTls>) -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    rt.spawn(async move {
        let _ = cynode_tls::serve_with(
            l,
            app,
            tls,
            cynode_tls::ListenerLimits::default(),
            std::future::pending(),
        )
        .await;
    });
    port
}

#[test]
fn a_job_of_run_fetches_and_calls_a_route_through_its_https_gateway() {
    cynode_tls::install_provider();
    let dir = cynode_tests::tempdir().unwrap();
    let ca = cynode_testkit::TestCa::new(dir.path(), "h5e2e");
    let cert = ca.server(dir.path(), "server");
    let tls = cynode_tls::ServerTls {
        cert_file: cert.cert_file.clone(),
        key_file: cert.key_file.clone(),
        client_ca_file: None,
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let seen: Arc<Mutex<Option<String>>> = Arc::default();
    let origin = serve(
        &rt,
        Router::new().route("/hello", get(|| async { "hello from the e2e origin" })),
        None,
    );
    // A SearxNG-compatible search API for `web.search`.
    let search = serve(
        &rt,
        Router::new().route(
            "/search",
            get(|| async {
                axum::Json(json!({ "query": "cynode", "results": [
                    { "title": "the e2e search result", "url": "https://example.org/e2e", "content": "found by web.search" }
                ] }))
            }),
        ),
        None,
    );
    let s = seen.clone();
    let api = serve(
        &rt,
        Router::new().route(
            "/api/whoami",
            get(move |h: HeaderMap| async move {
                *s.lock().unwrap() = h
                    .get("authorization")
                    .map(|v| v.to_str().unwrap().to_string());
                "you are known to the api"
            }),
        ),
        Some(tls),
    );

    let egress_file = dir.path().join("gateway-egress.yaml");
    std::fs::write(
        &egress_file,
        format!(
            "egress:\n  routes:\n    vault:\n      upstream: \"https://127.0.0.1:{api}/api\"\n      headers: {{ Authorization: {{ env: H5_E2E_VAULT }} }}\n      ca_file: \"{}\"\n  search:\n    base_url: \"http://127.0.0.1:{search}/\"\n",
            ca.cert_file.display()
        ),
    )
    .unwrap();
    let tenant = dir.path().join("tenant.yaml");
    std::fs::write(&tenant, "egress:\n  routes_allowed: [vault]\n").unwrap();

    let unc = unc_base64(dir.path());
    let skills = dir.path().join("skills");
    gateway_skill(
        &skills,
        "gw-egress",
        &unc,
        &["web.fetch", "api.call", "web.search"],
        &[
            (
                "fetch",
                http_call(
                    "web.fetch",
                    json!({ "url": format!("http://127.0.0.1:{origin}/hello") }),
                ),
            ),
            (
                "route",
                http_call(
                    "api.call",
                    json!({ "route": "vault", "method": "GET", "path": "/whoami" }),
                ),
            ),
            (
                "search",
                http_call("web.search", json!({ "query": "cynode" })),
            ),
        ],
        "",
    );
    let (pm_model, _m) = model_server(cynode_tests::one_job_script(
        "fetch and call",
        "gw-egress",
        json!({}),
        "done",
    ));
    let state = dir.path().join("state");
    let allow = format!("127.0.0.1:{origin}");
    let allow_search = format!("127.0.0.1:{search}");
    let out = cynode_tests::pm_with(
        &state,
        &pm_model,
        &[
            "run",
            "fetch a page and call the vault from a local job",
            "--skill-dir",
            &skills.display().to_string(),
            "--tenant",
            &tenant.display().to_string(),
            "--egress-allow",
            &allow,
            "--egress-allow",
            &allow_search,
            "--gateway-egress-file",
            &egress_file.display().to_string(),
            "--gateway-tls-cert",
            &cert.cert_file.display().to_string(),
            "--gateway-tls-key",
            &cert.key_file.display().to_string(),
        ],
        &[
            ("H5_E2E_VAULT", &format!("Bearer {SECRET}")),
            ("SSL_CERT_FILE", &ca.cert_file.display().to_string()),
        ],
    );
    let v = cynode_tests::completed(&out);
    let events = history(&v);
    let job = only_job(&v);
    let s = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(
        calls_of(&events, &job),
        [
            s("web.fetch", "ok"),
            s("api.call", "ok"),
            s("web.search", "ok")
        ],
        "{v}"
    );
    let calls: Vec<Value> = of_kind(&events, "gateway_calls")
        .iter()
        .flat_map(|d| d["calls"].as_array().cloned().unwrap_or_default())
        .collect();
    assert_eq!(
        (
            calls[0]["host"].clone(),
            calls[0]["port"].clone(),
            calls[0]["decision"].clone()
        ),
        (json!("127.0.0.1"), json!(origin), json!("allowed")),
        "{calls:?}"
    );
    assert_eq!(calls[1]["port"], json!(api), "{calls:?}");
    // The upstream got the credential.
    assert_eq!(
        seen.lock().unwrap().as_deref(),
        Some(format!("Bearer {SECRET}").as_str())
    );

    // The sandbox got the bodies (its dump holds the replies) and not the secret.
    let dump = v["state"]["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["path"] == "dump.txt")
        .unwrap_or_else(|| panic!("no dump: {v}"));
    let dump = std::fs::read(dump["location"].as_str().unwrap()).unwrap();
    // The dump holds the job's binary client too.
    let dump = String::from_utf8_lossy(&dump);
    assert!(dump.contains("hello from the e2e origin"), "{dump}");
    assert!(dump.contains("you are known to the api"), "{dump}");
    assert!(dump.contains("the e2e search result"), "{dump}");
    assert!(!dump.contains(SECRET), "the secret is in the sandbox");

    // Nowhere in run's output (the session record, the log) or its state directory.
    let holds = |hay: &[u8]| hay.windows(SECRET.len()).any(|w| w == SECRET.as_bytes());
    assert!(
        !holds(&out.stdout) && !holds(&out.stderr),
        "the secret in run's output"
    );
    let mut files = 0;
    let mut skipped = Vec::new();
    let mut todo = vec![state.clone()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let t = e.file_type().unwrap();
            if t.is_dir() {
                todo.push(e.path());
            } else if t.is_file() {
                // The local worker's volume images (sparse, gigabytes) are sandbox disks,
                // whose files the dump has already searched.
                if e.metadata().unwrap().len() > 64 << 20 {
                    skipped.push(e.path());
                    continue;
                }
                files += 1;
                let bytes = std::fs::read(e.path()).unwrap_or_default();
                assert!(!holds(&bytes), "the secret in {}", e.path().display());
            }
        }
    }
    assert!(files > 3, "only {files} files in {}", state.display());
    assert!(
        skipped
            .iter()
            .all(|p| p.extension().is_some_and(|x| x == "img")
                && p.parent().is_some_and(|d| d.ends_with("volumes"))),
        "big files other than the worker's volume images: {skipped:?}"
    );
    drop(rt);
}
