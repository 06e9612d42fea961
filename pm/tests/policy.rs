//! The policy gate: the default Rego policy, dry-run, loading errors, and the external
//! OPA-compatible engine (a real HTTP server) including its fail-closed cases.

use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use cynode_pm::policy::{
    Decision, LocalGate, Mode, PolicyError, PolicyGate, PolicyInput, RemoteGate, TenantPolicy,
    Violation, RULE_ENGINE_UNAVAILABLE, RULE_EVALUATION_FAILED, RULE_UNNAMED,
};
use serde_json::{json, Value};

fn policies_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies")
}

static GATE: LazyLock<LocalGate> = LazyLock::new(|| {
    LocalGate::from_dir(&policies_dir(), Mode::Enforce).expect("the default policy loads")
});

/// The manifest of a Go skill: go and git, no network, 900 s and 4 MiB.
fn skill() -> Value {
    json!({
        "skill_id": "go-test",
        "version": "1.0.0",
        "description": "run go test",
        "purpose": "go-tools",
        "allowed_commands": ["go", "git"],
        "network": false,
        "limits": {"max_runtime_seconds": 900, "max_output_bytes": 4194304},
        "inputs_schema": {"type": "object"}
    })
}

fn job_with(steps: Value) -> Value {
    json!({
        "protocol_version": "1.0",
        "job_id": "7d1b7f2e-0000-5000-8000-000000000001",
        "task_id": "task-1",
        "skill_id": "go-test",
        "constraints": {"max_runtime_seconds": 300, "max_output_bytes": 1048576},
        "steps": steps
    })
}

fn run(id: &str, command: &str, args: &[&str]) -> Value {
    json!({"id": id, "type": "run_command", "arguments": {"command": command, "args": args}})
}

/// A job touching every step type, that the default policy lets through silently.
fn clean_job() -> Value {
    job_with(json!([
        {"id": "tree", "type": "list_tree", "arguments": {"path": ".", "max_depth": 2}},
        {"id": "read", "type": "read_file", "arguments": {"path": "/workspace/go.mod"}},
        {"id": "write", "type": "write_file", "arguments": {"path": "notes/plan.md", "content": "x"}},
        {"id": "search", "type": "search_files", "arguments": {"pattern": "func Test", "path": "pkg"}},
        {"id": "patch", "type": "apply_unified_diff", "arguments": {
            "diff": "--- a/main.go\n+++ b/main.go\n@@ -1 +1 @@\n-a\n+b\n"}},
        {"id": "test", "type": "run_command", "arguments": {
            "command": "go", "args": ["test", "./..."], "working_dir": "/workspace",
            "env": {"CGO_ENABLED": "0", "GOFLAGS": "-mod=mod", "GITHUB_TOKEN": ""},
            "timeout_seconds": 120}},
        run("status", "git", &["status", "--porcelain"]),
    ]))
}

fn input(job: Value) -> PolicyInput {
    PolicyInput::new(job, skill(), TenantPolicy::default())
}

fn decide(input: &PolicyInput) -> Decision {
    GATE.evaluate_sync(input)
}

fn denials(job: Value) -> Vec<Violation> {
    decide(&input(job)).deny
}

fn v(rule: &str, message: &str) -> Violation {
    Violation::new(rule, message)
}

fn allowed_silently(mode: Mode) -> Decision {
    Decision {
        allowed: true,
        deny: vec![],
        warn: vec![],
        mode,
    }
}

// ---------------------------------------------------------------------------
// The default policy, in-process
// ---------------------------------------------------------------------------

#[test]
fn clean_job_is_allowed_without_findings() {
    assert_eq!(decide(&input(clean_job())), allowed_silently(Mode::Enforce));
}

#[test]
fn builtin_policy_decides_like_the_policies_dir() {
    let builtin = LocalGate::builtin(Mode::Enforce).unwrap();
    for job in [clean_job(), job_with(json!([run("s1", "curl", &["x"])]))] {
        let input = input(job);
        assert_eq!(builtin.evaluate_sync(&input), decide(&input));
    }
    assert_eq!(GATE.sources().len(), 1);
    assert!(GATE.sources()[0].ends_with("cynode.rego"));
}

#[test]
fn denies_a_command_the_skill_does_not_allow() {
    assert_eq!(
        denials(job_with(json!([run("fetch", "curl", &["https://example.com"])]))),
        vec![v(
            "command_not_allowed",
            "step fetch: command `curl` is not allowed by skill `go-test` or the tenant's global_allowed_commands"
        )]
    );
}

#[test]
fn commands_match_by_basename_and_by_the_tenant_global_list() {
    let job = job_with(json!([
        run("s1", "/usr/local/go/bin/go", &["vet"]),
        run("s2", "make", &["lint"]),
    ]));
    assert_eq!(
        denials(job.clone()),
        vec![v(
            "command_not_allowed",
            "step s2: command `make` is not allowed by skill `go-test` or the tenant's global_allowed_commands"
        )]
    );
    let tenant = TenantPolicy {
        global_allowed_commands: vec!["make".into()],
        ..TenantPolicy::default()
    };
    assert_eq!(
        decide(&PolicyInput::new(job, skill(), tenant)),
        allowed_silently(Mode::Enforce)
    );
}

#[test]
fn denies_a_command_outside_the_job_allowlist() {
    let mut job = job_with(json!([
        run("build", "go", &["build"]),
        run("st", "git", &["status"])
    ]));
    job["constraints"]["allowed_commands"] = json!(["git"]);
    assert_eq!(
        denials(job),
        vec![v(
            "command_not_in_job_allowlist",
            "step build: command `go` is not in constraints.allowed_commands"
        )]
    );
}

#[test]
fn denies_dotdot_paths_in_every_path_field() {
    let mut job = job_with(json!([
        {"id": "w", "type": "write_file", "arguments": {"path": "src/../../etc/cron.d/x", "content": ""}},
        {"id": "r", "type": "read_file", "arguments": {"path": ".."}},
        {"id": "t", "type": "list_tree", "arguments": {"path": "a/../b"}},
        {"id": "s", "type": "search_files", "arguments": {"pattern": "x", "path": "../other"}},
        {"id": "c", "type": "run_command", "arguments": {"command": "go", "working_dir": "/workspace/../root"}},
        {"id": "d", "type": "apply_unified_diff", "arguments": {"diff": "--- a/../x\n+++ b/../x\n@@ -1 +1 @@\n-a\n+b\n"}},
    ]));
    job["artifacts"] = json!(["reports/**", "../secrets/*"]);
    job["constraints"]["allowed_paths"] = json!(["/workspace/src/.."]);
    assert_eq!(
        denials(job),
        vec![
            v(
                "path_traversal",
                "artifacts[1]: path `../secrets/*` has a `..` component"
            ),
            v(
                "path_traversal",
                "constraints.allowed_paths[0]: path `/workspace/src/..` has a `..` component"
            ),
            v(
                "path_traversal",
                "step c: working_dir: path `/workspace/../root` has a `..` component"
            ),
            v(
                "path_traversal",
                "step d: diff header: path `../x` has a `..` component"
            ),
            v(
                "path_traversal",
                "step r: path: path `..` has a `..` component"
            ),
            v(
                "path_traversal",
                "step s: path: path `../other` has a `..` component"
            ),
            v(
                "path_traversal",
                "step t: path: path `a/../b` has a `..` component"
            ),
            v(
                "path_traversal",
                "step w: path: path `src/../../etc/cron.d/x` has a `..` component"
            ),
        ]
    );
}

