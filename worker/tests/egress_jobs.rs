//! Jobs with `network_policy: restricted` on the real node, on every backend:
//! bwrap, Podman and Docker bind the egress proxy inside the sandbox's own network
//! namespace at 127.0.0.1:3128 and the job reaches allowlisted origins through it; every
//! attack is denied with an audit record in the job's response; a direct connection fails;
//! a flood of denied attempts leaves the node answering with a bounded audit; a route's
//! secret is found nowhere in the sandbox, the response or the node's log. The attack case
//! runs once more on Podman and Docker with their warm pools on (the job takes a pooled
//! container, whose waiter holds it until the proxy is bound). gVisor cannot bind the
//! proxy inside its sandboxes: `restricted` is refused there with a 400. Only
//! 127.0.0.1 (and 127.0.0.3, never listened on) is reached; names come from a DNS server of
//! the test's own.

use std::net::Ipv4Addr;
use std::time::Duration;

use serde_json::{json, Value};

use crate::egress::{
    route_server, route_server_with, Dns, Origin, REDACTED_ECHO, ROUTE_CALL, ROUTE_SECRET,
    SECRET_SEARCH,
};
use crate::harness::{env, gates_egress, unique, Server};

/// Every test's bound.
const TEST_TIME: Duration = Duration::from_secs(240);
/// A loopback address nothing listens on and no allowlist lists.
const UNLISTED: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);

/// A command job with `network_policy: restricted`, its `egress_allow` and `env`.
fn restricted_job(id: &str, script: &str, allow: Option<Value>, env_vars: Value) -> Value {
    let mut sandbox = json!({
        "image": env().image, "command": ["sh", "-c", script],
        "network_policy": "restricted", "env": env_vars, "timeout_seconds": 120
    });
    if let Some(a) = allow {
        sandbox["egress_allow"] = a;
    }
    json!({ "version": 1, "task_id": "t-egress", "job_id": id, "sandbox": sandbox })
}

/// The records of `resp`'s audit for `host` and `method`.
fn records<'a>(resp: &'a Value, host: &str, method: &str) -> Vec<&'a Value> {
    resp["egress"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|r| r["host"] == host && r["method"] == method)
                .collect()
        })
        .unwrap_or_default()
}

fn assert_denied(resp: &Value, host: &str, method: &str, reason: &str) {
    let r = records(resp, host, method);
    assert!(
        r.iter()
            .any(|r| r["decision"] == "denied"
                && r["reason"].as_str().unwrap_or("").contains(reason)),
        "no denied {method} {host} record saying {reason:?}: {}",
        resp["egress"]
    );
}

/// One raw request to the proxy from inside the sandbox; prints `<tag> <status line>`.
fn ask(tag: &str, raw: &str) -> String {
    format!("printf '{tag} '; printf '{raw}' | nc -w 10 127.0.0.1 3128 | head -n 1; echo; ")
}

