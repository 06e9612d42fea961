//! Workers the tests start themselves (not through the PM): `cynode-worker serve` in a
//! process group the test owns, on the bubblewrap backend and the test image.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use cynode_testkit::OwnedChild;
use serde_json::Value;

use crate::{bin, rootfs};

/// A worker started by the test (not by the PM), on `port` (0 = any).
/// Dropping it kills the worker's process group; its directory goes after.
pub struct Worker {
    _child: OwnedChild,
    pub addr: String,
    _dir: crate::TempDir,
}

pub const TOKEN: &str = "e2e-worker-token-0123456789";

impl Worker {
    /// An authorised `GET path` on this worker, bounded at 60 s.
    pub async fn get(&self, path: &str) -> reqwest::Response {
        reqwest::Client::new()
            .get(format!("http://{}{path}", self.addr))
            .bearer_auth(TOKEN)
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path} on the worker: {e}"))
    }
}

pub fn start_worker(port: u16) -> Worker {
    let dir = crate::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(dir.path().join("token"), TOKEN).unwrap();
    let cfg = format!(
        "listen: 127.0.0.1:{port}\nbackend: bwrap\nstate_dir: {}\ntoken_file: {}\nbwrap:\n  rootfs:\n    \"localhost/cynode-sba-test:latest\": {}\n",
        dir.path().join("state").display(),
        dir.path().join("token").display(),
        rootfs().display()
    );
    std::fs::write(dir.path().join("w.yaml"), cfg).unwrap();
    let (child, addr) = serve_worker(&dir.path().join("w.yaml"));
    Worker {
        _child: child,
        addr,
        _dir: dir,
    }
}

/// Starts `cynode-worker serve --config CONFIG` (the binary beside cynode-pm) in a process
/// group the test owns, and returns it with the address it reports listening on.
pub fn serve_worker(config: &Path) -> (OwnedChild, String) {
    use std::io::BufRead;
    let bin = bin("cynode-worker");
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--config"])
        .arg(config)
        .stderr(std::process::Stdio::piped());
    let mut child = OwnedChild::spawn(cmd);
    let stderr = child.child_mut().stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if v["fields"]["message"] == "cynode-worker listening" {
                    if let Some(t) = tx.take() {
                        let _ = t.send(v["fields"]["addr"].as_str().unwrap().to_string());
                    }
                }
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("the worker did not report its address within 60 s"));
    (child, addr)
}

/// A pass-through to the worker at `upstream` (`host:port`) that keeps the JSON body of
/// every job request (`POST /v1/worker/jobs`, or `jobs:run`): the Worker API requests a PM
/// dispatched, gateway grant included. Returns its own `http://` URL. A worker that is
/// gone answers 502.
pub async fn recording_front(
    upstream: String,
    seen: std::sync::Arc<std::sync::Mutex<Vec<Value>>>,
) -> String {
    use axum::extract::State;
    type Front = (String, std::sync::Arc<std::sync::Mutex<Vec<Value>>>);
    async fn forward(
        State((up, seen)): State<Front>,
        req: axum::extract::Request,
    ) -> axum::response::Response {
        let (parts, body) = req.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        let path = parts.uri.path();
        if parts.method == axum::http::Method::POST
            && (path == "/v1/worker/jobs" || path.ends_with("jobs:run"))
        {
            seen.lock()
                .unwrap()
                .push(serde_json::from_slice(&bytes).unwrap());
        }
        let mut r = reqwest::Client::new()
            .request(parts.method.clone(), format!("http://{up}{}", parts.uri))
            .body(bytes.to_vec());
        for h in ["authorization", "content-type", "accept"] {
            if let Some(v) = parts.headers.get(h) {
                r = r.header(h, v.to_str().unwrap());
            }
        }
        // A worker a test killed on purpose answers 502 here, as a proxy would, instead
        // of a panic in the front's task.
        let bad_gateway = |e: reqwest::Error| {
            axum::response::Response::builder()
                .status(502)
                .body(axum::body::Body::from(e.to_string()))
                .unwrap()
        };
        let resp = match r.send().await {
            Ok(r) => r,
            Err(e) => return bad_gateway(e),
        };
        let mut b = axum::response::Response::builder().status(resp.status().as_u16());
        if let Some(c) = resp.headers().get("content-type") {
            b = b.header("content-type", c.to_str().unwrap());
        }
        match resp.bytes().await {
            Ok(body) => b.body(axum::body::Body::from(body)).unwrap(),
            Err(e) => bad_gateway(e),
        }
    }
    let app = axum::Router::new()
        .fallback(forward)
        .with_state((upstream, seen));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    format!("http://{addr}")
}
