//! The order in which the model writes a reply's keys.
//!
//! Grammar-constrained backends (llama.cpp's `json_schema_to_grammar`, and others that
//! follow it) make the model write an object's properties in the order the schema lists
//! them. `serde_json` without `preserve_order` sorts keys, which puts a reply's
//! `payload` before its `type` and a job's `inputs` before its `skill_id`: the model
//! would fill in the details before it has decided what to do. [`KeyOrdered`] serializes a
//! request body with [`KEY_ORDER`]'s keys first, in that order (decision before details),
//! and every other key sorted as before, so the order is the same on every call.

use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use serde_json::Value;

/// Keys written first, in this order, in every object of a request body. A reply reads
/// `type`, then its `payload` (`task_id`, `skill_id`, `inputs`; or `summary`), then the
/// `state_patch` (`op`, `path`, `value`); a plan entry reads `task_id`, `description`,
/// `status`. The order of a JSON Schema's own keywords does not matter to a grammar.
pub const KEY_ORDER: [&str; 17] = [
    "type",
    "payload",
    "op",
    "path",
    "from",
    "task_id",
    "skill_id",
    "inputs",
    "summary",
    "text",
    "note",
    "artifacts",
    "description",
    "status",
    "version",
    "value",
    "state_patch",
];

/// A JSON value that serializes its objects' keys in [`KEY_ORDER`].
#[derive(Debug, Clone, Copy)]
pub struct KeyOrdered<'a>(pub &'a Value);

fn rank(key: &str) -> usize {
    KEY_ORDER
        .iter()
        .position(|k| *k == key)
        .unwrap_or(KEY_ORDER.len())
}

impl Serialize for KeyOrdered<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Value::Object(map) => {
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                // Stable: keys outside KEY_ORDER keep serde_json's sorted order.
                entries.sort_by_key(|(k, _)| rank(k));
                let mut m = s.serialize_map(Some(entries.len()))?;
                for (k, v) in entries {
                    m.serialize_entry(k, &KeyOrdered(v))?;
                }
                m.end()
            }
            Value::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for v in items {
                    seq.serialize_element(&KeyOrdered(v))?;
                }
                seq.end()
            }
            other => other.serialize(s),
        }
    }
}

/// `value` as JSON text with its keys in [`KEY_ORDER`] (for prompts and for printing).
pub fn ordered_json(value: &Value, pretty: bool) -> String {
    let v = KeyOrdered(value);
    let text = if pretty {
        serde_json::to_string_pretty(&v)
    } else {
        serde_json::to_string(&v)
    };
    text.unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn decisions_come_before_details_and_other_keys_stay_sorted() {
        let reply = json!({
            "state_patch": [{"value": "done", "path": "/plan/0/status", "op": "replace"}],
            "payload": {"inputs": {"path": "."}, "skill_id": "repo-inspect", "task_id": "t1"},
            "type": "job_request",
            "zeta": 1,
            "alpha": 2,
        });
        assert_eq!(
            ordered_json(&reply, false),
            "{\"type\":\"job_request\",\"payload\":{\"task_id\":\"t1\",\"skill_id\":\
             \"repo-inspect\",\"inputs\":{\"path\":\".\"}},\"state_patch\":[{\"op\":\
             \"replace\",\"path\":\"/plan/0/status\",\"value\":\"done\"}],\"alpha\":2,\"zeta\":1}"
        );
        // The text parses back to the same value: only the order changed.
        let back: Value = serde_json::from_str(&ordered_json(&reply, true)).unwrap();
        assert_eq!(back, reply);
    }

    #[test]
    fn a_schema_lists_its_properties_in_the_reply_order() {
        let schema = json!({"type": "object", "properties": {
            "state_patch": {}, "payload": {}, "type": {"const": "final"}}});
        let text = ordered_json(&schema, false);
        let props = text.find("\"properties\"").unwrap();
        let order: Vec<usize> = ["\"type\":{", "\"payload\"", "\"state_patch\""]
            .iter()
            .map(|k| text[props..].find(k).unwrap())
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{text}");
    }
}