/// Allowed plain HTTP and CONNECT through the proxy; denied: a name outside the
/// allowlist, a listed name resolving to an unlisted loopback address, an IP literal, a
/// rebinding name's second answer, CONNECT to a port not allowed, a smuggled and an
/// oversized head; a direct connection fails; the proxy variables are the node's (a
/// request's own are dropped); `egress_allow` beyond the node's list is a 400.
pub async fn egress_restricted_job_reaches_only_its_allowlist(backend: &'static str) {
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let origin = Origin::http().await;
        let (secure, _ca) = Origin::https(dir.path(), "secure.test").await;
        let bypass = Origin::http().await;
        let dns = Dns::start(&[
            ("origin.test", &[Ipv4Addr::LOCALHOST]),
            ("secure.test", &[Ipv4Addr::LOCALHOST]),
            ("local.test", &[UNLISTED]),
            ("rebind.test", &[Ipv4Addr::LOCALHOST, UNLISTED]),
        ])
        .await;
        let p = origin.port;
        let config = format!(
            "egress:\n  allow: [\"origin.test:{p}\", \"rebind.test:{p}\", \"local.test:{p}\", \
             \"secure.test:{s}\", \"127.0.0.1\"]\n  nameservers: [\"{ns}\"]\n",
            s = secure.port,
            ns = dns.addr
        );
        let server = Server::start(backend, &config);
        let mut script = String::from("echo \"vars $HTTP_PROXY $https_proxy $NO_PROXY $CYNODE_EGRESS_ROUTES_URL\"; ");
        script += &ask("allowed", &format!("GET http://origin.test:{p}/hello HTTP/1.1\\r\\nHost: origin.test:{p}\\r\\n\\r\\n"));
        script += &ask("connect", &format!("CONNECT secure.test:{s} HTTP/1.1\\r\\nHost: secure.test:{s}\\r\\n\\r\\n", s = secure.port));
        script += &ask("outside", &format!("GET http://elsewhere.test:{p}/hello HTTP/1.1\\r\\n\\r\\n"));
        script += &ask("local", &format!("GET http://local.test:{p}/hello HTTP/1.1\\r\\n\\r\\n"));
        script += &ask("literal", &format!("GET http://127.0.0.3:{p}/hello HTTP/1.1\\r\\n\\r\\n"));
        script += &ask("rebind1", &format!("GET http://rebind.test:{p}/hello HTTP/1.1\\r\\n\\r\\n"));
        script += &ask("rebind2", &format!("GET http://rebind.test:{p}/hello HTTP/1.1\\r\\n\\r\\n"));
        script += &ask("port", &format!("CONNECT secure.test:{} HTTP/1.1\\r\\n\\r\\n", secure.port + 1));
        script += &ask("smuggled", &format!("POST http://origin.test:{p}/echo HTTP/1.1\\r\\nContent-Length: 4\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n0\\r\\n\\r\\n"));
        script += &format!(
            "printf 'oversized '; (printf 'GET http://origin.test:{p}/hello HTTP/1.1\\r\\nX-Big: '; head -c 70000 /dev/zero | tr '\\0' a; printf '\\r\\n\\r\\n') | nc -w 10 127.0.0.1 3128 | head -n 1; echo; "
        );
        script += &format!(
            "if nc -w 3 127.0.0.1 {} </dev/null; then echo BYPASSED; else echo bypass-refused; fi",
            bypass.port
        );
        let allow = json!([format!("origin.test:{p}"), format!("rebind.test:{p}"),
            format!("local.test:{p}"), format!("secure.test:{}", secure.port), "127.0.0.1"]);
        let vars = json!({"HTTP_PROXY": "http://evil.example:1", "no_proxy": "*"});
        let req = restricted_job(&unique("eg"), &script, Some(allow), vars);
        let (code, resp) = server.post("/v1/worker/jobs:run", &req).await;
        if !gates_egress(backend) {
            assert_eq!(code, 400, "{resp}");
            assert!(resp["detail"].as_str().unwrap_or("").contains("sandbox.network_policy"), "{resp}");
            return;
        }
        assert_eq!(code, 200, "{resp}");
        assert_eq!(resp["status"], "completed", "{resp}");
        let out = resp["stdout"].as_str().unwrap();
        let line = |tag: &str| -> String {
            out.lines()
                .find(|l| l.starts_with(&format!("{tag} ")))
                .unwrap_or_else(|| panic!("no {tag} line in {out}"))
                .to_string()
        };
        assert_eq!(
            line("vars"),
            "vars http://127.0.0.1:3128 http://127.0.0.1:3128 localhost,127.0.0.1 http://127.0.0.1:3128/routes"
        );
        assert!(line("allowed").contains(" 200"), "{out}");
        assert!(line("connect").contains(" 200"), "{out}");
        assert!(line("rebind1").contains(" 200"), "{out}");
        for tag in ["outside", "local", "literal", "rebind2", "port"] {
            assert!(line(tag).contains(" 403"), "{tag}: {out}");
        }
        assert!(line("smuggled").contains(" 400"), "{out}");
        assert!(line("oversized").contains(" 431"), "{out}");
        assert!(out.lines().any(|l| l == "bypass-refused"), "{out}");
        assert!(!out.contains("BYPASSED"), "{out}");
        assert_eq!(bypass.hits(), 0);
        assert_eq!(origin.hits(), 2, "the allowed GET and the first rebind.test GET only");
        assert!(records(&resp, "origin.test", "GET").iter().any(|r| r["decision"] == "allowed" && r["bytes_down"].as_u64() > Some(0)), "{}", resp["egress"]);
        assert!(records(&resp, "secure.test", "CONNECT").iter().any(|r| r["decision"] == "allowed"), "{}", resp["egress"]);
        assert_denied(&resp, "elsewhere.test", "GET", "not in the egress allowlist");
        assert_denied(&resp, "local.test", "GET", "127.0.0.3");
        assert_denied(&resp, "127.0.0.3", "GET", "");
        assert_denied(&resp, "rebind.test", "GET", "127.0.0.3");
        assert_denied(&resp, "secure.test", "CONNECT", "port");
        assert_eq!(dns.a_queries("rebind.test"), 2);
        if backend.ends_with("_warm") {
            assert_eq!(crate::warm_pool::pool_metric(&server, "claims_total").await, 1,
                "the job did not take a pooled container");
        }
        // A request's list may narrow the node's, never widen it.
        let wide = restricted_job(&unique("eg"), "true", Some(json!(["pypi.org"])), json!({}));
        let (code, resp) = server.post("/v1/worker/jobs:run", &wide).await;
        assert_eq!(code, 400, "{resp}");
        assert!(resp["detail"].as_str().unwrap_or("").contains("sandbox.egress_allow"), "{resp}");
        // `allow` stays refused; `none` stays without any network or variable.
        let mut open = restricted_job(&unique("eg"), "true", None, json!({}));
        open["sandbox"]["network_policy"] = "allow".into();
        let (code, resp) = server.post("/v1/worker/jobs:run", &open).await;
        assert_eq!(code, 400, "{resp}");
        assert!(resp["detail"].as_str().unwrap_or("").contains("`allow` (unrestricted network) is not offered"), "{resp}");
        let none_script = format!(
            "echo \"vars[$HTTP_PROXY]\"; if nc -w 3 127.0.0.1 3128 </dev/null; then echo REACHED; else echo no-proxy; fi; \
             if nc -w 3 127.0.0.1 {p} </dev/null; then echo BYPASSED; else echo no-route; fi"
        );
        let (code, resp) = server.run_job(&unique("eg"), "t-egress", &["sh", "-c", &none_script]).await;
        assert_eq!(code, 200, "{resp}");
        assert_eq!(resp["stdout"], "vars[]\nno-proxy\nno-route\n", "{resp}");
        assert!(resp.get("egress").is_none(), "{resp}");
    })
    .await
    .unwrap();
}