#[test]
fn denies_absolute_paths_outside_the_workspace() {
    let job = job_with(json!([
        {"id": "r", "type": "read_file", "arguments": {"path": "/etc/shadow"}},
        {"id": "r2", "type": "read_file", "arguments": {"path": "/workspacex/f"}},
        {"id": "ok1", "type": "read_file", "arguments": {"path": "/workspace"}},
        {"id": "ok2", "type": "read_file", "arguments": {"path": "/workspace/src/main.go"}},
        {"id": "c", "type": "run_command", "arguments": {"command": "go", "working_dir": "/tmp"}},
        {"id": "d", "type": "apply_unified_diff", "arguments": {"diff": "--- /dev/null\n+++ /etc/profile\n@@ -0,0 +1 @@\n+x\n"}},
    ]));
    assert_eq!(
        denials(job),
        vec![
            v(
                "path_outside_workspace",
                "step c: working_dir: absolute path `/tmp` is outside /workspace"
            ),
            v(
                "path_outside_workspace",
                "step d: diff header: absolute path `/etc/profile` is outside /workspace"
            ),
            v(
                "path_outside_workspace",
                "step r2: path: absolute path `/workspacex/f` is outside /workspace"
            ),
            v(
                "path_outside_workspace",
                "step r: path: absolute path `/etc/shadow` is outside /workspace"
            ),
        ]
    );
}

#[test]
fn denies_a_nul_byte_in_a_path() {
    let job = job_with(json!([
        {"id": "w", "type": "write_file", "arguments": {"path": "a\u{0}/../../b", "content": ""}}
    ]));
    assert_eq!(
        denials(job),
        vec![v("path_nul_byte", "step w: path: path contains a nul byte")]
    );
}

fn networked_job() -> Value {
    let mut job = job_with(json!([run("dl", "go", &["mod", "download"])]));
    job["constraints"]["ext_net_allowed"] = json!(true);
    job
}

#[test]
fn denies_network_the_skill_does_not_declare() {
    let tenant = TenantPolicy {
        tenant_id: "acme".into(),
        allow_network: true,
        ..TenantPolicy::default()
    };
    assert_eq!(
        decide(&PolicyInput::new(networked_job(), skill(), tenant)).deny,
        vec![v(
            "network_not_declared",
            "constraints.ext_net_allowed is true but skill `go-test` does not declare network"
        )]
    );
}

/// A skill's declared egress must stay within the tenant's `egress.allow` (exact, or
/// under a `*.suffix`); a tenant with an egress allowlist allows network.
#[test]
fn denies_egress_beyond_the_tenants_allowlist() {
    let mut skill = skill();
    skill["network"] = json!(true);
    skill["egress"] = json!(["proxy.golang.org", "sum.golang.org", "evil.example:8443"]);
    let tenant = TenantPolicy {
        tenant_id: "acme".into(),
        egress: cynode_pm::policy::TenantEgress {
            allow: vec!["*.golang.org".into(), "pypi.org".into()],
            ..Default::default()
        },
        ..TenantPolicy::default()
    };
    assert_eq!(
        decide(&PolicyInput::new(networked_job(), skill.clone(), tenant.clone())).deny,
        vec![v(
            "egress_not_allowed",
            "skill `go-test` needs egress to `evil.example:8443`, which tenant `acme` does not allow (its egress.allow: *.golang.org, pypi.org)"
        )]
    );
    skill["egress"] = json!(["proxy.golang.org", "sum.golang.org"]);
    assert_eq!(
        decide(&PolicyInput::new(
            networked_job(),
            skill.clone(),
            tenant.clone()
        )),
        allowed_silently(Mode::Enforce)
    );
    // Without network the declared egress is not used, so not checked.
    skill["egress"] = json!(["evil.example"]);
    let offline = job_with(json!([run("t", "go", &["test", "./..."])]));
    assert_eq!(
        decide(&PolicyInput::new(offline, skill, tenant)),
        allowed_silently(Mode::Enforce)
    );
}

#[test]
fn denies_network_the_tenant_does_not_allow() {
    let mut skill = skill();
    skill["network"] = json!(true);
    let tenant = TenantPolicy {
        tenant_id: "acme".into(),
        ..TenantPolicy::default()
    };
    assert_eq!(
        decide(&PolicyInput::new(
            networked_job(),
            skill.clone(),
            tenant.clone()
        ))
        .deny,
        vec![v(
            "network_not_allowed",
            "constraints.ext_net_allowed is true but tenant `acme` does not allow network"
        )]
    );
    // The alias `network_allowed` is read the same way.
    let mut aliased = job_with(json!([run("dl", "go", &["mod", "download"])]));
    aliased["constraints"]["network_allowed"] = json!(true);
    assert_eq!(
        decide(&PolicyInput::new(aliased, skill.clone(), tenant.clone()))
            .deny
            .len(),
        1
    );
    // Declared and allowed: fine.
    let open = TenantPolicy {
        allow_network: true,
        ..tenant
    };
    assert_eq!(
        decide(&PolicyInput::new(networked_job(), skill, open)),
        allowed_silently(Mode::Enforce)
    );
}

#[test]
fn denies_runtime_over_the_skill_and_the_tenant_ceilings() {
    let mut job = clean_job();
    job["constraints"]["max_runtime_seconds"] = json!(5000);
    assert_eq!(
        denials(job),
        vec![
            v(
                "runtime_ceiling",
                "constraints.max_runtime_seconds 5000 exceeds the skill `go-test` ceiling of 900"
            ),
            v(
                "runtime_ceiling",
                "constraints.max_runtime_seconds 5000 exceeds the tenant ceiling of 3600"
            ),
        ]
    );
    // Under the skill's limit but over a stricter tenant's.
    let tenant = TenantPolicy {
        max_runtime_seconds: 60,
        ..TenantPolicy::default()
    };
    assert_eq!(
        decide(&PolicyInput::new(clean_job(), skill(), tenant)).deny,
        vec![v(
            "runtime_ceiling",
            "constraints.max_runtime_seconds 300 exceeds the tenant ceiling of 60"
        )]
    );
}

