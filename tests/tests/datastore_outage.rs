//! A PostgreSQL outage under `cynode-pm serve`: requests are answered promptly with 503
//! problem+json naming the datastore, not held until the request timeout (408).
//!
//! The replica reaches the test PostgreSQL through a TCP relay this test owns; the
//! outage is the relay closing its listener and every connection it carried, so the
//! shared PostgreSQL (and the other tests on it) are never disturbed.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cynode_testkit::postgres_url;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::service::{start_replica_with, TENANT_A};

/// A TCP relay from a loopback port to `target`; [`Relay::cut`] is the outage.
struct Relay {
    port: u16,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Relay {
    async fn start(target: String) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let tasks: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let carried = tasks.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let target = target.clone();
                let relay = tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                carried.lock().unwrap().push(relay);
            }
        });
        tasks.lock().unwrap().push(accept);
        Relay { port, tasks }
    }

    /// Closes the listener and every relayed connection: nothing listens on the port.
    fn cut(&self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.cut();
    }
}

/// A fresh database on the test PostgreSQL: `(its URL, host:port of the server)`.
async fn fresh_database() -> (String, String) {
    let base = postgres_url();
    let name = format!("outage_{}", uuid::Uuid::new_v4().simple());
    sqlx::any::install_default_drivers();
    let pool = sqlx::AnyPool::connect(base).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&pool)
        .await
        .unwrap();
    let (prefix, _) = base.rsplit_once('/').unwrap();
    let server = url::Url::parse(base).unwrap();
    let addr = format!(
        "{}:{}",
        server.host_str().unwrap(),
        server.port().unwrap_or(5432)
    );
    (format!("{prefix}/{name}"), addr)
}

async fn get(url: &str) -> (u16, String, String) {
    let resp = reqwest::Client::new()
        .get(url)
        .bearer_auth(TENANT_A)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let kind = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    (status, kind, resp.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_is_answered_503_promptly() {
    let (db, server) = fresh_database().await;
    let relay = Relay::start(server.clone()).await;
    let relayed = db.replacen(&server, &format!("127.0.0.1:{}", relay.port), 1);
    assert_ne!(relayed, db, "the URL names {server}");
    let dir = cynode_tests::tempdir().unwrap();
    let replica = start_replica_with(
        dir.path(),
        "r1",
        &relayed,
        "http://127.0.0.1:9/v1",
        &["--worker-endpoint", "http://127.0.0.1:9"],
        &[],
    );
    let sessions = format!("{}/v1/sessions", replica.base);
    let (status, _, body) = get(&sessions).await;
    assert_eq!(status, 200, "{body}");

    relay.cut();
    for _ in 0..2 {
        let t = Instant::now();
        let (status, kind, body) = get(&sessions).await;
        let took = t.elapsed();
        assert_eq!(status, 503, "{body}");
        assert_eq!(kind, "application/problem+json", "{body}");
        let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(problem["status"], 503, "{problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.starts_with("datastore"), "{detail}");
        // Well before the 30 s request timeout that answered 408 before.
        assert!(took < Duration::from_secs(15), "answered after {took:?}");
    }
}