/// 300 denied attempts from one job: `/healthz` keeps answering while they run, the
/// response's audit holds at most the node's bound and counts the rest.
pub async fn egress_flood_keeps_the_node_answering_and_the_audit_bounded(backend: &'static str) {
    tokio::time::timeout(TEST_TIME, async {
        let dns = Dns::start(&[]).await;
        let config = format!(
            "egress:\n  allow: [\"allowed.test\"]\n  nameservers: [\"{}\"]\n  max_audit_records: 40\n",
            dns.addr
        );
        let server = Server::start(backend, &config);
        let script = "i=0; while [ $i -lt 300 ]; do \
             printf 'GET http://denied-%s.test/ HTTP/1.1\\r\\n\\r\\n' $i | nc -w 5 127.0.0.1 3128 >/dev/null; \
             i=$((i+1)); done; echo flooded";
        let id = unique("egf");
        let req = restricted_job(&id, script, None, json!({}));
        let (code, v) = server.post("/v1/worker/jobs", &req).await;
        if !gates_egress(backend) {
            assert_eq!(code, 400, "{v}");
            return;
        }
        assert_eq!(code, 202, "{v}");
        // While the job floods its proxy, the node answers.
        let mut health_checks = 0;
        loop {
            let r = server
                .client
                .get(server.url("/healthz"))
                .timeout(Duration::from_secs(5))
                .send()
                .await
                .expect("healthz answers during the flood");
            assert!(r.status().is_success());
            health_checks += 1;
            let (_, s) = server.get(&format!("/v1/worker/jobs/{id}")).await;
            if s["status"] != "accepted" && s["status"] != "in_progress" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(health_checks > 0);
        let done = server.wait_terminal(&id).await;
        let resp = &done["result"];
        assert_eq!(resp["status"], "completed", "{done}");
        assert_eq!(resp["stdout"], "flooded\n");
        let kept = resp["egress"].as_array().unwrap();
        assert_eq!(kept.len(), 40);
        assert!(kept.iter().all(|r| r["decision"] == "denied"));
        assert_eq!(resp["egress_dropped"], 260, "{}", resp["egress_dropped"]);
    })
    .await
    .unwrap();
}

/// A credentialed route: the sandbox reaches the upstream at
/// `$CYNODE_EGRESS_ROUTES_URL/api/…` and the node adds the header; the secret is in no
/// variable, no file and no process's environment inside the sandbox, nor in the response
/// or the node's log.
pub async fn egress_route_secret_never_enters_the_sandbox(backend: &'static str) {
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let (server, origin) = route_server(backend, dir.path()).await;
        let script = format!("{ROUTE_CALL}{SECRET_SEARCH}");
        let id = unique("egr");
        let req = restricted_job(&id, &script, None, json!({}));
        let (code, resp) = server.post("/v1/worker/jobs:run", &req).await;
        if !gates_egress(backend) {
            assert_eq!(code, 400, "{resp}");
            return;
        }
        assert_eq!(code, 200, "{resp}");
        let out = resp["stdout"].as_str().unwrap();
        assert!(
            out.contains("authorized"),
            "the route added its header: {out}"
        );
        let after: Vec<&str> = out
            .lines()
            .skip_while(|l| !l.contains("authorized"))
            .skip(1)
            .collect();
        assert_eq!(
            after,
            ["0", "searched"],
            "the secret was found in the sandbox: {out}"
        );
        assert!(origin.hits() >= 1);
        let text = resp.to_string();
        assert!(!text.contains(ROUTE_SECRET), "{text}");
        let log = server.log.lock().unwrap().join("\n");
        assert!(
            !log.contains(ROUTE_SECRET),
            "the node's log holds the secret"
        );
        assert!(
            log.contains("egress attempt"),
            "the attempt is in the node's log"
        );
    })
    .await
    .unwrap();
}