#[test]
fn denies_output_over_the_ceilings() {
    let mut job = clean_job();
    job["constraints"]["max_output_bytes"] = json!(8388608);
    assert_eq!(
        denials(job.clone()),
        vec![v(
            "output_ceiling",
            "constraints.max_output_bytes 8388608 exceeds the skill `go-test` ceiling of 4194304"
        )]
    );
    job["constraints"]["max_output_bytes"] = json!(17 * 1024 * 1024);
    assert_eq!(
        denials(job),
        vec![
            v("output_ceiling", "constraints.max_output_bytes 17825792 exceeds the skill `go-test` ceiling of 4194304"),
            v("output_ceiling", "constraints.max_output_bytes 17825792 exceeds the tenant ceiling of 16777216"),
        ]
    );
}

#[test]
fn denies_a_step_timeout_over_the_job_deadline() {
    let job = job_with(json!([
        {"id": "slow", "type": "run_command", "arguments": {"command": "go", "args": ["test"], "timeout_seconds": 301}}
    ]));
    assert_eq!(
        denials(job),
        vec![v(
            "step_timeout_ceiling",
            "step slow: timeout_seconds 301 exceeds constraints.max_runtime_seconds 300"
        )]
    );
}

#[test]
fn denies_missing_limits() {
    let mut job = clean_job();
    job["constraints"] = json!({"max_runtime_seconds": 0});
    assert_eq!(
        denials(job),
        vec![
            v(
                "limits_missing",
                "constraints.max_output_bytes must be a positive number"
            ),
            v(
                "limits_missing",
                "constraints.max_runtime_seconds must be a positive number"
            ),
        ]
    );
}

fn env_job(env: Value) -> Value {
    job_with(json!([
        {"id": "env", "type": "run_command", "arguments": {"command": "go", "args": ["test"], "env": env}}
    ]))
}

#[test]
fn denies_secret_looking_env_names() {
    let job = env_job(json!({
        "GITHUB_TOKEN": "abc",
        "db_password": "hunter2",
        "OPENAI_API_KEY": "x",
        "SSH_PRIVATE_KEY": "x",
        "MYSQL_PASSWD": "x",
        "CLIENT_SECRET": "x",
        "EMPTY_TOKEN": "",
        "HOME": "/workspace",
    }));
    let expect = |name: &str, marker: &str| {
        v(
            "secret_env_name",
            &format!("step env: env `{name}` looks like a secret (name contains {marker}); secrets never go into jobs"),
        )
    };
    assert_eq!(
        denials(job),
        vec![
            expect("CLIENT_SECRET", "secret"),
            expect("GITHUB_TOKEN", "token"),
            expect("MYSQL_PASSWD", "passwd"),
            expect("OPENAI_API_KEY", "api_key"),
            expect("SSH_PRIVATE_KEY", "private_key"),
            expect("db_password", "password"),
        ]
    );
}

#[test]
fn denies_secret_looking_env_values_without_echoing_them() {
    let cases = [
        ("ghp_0123456789abcdefghijABCDEFGHIJklmnop", "a github token"),
        (
            "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz",
            "a github token",
        ),
        (
            "Bearer sk-proj-abcdefghijklmnopqrstuvwxyz012345",
            "an openai-style api key",
        ),
        ("AKIAIOSFODNN7EXAMPLE", "an aws access key id"),
        ("xoxb-123456789012-abcdefghijkl", "a slack token"),
        (
            "-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn\n-----END OPENSSH PRIVATE KEY-----",
            "a pem private key or certificate",
        ),
        (
            "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.dBjftJeZ4CVPmB92K27uhbUJU1p1r_wW1gFWFOEjXk",
            "a jwt",
        ),
    ];
    for (value, kind) in cases {
        let decision = decide(&input(env_job(json!({"CONFIG": value}))));
        assert_eq!(
            decision.deny,
            vec![v(
                "secret_env_value",
                &format!("step env: env `CONFIG` has a value that looks like {kind}; secrets never go into jobs")
            )],
            "{value}"
        );
        assert!(!serde_json::to_string(&decision).unwrap().contains(value));
    }
    // Look-alikes that are not secrets pass.
    let benign = env_job(json!({
        "GOFLAGS": "-mod=mod", "TASK": "ask-the-user", "PKG": "scikit-learn", "ID": "AKIA", "EYE": "eyJ"
    }));
    assert_eq!(denials(benign), vec![]);
}

#[test]
fn denies_a_purpose_the_tenant_does_not_allow() {
    let tenant = TenantPolicy {
        allowed_purposes: vec!["base-tools".into(), "python-tools".into()],
        ..TenantPolicy::default()
    };
    assert_eq!(
        decide(&PolicyInput::new(clean_job(), skill(), tenant)).deny,
        vec![v(
            "purpose_not_allowed",
            "skill `go-test`: purpose `go-tools` is not in the tenant's allowed_purposes"
        )]
    );
    let tenant = TenantPolicy {
        allowed_purposes: vec!["go-tools".into()],
        ..TenantPolicy::default()
    };
    assert_eq!(
        decide(&PolicyInput::new(clean_job(), skill(), tenant)),
        allowed_silently(Mode::Enforce)
    );
}

#[test]
fn denies_an_image_the_tenant_does_not_allow() {
    let mut skill = skill();
    skill["image"] = json!("docker.io/library/golang:1.23");
    let tenant = TenantPolicy {
        allowed_images: vec!["localhost/cynode/*".into()],
        ..TenantPolicy::default()
    };
    assert_eq!(
        decide(&PolicyInput::new(clean_job(), skill.clone(), tenant)).deny,
        vec![v(
            "image_not_allowed",
            "skill `go-test`: image `docker.io/library/golang:1.23` is not in the tenant's allowed_images"
        )]
    );
    skill["image"] = json!("localhost/cynode/go-tools:1");
    let tenant = TenantPolicy {
        allowed_images: vec!["localhost/cynode/*".into()],
        ..TenantPolicy::default()
    };
    assert_eq!(
        decide(&PolicyInput::new(clean_job(), skill, tenant)),
        allowed_silently(Mode::Enforce)
    );
}

