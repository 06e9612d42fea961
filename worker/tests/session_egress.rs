//! Sessions with `network_policy: restricted` on the real node, on every backend: the
//! node's egress proxy at 127.0.0.1:3128 inside the session's network namespace (once for
//! a keep-alive container, per command under bubblewrap). A session reaches an allowed
//! origin through it across execs; a denied host is audited in that exec's response; a
//! direct connection fails; the byte budget is the session's, not each exec's; a list
//! wider than the node's is refused at create with a job's message; once the proxy's
//! sandbox is done its listener is gone (a connection made from inside the namespace,
//! kept open by the test, is refused) and the node holds no socket more than before; a
//! session without network has none; a route's secret is added by the node and found
//! nowhere in the session, its responses or the node's log. gVisor cannot bind the proxy
//! inside its sandboxes: `restricted` is refused there with a job's 400. Only 127.0.0.1
//! is reached; names come from a DNS server of the test's own.

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::egress::{route_server, Dns, Origin, ROUTE_CALL, ROUTE_SECRET, SECRET_SEARCH};
use crate::harness::{env, gates_egress, session_guard, unique, RemoveOnDrop, Server};

on_both_backends!(session_egress:
    session_egress_reaches_its_allowlist_across_execs_and_nothing_else,
    session_egress_proxy_is_gone_after_its_sandbox,
    session_egress_budget_is_the_sessions,
    session_egress_refusals_are_a_jobs_and_none_has_no_network,
    session_egress_route_secret_never_enters_the_session,
);

/// Every test's bound.
const TEST_TIME: Duration = Duration::from_secs(240);

/// A create body with `network_policy: restricted` and `egress_allow` when given.
fn restricted(session_id: &str, allow: Option<Value>) -> Value {
    let mut body = json!({
        "version": 1, "session_id": session_id, "task_id": unique("t-segress"),
        "image": env().image, "network_policy": "restricted"
    });
    if let Some(a) = allow {
        body["egress_allow"] = a;
    }
    body
}

fn exec_body(script: &str) -> Value {
    json!({ "version": 1, "command": ["sh", "-c", script], "timeout_seconds": 60 })
}

/// A node with egress on: `allow` is its ceiling, names from `dns`.
fn egress_config(allow: &[String], dns: &Dns, extra: &str) -> String {
    let list: Vec<String> = allow.iter().map(|a| format!("\"{a}\"")).collect();
    format!(
        "egress:\n  allow: [{}]\n  nameservers: [\"{}\"]\n{extra}",
        list.join(", "),
        dns.addr
    )
}

/// One GET through the proxy from inside; prints `<tag> <status line>`.
fn get(tag: &str, host: &str, port: u16, path: &str) -> String {
    format!(
        "printf '{tag} '; printf 'GET http://{host}:{port}{path} HTTP/1.1\\r\\nHost: {host}:{port}\\r\\n\\r\\n' \
         | nc -w 10 127.0.0.1 3128 | head -n 1; echo; "
    )
}

/// A direct connection to the host's `port`, bypassing the proxy.
fn bypass(port: u16) -> String {
    format!("if nc -w 3 127.0.0.1 {port} </dev/null; then echo BYPASSED; else echo bypass-refused; fi; ")
}

fn line(out: &str, tag: &str) -> String {
    out.lines()
        .find(|l| l.starts_with(&format!("{tag} ")))
        .unwrap_or_else(|| panic!("no {tag} line in {out}"))
        .to_string()
}

/// The records of `list` (an exec's `egress`, or a session's `egress.records`) for `host`.
fn records<'a>(list: &'a Value, host: &str) -> Vec<&'a Value> {
    list.as_array()
        .map(|a| a.iter().filter(|r| r["host"] == host).collect())
        .unwrap_or_default()
}

/// Creates the session; `None` when the backend cannot gate (then the 400 is checked).
async fn create(sv: &Server, body: &Value) -> Option<(String, RemoveOnDrop)> {
    let id = body["session_id"].as_str().unwrap().to_string();
    let guard = session_guard(sv.backend, &id);
    let (code, info) = sv.post("/v1/worker/sessions", body).await;
    if !gates_egress(sv.backend) {
        assert_eq!(code, 400, "{info}");
        assert!(
            info["detail"]
                .as_str()
                .unwrap_or("")
                .starts_with("network_policy: `restricted` is not offered on this node's backend"),
            "{info}"
        );
        return None;
    }
    assert_eq!(code, 201, "{info}");
    assert_eq!(
        info["egress"],
        json!({"records": [], "dropped": 0, "bytes": 0}),
        "{info}"
    );
    Some((id, guard))
}