/// A route whose upstream reflects the request's headers (`/api/reflect`, as httpbin
/// does): the sandbox reads `<redacted>` where the secret was, in the answer's header and
/// body (raw, chunked, through nc), and in a body that brought it in two writes (through
/// busybox wget, which decodes the chunks); a gzip answer is refused with a 502. (No
/// `wget -T`: the test image's static busybox crashes with it; the job's timeout bounds.)
pub async fn egress_route_answers_never_carry_the_secret(backend: &'static str) {
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let (server, origin) = route_server(backend, dir.path()).await;
        let script = "printf 'GET /routes/api/reflect HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n' | nc -w 10 127.0.0.1 3128; echo; \
             printf 'split '; wget -q -Y off -O - 'http://127.0.0.1:3128/routes/api/split?at=12'; \
             printf 'gzip '; printf 'GET /routes/api/gzip?always HTTP/1.1\\r\\nHost: x\\r\\nAccept-Encoding: gzip\\r\\n\\r\\n' | nc -w 10 127.0.0.1 3128 | head -n 1; echo";
        let req = restricted_job(&unique("egx"), script, None, json!({}));
        let (code, resp) = server.post("/v1/worker/jobs:run", &req).await;
        if !gates_egress(backend) {
            assert_eq!(code, 400, "{resp}");
            return;
        }
        assert_eq!(code, 200, "{resp}");
        let out = resp["stdout"].as_str().unwrap();
        assert!(!out.contains(ROUTE_SECRET), "the secret came back: {out}");
        assert!(!out.contains("s3cret-route"), "part of the secret came back: {out}");
        assert!(
            out.contains("x-echo-authorization: <redacted>\r\n"),
            "{out}"
        );
        assert!(out.contains("Transfer-Encoding: chunked\r\n"), "{out}");
        assert!(
            out.contains(&format!("split {}", REDACTED_ECHO)),
            "{out}"
        );
        let gzip = out.lines().find(|l| l.starts_with("gzip ")).unwrap_or("");
        assert!(gzip.contains(" 502"), "{out}");
        assert_eq!(out.matches("<redacted>").count(), 3, "{out}");
        assert!(origin.hits() >= 3);
        assert!(!resp.to_string().contains(ROUTE_SECRET));
    })
    .await
    .unwrap();
}