#[test]
fn denies_every_git_subcommand_that_reaches_a_remote() {
    let cases: &[(&str, &[&str], &str)] = &[
        (
            "git",
            &["clone", "https://github.com/x/y"],
            "`git clone` reaches a remote",
        ),
        ("git", &["fetch", "origin"], "`git fetch` reaches a remote"),
        ("git", &["pull", "--rebase"], "`git pull` reaches a remote"),
        (
            "git",
            &["push", "origin", "main"],
            "`git push` reaches a remote",
        ),
        (
            "git",
            &["ls-remote", "origin"],
            "`git ls-remote` reaches a remote",
        ),
        ("git", &["lfs", "pull"], "`git lfs` reaches a remote"),
        (
            "git",
            &["submodule", "update", "--init"],
            "`git submodule update` reaches a remote",
        ),
        (
            "git",
            &["submodule", "--quiet", "add", "../x"],
            "`git submodule add` reaches a remote",
        ),
        (
            "git",
            &["submodule", "foreach", "git pull"],
            "`git submodule foreach` reaches a remote",
        ),
        (
            "git",
            &["remote", "update"],
            "`git remote update` reaches a remote",
        ),
        (
            "git",
            &["archive", "--remote=origin", "HEAD"],
            "`git archive --remote=origin` reaches a remote",
        ),
        (
            "git",
            &["-C", "repo", "push"],
            "`git push` reaches a remote",
        ),
        (
            "git",
            &["-c", "http.proxy=x", "fetch"],
            "`git fetch` reaches a remote",
        ),
        (
            "git",
            &["--git-dir", ".git", "--no-pager", "pull"],
            "`git pull` reaches a remote",
        ),
        ("git", &["-c", "-C", "push"], "`git push` reaches a remote"),
        ("/usr/bin/git", &["push"], "`git push` reaches a remote"),
    ];
    for (command, args, what) in cases {
        assert_eq!(
            denials(job_with(json!([run("g", command, args)]))),
            vec![v(
                "git_local_only",
                &format!("step g: {what}; git is kept local-only")
            )],
            "{command} {args:?}"
        );
    }
}

#[test]
fn denies_git_aliases_set_on_the_command_line() {
    let job = job_with(json!([run("g", "git", &["-c", "alias.st=push", "st"])]));
    assert_eq!(
        denials(job),
        vec![v(
            "git_local_only",
            "step g: git config `alias.st=push` defines an alias; git is kept local-only"
        )]
    );
}

#[test]
fn allows_local_git() {
    let cases: &[&[&str]] = &[
        &["status"],
        &["diff", "--stat"],
        &["-c", "core.x=y", "log", "--oneline"],
        &["-C", "repo", "status"],
        &["-C", "fetch", "status"],
        &["commit", "-m", "push the fix"],
        &["checkout", "-b", "fetch"],
        &["log", "--format=%H", "origin/main"],
        &["submodule", "status"],
        &["remote", "-v"],
        &[],
    ];
    for args in cases {
        assert_eq!(
            decide(&input(job_with(json!([run("g", "git", args)])))),
            allowed_silently(Mode::Enforce),
            "git {args:?}"
        );
    }
}

#[test]
fn denies_a_manifest_that_is_not_the_jobs_skill() {
    let mut job = clean_job();
    job["skill_id"] = json!("python-test");
    assert_eq!(
        denials(job),
        vec![v(
            "skill_mismatch",
            "job skill_id `python-test` does not match the skill manifest `go-test`"
        )]
    );
}

#[test]
fn an_empty_manifest_allows_no_commands() {
    let decision = GATE.evaluate_sync(&PolicyInput::new(
        job_with(json!([run("s", "go", &["test"])])),
        json!({}),
        TenantPolicy::default(),
    ));
    assert_eq!(
        decision.deny,
        vec![v(
            "command_not_allowed",
            "step s: command `go` is not allowed by skill (unnamed skill) or the tenant's global_allowed_commands"
        )]
    );
}

#[test]
fn warns_without_denying() {
    assert_eq!(
        decide(&input(job_with(json!([])))),
        Decision {
            allowed: true,
            deny: vec![],
            warn: vec![v("no_steps", "job has no steps; it will do nothing")],
            mode: Mode::Enforce,
        }
    );
    let mut job = clean_job();
    job["constraints"]["max_runtime_seconds"] = json!(600);
    assert_eq!(
        decide(&input(job)),
        Decision {
            allowed: true,
            deny: vec![],
            warn: vec![v(
                "runtime_near_ceiling",
                "constraints.max_runtime_seconds 600 is over half the ceiling of 900"
            )],
            mode: Mode::Enforce,
        }
    );
    // agent_inference jobs have no steps by design.
    let mut agent = job_with(json!([]));
    agent["execution_mode"] = json!("agent_inference");
    assert_eq!(decide(&input(agent)), allowed_silently(Mode::Enforce));
}

#[test]
fn dry_run_reports_denials_but_allows() {
    let gate = GATE.clone().with_mode(Mode::DryRun);
    let job = job_with(json!([
        run("fetch", "curl", &["x"]),
        run("g", "git", &["push"])
    ]));
    assert_eq!(
        gate.evaluate_sync(&input(job)),
        Decision {
            allowed: true,
            deny: vec![
                v("command_not_allowed", "step fetch: command `curl` is not allowed by skill `go-test` or the tenant's global_allowed_commands"),
                v("git_local_only", "step g: `git push` reaches a remote; git is kept local-only"),
            ],
            warn: vec![],
            mode: Mode::DryRun,
        }
    );
}

#[tokio::test]
async fn the_gate_enum_evaluates_like_the_local_gate() {
    let gate = PolicyGate::local_from_dir(&policies_dir(), Mode::Enforce).unwrap();
    assert_eq!(gate.mode(), Mode::Enforce);
    for job in [
        clean_job(),
        job_with(json!([run("g", "git", &["-C", "repo", "push"])])),
    ] {
        let input = input(job);
        assert_eq!(gate.evaluate(&input).await, decide(&input));
    }
}

#[test]
fn decisions_serialize_to_the_documented_shape() {
    let decision = decide(&input(job_with(json!([run("fetch", "curl", &[])]))));
    assert_eq!(
        serde_json::to_value(&decision).unwrap(),
        json!({
            "allowed": false,
            "deny": [{"rule": "command_not_allowed", "message": "step fetch: command `curl` is not allowed by skill `go-test` or the tenant's global_allowed_commands"}],
            "warn": [],
            "mode": "enforce"
        })
    );
}

