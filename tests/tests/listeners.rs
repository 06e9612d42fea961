//! `cynode-pm serve` under floods from clients without a token: 64
//! slowloris heads, silent connections and unfinished 400 KB heads against a cap of 32
//! connections and two-second timeouts, over plain HTTP and over HTTPS. `/healthz` keeps
//! answering, the replica's descriptors and resident memory stay bounded, and every
//! stalled connection is closed.

use std::time::Duration;

use cynode_testkit::flood::{self, Stall};
use cynode_testkit::TestCa;

use crate::service::{start_replica_with, Replica};

/// The flags of a replica with a cap of 32 connections and two-second timeouts.
const TIGHT: [&str; 10] = [
    "--max-connections",
    "32",
    "--header-read-timeout-seconds",
    "2",
    "--idle-timeout-seconds",
    "2",
    "--tls-handshake-timeout-seconds",
    "2",
    "--max-header-bytes",
    "65536",
];

/// A replica with `extra` flags (no worker or model is needed for /healthz).
fn replica(dir: &std::path::Path, name: &str, extra: &[&str]) -> Replica {
    let db = format!("sqlite://{}", dir.join(format!("{name}.db")).display());
    let mut args: Vec<&str> = TIGHT.to_vec();
    args.extend_from_slice(extra);
    start_replica_with(
        dir,
        name,
        &db,
        "http://127.0.0.1:9/v1",
        &["--worker-endpoint", "http://127.0.0.1:9"],
        &args,
    )
}

/// `GET /healthz` on a new connection, bounded at two seconds, five times: all 200.
async fn assert_healthz_answers(client: &reqwest::Client, url: &str, during: &str) {
    for i in 0..5 {
        let r = client
            .get(format!("{url}/healthz"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .map_err(|e| format!("{e:?}"));
        assert_eq!(r, Ok(200), "/healthz probe {i} during {during}");
    }
}

/// 64 connections stalled with `stall` against the cap of 32: probes answer, the
/// replica's descriptors and memory stay bounded, and every stalled connection is closed
/// (displaced or timed out) within a few seconds.
async fn flood(r: &Replica, client: &reqwest::Client, url: &str, stall: Stall) {
    let addr = r.base.trim_start_matches("http://").to_string();
    let pid = r.pid();
    assert_healthz_answers(client, url, "no flood").await;
    let fds_before = flood::held_descriptors(pid);
    let rss_before = flood::rss_kib(pid);
    let attackers = flood::open(&addr, 64, stall);
    assert_eq!(attackers.len(), 64);
    assert_healthz_answers(client, url, &format!("64 stalled connections ({stall:?})")).await;
    let fds = flood::held_descriptors(pid);
    assert!(
        fds <= fds_before + 32 + 16,
        "the replica holds {fds} descriptors (before: {fds_before})"
    );
    let rss = flood::rss_kib(pid);
    assert!(
        rss < rss_before + 32 * 1024,
        "resident memory went from {rss_before} KiB to {rss} KiB"
    );
    let closed = flood::tcp_closed_within(attackers, Duration::from_secs(6));
    assert_eq!(closed, 64, "stalled connections left open ({stall:?})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_and_huge_heads_cannot_starve_pm_serve() {
    let dir = cynode_tests::tempdir().unwrap();
    let r = replica(dir.path(), "plain", &[]);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let url = r.base.clone();
    flood(&r, &client, &url, Stall::PartialHead).await;
    flood(&r, &client, &url, Stall::Silent).await;

    // Unfinished 400 KB heads: answered 431 and closed, not kept.
    let addr = r.base.trim_start_matches("http://").to_string();
    let rss_before = flood::rss_kib(r.pid());
    let huge = flood::open(&addr, 8, Stall::HugeHead(400_000));
    assert_healthz_answers(&client, &url, "huge heads").await;
    let rss = flood::rss_kib(r.pid());
    assert!(
        rss < rss_before + 32 * 1024,
        "resident memory went from {rss_before} KiB to {rss} KiB"
    );
    assert_eq!(
        flood::tcp_closed_within(huge, Duration::from_secs(5)),
        8,
        "huge heads left open"
    );

    // A kept-alive connection with nothing more to ask is closed after the idle timeout.
    assert!(
        flood::idle_keepalive_closed_within(&addr, Duration::from_secs(6)),
        "an idle keep-alive connection stayed open"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_tls_handshakes_cannot_starve_pm_serve() {
    let dir = cynode_tests::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "pm");
    let cert = ca.server(dir.path(), "pm-server");
    let r = replica(
        dir.path(),
        "tls",
        &[
            "--tls-cert-file",
            cert.cert_file.to_str().unwrap(),
            "--tls-key-file",
            cert.key_file.to_str().unwrap(),
        ],
    );
    let tls = cynode_tls::ClientTls {
        ca_file: Some(ca.cert_file.clone()),
        ..Default::default()
    };
    let client = tls
        .apply(reqwest::Client::builder().pool_max_idle_per_host(0))
        .unwrap()
        .build()
        .unwrap();
    let url = r.base.replacen("http://", "https://", 1);
    flood(&r, &client, &url, Stall::Silent).await;
}