/// busybox wget ignores `NO_PROXY`: asked for `$CYNODE_EGRESS_ROUTES_URL/api/whoami`, it
/// sends the request to the proxy in absolute form (`GET http://127.0.0.1:3128/routes/…`),
/// which serves it as the route. An absolute-form request to another port of 127.0.0.1,
/// or to the proxy's address outside `/routes/`, is refused as before.
pub async fn egress_route_reached_in_absolute_form_by_busybox_wget(backend: &'static str) {
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let (server, origin) = route_server(backend, dir.path()).await;
        let mut script = String::from(
            "printf 'wget '; wget -q -O - \"$CYNODE_EGRESS_ROUTES_URL/api/whoami\"; echo; ",
        );
        script += &ask(
            "other-port",
            &format!(
                "GET http://127.0.0.1:{}/api/whoami HTTP/1.1\\r\\n\\r\\n",
                origin.port
            ),
        );
        script += &ask(
            "outside",
            "GET http://127.0.0.1:3128/api/whoami HTTP/1.1\\r\\n\\r\\n",
        );
        let req = restricted_job(&unique("egw"), &script, None, json!({}));
        let (code, resp) = server.post("/v1/worker/jobs:run", &req).await;
        if !gates_egress(backend) {
            assert_eq!(code, 400, "{resp}");
            return;
        }
        assert_eq!(code, 200, "{resp}");
        let out = resp["stdout"].as_str().unwrap();
        assert!(out.lines().any(|l| l == "wget authorized"), "{resp}");
        for tag in ["other-port", "outside"] {
            let line = out
                .lines()
                .find(|l| l.starts_with(&format!("{tag} ")))
                .unwrap_or_else(|| panic!("no {tag} line in {out}"));
            assert!(line.contains(" 403"), "{tag}: {out}");
        }
        assert_eq!(origin.hits(), 1, "{out}");
        assert_eq!(
            records(&resp, "route:api", "GET").len(),
            1,
            "{}",
            resp["egress"]
        );
        assert_denied(&resp, "127.0.0.1", "GET", "IP literal not listed");
    })
    .await
    .unwrap();
}

on_both_backends!(egress_jobs:
    egress_restricted_job_reaches_only_its_allowlist,
    egress_flood_keeps_the_node_answering_and_the_audit_bounded,
    egress_route_secret_never_enters_the_sandbox,
    egress_route_answers_never_carry_the_secret,
    egress_route_reached_in_absolute_form_by_busybox_wget,
);