#[test]
fn tenant_policy_defaults_are_safe() {
    let parsed: TenantPolicy = serde_yaml::from_str("tenant_id: acme\n").unwrap();
    assert_eq!(
        parsed,
        TenantPolicy {
            tenant_id: "acme".into(),
            allow_network: false,
            allowed_purposes: vec![],
            allowed_images: vec![],
            global_allowed_commands: vec![],
            max_runtime_seconds: 3600,
            max_output_bytes: 16 * 1024 * 1024,
            egress: Default::default(),
        }
    );
    assert!(serde_yaml::from_str::<TenantPolicy>("allow_netwrok: true\n").is_err());
    let egress: TenantPolicy = serde_yaml::from_str("egress:\n  allow: [pypi.org]\n").unwrap();
    assert_eq!(egress.egress.allow, ["pypi.org"]);
    assert!(serde_yaml::from_str::<TenantPolicy>("egress:\n  alow: []\n").is_err());
}

#[test]
fn a_job_that_is_not_an_object_is_denied() {
    let decision = GATE.evaluate_sync(&PolicyInput::new(
        json!(null),
        skill(),
        TenantPolicy::default(),
    ));
    assert_eq!(
        decision,
        Decision {
            allowed: false,
            deny: vec![
                v(
                    "limits_missing",
                    "constraints.max_output_bytes must be a positive number"
                ),
                v(
                    "limits_missing",
                    "constraints.max_runtime_seconds must be a positive number"
                ),
            ],
            warn: vec![v("no_steps", "job has no steps; it will do nothing")],
            mode: Mode::Enforce,
        }
    );
}

#[test]
fn malformed_steps_are_denied_not_skipped() {
    let job = job_with(json!([
        {"type": "run_command", "arguments": {"command": "curl"}},
        {"id": "s", "type": "run_command", "arguments": {"args": ["x"]}},
        {"id": "t", "type": "read_file", "arguments": "etc/passwd"},
    ]));
    assert_eq!(
        denials(job),
        vec![
            v("step_malformed", "step s: run_command needs a command"),
            v(
                "step_malformed",
                "steps[0]: needs an id, a type and an arguments object"
            ),
            v(
                "step_malformed",
                "steps[2]: needs an id, a type and an arguments object"
            ),
        ]
    );
}

#[test]
fn mistyped_arguments_are_denied() {
    let job = job_with(json!([
        {"id": "a", "type": "run_command", "arguments": {"command": "git", "args": ["-C", 7, "push"]}},
        {"id": "b", "type": "run_command", "arguments": {"command": "go", "env": {"GITHUB_TOKEN": 12345}}},
        {"id": "c", "type": "run_command", "arguments": {"command": "go", "args": "test ./..."}},
        {"id": "d", "type": "run_command", "arguments": {"command": "go", "timeout_seconds": "9999"}},
        {"id": "e", "type": "apply_unified_diff", "arguments": {"diff": ["--- a/../x"]}},
        {"id": "f", "type": "read_file", "arguments": {"path": 5}},
    ]));
    let shape = |id: &str| {
        v(
            "step_malformed",
            &format!("step {id}: run_command needs a string command, string args, string env values and a numeric timeout_seconds"),
        )
    };
    let decision = decide(&input(job));
    let malformed: Vec<Violation> = decision
        .deny
        .iter()
        .filter(|d| d.rule == "step_malformed" || d.rule == "path_invalid")
        .cloned()
        .collect();
    assert_eq!(
        malformed,
        vec![
            v(
                "path_invalid",
                "step f: path: path must be a string, got number"
            ),
            shape("a"),
            shape("b"),
            shape("c"),
            shape("d"),
            v(
                "step_malformed",
                "step e: apply_unified_diff needs a string diff"
            ),
        ]
    );
    assert!(!decision.allowed);
}

/// Every input the tests above use, for checks over all of them.
fn corpus() -> Vec<PolicyInput> {
    let mut jobs = vec![
        clean_job(),
        networked_job(),
        job_with(json!([])),
        job_with(json!(null)),
    ];
    for (command, args) in [
        ("curl", vec!["x"]),
        ("git", vec!["-C", "repo", "push"]),
        ("git", vec!["-c", "alias.st=push", "st"]),
        ("git", vec!["commit", "-m", "push"]),
        ("git", vec!["submodule", "update"]),
        ("/usr/bin/git", vec!["archive", "--remote=x"]),
    ] {
        jobs.push(job_with(json!([run("s", command, &args)])));
    }
    jobs.push(env_job(
        json!({"GITHUB_TOKEN": "ghp_0123456789abcdefghijABCDEFGHIJklmnop", "A": "-----BEGIN"}),
    ));
    let mut paths = job_with(json!([
        {"id": "r", "type": "read_file", "arguments": {"path": "/etc/shadow"}},
        {"id": "w", "type": "write_file", "arguments": {"path": "a/../b", "content": ""}},
        {"id": "d", "type": "apply_unified_diff", "arguments": {"diff": "--- a/../x\n+++ /etc/x\n"}},
    ]));
    paths["constraints"]["max_runtime_seconds"] = json!(99999);
    paths["constraints"]["allowed_commands"] = json!(["git"]);
    jobs.push(paths);
    let mut inputs: Vec<PolicyInput> = jobs.into_iter().map(input).collect();
    let strict = TenantPolicy {
        allowed_purposes: vec!["base-tools".into()],
        allowed_images: vec!["x/*".into()],
        max_runtime_seconds: 10,
        ..TenantPolicy::default()
    };
    let mut imaged = skill();
    imaged["image"] = json!("y/z");
    inputs.push(PolicyInput::new(clean_job(), imaged, strict));
    inputs.push(PolicyInput::new(
        clean_job(),
        json!({}),
        TenantPolicy::default(),
    ));
    inputs.push(PolicyInput::new(
        clean_job(),
        json!("not a manifest"),
        TenantPolicy::default(),
    ));
    // Steps of other shapes and types than the job schema allows (`policy check` reads a
    // hand-written job): still a decision (step_malformed, path_invalid), not an error.
    inputs.push(input(job_with(json!([
        {"id": "a", "type": "run_command", "arguments": {"command": "git", "args": ["-C", 7, "push"]}},
        {"id": "b", "type": "run_command", "arguments": {"command": ["go"], "env": ["A=1"]}},
        {"id": "c", "type": "run_command", "arguments": {"command": "git", "args": {"0": "push"}}},
        {"id": "d", "type": "run_command", "arguments": {"command": "go", "working_dir": 7}},
        {"id": "e", "type": "write_file", "arguments": {"path": ["x"], "content": 1}},
        {"id": "f", "type": "apply_unified_diff", "arguments": {"diff": "--- \n+++ \t\n"}},
        {"id": 7, "type": 8, "arguments": []},
        "not a step",
    ]))));
    inputs
}