/// The host pid of an `sh` whose command line holds `needle` inside a network namespace
/// other than the test's (not the engine or bwrap client that started it), waited for
/// (bounded).
async fn pid_with_arg(needle: &str) -> u32 {
    let until = Instant::now() + Duration::from_secs(30);
    let own = std::fs::read_link("/proc/self/ns/net").unwrap();
    loop {
        if let Ok(entries) = std::fs::read_dir("/proc") {
            for e in entries.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else {
                    continue;
                };
                let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
                let ns = std::fs::read_link(e.path().join("ns/net")).ok();
                // The command itself (`sh -c …`), not bwrap's own processes, which carry
                // the same argv and enter the namespace before the proxy is bound.
                if cmd.starts_with(b"sh\0")
                    && String::from_utf8_lossy(&cmd).contains(needle)
                    && ns.is_some_and(|n| n != own)
                {
                    return pid;
                }
            }
        }
        assert!(Instant::now() < until, "no process with {needle}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether something accepts a TCP connection at 127.0.0.1:3128 inside the network
/// namespace `ns` (joined on a thread of its own).
fn proxy_listens_in(ns: &std::fs::File) -> bool {
    let ns = ns.try_clone().unwrap();
    std::thread::spawn(move || {
        // SAFETY: setns on this thread only, with an fd of a network namespace; the
        // thread ends right after.
        let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
        std::net::TcpStream::connect_timeout(
            &"127.0.0.1:3128".parse().unwrap(),
            Duration::from_secs(3),
        )
        .is_ok()
    })
    .join()
    .unwrap()
}

/// The worker's open sockets.
fn sockets_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path())
                .map(|l| l.to_string_lossy().starts_with("socket:"))
                .unwrap_or(false)
        })
        .count()
}

/// Two execs reach the allowed origin through the proxy, each response listing only its
/// own attempts; a name outside the list is denied and audited in that exec; a direct
/// connection fails; the proxy variables are the node's (an exec's own are dropped);
/// GET shows the session's totals.
pub async fn session_egress_reaches_its_allowlist_across_execs_and_nothing_else(
    backend: &'static str,
) {
    tokio::time::timeout(TEST_TIME, async {
        let origin = Origin::http().await;
        let direct = Origin::http().await;
        let dns = Dns::start(&[("origin.test", &[Ipv4Addr::LOCALHOST])]).await;
        let p = origin.port;
        let allow = [format!("origin.test:{p}"), "127.0.0.1".into()];
        let sv = Server::start(backend, &egress_config(&allow, &dns, ""));
        let body = restricted(&unique("se"), Some(json!(allow)));
        let Some((id, _guard)) = create(&sv, &body).await else {
            return;
        };
        let exec = format!("/v1/worker/sessions/{id}/exec");
        let script = String::from("echo \"vars $HTTP_PROXY $https_proxy $NO_PROXY $CYNODE_EGRESS_ROUTES_URL\"; ")
            + &get("first", "origin.test", p, "/hello");
        let mut first = exec_body(&script);
        first["env"] = json!({"HTTP_PROXY": "http://evil.example:1", "no_proxy": "*"});
        let (code, r1) = sv.post(&exec, &first).await;
        assert_eq!(code, 200, "{r1}");
        assert_eq!(r1["status"], "completed", "{r1}");
        let out = r1["stdout"].as_str().unwrap();
        assert_eq!(
            line(out, "vars"),
            "vars http://127.0.0.1:3128 http://127.0.0.1:3128 localhost,127.0.0.1 http://127.0.0.1:3128/routes"
        );
        assert!(line(out, "first").contains(" 200"), "{out}");
        let mine = records(&r1["egress"], "origin.test");
        assert_eq!(mine.len(), 1, "{}", r1["egress"]);
        assert_eq!(mine[0]["decision"], "allowed");
        assert!(mine[0]["bytes_down"].as_u64() > Some(0), "{}", r1["egress"]);

        let script = get("second", "origin.test", p, "/hello")
            + &get("outside", "elsewhere.test", p, "/hello")
            + &bypass(direct.port);
        let (code, r2) = sv.post(&exec, &exec_body(&script)).await;
        assert_eq!(code, 200, "{r2}");
        let out = r2["stdout"].as_str().unwrap();
        assert!(line(out, "second").contains(" 200"), "{out}");
        assert!(line(out, "outside").contains(" 403"), "{out}");
        assert!(out.lines().any(|l| l == "bypass-refused"), "{out}");
        assert!(!out.contains("BYPASSED"), "{out}");
        // This exec's attempts only: its one GET of the origin, and the denied name.
        let list = r2["egress"].as_array().unwrap();
        assert_eq!(list.len(), 2, "{}", r2["egress"]);
        assert_eq!(records(&r2["egress"], "origin.test").len(), 1);
        let denied = records(&r2["egress"], "elsewhere.test");
        assert_eq!(denied.len(), 1, "{}", r2["egress"]);
        assert_eq!(denied[0]["decision"], "denied");
        assert!(
            denied[0]["reason"].as_str().unwrap().contains("not in the egress allowlist"),
            "{}",
            r2["egress"]
        );
        assert_eq!(origin.hits(), 2);
        assert_eq!(direct.hits(), 0);

        // An exec without any attempt lists none.
        let (_, r3) = sv.post(&exec, &exec_body("true")).await;
        assert_eq!(r3["egress"], json!([]), "{r3}");
        // The session's totals: all three attempts, and the bytes they carried.
        let (code, info) = sv.get(&format!("/v1/worker/sessions/{id}")).await;
        assert_eq!(code, 200, "{info}");
        assert_eq!(info["egress"]["records"].as_array().unwrap().len(), 3, "{info}");
        assert_eq!(records(&info["egress"]["records"], "origin.test").len(), 2);
        assert!(info["egress"]["bytes"].as_u64().unwrap() > 0, "{info}");
        let (code, ended) = sv.post(&format!("/v1/worker/sessions/{id}/end"), &json!({})).await;
        assert_eq!(code, 200, "{ended}");
        assert_eq!(ended["egress"]["records"], info["egress"]["records"], "{ended}");
    })
    .await
    .unwrap();
}