/// The attack case on Podman and Docker with their warm pools on (`warm_pool.rs`).
mod warm {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn podman_restricted_job_takes_a_pooled_container() {
        crate::cases::setup();
        super::egress_restricted_job_reaches_only_its_allowlist("podman_warm").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn docker_restricted_job_takes_a_pooled_container() {
        crate::cases::setup();
        super::egress_restricted_job_reaches_only_its_allowlist("docker_warm").await;
    }
}

/// The host's root filesystem with the `/job` and `/workspace` mount points a sandbox
/// root needs: an overlay (lower `/`, upper a temp directory holding the two), unmounted
/// when dropped.
struct HostRoot {
    dir: tempfile::TempDir,
}

impl HostRoot {
    fn mount() -> HostRoot {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        for d in ["upper/job", "upper/workspace", "work", "merged"] {
            std::fs::create_dir_all(dir.path().join(d)).unwrap();
        }
        for d in ["", "upper", "merged"] {
            std::fs::set_permissions(dir.path().join(d), std::fs::Permissions::from_mode(0o755))
                .unwrap();
        }
        let opts = format!(
            "lowerdir=/,upperdir={},workdir={}",
            dir.path().join("upper").display(),
            dir.path().join("work").display()
        );
        let out = std::process::Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o", &opts])
            .arg(dir.path().join("merged"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        HostRoot { dir }
    }

    fn merged(&self) -> std::path::PathBuf {
        self.dir.path().join("merged")
    }
}

impl Drop for HostRoot {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.merged())
            .output();
    }
}

/// What a pip job's answer must show: completed, the wheel fetched once from the index
/// and the HTTPS origin reached once, each through the proxy and audited as allowed.
fn assert_fetched(
    code: u16,
    resp: &Value,
    downloads: &std::sync::atomic::AtomicUsize,
    secure: &Origin,
) {
    assert_eq!(code, 200, "{resp}");
    assert_eq!(resp["status"], "completed", "{resp}");
    assert_eq!(
        resp["stdout"], "fetched through the egress proxy\nhello from origin\n",
        "{resp}"
    );
    assert_eq!(downloads.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(secure.hits(), 1);
    let pip: Vec<&Value> = records(resp, "pypi.test", "GET");
    assert!(
        pip.len() >= 2 && pip.iter().all(|r| r["decision"] == "allowed"),
        "{}",
        resp["egress"]
    );
    let tls = records(resp, "secure.test", "CONNECT");
    assert!(
        tls.len() == 1 && tls[0]["bytes_down"].as_u64() > Some(1000),
        "{}",
        resp["egress"]
    );
}

/// A PEP 503 simple index on 127.0.0.1 serving one wheel; counts the wheel's downloads.
async fn index_with(wheel: Vec<u8>) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use axum::routing::get;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let downloads = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = downloads.clone();
    let name = "egresspkg-0.1-py3-none-any.whl";
    let page =
        format!("<!DOCTYPE html><html><body><a href=\"/files/{name}\">{name}</a></body></html>");
    let app = axum::Router::new()
        .route(
            "/simple/egresspkg/",
            get(move || async move { axum::response::Html(page) }),
        )
        .route(
            &format!("/files/{name}"),
            get(move || async move {
                counted.fetch_add(1, Ordering::SeqCst);
                wheel
            }),
        );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    (port, downloads)
}

/// The offline test image with the host's Debian Python and pip
/// (deploy/sba/build-python-test-image.sh, built by deploy/test-env.sh) and its root
/// filesystem for bwrap: (image, rootfs). Built once per test binary.
pub(crate) fn python_image() -> &'static (String, std::path::PathBuf) {
    static IMAGE: std::sync::OnceLock<(String, std::path::PathBuf)> = std::sync::OnceLock::new();
    IMAGE.get_or_init(|| {
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let base = env().image.clone();
        let image = "localhost/cynode-sba-test-python:latest".to_string();
        cynode_testkit::setup_script(
            &root,
            &["deploy/sba/build-python-test-image.sh", &base, &image],
        );
        let rootfs = cynode_testkit::setup_script(&root, &["deploy/sba/export-rootfs.sh", &image]);
        (image, rootfs.into())
    })
}