#[test]
fn the_default_policy_evaluates_every_input_of_the_corpus() {
    // The gate fails closed on any evaluation error: the default policy must never hit one
    // (it type-checks what its builtins receive), or it would deny with the wrong reason.
    for input in corpus() {
        let decision = GATE.evaluate_sync(&input);
        assert!(!decision.is_engine_failure(), "{input:?}: {decision:?}");
    }
}

#[test]
fn the_gate_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<LocalGate>();
    assert_send_sync::<PolicyGate>();
    let input = input(job_with(json!([run("s", "curl", &[])])));
    let expected = decide(&input);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| GATE.evaluate_sync(&input)))
            .collect();
        for handle in handles {
            assert_eq!(handle.join().unwrap(), expected);
        }
    });
}

#[test]
fn a_builtin_error_fails_closed_instead_of_passing() {
    // OPA's default would make these rules undefined (no denial) and let everything pass.
    // A constant error is found when the policy loads.
    let constant = policy_dir_with(&[(
        "p.rego",
        "package cynode.policy\n\ndeny contains \"bad\" if regex.match(\"(unclosed\", \"x\")\n",
    )]);
    assert!(matches!(
        LocalGate::from_dir(constant.path(), Mode::Enforce),
        Err(PolicyError::Compile { message, .. }) if message.contains("invalid regex")
    ));

    let input_dependent = policy_dir_with(&[(
        "p.rego",
        "package cynode.policy\n\ndeny contains \"bad\" if regex.match(input.tenant.tenant_id, \"x\")\n",
    )]);
    let gate = LocalGate::from_dir(input_dependent.path(), Mode::DryRun).unwrap();
    let tenant = TenantPolicy {
        tenant_id: "(unclosed".into(),
        ..TenantPolicy::default()
    };
    // The strict interpreter fails closed (OPA by default, and regorus' VM even in strict
    // mode, would make the rule body undefined and deny nothing).
    let decision = gate.evaluate_sync(&PolicyInput::new(clean_job(), skill(), tenant));
    assert!(!decision.allowed, "{decision:?}");
    assert_eq!(decision.deny.len(), 1);
    assert_eq!(decision.deny[0].rule, RULE_EVALUATION_FAILED);
    assert!(
        decision.deny[0].message.contains("invalid regex"),
        "{decision:?}"
    );
}

// ---------------------------------------------------------------------------
// Loading policies
// ---------------------------------------------------------------------------

fn policy_dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    dir
}

#[test]
fn loading_fails_with_a_clear_error() {
    let empty = policy_dir_with(&[("README.md", "no policy here")]);
    assert_eq!(
        LocalGate::from_dir(empty.path(), Mode::Enforce)
            .unwrap_err()
            .to_string(),
        format!("no .rego policy files in {}", empty.path().display())
    );

    let missing = Path::new("/nonexistent/policies");
    assert!(matches!(
        LocalGate::from_dir(missing, Mode::Enforce),
        Err(PolicyError::Io { .. })
    ));

    let broken = policy_dir_with(&[("p.rego", "package cynode.policy\n\ndeny contains x if {\n")]);
    let err = LocalGate::from_dir(broken.path(), Mode::Enforce).unwrap_err();
    assert!(
        matches!(&err, PolicyError::Parse { path, .. } if path.ends_with("p.rego")),
        "{err}"
    );

    let no_deny = policy_dir_with(&[(
        "p.rego",
        "package cynode.policy\n\nwarn contains \"x\" if true\n",
    )]);
    assert_eq!(
        LocalGate::from_dir(no_deny.path(), Mode::Enforce)
            .unwrap_err()
            .to_string(),
        "policy does not define `data.cynode.policy.deny`"
    );
}

#[test]
fn custom_policies_may_deny_with_bare_strings_and_skip_warn() {
    let dir = policy_dir_with(&[
        (
            "team.rego",
            "package cynode.policy\n\ndeny contains msg if {\n\tinput.tenant.tenant_id == \"blocked\"\n\tmsg := \"tenant is blocked\"\n}\n",
        ),
        // OPA convention: *_test.rego files are tests, not policy.
        ("team_test.rego", "this is not rego"),
    ]);
    let gate = LocalGate::from_dir(dir.path(), Mode::Enforce).unwrap();
    let blocked = TenantPolicy {
        tenant_id: "blocked".into(),
        ..TenantPolicy::default()
    };
    assert_eq!(
        gate.evaluate_sync(&PolicyInput::new(clean_job(), skill(), blocked)),
        Decision {
            allowed: false,
            deny: vec![v(RULE_UNNAMED, "tenant is blocked")],
            warn: vec![],
            mode: Mode::Enforce,
        }
    );
    assert_eq!(
        gate.evaluate_sync(&input(clean_job())),
        allowed_silently(Mode::Enforce)
    );
}

// ---------------------------------------------------------------------------
// External engine: a real HTTP server speaking the OPA Data API
// ---------------------------------------------------------------------------

#[derive(Clone, Default)]
struct Seen {
    requests: Arc<Mutex<Vec<(String, Value)>>>,
}

/// An OPA stand-in: evaluates the posted input with the default policy and answers
/// `{"result": {"deny": …, "warn": …}}`, recording what it was asked.
async fn opa(
    State(seen): State<Seen>,
    UrlPath(path): UrlPath<String>,
    Json(body): Json<Value>,
) -> Json<Value> {
    seen.requests.lock().unwrap().push((path, body.clone()));
    let input: PolicyInput = serde_json::from_value(body["input"].clone()).unwrap();
    let decision = GATE.evaluate_sync(&input);
    Json(
        json!({"result": {"deny": decision.deny, "warn": decision.warn, "allow": decision.allowed}}),
    )
}

async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

async fn fixed_answer(status: StatusCode, body: &'static str) -> String {
    serve(Router::new().route(
        "/v1/data/{*path}",
        post(move || async move { (status, body) }),
    ))
    .await
}

#[tokio::test]
async fn remote_engine_decides_with_the_same_input() {
    let seen = Seen::default();
    let base = serve(
        Router::new()
            .route("/v1/data/{*path}", post(opa))
            .with_state(seen.clone()),
    )
    .await;
    let gate = PolicyGate::remote(&format!("{base}/"), "cynode/policy", Mode::Enforce);
    assert_eq!(
        gate.describe(),
        format!("external: {base}/v1/data/cynode/policy")
    );

    let denied = input(job_with(json!([run("g", "git", &["-C", "repo", "push"])])));
    assert_eq!(
        gate.evaluate(&denied).await,
        Decision {
            allowed: false,
            deny: vec![v(
                "git_local_only",
                "step g: `git push` reaches a remote; git is kept local-only"
            )],
            warn: vec![],
            mode: Mode::Enforce,
        }
    );
    let clean = input(clean_job());
    assert_eq!(gate.evaluate(&clean).await, allowed_silently(Mode::Enforce));

    let requests = seen.requests.lock().unwrap().clone();
    assert_eq!(
        requests,
        vec![
            (
                "cynode/policy".to_string(),
                json!({"input": serde_json::to_value(&denied).unwrap()})
            ),
            (
                "cynode/policy".to_string(),
                json!({"input": serde_json::to_value(&clean).unwrap()})
            ),
        ]
    );

    // Dry-run applies to remote answers too; a dotted package path maps to the same URL.
    let dry = RemoteGate::new(&base, "cynode.policy", Mode::DryRun);
    assert_eq!(dry.url(), format!("{base}/v1/data/cynode/policy"));
    let decision = dry.evaluate(&denied).await;
    assert_eq!((decision.allowed, decision.deny.len()), (true, 1));
}

