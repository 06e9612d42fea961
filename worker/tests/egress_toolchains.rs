//! The dependency steps of node-test (`npm ci`), rust-test (`cargo fetch`) and go-test
//! (`go mod download`), for real, through the node's egress proxy, on bwrap
//! and Podman, in the toolchain test image (deploy/sba/build-toolchain-test-image.sh: the
//! host's Debian node, npm, go, cargo and rustc on the busybox test image).
//!
//! Each step is the one the PM renders: the skill is loaded from skills/ and built with
//! `fetch_deps: true` by the PM's own job builder, and its `deps` step runs as the SBA
//! job of a `network_policy: restricted` request whose `egress_allow` names the
//! registry. The registries are the test's own, on 127.0.0.1, with content it builds:
//! an npm registry over plain HTTP (a package's metadata and tarball, the project's
//! .npmrc and package-lock.json pointing there), a cargo sparse registry over HTTPS
//! reached through CONNECT with a CA made here (the project's .cargo/config.toml replaces
//! crates.io with it), and a Go module proxy over plain HTTP (the only change to the
//! rendered step: its `GOPROXY`; go.sum holds the module's hashes, so the checksum
//! database is not asked). Names resolve to 127.0.0.1 through a DNS server of the test's
//! own that the proxy asks; no default registry host is ever named, and the proxy would
//! refuse one. Each test asserts that the dependency is in the workspace or the tool's
//! cache afterwards (a second step of the same tool, offline, reads it there), that the
//! audit shows the allowed requests, and that the same job without the registry in its
//! `egress_allow` fails with a denied record and never reaches the registry. For
//! node-test and go-test the skill's own test step then runs too (`npm test`, `go test
//! ./...`, offline) and uses the dependency; rust-test's cannot (the image has no Rust
//! standard library or linker).

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sha2::{Digest, Sha256, Sha512};

use crate::egress::{certificates, Dns};
use crate::harness::{unique, Server};

/// Every test's bound.
const TEST_TIME: Duration = Duration::from_secs(300);
/// A name the node's allowlist holds that no registry answers to: the denied job's
/// `egress_allow`.
const OTHER: &str = "other.test";

// --- the image and the skills -----------------------------------------------------------

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The toolchain test image (built by deploy/test-env.sh; cheap here once it is) and its
/// root filesystem for bwrap: (image, rootfs). Built once per test binary.
fn toolchain_image() -> &'static (String, PathBuf) {
    static IMAGE: std::sync::OnceLock<(String, PathBuf)> = std::sync::OnceLock::new();
    IMAGE.get_or_init(|| {
        let root = repo_root();
        let base = crate::harness::env().image.clone();
        let image = "localhost/cynode-sba-test-toolchains:latest".to_string();
        cynode_testkit::setup_script(
            &root,
            &["deploy/sba/build-toolchain-test-image.sh", &base, &image],
        );
        let rootfs = cynode_testkit::setup_script(&root, &["deploy/sba/export-rootfs.sh", &image]);
        (image, rootfs.into())
    })
}

/// The job the PM builds for `skill` with `fetch_deps: true` (its own registry and job
/// builder over skills/), its steps taken out: the steps' commands, arguments and
/// environments are the skill's, unchanged. Returns (job, the `deps` step, the `test`
/// step).
fn rendered_fetch_job(skill: &str) -> (Value, Value, Value) {
    use cynode_pm::skills::{build_job, JobRef, Registry};
    let registry = Registry::load(&[repo_root().join("skills")])
        .unwrap_or_else(|e| panic!("skills/ does not load: {e:?}"));
    let r = JobRef {
        session_id: "s-toolchains".into(),
        task_id: "t-toolchains".into(),
        attempt: 0,
    };
    let built = build_job(
        registry.get(skill).expect("the skill is registered"),
        &json!({ "fetch_deps": true }),
        &r,
    )
    .unwrap_or_else(|e| panic!("{skill}: {e}"));
    let mut job = built.value;
    assert_eq!(
        job["constraints"]["ext_net_allowed"], true,
        "{skill} asks for network"
    );
    let step = |id: &str| {
        job["steps"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["id"] == id))
            .unwrap_or_else(|| panic!("{skill} has no {id} step: {job}"))
            .clone()
    };
    let (deps, test) = (step("deps"), step("test"));
    job["steps"] = json!([]);
    (job, deps, test)
}

