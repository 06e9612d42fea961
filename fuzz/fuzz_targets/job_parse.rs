//! Fuzzes `JobSpec::from_json` (strict job.json parsing plus validation).
//!
//! Arbitrary bytes go in. Parsing must never panic, and every job that parses must
//! survive a round trip: serialising it with serde_json and parsing the result again
//! must succeed and give an equal `JobSpec`.

#![no_main]

use cynode_protocol::job::JobSpec;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(job) = JobSpec::from_json(data) else {
        return;
    };
    let bytes = match serde_json::to_vec(&job) {
        Ok(b) => b,
        Err(e) => panic!("a JobSpec accepted by from_json failed to serialise: {e}\njob: {job:?}"),
    };
    let again = match JobSpec::from_json(&bytes) {
        Ok(j) => j,
        Err(e) => panic!(
            "re-parse of a serialised JobSpec failed: {e}\nserialised: {}",
            String::from_utf8_lossy(&bytes)
        ),
    };
    assert_eq!(
        job,
        again,
        "JobSpec changed in a serialise/parse round trip; serialised: {}",
        String::from_utf8_lossy(&bytes)
    );
});
