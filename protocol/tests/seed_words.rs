//! The seeds' words (upstream CyNodeAI's specs) where ours differ: each seed word read
//! through our types comes out as our word, and ours is what we write. The table is
//! docs/INTEROP.md's "The seeds' words"; a row added there belongs here too.

use cynode_protocol::result::FailureCode;
use cynode_protocol::session::TaskStatus;

/// (seed word, our word) for `failure_code`.
const FAILURE_CODES: [(&str, FailureCode); 1] = [("schema_error", FailureCode::SchemaValidation)];

/// (seed word, our word) for a plan entry's `status`.
const PLAN_STATUSES: [(&str, TaskStatus); 2] = [
    ("running", TaskStatus::InProgress),
    ("completed", TaskStatus::Done),
];

fn read<T: serde::de::DeserializeOwned>(word: &str) -> T {
    serde_json::from_value(serde_json::Value::String(word.into()))
        .unwrap_or_else(|e| panic!("`{word}` is not read: {e}"))
}

fn written<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_value(v)
        .unwrap()
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn each_seed_word_reads_as_ours_and_ours_is_written() {
    for (seed, ours) in FAILURE_CODES {
        assert_eq!(read::<FailureCode>(seed), ours, "{seed}");
        assert_eq!(written(&ours), ours.as_str());
        assert_ne!(written(&ours), seed);
    }
    for (seed, ours) in PLAN_STATUSES {
        assert_eq!(read::<TaskStatus>(seed), ours, "{seed}");
        assert_ne!(written(&ours), seed);
    }
}

#[test]
fn the_interop_table_lists_every_mapping() {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/INTEROP.md"),
    )
    .unwrap();
    let rows: Vec<(&str, String)> = FAILURE_CODES
        .iter()
        .map(|(s, o)| (*s, written(o)))
        .chain(PLAN_STATUSES.iter().map(|(s, o)| (*s, written(o))))
        .collect();
    for (seed, ours) in rows {
        let row = format!("| `{seed}` | `{ours}` |");
        assert!(doc.contains(&row), "docs/INTEROP.md lacks the row {row}");
    }
}

/// A word that is neither ours nor a seed's is still refused.
#[test]
fn other_words_stay_refused() {
    assert!(serde_json::from_str::<TaskStatus>("\"runing\"").is_err());
    assert!(serde_json::from_str::<FailureCode>("\"schema\"").is_err());
}