/// The same tool as `deps`, offline, in the same environment (plus `extra_env`): it
/// reads what the fetch left in the workspace or the cache.
fn check_step(deps: &Value, args: &[&str], extra_env: &[(&str, &str)]) -> Value {
    let mut step = deps.clone();
    step["id"] = json!("check");
    step["arguments"]["args"] = json!(args);
    for (k, v) in extra_env {
        step["arguments"]["env"][*k] = json!(v);
    }
    step
}

// --- registries of the test's own ------------------------------------------------------

/// Files served by path on 127.0.0.1 over plain HTTP or HTTPS, each request's path
/// recorded.
struct Registry {
    port: u16,
    requests: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Registry {
    /// A listener first (the files name the port), then [`Registry::serve`].
    fn bind() -> (std::net::TcpListener, u16) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        (l, port)
    }

    /// Serves `files` on `l`; with `tls` (directory, name) over HTTPS with a certificate
    /// for that name from a CA made here, whose PEM is returned.
    fn serve(
        l: std::net::TcpListener,
        files: HashMap<String, Vec<u8>>,
        tls: Option<(&Path, &str)>,
    ) -> (Registry, Option<String>) {
        let port = l.local_addr().unwrap().port();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = requests.clone();
        let files = Arc::new(files);
        let app = axum::Router::new().fallback(move |uri: axum::http::Uri| {
            let files = files.clone();
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(uri.path().to_string());
                match files.get(uri.path()) {
                    Some(body) => (axum::http::StatusCode::OK, body.clone()),
                    None => (axum::http::StatusCode::NOT_FOUND, b"not found".to_vec()),
                }
            }
        });
        let (tls, ca) = match tls {
            Some((dir, name)) => {
                let (ca, cert, key) = certificates(name);
                let cert_file = dir.join(format!("{name}.pem"));
                let key_file = dir.join(format!("{name}-key.pem"));
                std::fs::write(&cert_file, cert).unwrap();
                std::fs::write(&key_file, key).unwrap();
                let tls = cynode_tls::ServerTls {
                    cert_file,
                    key_file,
                    client_ca_file: None,
                };
                (Some(tls), Some(ca))
            }
            None => (None, None),
        };
        let task = tokio::spawn(async move {
            let _ = cynode_tls::serve(l, app, tls, std::future::pending()).await;
        });
        (
            Registry {
                port,
                requests,
                task,
            },
            ca,
        )
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }

    fn count(&self, path: &str) -> usize {
        self.requests().iter().filter(|p| *p == path).count()
    }
}

/// Standard base64 with padding (npm's `integrity`, go.sum's `h1:`).
fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A gzipped tar of `files` (relative paths) made by the host's GNU tar with fixed owner
/// and times: npm's package tarball and cargo's .crate.
fn tgz(dir: &Path, name: &str, files: &[(&str, &str)]) -> Vec<u8> {
    let src = dir.join(format!("{name}.src"));
    for (path, content) in files {
        let p = src.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content).unwrap();
    }
    let out_file = dir.join(name);
    let top: Vec<&str> = {
        let mut t: Vec<&str> = files
            .iter()
            .map(|(p, _)| p.split('/').next().unwrap())
            .collect();
        t.sort_unstable();
        t.dedup();
        t
    };
    let out = Command::new("tar")
        .args([
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--mtime=2024-01-01",
            "-czf",
        ])
        .arg(&out_file)
        .arg("-C")
        .arg(&src)
        .args(&top)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    std::fs::read(out_file).unwrap()
}

/// A plain tar of `files` (a workspace's seed).
fn tar_of(files: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, path, &data[..]).unwrap();
    }
    b.into_inner().unwrap()
}

// --- one fetch job, allowed and denied ------------------------------------------------

/// One ecosystem's case: its registry, the workspace's files, the job's steps.
struct Case {
    /// The registry's name (resolved to 127.0.0.1 by the test's DNS).
    host: &'static str,
    registry: Registry,
    /// The CONNECT (HTTPS) or GET (plain HTTP) the tool sends the proxy.
    method: &'static str,
    workspace: Vec<(&'static str, Vec<u8>)>,
    /// The job: the rendered job with its steps (the fetch, then the offline check).
    job: Value,
    /// The paths the registry must have served, once each at least.
    fetched: Vec<String>,
}

fn request(case: &Case, image: &str, ws: &str, allow: &[String]) -> (String, Value) {
    let id = unique("tc");
    let mut spec = case.job.clone();
    spec["job_id"] = json!(id);
    let req = json!({
        "version": 1, "task_id": spec["task_id"], "job_id": id, "workspace_id": ws,
        "sandbox": {
            "image": image, "job_spec_json": spec.to_string(),
            "network_policy": "restricted", "egress_allow": allow,
        }
    });
    (id, req)
}

/// The audit records of `resp` for `host`.
fn records<'a>(resp: &'a Value, host: &str) -> Vec<&'a Value> {
    resp["egress"]
        .as_array()
        .map(|a| a.iter().filter(|r| r["host"] == host).collect())
        .unwrap_or_default()
}

