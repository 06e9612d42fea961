//! The test PostgreSQL: started (once per test process) by the project's own
//! `deploy/postgres/start.sh`, which prints the URL to connect with.

use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use crate::output_bounded;

/// The URL of the test PostgreSQL, starting it when it is not running.
///
/// # Panics
/// When the script fails or prints no URL: a test cannot go on without the database.
pub fn postgres_url() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        let mut cmd = Command::new("bash");
        cmd.arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/postgres/start.sh"
        ));
        let out = output_bounded(cmd, Duration::from_secs(240));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .find_map(|l| l.strip_prefix("CYNODE_TEST_POSTGRES_URL="))
            .unwrap_or_else(|| panic!("deploy/postgres/start.sh printed no URL: {text}"))
            .to_string()
    })
}
