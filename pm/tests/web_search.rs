//! The gateway's `web.search` (pm/src/mcp/egress.rs) against a SearxNG-like JSON server of
//! the test's own on 127.0.0.1: a job's search through the gateway comes back as the
//! normalised `[{title, url, snippet}]`, bounded; a PM without a search route answers
//! `search_not_configured`; a huge, malformed or failed upstream answer is
//! `search_upstream_invalid`; a tenant whose egress does not list the search host is
//! denied before the host is touched; odd queries are refused before any work. Every call
//! is audited with the search host as its destination.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Query;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use cynode_pm::gateway::{self, AuditEntry, Grant};
use serde_json::{json, Value};

const LIMIT: Duration = Duration::from_secs(60);
/// The route's answer bound in these tests.
const ANSWER_CAP: usize = 64 << 10;

/// The search server: what it was asked, and its port.
struct Search {
    port: u16,
    queries: Arc<Mutex<Vec<(String, String)>>>,
}

/// SearxNG's answer shape, with `n` results (one without a URL, one with a huge title).
fn answer(q: &str, n: usize) -> Value {
    let mut results: Vec<Value> = (0..n)
        .map(|i| {
            json!({ "title": format!("result {i} for {q}"), "url": format!("https://example.org/{i}"),
                    "content": format!("snippet {i}"), "engine": "test", "score": 1.0 })
        })
        .collect();
    results.insert(1, json!({ "title": "no url", "content": "skipped" }));
    results.insert(
        2,
        json!({ "title": "t".repeat(10_000), "url": "https://example.org/long", "content": "c" }),
    );
    json!({ "query": q, "number_of_results": n, "results": results, "answers": [], "suggestions": [] })
}