/// Runs `case` on `backend`: with the registry allowed, the fetch succeeds, the check
/// step finds the dependency and the audit shows the allowed requests; returns the
/// stdout of each step after the fetch, the workspace's directory on the host and the
/// node (which keeps the workspace). Then the same job in a fresh
/// workspace with only [`OTHER`] allowed fails with a denied record, and the registry
/// sees nothing of it.
async fn run_case(backend: &'static str, case: Case) -> (Vec<String>, PathBuf, Server) {
    let (image, rootfs) = toolchain_image();
    let dns = Dns::start(&[(case.host, &[Ipv4Addr::LOCALHOST])]).await;
    let registry_pattern = format!("{}:{}", case.host, case.registry.port);
    // Continues the harness's `bwrap.rootfs` map (Podman runs the image itself).
    let config = format!(
        "    \"{image}\": {}\negress:\n  allow: [\"{registry_pattern}\", \"{OTHER}\", \"127.0.0.1\"]\n  nameservers: [\"{}\"]\n",
        rootfs.display(),
        dns.addr
    );
    let server = Server::start(backend, &config);

    let ws = unique("ws");
    let (code, v) = server.put_tar(&ws, tar_of(&case.workspace)).await;
    assert_eq!(code, 201, "{v}");
    let started = Instant::now();
    let (_, req) = request(&case, image, &ws, std::slice::from_ref(&registry_pattern));
    let (code, resp) = server.post("/v1/worker/jobs:run", &req).await;
    eprintln!(
        "{backend} {}: the allowed fetch job took {:?}",
        case.host,
        started.elapsed()
    );
    assert_eq!(code, 200, "{resp}");
    assert_eq!(resp["status"], "completed", "{resp}");
    let sba = &resp["sba_result"];
    assert_eq!(sba["status"], "success", "{sba:#}");
    for path in &case.fetched {
        assert!(
            case.registry.count(path) >= 1,
            "{path} was not fetched: {:?}",
            case.registry.requests()
        );
    }
    // No other host was asked for (no default registry, no checksum database).
    assert!(
        resp["egress"]
            .as_array()
            .is_some_and(|a| a.iter().all(|r| r["host"] == case.host)),
        "{}",
        resp["egress"]
    );
    let audit = records(&resp, case.host);
    assert!(
        !audit.is_empty()
            && audit
                .iter()
                .all(|r| r["decision"] == "allowed" && r["method"] == case.method),
        "{}",
        resp["egress"]
    );
    assert!(
        audit
            .iter()
            .map(|r| r["bytes_down"].as_u64().unwrap_or(0))
            .sum::<u64>()
            > 0,
        "{}",
        resp["egress"]
    );
    let outputs: Vec<String> = sba["steps"]
        .as_array()
        .unwrap()
        .iter()
        .skip(1)
        .map(|s| {
            s["result"]["stdout"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    let workspace = server.state_dir().join("workspaces").join(&ws);

    // The same job, the registry not in its list: denied and audited, nothing reached.
    let served = case.registry.requests().len();
    let ws2 = unique("ws");
    let (code, v) = server.put_tar(&ws2, tar_of(&case.workspace)).await;
    assert_eq!(code, 201, "{v}");
    let started = Instant::now();
    let (_, req) = request(&case, image, &ws2, &[OTHER.to_string()]);
    let (code, resp) = server.post("/v1/worker/jobs:run", &req).await;
    eprintln!(
        "{backend} {}: the denied fetch job took {:?}",
        case.host,
        started.elapsed()
    );
    assert_eq!(code, 200, "{resp}");
    assert_ne!(resp["sba_result"]["status"], "success", "{resp}");
    assert_eq!(
        resp["sba_result"]["steps"][0]["id"], "deps",
        "{}",
        resp["sba_result"]
    );
    assert_ne!(
        resp["sba_result"]["steps"][0]["result"]["exit_code"], 0,
        "{}",
        resp["sba_result"]
    );
    let denied = records(&resp, case.host);
    assert!(
        denied.iter().any(|r| r["decision"] == "denied"
            && r["method"] == case.method
            && r["reason"]
                .as_str()
                .unwrap_or("")
                .contains("not in the egress allowlist")),
        "{}",
        resp["egress"]
    );
    assert!(
        denied.iter().all(|r| r["decision"] == "denied"),
        "{}",
        resp["egress"]
    );
    assert_eq!(
        case.registry.requests().len(),
        served,
        "the denied job reached the registry"
    );
    (outputs, workspace, server)
}

// --- npm ---------------------------------------------------------------------------------

/// `npm ci` of a project depending on `cynode-dep` 1.0.0, from an npm registry over plain
/// HTTP (metadata and a tarball made here; package-lock.json with its sha512 integrity);
/// node_modules/cynode-dep is in the workspace afterwards, and `npm ls` (offline) lists it.
async fn npm_ci_fetches_through_the_proxy(backend: &'static str) {
    crate::cases::setup();
    toolchain_image();
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let host = "npm.test";
        let (listener, port) = Registry::bind();
        let base = format!("http://{host}:{port}");
        let index_js = "module.exports = 'fetched through the egress proxy';\n";
        let tarball = tgz(
            dir.path(),
            "cynode-dep-1.0.0.tgz",
            &[
                (
                    "package/package.json",
                    r#"{"name":"cynode-dep","version":"1.0.0","main":"index.js"}"#,
                ),
                ("package/index.js", index_js),
            ],
        );
        let integrity = format!("sha512-{}", base64(&Sha512::digest(&tarball)));
        let tarball_path = "/cynode-dep/-/cynode-dep-1.0.0.tgz".to_string();
        let metadata = json!({
            "name": "cynode-dep", "dist-tags": { "latest": "1.0.0" },
            "versions": { "1.0.0": {
                "name": "cynode-dep", "version": "1.0.0",
                "dist": { "tarball": format!("{base}{tarball_path}"), "integrity": integrity }
            } }
        });
        let files = HashMap::from([
            ("/cynode-dep".to_string(), metadata.to_string().into_bytes()),
            (tarball_path.clone(), tarball),
        ]);
        let (registry, _) = Registry::serve(listener, files, None);
        let lock = json!({
            "name": "app", "version": "1.0.0", "lockfileVersion": 3, "requires": true,
            "packages": {
                "": { "name": "app", "version": "1.0.0", "dependencies": { "cynode-dep": "1.0.0" } },
                "node_modules/cynode-dep": {
                    "version": "1.0.0", "resolved": format!("{base}{tarball_path}"), "integrity": integrity
                }
            }
        });
        let package = json!({
            "name": "app", "version": "1.0.0", "private": true,
            "dependencies": { "cynode-dep": "1.0.0" },
            "scripts": {
                "test": "node -e \"if (require('cynode-dep') !== 'fetched through the egress proxy') process.exit(1); console.log('dependency used')\""
            }
        });
        let (mut job, deps, test) = rendered_fetch_job("node-test");
        let check = check_step(&deps, &["ls", "--all", "--offline"], &[]);
        // Then the skill's own test step (`npm test`, offline) uses the dependency.
        job["steps"] = json!([deps, check, test]);
        let case = Case {
            host,
            registry,
            method: "GET",
            workspace: vec![
                ("package.json", package.to_string().into_bytes()),
                ("package-lock.json", lock.to_string().into_bytes()),
                (".npmrc", format!("registry={base}/\n").into_bytes()),
            ],
            job,
            fetched: vec![tarball_path],
        };
        let (out, workspace, _server) = run_case(backend, case).await;
        assert!(out[0].contains("cynode-dep@1.0.0"), "{out:?}");
        assert_eq!(out[1].trim(), "dependency used", "{out:?}");
        let fetched =
            std::fs::read_to_string(workspace.join("node_modules/cynode-dep/index.js")).unwrap();
        assert_eq!(fetched, index_js);
    })
    .await
    .unwrap();
}

// --- cargo -------------------------------------------------------------------------------

/// `cargo fetch` of a crate depending on `cynodedep` 0.1.0, from a sparse registry over
/// HTTPS (CONNECT; a CA made here, named by the project's .cargo/config.toml, which
/// replaces crates.io with the registry); Cargo.lock records it with its checksum, and
/// `cargo metadata --offline` finds its sources in CARGO_HOME.
async fn cargo_fetch_fetches_through_the_proxy(backend: &'static str) {
    crate::cases::setup();
    toolchain_image();
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let host = "crates.test";
        let (listener, port) = Registry::bind();
        let base = format!("https://{host}:{port}");
        let krate = tgz(
            dir.path(),
            "cynodedep-0.1.0.crate",
            &[
                (
                    "cynodedep-0.1.0/Cargo.toml",
                    "[package]\nname = \"cynodedep\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
                ),
                (
                    "cynodedep-0.1.0/src/lib.rs",
                    "pub const VALUE: &str = \"fetched through the egress proxy\";\n",
                ),
            ],
        );
        let cksum = hex::encode(Sha256::digest(&krate));
        let index_line = json!({
            "name": "cynodedep", "vers": "0.1.0", "deps": [], "cksum": cksum,
            "features": {}, "yanked": false
        });
        let crate_path = "/dl/cynodedep/0.1.0/download".to_string();
        let files = HashMap::from([
            (
                "/index/config.json".to_string(),
                json!({ "dl": format!("{base}/dl") }).to_string().into_bytes(),
            ),
            (
                "/index/cy/no/cynodedep".to_string(),
                format!("{index_line}\n").into_bytes(),
            ),
            (crate_path.clone(), krate),
        ]);
        let (registry, ca) = Registry::serve(listener, files, Some((dir.path(), host)));
        let config = format!(
            "[source.crates-io]\nreplace-with = \"test-registry\"\n\n\
             [source.test-registry]\nregistry = \"sparse+{base}/index/\"\n\n\
             [http]\ncainfo = \"/workspace/.cargo/test-ca.pem\"\n"
        );
        // Not the skill's test step: the image has no Rust standard library or linker.
        let (mut job, deps, _) = rendered_fetch_job("rust-test");
        let check = check_step(
            &deps,
            &["metadata", "--offline", "--format-version", "1", "--color", "never"],
            &[],
        );
        job["steps"] = json!([deps, check]);
        let case = Case {
            host,
            registry,
            method: "CONNECT",
            workspace: vec![
                (
                    "Cargo.toml",
                    b"[package]\nname = \"app\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[dependencies]\ncynodedep = \"0.1.0\"\n".to_vec(),
                ),
                ("src/lib.rs", b"pub use cynodedep::VALUE;\n".to_vec()),
                (".cargo/config.toml", config.into_bytes()),
                (".cargo/test-ca.pem", ca.unwrap().into_bytes()),
            ],
            job,
            fetched: vec![
                "/index/config.json".into(),
                "/index/cy/no/cynodedep".into(),
                crate_path,
            ],
        };
        let (out, workspace, _server) = run_case(backend, case).await;
        let metadata = &out[0];
        assert!(
            metadata.contains("/tmp/cargo-home/registry/src/")
                && metadata.contains("cynodedep-0.1.0/Cargo.toml"),
            "{metadata}"
        );
        let lock = std::fs::read_to_string(workspace.join("Cargo.lock")).unwrap();
        assert!(
            lock.contains("name = \"cynodedep\"") && lock.contains(&cksum),
            "{lock}"
        );
    })
    .await
    .unwrap();
}

