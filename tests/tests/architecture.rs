//! ARCHITECTURE.md's code map names every module each crate declares (in `lib.rs`,
//! `main.rs` or any other source file, down to the files of a module directory), so a
//! newcomer finds any module from the map (a module added without its map entry fails).

use std::fs;

use cynode_tests::workspace_root;

/// The crates whose sources the map covers.
const CRATES: [&str; 8] = [
    "protocol",
    "sba",
    "worker",
    "pm",
    "tls",
    "testkit",
    "tests",
    "egress-rules",
];

/// Every `.rs` file under `dir`.
fn sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for e in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `mod name;` and `pub mod name;` (any visibility) declarations of one file.
fn declared_modules(source: &str) -> Vec<String> {
    source
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with("//"))
        .filter_map(|l| {
            let rest = l.split("mod ").nth(1)?;
            let before = &l[..l.len() - rest.len() - 4];
            let visibility_only = before.is_empty() || before.trim_end().starts_with("pub");
            let name = rest.strip_suffix(';')?;
            (visibility_only && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
                .then(|| name.to_string())
        })
        .collect()
}

#[test]
fn every_module_of_every_crate_is_in_the_code_map() {
    let root = workspace_root();
    let map = fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let named = |m: &str| {
        ["`", "/"].iter().any(|before| {
            map.contains(&format!("{before}{m}.rs`")) || map.contains(&format!("{before}{m}/`"))
        })
    };
    let mut missing = Vec::new();
    let mut seen = 0;
    for krate in CRATES {
        let mut files = Vec::new();
        sources(&root.join(krate).join("src"), &mut files);
        for file in files {
            let text = fs::read_to_string(&file).unwrap();
            // Unit-test modules (`mod tests;`) are not part of the map.
            for m in declared_modules(&text).into_iter().filter(|m| m != "tests") {
                seen += 1;
                if !named(&m) {
                    let at = file
                        .strip_prefix(&root)
                        .unwrap_or(&file)
                        .display()
                        .to_string();
                    missing.push(format!("{m} (declared in {at})"));
                }
            }
        }
    }
    assert!(
        seen > 60,
        "only {seen} modules found: is the parser still right?"
    );
    assert!(
        missing.is_empty(),
        "modules missing from ARCHITECTURE.md's code map (name them as `name.rs` or `name/`): {missing:?}"
    );
}

/// The egress rules are shared by the worker and the PM, so they depend on neither (nor on
/// any other workspace crate but `cynode-tls`), and on no server framework or database.
#[test]
fn the_egress_rules_depend_on_no_sibling_but_tls() {
    let manifest = fs::read_to_string(workspace_root().join("egress-rules/Cargo.toml")).unwrap();
    let deps: Vec<&str> = manifest
        .lines()
        .skip_while(|l| l.trim() != "[dependencies]")
        .skip(1)
        .take_while(|l| !l.starts_with('['))
        .filter_map(|l| l.split(['=', '.', ' ']).next())
        .filter(|n| !n.is_empty() && !n.starts_with('#'))
        .collect();
    assert!(deps.contains(&"hickory-resolver"), "parser: {deps:?}");
    for d in &deps {
        assert!(
            !d.starts_with("cynode-") || *d == "cynode-tls",
            "cynode-egress depends on {d}"
        );
        assert!(
            !["axum", "sqlx", "hyper"].contains(d),
            "cynode-egress depends on {d}"
        );
    }
    for user in ["worker", "pm"] {
        let m = fs::read_to_string(workspace_root().join(user).join("Cargo.toml")).unwrap();
        assert!(
            m.contains("cynode-egress"),
            "{user} does not use cynode-egress"
        );
    }
}

#[test]
fn the_parser_sees_declarations_and_nothing_else() {
    let src = "//! doc mod x;\npub mod a;\nmod b;\npub(crate) mod c;\nmod d {\n}\n// mod e;\nuse f::mod_g;\n";
    assert_eq!(declared_modules(src), ["a", "b", "c"]);
}