/// The same job on bwrap and on Podman, in the Python test image (busybox, the runner,
/// the host's python3 and pip): `pip install` of a wheel the test built, from a PEP 503
/// index on 127.0.0.1 reached by name through the proxy, then Python's own urllib to an
/// HTTPS origin with a CA made here, through CONNECT. Only the proxy's variables tell the
/// tools where to go.
async fn pip_installs_a_wheel_through_the_proxy(backend: &'static str) {
    crate::cases::setup();
    let (image, rootfs) = python_image();
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let (index_port, downloads) = index_with(crate::harness::wheel("egresspkg", "fetched through the egress proxy")).await;
        let (secure, ca) = Origin::https(dir.path(), "secure.test").await;
        let dns = Dns::start(&[
            ("pypi.test", &[Ipv4Addr::LOCALHOST]),
            ("secure.test", &[Ipv4Addr::LOCALHOST]),
        ])
        .await;
        // Continues the harness's `bwrap.rootfs` map (Podman runs the image itself).
        let config = format!(
            "    \"{image}\": {}\negress:\n  allow: [\"pypi.test:{index_port}\", \"secure.test:{}\", \"127.0.0.1\"]\n  nameservers: [\"{}\"]\n",
            rootfs.display(),
            secure.port,
            dns.addr
        );
        let server = Server::start(backend, &config);
        let script = format!(
            "set -e; printf '%s' \"$TEST_CA\" > /tmp/ca.pem; \
             python3 -m pip install --no-cache-dir --disable-pip-version-check -q \
               --index-url http://pypi.test:{index_port}/simple/ --trusted-host pypi.test:{index_port} \
               --target /workspace/site egresspkg; \
             PYTHONPATH=/workspace/site python3 -c 'import egresspkg; print(egresspkg.VALUE)'; \
             python3 -c 'import ssl, sys, urllib.request; \
ctx = ssl.create_default_context(cafile=\"/tmp/ca.pem\"); \
print(urllib.request.urlopen(sys.argv[1], context=ctx, timeout=20).read().decode())' \
               https://secure.test:{}/hello"
            , secure.port
        );
        let mut req = restricted_job(&unique("pip"), &script, None, json!({ "TEST_CA": ca }));
        req["sandbox"]["image"] = image.as_str().into();
        let (code, resp) = server.post("/v1/worker/jobs:run", &req).await;
        assert_fetched(code, &resp, &downloads, &secure);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bwrap_pip_installs_a_wheel_through_the_proxy() {
    pip_installs_a_wheel_through_the_proxy("bwrap").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_pip_installs_a_wheel_through_the_proxy() {
    pip_installs_a_wheel_through_the_proxy("podman").await;
}

/// bwrap with the host's root filesystem as the image (it has python3, pip and curl; the
/// busybox test image has neither): `pip install` of a wheel the test built, from a PEP
/// 503 index on 127.0.0.1 reached by name through the proxy, and curl to an HTTPS origin
/// with a CA made here through CONNECT. Only the proxy's variables tell the tools where
/// to go. (bwrap only: a full distribution's tools, curl among them; the Python test
/// image runs pip on both backends above.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bwrap_pip_installs_a_wheel_and_curl_reaches_https_through_the_proxy() {
    crate::cases::setup();
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let (index_port, downloads) = index_with(crate::harness::wheel("egresspkg", "fetched through the egress proxy")).await;
        let (secure, ca) = Origin::https(dir.path(), "secure.test").await;
        let dns = Dns::start(&[
            ("pypi.test", &[Ipv4Addr::LOCALHOST]),
            ("secure.test", &[Ipv4Addr::LOCALHOST]),
        ])
        .await;
        let host_image = "localhost/cynode-host-root:latest";
        let root = HostRoot::mount();
        // Continues the harness's `bwrap.rootfs` map: the host's / as an image.
        let config = format!(
            "    \"{host_image}\": {}\negress:\n  allow: [\"pypi.test:{index_port}\", \"secure.test:{}\", \"127.0.0.1\"]\n  nameservers: [\"{}\"]\n",
            root.merged().display(),
            secure.port,
            dns.addr
        );
        let server = Server::start("bwrap", &config);
        let script = format!(
            "set -e; printf '%s' \"$TEST_CA\" > /tmp/ca.pem; \
             /usr/bin/python3 -m pip install --no-cache-dir --disable-pip-version-check -q \
               --index-url http://pypi.test:{index_port}/simple/ --trusted-host pypi.test:{index_port} \
               --target /workspace/site egresspkg; \
             PYTHONPATH=/workspace/site /usr/bin/python3 -c 'import egresspkg; print(egresspkg.VALUE)'; \
             curl -sS --max-time 20 --cacert /tmp/ca.pem https://secure.test:{}/hello; echo"
            , secure.port
        );
        let mut req = restricted_job(&unique("pip"), &script, None, json!({ "TEST_CA": ca }));
        req["sandbox"]["image"] = host_image.into();
        let (code, resp) = server.post("/v1/worker/jobs:run", &req).await;
        assert_fetched(code, &resp, &downloads, &secure);
    })
    .await
    .unwrap();
}