/// The proxy's listener lives exactly as long as the sandbox it serves: the test holds
/// the network namespace of a running command and connects to 127.0.0.1:3128 there.
/// Under bubblewrap the command's own proxy closes when the command ends; in a keep-alive
/// container the session's stays until the session ends (end, idle timeout, the
/// container killed), then closes.
/// The worker holds no socket more than before the session.
pub async fn session_egress_proxy_is_gone_after_its_sandbox(backend: &'static str) {
    tokio::time::timeout(TEST_TIME, async {
        let dns = Dns::start(&[]).await;
        let sv = Server::start(backend, &egress_config(&["allowed.test".into()], &dns, ""));
        let (code, _) = sv.get("/healthz").await;
        assert_eq!(code, 200);
        let before = sockets_of(sv.pid());
        // A keep-alive container can also die (killed by the engine): the reaper ends
        // the session then.
        let endings: &[&str] = if crate::harness::is_engine(backend) {
            &["end", "idle", "death"]
        } else {
            &["end", "idle"]
        };
        for &ending in endings {
            let mut body = restricted(&unique("sg"), None);
            if ending == "idle" {
                body["idle_timeout_seconds"] = json!(2);
            }
            let Some((id, _guard)) = create(&sv, &body).await else {
                return;
            };
            let marker = unique("holdns");
            let exec = format!("/v1/worker/sessions/{id}/exec");
            let run = {
                let script = format!("sleep 4; echo {marker} >/dev/null");
                let (url, client) = (sv.url(&exec), reqwest::Client::new());
                tokio::spawn(async move {
                    let r = client
                        .post(url)
                        .bearer_auth(crate::harness::TOKEN)
                        .json(&exec_body(&script))
                        .send()
                        .await
                        .unwrap();
                    crate::harness::answer(r).await
                })
            };
            let pid = pid_with_arg(&marker).await;
            let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).unwrap();
            assert!(proxy_listens_in(&ns), "no proxy while the command runs");
            let (code, v) = run.await.unwrap();
            assert_eq!(code, 200, "{v}");
            assert_eq!(v["status"], "completed", "{v}");
            if backend == "bwrap" {
                assert!(!proxy_listens_in(&ns), "the command's proxy outlived it");
            } else {
                assert!(
                    proxy_listens_in(&ns),
                    "the session's proxy ended with a command"
                );
            }
            if ending == "end" {
                let (code, v) = sv
                    .post(&format!("/v1/worker/sessions/{id}/end"), &json!({}))
                    .await;
                assert_eq!(code, 200, "{v}");
            } else {
                if ending == "death" {
                    let cli = crate::harness::engine_cli(backend).unwrap();
                    let out = std::process::Command::new(cli)
                        .args(["kill", &format!("cynode-session-{id}")])
                        .output()
                        .unwrap();
                    assert!(out.status.success(), "{cli} kill: {out:?}");
                }
                let reason = if ending == "death" {
                    "sandbox_exited"
                } else {
                    "idle_timeout"
                };
                let until = Instant::now() + Duration::from_secs(30);
                loop {
                    let (_, v) = sv.get(&format!("/v1/worker/sessions/{id}")).await;
                    if v["status"] == "ended" {
                        assert_eq!(v["end_reason"], reason, "{v}");
                        break;
                    }
                    assert!(Instant::now() < until, "never ended: {v}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                // The reaper removes the sandbox and closes the proxy in a task of its own.
                let until = Instant::now() + Duration::from_secs(30);
                while proxy_listens_in(&ns) {
                    assert!(
                        Instant::now() < until,
                        "the proxy outlived the session ({ending})"
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            assert!(
                !proxy_listens_in(&ns),
                "the proxy outlived the session ({ending})"
            );
        }
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let now = sockets_of(sv.pid());
            if now <= before {
                break;
            }
            assert!(
                Instant::now() < until,
                "the worker holds {now} sockets, {before} before the sessions"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .unwrap();
}

/// A 1 MiB byte budget is the session's: the first exec moves 800 kB through the proxy,
/// the second cannot move its 800 kB (a per-exec budget would let it).
pub async fn session_egress_budget_is_the_sessions(backend: &'static str) {
    tokio::time::timeout(TEST_TIME, async {
        let origin = Origin::http().await;
        let dns = Dns::start(&[("origin.test", &[Ipv4Addr::LOCALHOST])]).await;
        let p = origin.port;
        let allow = [format!("origin.test:{p}"), "127.0.0.1".into()];
        let sv = Server::start(backend, &egress_config(&allow, &dns, "  max_total_mb: 1\n"));
        let Some((id, _guard)) = create(&sv, &restricted(&unique("sb"), None)).await else {
            return;
        };
        let exec = format!("/v1/worker/sessions/{id}/exec");
        let script = format!(
            "i=0; while [ $i -lt 8 ]; do \
             printf 'GET http://origin.test:{p}/big HTTP/1.1\\r\\n\\r\\n' | nc -w 10 127.0.0.1 3128 | wc -c; \
             i=$((i+1)); done"
        );
        let sizes = |v: &Value| -> Vec<u64> {
            v["stdout"]
                .as_str()
                .unwrap()
                .lines()
                .map(|l| l.trim().parse().unwrap())
                .collect()
        };
        let (code, r1) = sv.post(&exec, &exec_body(&script)).await;
        assert_eq!(code, 200, "{r1}");
        let first = sizes(&r1);
        assert_eq!(first.len(), 8, "{r1}");
        assert!(first.iter().all(|n| *n > 100_000), "{first:?}");
        let (code, r2) = sv.post(&exec, &exec_body(&script)).await;
        assert_eq!(code, 200, "{r2}");
        let second = sizes(&r2);
        let full = second.iter().filter(|n| **n > 100_000).count();
        assert!(full < 4, "the second exec got a budget of its own: {second:?}");
        let (_, info) = sv.get(&format!("/v1/worker/sessions/{id}")).await;
        let bytes = info["egress"]["bytes"].as_u64().unwrap();
        assert!(bytes <= 1024 * 1024 + 200_000, "{bytes} bytes: {info}");
        assert!(bytes > 800_000, "{bytes} bytes: {info}");
    })
    .await
    .unwrap();
}

/// The detail of a refused job with this `sandbox` network, without its field name.
async fn job_refusal(sv: &Server, network: Value) -> String {
    let mut sandbox = json!({ "image": env().image, "command": ["true"] });
    for (k, v) in network.as_object().unwrap() {
        sandbox[k] = v.clone();
    }
    let job = json!({ "version": 1, "task_id": "t", "job_id": unique("j"), "sandbox": sandbox });
    let (code, v) = sv.post("/v1/worker/jobs:run", &job).await;
    assert_eq!(code, 400, "{v}");
    let d = v["detail"].as_str().unwrap();
    d.strip_prefix("sandbox.").unwrap_or(d).to_string()
}

/// A session's network is refused exactly as a job's (the same message, naming the
/// session's own field): `egress_allow` beyond the node's ceiling, `allow`, a list
/// without `restricted`. A session with `none` (the default) has no proxy, no variable
/// and no route; its responses carry no audit.
pub async fn session_egress_refusals_are_a_jobs_and_none_has_no_network(backend: &'static str) {
    tokio::time::timeout(TEST_TIME, async {
        let origin = Origin::http().await;
        let dns = Dns::start(&[]).await;
        let p = origin.port;
        let sv = Server::start(
            backend,
            &egress_config(&[format!("origin.test:{p}")], &dns, ""),
        );
        let cases = [
            json!({"network_policy": "restricted", "egress_allow": ["pypi.org"]}),
            json!({"network_policy": "allow"}),
            json!({"egress_allow": [format!("origin.test:{p}")]}),
        ];
        for network in cases {
            let mut body = restricted(&unique("sr"), None);
            body.as_object_mut().unwrap().remove("network_policy");
            for (k, v) in network.as_object().unwrap() {
                body[k] = v.clone();
            }
            let (code, v) = sv.post("/v1/worker/sessions", &body).await;
            assert_eq!(code, 400, "{network}: {v}");
            let expected = job_refusal(&sv, network.clone()).await;
            if !gates_egress(backend) && network["network_policy"] == "restricted" {
                assert!(
                    expected.starts_with("network_policy: `restricted` is not offered"),
                    "{expected}"
                );
            }
            assert_eq!(v["detail"].as_str().unwrap(), expected, "{network}");
        }
        // `none`: nothing at all.
        let id = unique("sn");
        let _guard = session_guard(sv.backend, &id);
        let body =
            json!({ "version": 1, "session_id": id, "task_id": unique("t"), "image": env().image });
        let (code, info) = sv.post("/v1/worker/sessions", &body).await;
        assert_eq!(code, 201, "{info}");
        assert!(info.get("egress").is_none(), "{info}");
        let script = format!(
            "echo \"vars[$HTTP_PROXY$https_proxy$CYNODE_EGRESS_ROUTES_URL]\"; \
             if nc -w 3 127.0.0.1 3128 </dev/null; then echo REACHED; else echo no-proxy; fi; {}",
            bypass(p)
        );
        let (code, r) = sv
            .post(
                &format!("/v1/worker/sessions/{id}/exec"),
                &exec_body(&script),
            )
            .await;
        assert_eq!(code, 200, "{r}");
        assert_eq!(r["stdout"], "vars[]\nno-proxy\nbypass-refused\n", "{r}");
        assert!(r.get("egress").is_none(), "{r}");
        assert_eq!(origin.hits(), 0);
        let (_, shown) = sv.get(&format!("/v1/worker/sessions/{id}")).await;
        assert!(shown.get("egress").is_none(), "{shown}");
        let (code, _) = sv
            .post(&format!("/v1/worker/sessions/{id}/end"), &json!({}))
            .await;
        assert_eq!(code, 200);
    })
    .await
    .unwrap();
}

/// A credentialed route in a session: the node adds the header (the origin says
/// `authorized`); the secret is in no exec's environment, process or file (searched from a
/// later exec, while a process the first exec left may still run), nor in any exec's
/// response, the session's info or end, or the node's log.
pub async fn session_egress_route_secret_never_enters_the_session(backend: &'static str) {
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let (sv, origin) = route_server(backend, dir.path()).await;
        let Some((id, _guard)) = create(&sv, &restricted(&unique("sr"), None)).await else {
            return;
        };
        let exec = format!("/v1/worker/sessions/{id}/exec");
        let call = format!("{ROUTE_CALL}(sleep 30 &) ; echo left");
        let (code, r1) = sv.post(&exec, &exec_body(&call)).await;
        assert_eq!(code, 200, "{r1}");
        let out = r1["stdout"].as_str().unwrap();
        assert!(
            out.contains("authorized"),
            "the route added its header: {out}"
        );
        assert_eq!(origin.hits(), 1);
        let (code, r2) = sv.post(&exec, &exec_body(SECRET_SEARCH)).await;
        assert_eq!(code, 200, "{r2}");
        assert_eq!(
            r2["stdout"], "0\nsearched\n",
            "the secret was found in the session: {r2}"
        );
        let (_, info) = sv.get(&format!("/v1/worker/sessions/{id}")).await;
        let (_, ended) = sv
            .post(&format!("/v1/worker/sessions/{id}/end"), &json!({}))
            .await;
        assert_eq!(
            records(&info["egress"]["records"], "route:api").len(),
            1,
            "the route call is not in the session's audit: {info}"
        );
        for (what, v) in [
            ("exec", &r1),
            ("search", &r2),
            ("info", &info),
            ("end", &ended),
        ] {
            assert!(!v.to_string().contains(ROUTE_SECRET), "{what}: {v}");
        }
        let log = sv.log.lock().unwrap().join("\n");
        assert!(
            !log.contains(ROUTE_SECRET),
            "the node's log holds the secret"
        );
    })
    .await
    .unwrap();
}
