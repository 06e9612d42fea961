//! Integration tests of cynode-protocol: schema drift and dependency hygiene, and
//! upstream CyNodeAI's shapes ([`upstream`]).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod seed_words;
mod upstream;

use std::path::PathBuf;
use std::process::Command;

fn schema_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("schemas")
}

#[test]
fn schemas_match_checked_in_files() {
    let regenerate = std::env::var_os("CYNODE_REGENERATE_SCHEMAS").is_some();
    let mut drift = Vec::new();
    for (name, text) in cynode_protocol::schema::all() {
        let path = schema_dir().join(name);
        if regenerate {
            std::fs::create_dir_all(schema_dir()).unwrap();
            std::fs::write(&path, &text).unwrap();
            continue;
        }
        match std::fs::read_to_string(&path) {
            Ok(existing) if existing == text => {}
            _ => drift.push(name),
        }
    }
    assert!(
        drift.is_empty(),
        "schemas out of date: {drift:?}\nregenerate with: \
         CYNODE_REGENERATE_SCHEMAS=1 cargo test -p cynode-protocol --test all"
    );
}

#[test]
fn job_schema_rejects_unknown_fields() {
    let text = std::fs::read_to_string(schema_dir().join("job.schema.json")).unwrap();
    let schema: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(schema["additionalProperties"], serde_json::json!(false));
    assert_eq!(schema["title"], serde_json::json!("JobSpec"));
}

#[test]
fn no_async_http_or_database_dependencies() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "-p",
            "cynode-protocol",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        tree.contains("serde_json"),
        "cargo tree printed nothing useful: {tree}"
    );
    for banned in ["tokio ", "axum ", "sqlx ", "reqwest ", "hyper "] {
        assert!(
            !tree.contains(banned),
            "cynode-protocol depends on {banned}:\n{tree}"
        );
    }
}