/// The library layers of a crate, lowest first: a module may import (`crate::name`) only
/// from its own layer or a lower one. The same lists stand in ARCHITECTURE.md.
const LAYERS: [(&str, &[&[&str]]); 3] = [
    (
        "sba",
        &[
            &[
                "error",
                "capture",
                "walk",
                "http",
                "result_file",
                "patch",
                "confine",
                "launch",
            ],
            &["process", "artifacts", "lifecycle", "steps"],
            &["step_runner", "agent"],
            &["runner"],
            &["cli"],
        ],
    ),
    (
        "pm",
        &[
            &[
                "settings_file",
                "gateway",
                "session",
                "store",
                "artifacts",
                "metrics",
                "telemetry",
                "skills",
                "policy",
                "llm",
                "dispatch",
                "workers",
                "inference_relay",
            ],
            &["config", "driver", "job_run", "app"],
            &["local_worker", "bootstrap", "service", "mcp"],
        ],
    ),
    (
        "worker",
        &[
            &[
                "sandbox",
                "sandbox_files",
                "config",
                "image_ref",
                "trace",
                "egress",
                "job_dir",
                "fd_walk",
                "remove_tree",
                "disk_usage",
                "loopfs",
                "job_grants",
            ],
            &[
                "backend",
                "inference",
                "callback",
                "gateway_forward",
                "store",
                "disk_guard",
                "disk_limit",
                "uid_pool",
                "reown",
                "open_unlinked",
            ],
            &["sessions", "workspace", "executor", "job_egress"],
            &["node", "replay", "janitor"],
            &["http"],
        ],
    ),
];

