//! `cynode-pm sessions show` of a session whose jobs went through a worker's egress
//! proxy: the `job_egress` events stored in a real SQLite store (in the shape the driver
//! stores a worker's `egress` audit), read back by the real binary in both output forms.

use std::process::Command;
use std::time::Duration;

use cynode_pm::config::datastore_url;
use cynode_pm::session::{egress, Budgets, SessionRecord};
use cynode_pm::store::Store;
use cynode_protocol::egress::{EgressDecision, EgressRecord};
use serde_json::{json, Value};

const LIMIT: Duration = Duration::from_secs(60);

fn record(i: usize, decision: EgressDecision) -> EgressRecord {
    EgressRecord {
        host: format!("h{i}.example"),
        port: 443,
        method: "CONNECT".into(),
        decision,
        reason: match decision {
            EgressDecision::Allowed => "ok".into(),
            EgressDecision::Denied => "not in the allowlist".into(),
        },
        bytes_up: 100 + i as u64,
        bytes_down: 2000 + i as u64,
    }
}

/// Stores a session with two jobs' egress: j-small (one allowed GET to 127.0.0.1, one
/// denied CONNECT) and j-big (25 records kept, 7 more only counted by the worker).
async fn stored_session(state: &std::path::Path) -> (String, Vec<EgressRecord>) {
    let store = Store::connect(&datastore_url(None, state)).await.unwrap();
    let id = format!("s-egress-{}", uuid::Uuid::new_v4().simple());
    let mut rec = SessionRecord::new(&id, "default", "fetch the deps", Budgets::default());
    assert!(store.create(&rec).await.unwrap());
    let small = vec![
        EgressRecord {
            host: "127.0.0.1".into(),
            port: 8080,
            method: "GET".into(),
            decision: EgressDecision::Allowed,
            reason: "ok".into(),
            bytes_up: 87,
            bytes_down: 1234,
        },
        EgressRecord {
            host: "evil.example".into(),
            port: 443,
            method: "CONNECT".into(),
            decision: EgressDecision::Denied,
            reason: "not in the allowlist".into(),
            bytes_up: 0,
            bytes_down: 0,
        },
    ];
    let big: Vec<EgressRecord> = (0..25)
        .map(|i| {
            record(
                i,
                if i % 5 == 0 {
                    EgressDecision::Allowed
                } else {
                    EgressDecision::Denied
                },
            )
        })
        .collect();
    // As the driver stores a worker's response (driver/await_job.rs).
    rec.event(
        "job_egress",
        json!({ "job_id": "j-small", "records": small, "dropped": 0 }),
    );
    rec.event(
        "job_result",
        json!({ "job_id": "j-small", "status": "completed" }),
    );
    rec.event(
        "job_egress",
        json!({ "job_id": "j-big", "records": big, "dropped": 7 }),
    );
    store.save(&rec, 1, &[]).await.unwrap();
    (id, big)
}

fn show(state: &std::path::Path, id: &str, json_out: bool) -> String {
    let mut c = Command::new(env!("CARGO_BIN_EXE_cynode-pm"));
    if json_out {
        c.args(["--output", "json"]);
    }
    c.args(["sessions", "show", id, "--state-dir"]).arg(state);
    let out = cynode_testkit::output_bounded(c, LIMIT);
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn sessions_show_lists_each_jobs_egress_bounded_and_all_of_it_in_json() {
    let state = tempfile::tempdir().unwrap();
    let (id, big) = stored_session(state.path()).await;

    // The library view of the stored events.
    let store = Store::connect(&datastore_url(None, state.path()))
        .await
        .unwrap();
    let (rec, _) = store.load(&id).await.unwrap().unwrap();
    let jobs = egress::of(&rec);
    assert_eq!(
        jobs.iter()
            .map(|j| (j.job_id.as_str(), j.records.len(), j.dropped))
            .collect::<Vec<_>>(),
        [("j-small", 2, 0), ("j-big", 25, 7)]
    );
    assert_eq!(jobs[1].records, big);

    let human = show(state.path(), &id, false);
    let lines: Vec<&str> = human.lines().collect();
    let at = |prefix: &str| {
        lines
            .iter()
            .position(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no line `{prefix}` in:\n{human}"))
    };
    let small = at("egress of job j-small:");
    assert_eq!(
        lines[small],
        "egress of job j-small: 2 attempts (1 allowed, 1 denied)"
    );
    assert_eq!(
        lines[small + 1],
        "  allowed GET 127.0.0.1:8080  ok  up 87 B, down 1234 B"
    );
    assert_eq!(
        lines[small + 2],
        "  denied  CONNECT evil.example:443  not in the allowlist  up 0 B, down 0 B"
    );
    let big_at = at("egress of job j-big:");
    assert_eq!(big_at, small + 3, "{human}");
    assert_eq!(
        lines[big_at],
        "egress of job j-big: 32 attempts (5 allowed, 20 denied, 7 beyond the worker's audit bound)"
    );
    // The first 20 records, in order, then what is left: 5 kept + 7 counted.
    for i in 0..20 {
        let l = lines[big_at + 1 + i];
        assert!(
            l.contains(&format!(" h{i}.example:443 "))
                && l.contains(&format!("down {} B", 2000 + i)),
            "{l}"
        );
    }
    assert_eq!(
        lines[big_at + 21],
        "  … 12 more (--output json lists every kept record)"
    );
    assert!(!human.contains("h20.example"), "{human}");

    let v: Value = serde_json::from_str(&show(state.path(), &id, true)).unwrap();
    let e = v["egress"].as_array().unwrap();
    assert_eq!(e.len(), 2, "{v}");
    assert_eq!(e[0]["job_id"], "j-small");
    assert_eq!(e[0]["records"][0]["decision"], "allowed");
    assert_eq!(e[0]["records"][0]["bytes_down"], 1234);
    assert_eq!(e[1]["records"].as_array().unwrap().len(), 25);
    assert_eq!(e[1]["records"][24]["host"], "h24.example");
    assert_eq!(e[1]["dropped"], 7);
}

/// A session without egress shows no egress lines, and its JSON an empty list.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_without_egress_shows_none() {
    let state = tempfile::tempdir().unwrap();
    let store = Store::connect(&datastore_url(None, state.path()))
        .await
        .unwrap();
    let rec = SessionRecord::new("s-offline", "default", "offline", Budgets::default());
    assert!(store.create(&rec).await.unwrap());
    assert!(!show(state.path(), "s-offline", false).contains("egress"));
    let v: Value = serde_json::from_str(&show(state.path(), "s-offline", true)).unwrap();
    assert_eq!(v["egress"], json!([]));
}
