//! Babble is a contract violation: a summary, note, message or task description that
//! repeats a clause (the same 4 words three times or more) or whose text compresses far
//! below its length (most of it copies of what came before) is refused, and the model is
//! told why and asked again (with repetition penalties, see `llm::client`).
//!
//! A small model at temperature 0 falls into loops ("the plan_update is finished, the
//! plan_update is finished, …"); the schema's length bound only cuts them short.

/// Words of a repeated clause.
pub const CLAUSE_WORDS: usize = 4;
/// How often the same clause may appear before the text is babble.
pub const CLAUSE_REPEATS: usize = 3;
/// Texts shorter than this are not judged by their compression.
pub const COMPRESSION_MIN_CHARS: usize = 120;
/// The least share of a text's bytes that must be new (not a copy of an earlier run of
/// [`COPY_MIN`] bytes or more); below it the text compresses far below its length.
pub const NOVEL_MIN: f64 = 0.35;
/// The shortest copy that counts.
const COPY_MIN: usize = 8;

/// Why a text is babble.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Babble {
    /// The clause `clause` appears `times` times.
    Repeated { clause: String, times: usize },
    /// Only `novel_percent`% of the text is not a copy of what came before it.
    Compressible { novel_percent: u32 },
}

impl std::fmt::Display for Babble {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Babble::Repeated { clause, times } => write!(
                f,
                "it repeats \"{clause}\" {times} times; say each thing once, in your own short words"
            ),
            Babble::Compressible { novel_percent } => write!(
                f,
                "only {novel_percent}% of it is not a repetition of its own earlier words; say each thing once, in your own short words"
            ),
        }
    }
}

/// The first sign of babble in `text`, if any.
pub fn check(text: &str) -> Option<Babble> {
    repeated_clause(text).or_else(|| compressible(text))
}

fn repeated_clause(text: &str) -> Option<Babble> {
    let words: Vec<String> = text
        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '\''))
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect();
    let mut counts: std::collections::HashMap<&[String], usize> = Default::default();
    for w in words.windows(CLAUSE_WORDS) {
        let n = counts.entry(w).or_default();
        *n += 1;
    }
    // The first clause (in text order) that repeats too often.
    words.windows(CLAUSE_WORDS).find_map(|w| {
        let times = counts.get(w).copied().unwrap_or(0);
        (times >= CLAUSE_REPEATS).then(|| Babble::Repeated {
            clause: w.join(" "),
            times,
        })
    })
}

/// A greedy LZ77 pass: the share of bytes not covered by a copy of an earlier run.
fn compressible(text: &str) -> Option<Babble> {
    if text.chars().count() < COMPRESSION_MIN_CHARS {
        return None;
    }
    let b = text.as_bytes();
    let mut seen: std::collections::HashMap<&[u8], usize> = Default::default();
    let (mut i, mut novel) = (0usize, 0usize);
    while i < b.len() {
        let copy = (i + COPY_MIN <= b.len())
            .then(|| seen.get(&b[i..i + COPY_MIN]).copied())
            .flatten()
            .map(|j| {
                let mut n = COPY_MIN;
                while i + n < b.len() && b[j + n] == b[i + n] {
                    n += 1;
                }
                n
            });
        let step = match copy {
            Some(n) => n,
            None => {
                novel += 1;
                1
            }
        };
        for k in i..(i + step) {
            if k + COPY_MIN <= b.len() {
                seen.entry(&b[k..k + COPY_MIN]).or_insert(k);
            }
        }
        i += step;
    }
    let share = novel as f64 / b.len() as f64;
    (share < NOVEL_MIN).then(|| Babble::Compressible {
        novel_percent: (share * 100.0).round() as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demos_deliverable_is_babble() {
        let text = "The plan is done, the objective is met, the plan_update is finished, \
                    the plan_update is finished, the plan_update is finished, the plan_update is finished";
        match check(text) {
            Some(Babble::Repeated { clause, times }) => {
                assert_eq!(clause, "the plan_update is finished");
                assert_eq!(times, 4);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_clause_twice_is_fine_three_times_is_not() {
        assert_eq!(check("the tests pass now; yes, the tests pass now"), None);
        assert!(matches!(
            check("The tests pass now. The tests pass now! the TESTS pass now"),
            Some(Babble::Repeated { times: 3, .. })
        ));
    }

    #[test]
    fn text_that_copies_itself_compresses_far_below_its_length() {
        // No 4-word clause three times, yet most of it is a copy: one long word run.
        let text = "abcdefghijklmnopqrstuvwxyz0123456789".repeat(5);
        assert!(matches!(
            check(&text),
            Some(Babble::Compressible { novel_percent }) if novel_percent < 35
        ));
    }

    #[test]
    fn ordinary_summaries_pass() {
        for text in [
            "Listed the repository (12 entries), read README.md and ran the unit tests: \
             23 passed, 0 failed. The greeting in hello.txt is written and found by search.",
            "wrote hello.txt and found it",
            "Inspected src/ and tests/; the failing test is parse_empty_input in src/lib.rs:42, \
             which unwraps an empty Vec. Added a guard and a test; cargo test now passes (31 tests).",
            "",
        ] {
            assert_eq!(check(text), None, "{text}");
        }
    }
}