fn assert_fail_closed(decision: &Decision, url: &str, reason_prefix: &str) {
    assert!(!decision.allowed, "{decision:?}");
    assert_eq!(decision.warn, vec![]);
    assert_eq!(decision.deny.len(), 1, "{decision:?}");
    assert_eq!(decision.deny[0].rule, RULE_ENGINE_UNAVAILABLE);
    let expected =
        format!("policy engine at {url}/v1/data/cynode/policy gave no decision: {reason_prefix}");
    assert!(
        decision.deny[0].message.starts_with(&expected),
        "{:?} does not start with {expected:?}",
        decision.deny[0].message
    );
}

#[tokio::test]
async fn remote_engine_fails_closed_when_nothing_listens() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let base = format!("http://127.0.0.1:{port}");
    for mode in [Mode::Enforce, Mode::DryRun] {
        let decision = PolicyGate::remote(&base, "cynode/policy", mode)
            .evaluate(&input(clean_job()))
            .await;
        assert_fail_closed(&decision, &base, "cannot connect");
        assert_eq!(decision.mode, mode);
        assert!(decision.is_engine_failure());
    }
}

#[tokio::test]
async fn remote_engine_fails_closed_on_a_server_error() {
    let base = fixed_answer(StatusCode::INTERNAL_SERVER_ERROR, "boom").await;
    let decision = PolicyGate::remote(&base, "cynode/policy", Mode::Enforce)
        .evaluate(&input(clean_job()))
        .await;
    assert_eq!(
        decision,
        Decision::fail_closed(
            RULE_ENGINE_UNAVAILABLE,
            format!("policy engine at {base}/v1/data/cynode/policy gave no decision: http status 500 Internal Server Error: boom"),
            Mode::Enforce,
        )
    );
}