// --- go ----------------------------------------------------------------------------------

/// go.sum's `h1:` hash (golang.org/x/mod/sumdb/dirhash.Hash1) of `files` (name, content).
fn dirhash(files: &[(String, Vec<u8>)]) -> String {
    let mut sorted: Vec<&(String, Vec<u8>)> = files.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut summary = String::new();
    for (name, data) in sorted {
        summary += &format!("{}  {name}\n", hex::encode(Sha256::digest(data)));
    }
    format!("h1:{}", base64(&Sha256::digest(summary.as_bytes())))
}

/// A module zip of `files` (name, content), made with the host's python3 zipfile.
fn module_zip(dir: &Path, files: &[(String, Vec<u8>)]) -> Vec<u8> {
    let src = dir.join("zip-src");
    let mut names = Vec::new();
    for (name, data) in files {
        let p = src.join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
        names.push(name.clone());
    }
    let out_file = dir.join("module.zip");
    let script = "import sys, zipfile\n\
        with zipfile.ZipFile(sys.argv[1], 'w') as z:\n\
        \x20   for name in sys.argv[3:]:\n\
        \x20       z.write(sys.argv[2] + '/' + name, name)\n";
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(&out_file)
        .arg(&src)
        .args(&names)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    std::fs::read(out_file).unwrap()
}