/// Python's urllib reaches a route honouring `NO_PROXY` (straight to the proxy's listener,
/// origin form) and, with `NO_PROXY` unset as by a runtime that ignores it, through the
/// proxy in absolute form; the echoed secret comes back redacted. The Python test image,
/// on bwrap, Podman and Docker (loaded into its daemon here).
async fn python_urllib_reaches_a_route_either_way(backend: &'static str) {
    crate::cases::setup();
    let (image, rootfs) = python_image();
    if backend == "docker" {
        crate::harness::docker_ready();
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        cynode_testkit::setup_script(&root, &["deploy/docker/start.sh", image]);
    }
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        // Continues the harness's `bwrap.rootfs` map (the engines run the image itself).
        let extra = format!("    \"{image}\": {}\n", rootfs.display());
        let (server, origin) = route_server_with(backend, dir.path(), &extra).await;
        let fetch = "import os, sys, urllib.request as u; \
print(sys.argv[1], u.urlopen(os.environ[\"CYNODE_EGRESS_ROUTES_URL\"] + sys.argv[2], timeout=20).read().decode())";
        let script = format!(
            "set -e; python3 -c '{fetch}' direct /api/whoami; \
             env -u NO_PROXY -u no_proxy python3 -c '{fetch}' proxied /api/reflect"
        );
        let mut req = restricted_job(&unique("egp"), &script, None, json!({}));
        req["sandbox"]["image"] = image.as_str().into();
        let (code, resp) = server.post("/v1/worker/jobs:run", &req).await;
        assert_eq!(code, 200, "{resp}");
        assert_eq!(resp["status"], "completed", "{resp}");
        assert_eq!(
            resp["stdout"],
            format!("direct authorized\nproxied {REDACTED_ECHO}\n"),
            "{resp}"
        );
        assert_eq!(origin.hits(), 2);
        assert_eq!(records(&resp, "route:api", "GET").len(), 2, "{}", resp["egress"]);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bwrap_python_urllib_reaches_a_route_either_way() {
    python_urllib_reaches_a_route_either_way("bwrap").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_python_urllib_reaches_a_route_either_way() {
    python_urllib_reaches_a_route_either_way("podman").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_python_urllib_reaches_a_route_either_way() {
    python_urllib_reaches_a_route_either_way("docker").await;
}

/// curl (the host's, bwrap with the host's root filesystem as the image: the busybox and
/// Python test images have none) reaches a route honouring `NO_PROXY` and, with it unset,
/// through the proxy in absolute form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bwrap_curl_reaches_a_route_either_way() {
    crate::cases::setup();
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let host_image = "localhost/cynode-host-root:latest";
        let root = HostRoot::mount();
        let extra = format!("    \"{host_image}\": {}\n", root.merged().display());
        let (server, origin) = route_server_with("bwrap", dir.path(), &extra).await;
        let script = "set -e; printf 'direct '; curl -sS --max-time 20 \"$CYNODE_EGRESS_ROUTES_URL/api/whoami\"; echo; \
             printf 'proxied '; env -u NO_PROXY -u no_proxy curl -sS --max-time 20 \"$CYNODE_EGRESS_ROUTES_URL/api/reflect\"";
        let mut req = restricted_job(&unique("egc"), script, None, json!({}));
        req["sandbox"]["image"] = host_image.into();
        let (code, resp) = server.post("/v1/worker/jobs:run", &req).await;
        assert_eq!(code, 200, "{resp}");
        assert_eq!(
            resp["stdout"],
            format!("direct authorized\nproxied {REDACTED_ECHO}"),
            "{resp}"
        );
        assert_eq!(origin.hits(), 2);
        assert_eq!(records(&resp, "route:api", "GET").len(), 2, "{}", resp["egress"]);
    })
    .await
    .unwrap();
}
