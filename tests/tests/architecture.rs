//! ARCHITECTURE.md's code map names every module each crate's `lib.rs` declares, so a
//! newcomer finds any module from the map (a module added without its map entry fails).

use std::fs;

use cynode_tests::workspace_root;

/// The crates whose `lib.rs` the map covers.
const CRATES: [&str; 6] = ["protocol", "sba", "worker", "pm", "tls", "testkit"];

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
fn every_module_of_every_lib_rs_is_in_the_code_map() {
    let root = workspace_root();
    let map = fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let mut missing = Vec::new();
    let mut seen = 0;
    for krate in CRATES {
        let lib = fs::read_to_string(root.join(krate).join("src/lib.rs"))
            .unwrap_or_else(|e| panic!("{krate}/src/lib.rs: {e}"));
        for m in declared_modules(&lib) {
            seen += 1;
            if !map.contains(&format!("`{m}.rs`")) && !map.contains(&format!("`{m}/`")) {
                missing.push(format!("{krate}::{m}"));
            }
        }
    }
    assert!(
        seen > 30,
        "only {seen} modules found: is the parser still right?"
    );
    assert!(
        missing.is_empty(),
        "modules missing from ARCHITECTURE.md's code map (name them as `name.rs` or `name/`): {missing:?}"
    );
}

#[test]
fn the_parser_sees_declarations_and_nothing_else() {
    let src = "//! doc mod x;\npub mod a;\nmod b;\npub(crate) mod c;\nmod d {\n}\n// mod e;\nuse f::mod_g;\n";
    assert_eq!(declared_modules(src), ["a", "b", "c"]);
}