#[tokio::test]
async fn remote_engine_fails_closed_on_garbage() {
    let cases = [
        ("<html>not opa</html>", "response is not json"),
        ("{}", "response has no `result` (is the package loaded?)"),
        (r#"{"result": {"warn": []}}"#, "`result` has no `deny` rule"),
        (
            r#"{"result": {"deny": true}}"#,
            "`deny` must be a set or array, got a boolean",
        ),
        (
            r#"{"result": {"deny": [42]}}"#,
            "`deny[0]` must be an object or a string, got a number",
        ),
        (r#"{"result": "yes"}"#, "`result` is not an object"),
    ];
    for (body, reason) in cases {
        let base = fixed_answer(StatusCode::OK, body).await;
        let decision = PolicyGate::remote(&base, "cynode/policy", Mode::Enforce)
            .evaluate(&input(clean_job()))
            .await;
        assert_fail_closed(&decision, &base, reason);
    }
}

#[tokio::test]
async fn remote_engine_fails_closed_when_it_never_answers() {
    let base = serve(Router::new().route(
        "/v1/data/{*path}",
        post(std::future::pending::<&'static str>),
    ))
    .await;
    let gate = RemoteGate::with_timeout(
        &base,
        "cynode/policy",
        Mode::Enforce,
        Duration::from_millis(200),
    );
    let decision = gate.evaluate(&input(clean_job())).await;
    assert_fail_closed(&decision, &base, "");
    assert!(
        decision.deny[0].message.contains("timed out")
            || decision.deny[0].message.contains("no answer within 200 ms"),
        "{:?}",
        decision.deny[0].message
    );
}

// ---------------------------------------------------------------------------
// A policy that errors while it evaluates denies (fail closed), in both modes, locally
// and through the external engine.
// ---------------------------------------------------------------------------

/// `(what, policy text, job fields that make it fail, what the error names)`. Each policy
/// loads (an empty input evaluates) and allows the clean job; the listed job fields make
/// its evaluation fail.
const ERRORING_POLICIES: &[(&str, &str, &str, &str)] = &[
    (
        "a complete rule with two values",
        "package cynode.policy\n\nimport rego.v1\n\nlevel := 1 if input.job.a\n\nlevel := 2 if input.job.b\n\ndeny contains \"too high\" if level > 5\n",
        r#"{"a": true, "b": true}"#,
        "",
    ),
    (
        "a function with two values",
        "package cynode.policy\n\nimport rego.v1\n\nf(x) := 1 if x\n\nf(x) := 2 if x\n\ndeny contains \"never\" if f(input.job.a) == 3\n",
        r#"{"a": true}"#,
        "",
    ),
    (
        "an object rule with two values for one key",
        "package cynode.policy\n\nimport rego.v1\n\nlevels[\"k\"] := 1 if input.job.a\n\nlevels[\"k\"] := 2 if input.job.b\n\ndeny contains \"never\" if levels.k == 3\n",
        r#"{"a": true, "b": true}"#,
        "",
    ),
    (
        "to_number of a non-number",
        "package cynode.policy\n\nimport rego.v1\n\ndeny contains \"too many\" if to_number(input.job.n) > 5\n",
        r#"{"n": "x"}"#,
        "to_number",
    ),
    (
        "an invalid regex from the input",
        "package cynode.policy\n\nimport rego.v1\n\ndeny contains \"matched\" if regex.match(input.job.pattern, \"x\")\n",
        r#"{"pattern": "(unclosed"}"#,
        "regex",
    ),
];

fn erroring_job(fields: &str) -> Value {
    let mut job = clean_job();
    let extra: serde_json::Map<String, Value> = serde_json::from_str(fields).unwrap();
    job.as_object_mut().unwrap().extend(extra);
    job
}

fn assert_evaluation_failed(decision: &Decision, mode: Mode, names: &str, what: &str) {
    assert!(!decision.allowed, "{what}: {decision:?}");
    assert_eq!(decision.mode, mode, "{what}");
    assert_eq!(decision.deny.len(), 1, "{what}: {decision:?}");
    assert_eq!(decision.deny[0].rule, RULE_EVALUATION_FAILED, "{what}");
    assert!(
        decision.deny[0].message.contains(names),
        "{what}: {:?} does not name {names:?}",
        decision.deny[0].message
    );
    assert!(decision.is_engine_failure(), "{what}");
}

#[test]
fn a_policy_that_errors_at_evaluation_denies() {
    for (what, policy, fields, names) in ERRORING_POLICIES {
        let dir = policy_dir_with(&[("p.rego", policy)]);
        for mode in [Mode::Enforce, Mode::DryRun] {
            let gate = LocalGate::from_dir(dir.path(), mode)
                .unwrap_or_else(|e| panic!("{what}: the policy loads: {e}"));
            assert_eq!(
                gate.evaluate_sync(&input(clean_job())),
                allowed_silently(mode),
                "{what}: the clean job passes"
            );
            let failing = input(erroring_job(fields));
            assert_evaluation_failed(&gate.evaluate_sync(&failing), mode, names, what);
        }
    }
}

/// The gate an [`erroring_opa`] evaluates with, and the query strings it was asked with.
type ErroringOpa = (Arc<LocalGate>, Arc<Mutex<Vec<Option<String>>>>);

/// An OPA stand-in for a policy of [`ERRORING_POLICIES`]: evaluates with the local gate
/// and, as OPA does for `?strict-builtin-errors=true` or an eval conflict, answers 500
/// `{"code": "internal_error", "message": …}` when the evaluation fails. Without the
/// strict query a builtin error is OPA's default: the rule is undefined (no denial).
async fn erroring_opa(
    State((gate, queries)): State<ErroringOpa>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    queries.lock().unwrap().push(query.clone());
    let input: PolicyInput = serde_json::from_value(body["input"].clone()).unwrap();
    let decision = gate.evaluate_sync(&input);
    let strict = query.as_deref().is_some_and(|q| {
        q.split('&')
            .any(|kv| kv == "strict-builtin-errors=true" || kv == "strict-builtin-errors")
    });
    match decision.deny.first() {
        Some(d) if d.rule == RULE_EVALUATION_FAILED => {
            let conflict = !d.message.contains("to_number") && !d.message.contains("regex");
            if strict || conflict {
                let message = if conflict {
                    format!(
                        "1 error occurred: p.rego:5: eval_conflict_error: {}",
                        d.message
                    )
                } else {
                    format!(
                        "1 error occurred: p.rego:5: eval_builtin_error: {}",
                        d.message
                    )
                };
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    Json(json!({"code": "internal_error", "message": message})),
                )
            } else {
                (
                    StatusCode::OK,
                    Json(json!({"result": {"deny": [], "warn": []}})),
                )
            }
        }
        _ => (
            StatusCode::OK,
            Json(json!({"result": {"deny": decision.deny, "warn": decision.warn}})),
        ),
    }
}

#[tokio::test]
async fn a_remote_policy_that_errors_at_evaluation_denies() {
    for (what, policy, fields, names) in ERRORING_POLICIES {
        let dir = policy_dir_with(&[("p.rego", policy)]);
        let local = Arc::new(LocalGate::from_dir(dir.path(), Mode::Enforce).unwrap());
        let queries = Arc::new(Mutex::new(Vec::new()));
        let base = serve(
            Router::new()
                .route("/v1/data/{*path}", post(erroring_opa))
                .with_state((local, queries.clone())),
        )
        .await;
        for mode in [Mode::Enforce, Mode::DryRun] {
            let gate = PolicyGate::remote(&base, "cynode/policy", mode);
            assert_eq!(
                gate.evaluate(&input(clean_job())).await,
                allowed_silently(mode),
                "{what}: the clean job passes"
            );
            let decision = gate.evaluate(&input(erroring_job(fields))).await;
            assert_evaluation_failed(&decision, mode, names, what);
            assert!(
                decision.deny[0].message.starts_with(&format!(
                    "policy engine at {base}/v1/data/cynode/policy failed to evaluate the policy: "
                )),
                "{what}: {:?}",
                decision.deny[0].message
            );
        }
        // Every request asked for strict builtin errors.
        let queries = queries.lock().unwrap().clone();
        assert_eq!(queries.len(), 4);
        assert!(
            queries
                .iter()
                .all(|q| q.as_deref() == Some("strict-builtin-errors=true")),
            "{queries:?}"
        );
    }
}

/// The policy's `path_fields` block is the one generated from the step definitions
/// (`cynode_protocol::job::step_defs`); `CYNODE_REGENERATE_POLICY=1` rewrites it.
#[test]
fn the_policys_path_fields_are_generated_from_the_step_definitions() {
    let path = policies_dir().join("cynode.rego");
    let text = std::fs::read_to_string(&path).unwrap();
    let (begin, end) = ("# BEGIN generated", "# END generated");
    let start = text.find(begin).expect("the generated block's start");
    let body_at = start + text[start..].find('\n').unwrap() + 1;
    let stop = text.find(end).expect("the generated block's end");
    let want = cynode_protocol::job::step_defs::rego_path_fields();
    if text[body_at..stop] != want {
        if std::env::var_os("CYNODE_REGENERATE_POLICY").is_some() {
            let new = format!("{}{want}{}", &text[..body_at], &text[stop..]);
            std::fs::write(&path, new).unwrap();
            return;
        }
        panic!(
            "policies/cynode.rego's path_fields differ from the step definitions; \
             regenerate with CYNODE_REGENERATE_POLICY=1:\n{want}"
        );
    }
}

/// Every step type with a path argument has it checked by the policy: a `..` there is
/// denied, whichever type it is (a type missing from `path_fields` would pass).
#[test]
fn every_step_types_path_argument_is_checked() {
    for d in cynode_protocol::job::STEP_DEFS.iter() {
        let Some(field) = d.path_field else { continue };
        let mut arguments = serde_json::Map::new();
        for a in d.agent_args.iter().filter(|a| a.required) {
            let value = match a.kind {
                cynode_protocol::job::ArgKind::Text => json!("x"),
                cynode_protocol::job::ArgKind::TextList => json!([]),
                cynode_protocol::job::ArgKind::Count => json!(1),
            };
            arguments.insert(a.name.to_string(), value);
        }
        if d.ty == cynode_protocol::job::StepType::RunCommand {
            arguments.insert("command".into(), json!("go"));
        }
        arguments.insert(field.to_string(), json!("../escape"));
        let job = job_with(json!([{"id": "s", "type": d.ty.as_str(), "arguments": arguments}]));
        let deny = denials(job);
        assert!(
            deny.iter().any(|v| v.message.contains("../escape")),
            "{}.{field} = ../escape passed: {deny:?}",
            d.ty.as_str()
        );
    }
}