/// `go mod download` of a module requiring `example.test/dep` v0.1.0, from a Go module
/// proxy over plain HTTP (list, info, mod and a zip made here; go.sum holds their hashes,
/// so the checksum database is never asked); `go list -m` (GOPROXY=off) finds the module
/// in the module cache under GOPATH.
async fn go_mod_download_fetches_through_the_proxy(backend: &'static str) {
    crate::cases::setup();
    toolchain_image();
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let host = "goproxy.test";
        let (listener, port) = Registry::bind();
        let module = "example.test/dep";
        let go_mod = format!("module {module}\n\ngo 1.19\n").into_bytes();
        let prefix = format!("{module}@v0.1.0/");
        let zip_files = vec![
            (format!("{prefix}go.mod"), go_mod.clone()),
            (
                format!("{prefix}dep.go"),
                b"package dep\n\nconst Value = \"fetched through the egress proxy\"\n".to_vec(),
            ),
        ];
        let zip = module_zip(dir.path(), &zip_files);
        let go_sum = format!(
            "{module} v0.1.0 {}\n{module} v0.1.0/go.mod {}\n",
            dirhash(&zip_files),
            dirhash(&[("go.mod".to_string(), go_mod.clone())])
        );
        let at = format!("/{module}/@v");
        let files = HashMap::from([
            (format!("{at}/list"), b"v0.1.0\n".to_vec()),
            (
                format!("{at}/v0.1.0.info"),
                br#"{"Version":"v0.1.0","Time":"2024-01-01T00:00:00Z"}"#.to_vec(),
            ),
            (format!("{at}/v0.1.0.mod"), go_mod),
            (format!("{at}/v0.1.0.zip"), zip),
        ]);
        let (registry, _) = Registry::serve(listener, files, None);
        let (mut job, mut deps, test) = rendered_fetch_job("go-test");
        // The one change to the rendered step: where the module proxy is.
        assert!(deps["arguments"]["env"]["GOPROXY"].is_string(), "{deps}");
        deps["arguments"]["env"]["GOPROXY"] = json!(format!("http://{host}:{port}"));
        let check = check_step(
            &deps,
            &[
                "list",
                "-m",
                "-f",
                "{{.Path}} {{.Version}} {{.Dir}}",
                module,
            ],
            &[("GOPROXY", "off")],
        );
        // Then the skill's own test step (`go test ./...`, GOPROXY=off) builds with it.
        job["steps"] = json!([deps, check, test]);
        let case = Case {
            host,
            registry,
            method: "GET",
            workspace: vec![
                (
                    "go.mod",
                    format!("module example.test/app\n\ngo 1.19\n\nrequire {module} v0.1.0\n")
                        .into_bytes(),
                ),
                ("go.sum", go_sum.into_bytes()),
                (
                    "app.go",
                    format!("package app\n\nimport \"{module}\"\n\nvar V = dep.Value\n")
                        .into_bytes(),
                ),
                (
                    "app_test.go",
                    b"package app\n\nimport \"testing\"\n\nfunc TestValue(t *testing.T) {\n\tif V != \"fetched through the egress proxy\" {\n\t\tt.Fatal(V)\n\t}\n}\n".to_vec(),
                ),
            ],
            job,
            fetched: vec![format!("{at}/v0.1.0.mod"), format!("{at}/v0.1.0.zip")],
        };
        let (out, _workspace, _server) = run_case(backend, case).await;
        assert_eq!(
            out[0].trim(),
            format!("{module} v0.1.0 /tmp/go/pkg/mod/{module}@v0.1.0"),
            "{out:?}"
        );
        assert!(out[1].starts_with("ok "), "{out:?}");
    })
    .await
    .unwrap();
}

/// `<backend>_<case>` tests for bwrap and Podman (the backends that bind the proxy in the
/// sandbox; Docker and gVisor refuse `restricted`, tested in egress_jobs.rs).
macro_rules! on_proxy_backends {
    ($($case:ident),* $(,)?) => {
        mod bwrap {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case("bwrap").await;
                }
            )*
        }
        mod podman {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case("podman").await;
                }
            )*
        }
    };
}

on_proxy_backends!(
    npm_ci_fetches_through_the_proxy,
    cargo_fetch_fetches_through_the_proxy,
    go_mod_download_fetches_through_the_proxy,
);