/// Serves `/search`: by the query, a good answer, a huge one, malformed JSON, a 500, or
/// JSON without `results`.
async fn search_server() -> Search {
    let queries: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let seen = queries.clone();
    let app = Router::new().route(
        "/search",
        get(
            move |Query(p): Query<std::collections::HashMap<String, String>>| {
                let seen = seen.clone();
                async move {
                    let q = p.get("q").cloned().unwrap_or_default();
                    let format = p.get("format").cloned().unwrap_or_default();
                    seen.lock().unwrap().push((q.clone(), format));
                    let json_reply = |v: Value| {
                        ([("content-type", "application/json")], v.to_string()).into_response()
                    };
                    match q.as_str() {
                        "huge" => Response::builder()
                            .header("content-type", "application/json")
                            .body(Body::from(format!(
                                "{{\"results\": [\"{}\"]}}",
                                "x".repeat(4 << 20)
                            )))
                            .unwrap(),
                        "malformed" => ([("content-type", "application/json")], "{\"results\": [")
                            .into_response(),
                        "failing" => {
                            (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "down").into_response()
                        }
                        "shapeless" => json_reply(json!({ "hits": [] })),
                        _ => json_reply(answer(&q, 30)),
                    }
                }
            },
        ),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    Search { port, queries }
}

/// Installs this process's gateway egress, with a search route to `search_port` or none.
fn install(search_port: Option<u16>) {
    cynode_tls::install_provider();
    let search = search_port
        .map(|p| {
            format!(
                "search:\n  base_url: \"http://127.0.0.1:{p}/\"\n  max_results: 5\n  max_response_bytes: {ANSWER_CAP}\n"
            )
        })
        .unwrap_or_default();
    let settings: cynode_pm::mcp::egress::Settings =
        serde_yaml::from_str(&format!("timeout_seconds: 5\n{search}")).unwrap();
    cynode_pm::mcp::egress::install_with(&settings, |_| None).unwrap();
}

/// A PM whose tenant settings are `tenant_yaml`, its gateway hosted on 127.0.0.1: the URL.
async fn gateway_for(dir: &std::path::Path, name: &str, tenant_yaml: &str) -> String {
    let state = dir.join(name);
    std::fs::create_dir_all(&state).unwrap();
    let tenant = state.join("tenant.yaml");
    std::fs::write(&tenant, tenant_yaml).unwrap();
    let config = cynode_pm::config::PmConfig {
        model: cynode_pm::llm::ModelConfig::new("http://127.0.0.1:9/v1", "none"),
        state_dir: state.clone(),
        datastore: None,
        skills: cynode_pm::config::SkillSources::default(),
        policy: cynode_pm::config::PolicySource::Builtin,
        tenant_file: Some(tenant),
        worker_wait: Duration::from_secs(1),
    };
    let workers = cynode_pm::workers::WorkerPool::single(
        cynode_pm::dispatch::WorkerClient::new("http://127.0.0.1:9", "unused"),
        "img",
    );
    let pm = cynode_pm::bootstrap::build_pm(&config, workers)
        .await
        .unwrap();
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let hosted = cynode_pm::mcp::gateway::host(Arc::new(pm), l, 12 << 20, None);
    // Lives as long as the test process.
    std::mem::forget(hosted);
    format!("http://{addr}/v1/gateway")
}

/// A token for a job listing `tools`; its job id.
fn token(tools: &[&str]) -> (String, String) {
    let job = format!("j-{}", uuid::Uuid::new_v4().simple());
    let t = gateway::tokens().mint(
        Grant {
            tenant: "default".into(),
            session_id: "s-search".into(),
            task_id: "t-search".into(),
            job_id: job.clone(),
            skill_id: "none".into(),
            tools: tools.iter().map(|t| t.to_string()).collect(),
        },
        Duration::from_secs(300),
    );
    (t.expose().to_string(), job)
}

/// `web.search` with `args` on `gw` by a job listing it: the result (`structuredContent`),
/// whether it is an error, and the call's audit entry.
async fn search(gw: &str, args: Value) -> (Value, bool, AuditEntry) {
    let (tok, job) = token(&["web.search"]);
    let body = json!({ "jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": { "name": "web.search", "arguments": args } });
    let r = reqwest::Client::new()
        .post(gw)
        .bearer_auth(tok)
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-06-18")
        .json(&body)
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let reply: Value = r.json().await.unwrap();
    let mut audit = gateway::tokens().revoke_job(&job).audit;
    assert_eq!(audit.len(), 1, "{audit:?}");
    let r = &reply["result"];
    (
        r["structuredContent"].clone(),
        r["isError"] == true,
        audit.remove(0),
    )
}

fn detail(v: &Value) -> String {
    v["detail"].as_str().unwrap_or_default().to_string()
}

fn listing(port: u16) -> String {
    format!("egress:\n  allow: [\"127.0.0.1:{port}\"]\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_searches_through_the_gateway() {
    tokio::time::timeout(LIMIT, async {
        let s = search_server().await;
        install(Some(s.port));
        let dir = tempfile::tempdir().unwrap();
        let gw = gateway_for(dir.path(), "pm", &listing(s.port)).await;

        let (v, is_error, e) = search(&gw, json!({ "query": "rust sandboxes" })).await;
        assert!(!is_error, "{v}");
        assert_eq!(v["query"], "rust sandboxes");
        // The route's max_results (5); the result without a URL is skipped; a long title
        // is cut and marked.
        assert_eq!(v["count"], 5, "{v}");
        let results = v["results"].as_array().unwrap();
        assert_eq!(results.len(), 5);
        assert_eq!(
            results[0],
            json!({ "title": "result 0 for rust sandboxes", "url": "https://example.org/0", "snippet": "snippet 0" })
        );
        assert_eq!(results[1]["url"], "https://example.org/long");
        assert_eq!(results[1]["truncated"], true);
        assert_eq!(
            results[1]["title"].as_str().unwrap().len(),
            cynode_pm::mcp::egress::MAX_RESULT_FIELD
        );
        for r in results {
            let keys: Vec<&String> = r.as_object().unwrap().keys().collect();
            assert!(keys.iter().all(|k| ["title", "url", "snippet", "truncated"]
                .contains(&k.as_str())));
        }
        // SearxNG's API was asked as documented; the audit names the search host.
        assert_eq!(
            s.queries.lock().unwrap().last().unwrap(),
            &("rust sandboxes".to_string(), "json".to_string())
        );
        assert_eq!(
            (
                e.tool.as_str(),
                e.outcome.as_str(),
                e.host.as_deref(),
                e.port,
                e.decision.as_deref()
            ),
            ("web.search", "ok", Some("127.0.0.1"), Some(s.port), Some("allowed"))
        );
        assert!(e.bytes > 0);

        // A caller may ask fewer, never more.
        let (v, _, _) = search(&gw, json!({ "query": "q", "max_results": 2 })).await;
        assert_eq!(v["count"], 2, "{v}");
        let (v, _, _) = search(&gw, json!({ "query": "q", "max_results": 500 })).await;
        assert_eq!(v["count"], 5, "{v}");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_upstream_answers_are_structured_errors() {
    tokio::time::timeout(LIMIT, async {
        let s = search_server().await;
        install(Some(s.port));
        let dir = tempfile::tempdir().unwrap();
        let gw = gateway_for(dir.path(), "pm", &listing(s.port)).await;
        for (q, why) in [
            ("huge", format!("the answer is over {ANSWER_CAP} bytes")),
            ("malformed", "the answer is not JSON".to_string()),
            ("failing", "the search API answered 500".to_string()),
            ("shapeless", "the answer has no `results` list".to_string()),
        ] {
            let (v, is_error, e) = search(&gw, json!({ "query": q })).await;
            assert!(is_error, "{q}: {v}");
            assert_eq!(v["status"], 502, "{q}: {v}");
            assert!(
                detail(&v).starts_with(&format!("web.search: search_upstream_invalid: {why}")),
                "{q}: {v}"
            );
            assert_eq!((e.outcome.as_str(), e.bytes), ("refused", 0), "{q}");
        }
        // Queries off the bounds are refused before the search host is asked.
        let asked = s.queries.lock().unwrap().len();
        for (args, why) in [
            (json!({ "query": "" }), "query: must not be empty"),
            (
                json!({ "query": "q".repeat(513) }),
                "query: longer than 512 bytes",
            ),
            (
                json!({ "query": "a\nb" }),
                "query: control characters are not accepted",
            ),
            (
                json!({ "query": "q", "max_results": 0 }),
                "max_results: must be positive",
            ),
        ] {
            let (v, is_error, _) = search(&gw, args.clone()).await;
            assert!(is_error, "{args}: {v}");
            assert_eq!(detail(&v), format!("web.search: {why}"), "{args}");
        }
        assert_eq!(s.queries.lock().unwrap().len(), asked);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_egress_rules_deny_an_unlisted_search_host() {
    tokio::time::timeout(LIMIT, async {
        let s = search_server().await;
        install(Some(s.port));
        let dir = tempfile::tempdir().unwrap();
        // Another port of 127.0.0.1 is listed, and a name: not the search host.
        let gw = gateway_for(
            dir.path(),
            "pm",
            &format!(
                "egress:\n  allow: [\"127.0.0.1:{}\", \"search.example\"]\n",
                s.port + 1
            ),
        )
        .await;
        let (v, is_error, e) = search(&gw, json!({ "query": "anything" })).await;
        assert!(is_error, "{v}");
        assert_eq!(v["status"], 403, "{v}");
        assert!(
            detail(&v).contains(&format!("port {} of 127.0.0.1", s.port)),
            "{v}"
        );
        assert_eq!(
            (e.outcome.as_str(), e.host.as_deref(), e.decision.as_deref()),
            ("refused", Some("127.0.0.1"), Some("denied"))
        );
        let nothing = "egress:\n  allow: []\n";
        let gw = gateway_for(dir.path(), "closed", nothing).await;
        let (v, is_error, _) = search(&gw, json!({ "query": "anything" })).await;
        assert!(is_error, "{v}");
        assert_eq!(v["status"], 403, "{v}");
        assert!(s.queries.lock().unwrap().is_empty());
        // A job whose context does not list web.search is refused before any work.
        let (tok, job) = token(&["web.fetch"]);
        let body = json!({ "jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": { "name": "web.search", "arguments": { "query": "x" } } });
        let reply: Value = reqwest::Client::new()
            .post(&gw)
            .bearer_auth(tok)
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", "2025-06-18")
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert!(
            reply["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("not in the job's context.mcp_tools"),
            "{reply}"
        );
        gateway::tokens().revoke_job(&job);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_search_route_the_error_is_named() {
    tokio::time::timeout(LIMIT, async {
        let s = search_server().await;
        install(None);
        let dir = tempfile::tempdir().unwrap();
        let gw = gateway_for(dir.path(), "pm", &listing(s.port)).await;
        let (v, is_error, e) = search(&gw, json!({ "query": "anything" })).await;
        assert!(is_error, "{v}");
        assert_eq!(v["status"], 503, "{v}");
        assert!(
            detail(&v).starts_with("web.search: search_not_configured: "),
            "{v}"
        );
        assert_eq!(e.outcome, "refused");
        assert!(s.queries.lock().unwrap().is_empty());
    })
    .await
    .unwrap();
}

/// A search route that is not an http(s) URL with a host is refused when the gateway's
/// egress is set up, not at the first search.
#[test]
fn a_bad_search_route_is_refused_at_start() {
    cynode_tls::install_provider();
    for base in [
        "ftp://search.example",
        "http://user:pw@search.example",
        "http://search.example/?q=x",
        "not a url",
    ] {
        let settings: cynode_pm::mcp::egress::Settings =
            serde_yaml::from_str(&format!("search:\n  base_url: \"{base}\"\n")).unwrap();
        let e = cynode_pm::mcp::egress::Egress::build(&settings, |_| None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("egress.search.base_url"), "{base}: {e}");
    }
}
