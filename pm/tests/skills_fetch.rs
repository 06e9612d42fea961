//! node-test, rust-test and go-test with `fetch_deps`, as python-test: the job asks for
//! network and runs the ecosystem's dependency step (`npm ci`, `cargo fetch`, `go mod
//! download`) before its tests, from the skill's declared egress hosts; without
//! `fetch_deps` it stays offline with the test step alone. The policy gate refuses the
//! fetching job for a tenant whose egress does not cover those hosts, and lets it
//! through for one that does. (Rendered and gated here; the real fetches, with the
//! rendered steps run through the node's proxy against local registries, are the worker's
//! `egress_jobs` (pip) and `egress_toolchains` (npm, cargo, go) tests.)

use cynode_pm::policy::{LocalGate, Mode, PolicyInput, TenantEgress, TenantPolicy};
use cynode_pm::skills::{build_job, JobRef, Registry};
use serde_json::{json, Value};

fn registry() -> Registry {
    Registry::load(&[std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../skills")])
        .unwrap()
}

fn build(reg: &Registry, skill: &str, inputs: Value) -> Value {
    let r = JobRef {
        session_id: "s-1".into(),
        task_id: "t-1".into(),
        attempt: 0,
    };
    build_job(reg.get(skill).unwrap(), &inputs, &r)
        .unwrap_or_else(|e| panic!("{skill}: {e}"))
        .value
}

fn tenant(allow: &[&str]) -> TenantPolicy {
    TenantPolicy {
        egress: TenantEgress {
            allow: allow.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        },
        ..TenantPolicy::default()
    }
}

/// (skill, the dependency step's command line, its declared egress, a tenant allowlist
/// that covers it, the test step's environment that must stay offline).
type Case = (
    &'static str,
    &'static [&'static str],
    &'static [&'static str],
    &'static [&'static str],
    Option<(&'static str, &'static str)>,
);

const CASES: &[Case] = &[
    (
        "node-test",
        &["npm", "ci", "--no-audit", "--no-fund"],
        &["registry.npmjs.org"],
        &["registry.npmjs.org"],
        None,
    ),
    (
        "rust-test",
        &["cargo", "fetch", "--color", "never"],
        &["index.crates.io", "static.crates.io"],
        &["*.crates.io"],
        None,
    ),
    (
        "go-test",
        &["go", "mod", "download"],
        &[
            "proxy.golang.org",
            "sum.golang.org",
            "storage.googleapis.com",
        ],
        &["*.golang.org", "storage.googleapis.com"],
        Some(("GOPROXY", "off")),
    ),
];

#[test]
fn test_skills_fetch_dependencies_only_when_asked_and_allowed() {
    let reg = registry();
    let gate = LocalGate::builtin(Mode::Enforce).unwrap();
    for (skill, deps, egress, covering, offline_env) in CASES {
        let manifest = &reg.get(skill).unwrap().manifest;
        assert!(manifest.network, "{skill}");
        assert_eq!(&manifest.egress, egress, "{skill}");

        // Without fetch_deps (and with it false): offline, the test step alone.
        for inputs in [json!({}), json!({ "fetch_deps": false })] {
            let offline = build(&reg, skill, inputs);
            assert_eq!(
                offline["constraints"].get("ext_net_allowed"),
                None,
                "{skill}"
            );
            let steps = offline["steps"].as_array().unwrap();
            assert_eq!(steps.len(), 1, "{skill}: {offline}");
            assert_eq!(steps[0]["id"], "test", "{skill}");
            let allowed = gate.evaluate_sync(&PolicyInput::for_job(
                offline.clone(),
                manifest,
                None,
                TenantPolicy::default(),
            ));
            assert!(allowed.deny.is_empty(), "{skill}: {allowed:?}");
        }

        // With fetch_deps: network, and the dependency step first, in the same
        // working directory as the tests.
        let job = build(
            &reg,
            skill,
            json!({ "fetch_deps": true, "working_dir": "sub" }),
        );
        assert_eq!(job["constraints"]["ext_net_allowed"], true, "{skill}");
        let steps = job["steps"].as_array().unwrap();
        assert_eq!(steps.len(), 2, "{skill}: {job}");
        assert_eq!(steps[0]["id"], "deps", "{skill}");
        assert_eq!(steps[1]["id"], "test", "{skill}");
        let a = &steps[0]["arguments"];
        let mut argv = vec![a["command"].clone()];
        argv.extend(a["args"].as_array().unwrap().iter().cloned());
        assert_eq!(
            argv,
            deps.iter().map(|s| json!(s)).collect::<Vec<_>>(),
            "{skill}"
        );
        assert_eq!(a["working_dir"], "sub", "{skill}");
        assert_eq!(steps[1]["arguments"]["working_dir"], "sub", "{skill}");
        if let Some((k, v)) = offline_env {
            assert_eq!(steps[1]["arguments"]["env"][k], *v, "{skill}");
            assert_ne!(a["env"][k], *v, "{skill}: the fetch may not be offline");
        }
        // The dependency step shares the test step's caches (CARGO_HOME, GOPATH,
        // npm_config_cache), so the offline tests find what it fetched.
        for cache in ["CARGO_HOME", "GOPATH", "npm_config_cache"] {
            assert_eq!(
                a["env"].get(cache),
                steps[1]["arguments"]["env"].get(cache),
                "{skill}: {cache}"
            );
        }

        // The gate: no network for the default tenant; one host short is refused with
        // egress_not_allowed naming it; a covering allowlist passes.
        let denied = gate.evaluate_sync(&PolicyInput::for_job(
            job.clone(),
            manifest,
            None,
            TenantPolicy::default(),
        ));
        assert!(
            denied.deny.iter().any(|v| v.rule == "network_not_allowed"),
            "{skill}: {denied:?}"
        );
        let short: Vec<&str> = egress[..egress.len() - 1].to_vec();
        let missing = egress[egress.len() - 1];
        let short = if short.is_empty() {
            vec!["pypi.org"]
        } else {
            short
        };
        let denied = gate.evaluate_sync(&PolicyInput::for_job(
            job.clone(),
            manifest,
            None,
            tenant(&short),
        ));
        assert!(
            denied
                .deny
                .iter()
                .any(|v| v.rule == "egress_not_allowed" && v.message.contains(missing)),
            "{skill}: {denied:?}"
        );
        let allowed =
            gate.evaluate_sync(&PolicyInput::for_job(job, manifest, None, tenant(covering)));
        assert!(allowed.deny.is_empty(), "{skill}: {allowed:?}");
    }
}