/// The top-level modules the code of `text` names as `crate::name` (comments, where a
/// doc link may point anywhere, are left out).
fn crate_imports(text: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .map(|l| format!("{l}\n"))
        .collect();
    let text = code.as_str();
    text.match_indices("crate::")
        .filter(|(i, _)| {
            // `cynode_pm::…` and `$crate::` are not this crate's paths.
            !text[..*i].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == '$')
        })
        .map(|(i, m)| {
            text[i + m.len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .filter(|name: &String| !name.is_empty())
        .collect()
}

#[test]
fn no_module_imports_from_a_layer_above_it() {
    let root = workspace_root();
    let mut violations = Vec::new();
    for (krate, layers) in LAYERS {
        let rank = |m: &str| layers.iter().position(|l| l.contains(&m));
        let src = root.join(krate).join("src");
        let lib = fs::read_to_string(src.join("lib.rs")).unwrap();
        for m in declared_modules(&lib) {
            let mine = rank(&m).unwrap_or_else(|| panic!("{krate}::{m} has no layer in LAYERS"));
            let mut files = Vec::new();
            let file = src.join(format!("{m}.rs"));
            if file.is_file() {
                files.push(file);
            }
            if src.join(&m).is_dir() {
                sources(&src.join(&m), &mut files);
            }
            for f in files {
                let text = fs::read_to_string(&f).unwrap();
                for used in crate_imports(&text) {
                    if rank(&used).is_some_and(|theirs| theirs > mine) {
                        let at = f.strip_prefix(&root).unwrap_or(&f).display().to_string();
                        violations.push(format!("{at} imports crate::{used}"));
                    }
                }
            }
        }
    }
    violations.sort();
    violations.dedup();
    assert!(
        violations.is_empty(),
        "imports from a layer above: {violations:#?}"
    );
}

#[test]
fn crate_paths_are_read_as_this_crates_only() {
    let text = "//! [`crate::service`]\nuse crate::driver::Pm;\nuse cynode_pm::service;\n$crate::x\ncrate::llm::X";
    assert_eq!(crate_imports(text), ["driver", "llm"]);
}

/// Every file or directory the "Finding a behaviour" table names exists.
#[test]
fn the_behaviour_table_names_files_that_exist() {
    let root = workspace_root();
    let map = fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let table = map
        .split("## Finding a behaviour")
        .nth(1)
        .and_then(|t| t.split("\n## ").next())
        .expect("a \"Finding a behaviour\" section");
    let mut named = 0;
    let mut missing = Vec::new();
    for path in table
        .lines()
        .filter(|l| l.starts_with('|'))
        .flat_map(|l| l.split('`').skip(1).step_by(2))
        .filter(|p| p.contains('/') && !p.starts_with('/'))
    {
        named += 1;
        if !root.join(path).exists() {
            missing.push(path.to_string());
        }
    }
    assert!(
        named > 20,
        "only {named} paths found: is the parser still right?"
    );
    assert!(missing.is_empty(), "named but missing: {missing:?}");
}

/// ARCHITECTURE.md's claim about the SBA: only `cli.rs`, `runner.rs` (`base_env`) and
/// `agent/client.rs` (`Endpoint::discover`) read the process environment.
#[test]
fn only_three_sba_modules_read_the_environment() {
    let src = workspace_root().join("sba/src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut readers: Vec<String> = files
        .iter()
        .filter(|f| {
            let text = fs::read_to_string(f).unwrap();
            text.lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .any(|l| {
                    ["env::var(", "env::vars(", "env::var_os(", "env::vars_os("]
                        .iter()
                        .any(|call| l.contains(call))
                })
        })
        .map(|f| f.strip_prefix(&src).unwrap().display().to_string())
        .collect();
    readers.sort();
    assert_eq!(readers, ["agent/client.rs", "cli.rs", "runner.rs"]);
}

/// ARCHITECTURE.md's claim about problem types: every `urn:cynodeai:error:` kind is
/// written by `protocol/src/problem.rs` (`ProblemKind`), the one vocabulary the worker and
/// the PM share; no other source spells one.
#[test]
fn only_the_protocol_spells_a_problem_type() {
    let mut files = Vec::new();
    for krate in ["protocol", "sba", "worker", "pm", "tls"] {
        sources(&workspace_root().join(krate).join("src"), &mut files);
    }
    let mut spellers: Vec<String> = files
        .iter()
        .filter(|f| {
            fs::read_to_string(f)
                .unwrap()
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .any(|l| l.contains("urn:cynodeai:error:"))
        })
        .map(|f| {
            f.strip_prefix(workspace_root())
                .unwrap()
                .display()
                .to_string()
        })
        .collect();
    spellers.sort();
    assert_eq!(spellers, ["protocol/src/problem.rs"]);
}

mod imports;

/// The crate roots whose module trees the import-cycle check reads.
fn crate_roots() -> Vec<(String, std::path::PathBuf)> {
    let root = workspace_root();
    let mut out = Vec::new();
    for krate in CRATES.iter().chain(&["vminit", "poolwaiter"]) {
        for file in ["lib.rs", "main.rs"] {
            let p = root.join(krate).join("src").join(file);
            if p.is_file() {
                out.push((format!("{krate}/src/{file}"), p));
            }
        }
    }
    out
}

/// The import cycles between the files of every crate (see `imports.rs` for what counts),
/// as `root: parent: a <-> b`.
fn import_cycles() -> (Vec<String>, Vec<String>) {
    let root = workspace_root();
    let (mut cycles, mut detail) = (Vec::new(), Vec::new());
    let mut files = 0;
    for (name, path) in crate_roots() {
        let tree = imports::module_tree(&root, &path);
        files += tree.len();
        for c in imports::cycles(&imports::sibling_edges(&tree)) {
            let short = c.split(" (").next().unwrap_or(&c).to_string();
            cycles.push(format!("{name}: {short}"));
            detail.push(format!("{name}: {c}"));
        }
    }
    assert!(
        files > 200,
        "only {files} files in the module trees: is the walk still right?"
    );
    (cycles, detail)
}

#[test]
fn no_import_cycle_between_the_files_of_a_crate() {
    let (cycles, detail) = import_cycles();
    assert!(
        cycles.is_empty(),
        "import cycles between sibling modules: {cycles:?}\n(each with the imports that \
         make it):\n{}\nBreak a cycle by moving what both sides use below both.",
        detail.join("\n")
    );
}

#[test]
fn the_cycle_check_sees_use_trees_inline_paths_and_nothing_in_comments_or_strings() {
    let src = "//! [`crate::x`]\nuse super::{a::X, b::{self, Y}};\nuse crate::c::*;\nfn f() { let s = \"crate::d\"; super::e::g(); '{'; }\n#[cfg(test)]\nmod tests { use crate::t; }\n";
    let code = imports::without_test_modules(&imports::code_only(src));
    let paths: Vec<String> = imports::relative_paths(&code)
        .iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(
        paths,
        [
            "super::a::X",
            "super::b",
            "super::b::Y",
            "crate::c",
            "super::e::g"
        ]
    );
    let module: Vec<String> = vec!["m".into(), "n".into()];
    let resolved = imports::resolve(&module, &["super".into(), "super".into(), "k".into()]);
    assert_eq!(resolved, Some(vec!["k".to_string()]));
}

/// The shapes the three broken cycles had: `use super::sibling::*` both ways, a
/// `crate::` path one way and `super::` the other, and a cycle through a directory module
/// (its files seen as one sibling); a child naming its parent's items is no cycle.
#[test]
fn the_cycle_check_finds_sibling_cycles_and_not_the_tree() {
    let dir = cynode_tests::tempdir().unwrap();
    let src = dir.path().join("src");
    for (file, text) in [
        (
            "lib.rs",
            "pub mod a;\npub mod b;\npub mod c;\npub mod d;\npub struct Top;\n",
        ),
        (
            "a/mod.rs",
            "mod p;\nmod v;\npub use p::X;\npub struct E;\nfn h() { crate::d::inner::k() }\n",
        ),
        ("a/p.rs", "use super::v::*;\nuse super::E;\npub struct X;\n"),
        ("a/v.rs", "use super::p::*;\n"),
        ("b.rs", "pub fn f() { super::c::g() }\n"),
        ("c.rs", "use crate::{b, Top};\npub fn g() {}\n"),
        ("d/mod.rs", "pub mod inner;\n"),
        ("d/inner.rs", "use crate::a::X;\n"),
    ] {
        let p = src.join(file);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }
    let tree = imports::module_tree(dir.path(), &src.join("lib.rs"));
    assert_eq!(tree.len(), 8);
    let found: Vec<String> = imports::cycles(&imports::sibling_edges(&tree))
        .iter()
        .map(|c| c.split(" (").next().unwrap().to_string())
        .collect();
    assert_eq!(
        found,
        ["crate: a <-> d", "crate: b <-> c", "crate::a: p <-> v"]
    );
}

/// The workspace crates a manifest's `[section]` names (`cynode-…`).
fn sibling_deps(krate: &str, section: &str) -> Vec<String> {
    let manifest = fs::read_to_string(workspace_root().join(krate).join("Cargo.toml")).unwrap();
    let mut out: Vec<String> = manifest
        .lines()
        .skip_while(|l| l.trim() != format!("[{section}]"))
        .skip(1)
        .take_while(|l| !l.starts_with('['))
        .filter_map(|l| l.split(['=', '.', ' ']).next())
        .filter(|n| n.starts_with("cynode-"))
        .map(String::from)
        .collect();
    out.sort();
    out
}

/// ARCHITECTURE.md ("tests/"): besides cynode-tests, only the worker dev-depends on a
/// sibling binary crate (cynode-pm, for its skill builder).
#[test]
fn only_the_listed_crates_dev_depend_on_a_binary_crate() {
    let binaries = ["cynode-pm", "cynode-worker", "cynode-sba"];
    let mut found = Vec::new();
    for krate in CRATES.iter().chain(&["vminit", "poolwaiter"]) {
        for d in sibling_deps(krate, "dev-dependencies") {
            if binaries.contains(&d.as_str()) {
                found.push(format!("{krate} -> {d}"));
            }
        }
    }
    assert_eq!(
        found,
        ["worker -> cynode-pm", "tests -> cynode-pm", "tests -> cynode-worker"],
        "a new dev-dependency on a binary crate: move the test to tests/ or update ARCHITECTURE.md and this list"
    );
}

/// ARCHITECTURE.md ("Observability"): the crates both binaries depend on.
#[test]
fn the_crates_both_binaries_share_are_the_listed_ones() {
    let pm = sibling_deps("pm", "dependencies");
    let shared: Vec<String> = sibling_deps("worker", "dependencies")
        .into_iter()
        .filter(|d| pm.contains(d))
        .collect();
    assert_eq!(
        shared,
        [
            "cynode-egress",
            "cynode-otel",
            "cynode-protocol",
            "cynode-tls"
        ]
    );
}

/// ARCHITECTURE.md (`config/`, the worker's layers): `config` imports nothing of the node
/// but `image_ref` and `egress`, and `sandbox` nothing but `config` and `fd_walk`.
#[test]
fn worker_config_and_sandbox_import_only_their_leaves() {
    let src = workspace_root().join("worker/src");
    let imports_of = |files: Vec<std::path::PathBuf>, own: &str| {
        let mut used: Vec<String> = files
            .iter()
            .flat_map(|f| crate_imports(&fs::read_to_string(f).unwrap()))
            .filter(|m| m != own)
            .collect();
        used.sort();
        used.dedup();
        used
    };
    let mut config = Vec::new();
    sources(&src.join("config"), &mut config);
    assert!(config.len() > 2, "config/ has {} files", config.len());
    assert_eq!(imports_of(config, "config"), ["egress", "image_ref"]);
    assert_eq!(
        imports_of(vec![src.join("sandbox.rs")], "sandbox"),
        ["config", "fd_walk"]
    );
}

/// ARCHITECTURE.md ("Adding a sandbox backend") lists every file outside
/// `worker/src/backend/` whose code names a backend: its module (`backend::bwrap`) or its
/// `BackendKind` variant. A backend is a module of `backend/` with an
/// `impl SandboxBackend for`.
#[test]
fn the_files_that_name_a_backend_are_the_ones_listed() {
    let root = workspace_root();
    let backend_dir = root.join("worker/src/backend");
    let mut backend_files = Vec::new();
    sources(&backend_dir, &mut backend_files);
    let mut backends: Vec<String> = backend_files
        .iter()
        .filter(|f| {
            fs::read_to_string(f)
                .unwrap()
                .contains("impl SandboxBackend for")
        })
        .filter_map(|f| {
            let rel = f.strip_prefix(&backend_dir).ok()?;
            let first = rel.components().next()?.as_os_str().to_str()?;
            Some(first.trim_end_matches(".rs").to_string())
        })
        .filter(|m| m != "mod")
        .collect();
    backends.sort();
    backends.dedup();
    assert!(backends.len() >= 3, "backends found: {backends:?}");
    let config = fs::read_to_string(root.join("worker/src/config/mod.rs")).unwrap();
    let variants: Vec<String> = config
        .split("pub enum BackendKind")
        .nth(1)
        .and_then(|t| t.split('}').next())
        .map(|body| {
            imports::code_only(body)
                .lines()
                .map(|l| l.trim().trim_end_matches(','))
                .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with('{'))
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    assert!(variants.len() >= 4, "BackendKind variants: {variants:?}");
    let mut needles: Vec<String> = backends.iter().map(|b| format!("backend::{b}")).collect();
    needles.extend(variants.iter().map(|v| format!("BackendKind::{v}")));

    let map = fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let section = map
        .split("## Adding a sandbox backend")
        .nth(1)
        .and_then(|t| t.split("\n## ").next())
        .expect("an \"Adding a sandbox backend\" section");
    let listed: Vec<&str> = section.split('`').skip(1).step_by(2).collect();
    let mut files = Vec::new();
    sources(&root.join("worker/src"), &mut files);
    let mut unlisted = Vec::new();
    let mut naming = 0;
    for f in files.iter().filter(|f| !f.starts_with(&backend_dir)) {
        let code =
            imports::without_test_modules(&imports::code_only(&fs::read_to_string(f).unwrap()));
        let names = needles.iter().any(|n| {
            code.match_indices(n.as_str()).any(|(i, _)| {
                !code[i + n.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '_')
            })
        });
        if names {
            naming += 1;
            let rel = f.strip_prefix(&root).unwrap().display().to_string();
            if !listed.contains(&rel.as_str()) {
                unlisted.push(rel);
            }
        }
    }
    assert!(
        naming >= 1,
        "no file names a backend: is the search still right?"
    );
    assert!(
        unlisted.is_empty(),
        "files that name a backend ({needles:?}) but are not in ARCHITECTURE.md's \"Adding a sandbox backend\": {unlisted:?}"
    );
}

/// Runs `deploy/perf-headline.py` with `args`.
fn perf_headline(args: &[&std::ffi::OsStr]) -> std::process::Output {
    std::process::Command::new("python3")
        .arg(workspace_root().join("deploy/perf-headline.py"))
        .args(args)
        .output()
        .expect("python3")
}

/// PERFORMANCE.md's headline table is `deploy/perf-headline.py`'s: every row of it is one
/// of the script's rows, in order, so a figure added by hand gets a row (and a bench file,
/// where one writes it) in the script.
#[test]
fn the_headline_table_is_the_scripts() {
    let out = perf_headline(&["--check".as_ref()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The script rewrites a row from its bench's JSON, keeps a row whose file is absent or
/// was written under other conditions (another pool size) than its figure names, and
/// leaves the rest of the document as it was.
#[test]
fn the_headline_script_rewrites_rows_from_the_benches_json_and_keeps_the_rest() {
    let root = workspace_root();
    let dir = tempfile::tempdir().unwrap();
    let doc = dir.path().join("PERFORMANCE.md");
    let original = fs::read_to_string(root.join("docs/PERFORMANCE.md")).unwrap();
    fs::write(&doc, &original).unwrap();
    let bench = dir.path().join("bench");
    fs::create_dir_all(bench.join("results")).unwrap();
    fs::create_dir_all(bench.join("worker")).unwrap();
    let timing = |mean: f64, median: f64| serde_json::json!({"mean_ms": mean, "stddev_ms": 0.25, "median_ms": median, "min_ms": 1.0});
    fs::write(
        bench.join("results/summary.json"),
        serde_json::json!({
            "date": "2031-02-03T04:05:06Z", "load_before": "0.42 0.5 0.5", "load_after": "0.61 0.5 0.5",
            "sba": timing(2.5, 2.25), "baseline": timing(0.75, 0.5), "max_rss_kib": 4000
        })
        .to_string(),
    )
    .unwrap();
    fs::write(
        bench.join("worker/session-state-latest.json"),
        serde_json::json!({
            "date": "20310203T040506Z", "runs": 10, "worker": "/x/release/cynode-worker",
            "state_fs": "default", "pool_size": 3, "load_before": "1.0 1 1", "load_after": "2.0 2 2",
            "results": [{"engine": "bwrap", "time_to_interactive_ms": {"p50": 41.5, "p95": 60}}]
        })
        .to_string(),
    )
    .unwrap();
    fs::write(
        bench.join("worker/latest.json"),
        serde_json::json!({
            "env": {"stamp": "20310203T040506Z", "loadavg": {"start": "1.5 1 1", "end": "0.5 1 1"}},
            "podman": {"worker_http": {"p50_ms": 150.0}, "bare_hyperfine": {"median_ms": 120.0}, "ratio_median": 1.25},
            "bwrap": {"worker_http": {"p50_ms": 12.0}, "bare_hyperfine": {"median_ms": 8.0}}
        })
        .to_string(),
    )
    .unwrap();
    let out = perf_headline(&[
        "--bench-dir".as_ref(),
        bench.as_os_str(),
        "--doc".as_ref(),
        doc.as_os_str(),
    ]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    let new = fs::read_to_string(&doc).unwrap();
    let row = |text: &str, figure: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("| {figure} |")))
            .unwrap_or_else(|| panic!("no row `{figure}`"))
            .to_string()
    };
    for (figure, cells) in [
        (
            "a `run_command true` job in cynode-sba",
            "2.50 ± 0.25 ms (median 2.25) | bare `/bin/true`, 0.75 ± 0.25 ms (median 0.50) | +1.75 ms | 2031-02-03 | 0.4–0.6",
        ),
        (
            "a session's time to interactive, bwrap",
            "p50 41.5 ms | the goal, 50 ms | 0.83× | 2031-02-03 | 1.0–2.0",
        ),
        (
            "a trivial job through the worker, Podman",
            "p50 150.0 ms | bare `podman run`, same flags, 120.0 ms | 1.25× | 2031-02-03 | 0.5–1.5",
        ),
        (
            "the same, bwrap cold",
            "p50 12.00 ms | bare `bwrap`, 8.00 ms | 1.50× | 2031-02-03 | 0.5–1.5",
        ),
    ] {
        assert_eq!(row(&new, figure), format!("| {figure} | {cells} |"));
    }
    // Pool size 3 is not the figure's 2; no egress file at all; a row no bench writes.
    for kept in [
        "a session's time to interactive, Podman with a pool of 2",
        "a trivial bwrap job, `restricted` (egress proxy) against `none`",
        "a trivial job through the worker, bwrap, warm sandboxes",
    ] {
        assert_eq!(row(&new, kept), row(&original, kept));
    }
    assert!(log.contains("pool_size 3"), "{log}");
    let outside = |text: &str| {
        let (head, rest) = text.split_once("<!-- headline:begin").unwrap();
        (
            head.to_string(),
            rest.split_once("<!-- headline:end -->")
                .unwrap()
                .1
                .to_string(),
        )
    };
    assert_eq!(outside(&new), outside(&original));
}
