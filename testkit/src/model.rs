//! The local model server (llama-server + SmolLM2, `deploy/llm/start.sh`) as a test-owned
//! resource: started on a port of the test's own, stopped on drop when the test started it,
//! and read for what it measured (tokens per second) when a test reports its verdict.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::proc::output_bounded;

/// A running local model server.
#[derive(Debug)]
pub struct LocalModel {
    /// `http://127.0.0.1:PORT/v1`.
    pub base_url: String,
    /// The server's log file (llama-server's timings are in it).
    pub log: PathBuf,
    /// The pid to stop on drop: set only when this test started the server.
    started: Option<i32>,
}

fn cache_dir() -> PathBuf {
    std::env::var_os("CYNODE_LLM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/cynode/llm"))
}

/// A port on 127.0.0.1 that nothing listens on now, for a test's own model server: tests
/// that each started a server on one fixed port would share it, and the first to end would
/// stop it under the others.
///
/// # Panics
/// When no port can be had.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free port on 127.0.0.1: {e}"))
}

impl LocalModel {
    /// Starts (or finds) the server on `port` through the project's own script, run from
    /// `repo`; the first call may build llama-server, so `limit` bounds the whole set-up.
    ///
    /// # Panics
    /// When the script fails or outlives `limit`.
    pub fn start(repo: &Path, port: u16, limit: Duration) -> LocalModel {
        let mut cmd = Command::new("bash");
        cmd.arg("deploy/llm/start.sh")
            .arg(port.to_string())
            .current_dir(repo);
        let out = output_bounded(cmd, limit);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "deploy/llm/start.sh {port} failed: {stderr}"
        );
        let base_url = String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("CYNODE_MODEL_BASE_URL=").map(str::to_string))
            .unwrap_or_else(|| panic!("deploy/llm/start.sh printed no URL: {stderr}"));
        let run = cache_dir().join("run");
        // "already up": someone else's server on this port; it is not ours to stop.
        let started = if stderr.contains("already up") {
            None
        } else {
            std::fs::read_to_string(run.join(format!("llama-server-{port}.pid")))
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok())
        };
        LocalModel {
            base_url,
            log: run.join(format!("llama-server-{port}.log")),
            started,
        }
    }

    /// Generation speed of the server's most recent completion, from its log.
    pub fn last_tokens_per_second(&self) -> Option<f64> {
        let text = std::fs::read_to_string(&self.log).ok()?;
        text.lines()
            .filter(|l| l.contains("eval time =") && !l.contains("prompt eval"))
            .filter_map(|l| {
                let (head, _) = l.split_once("tokens per second")?;
                head.rsplit(',').next()?.trim().parse::<f64>().ok()
            })
            .next_back()
    }
}

impl Drop for LocalModel {
    fn drop(&mut self) {
        let Some(pid) = self.started else {
            return;
        };
        let is_server = std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|c| String::from_utf8_lossy(&c).contains("llama-server"))
            .unwrap_or(false);
        if !is_server {
            return;
        }
        // Two SIGTERMs end llama-server at once (the first waits for requests in flight).
        for sig in [libc::SIGTERM, libc::SIGTERM, libc::SIGKILL] {
            // SAFETY: signalling the llama-server this test started (checked above).
            unsafe {
                libc::kill(pid, sig);
            }
            for _ in 0..50 {
                if std::fs::metadata(format!("/proc/{pid}")).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn tokens_per_second_comes_from_the_last_eval_line() {
        let dir = std::env::temp_dir().join(format!("testkit-llm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("l.log");
        std::fs::write(
            &log,
            "prompt eval time =     100.00 ms /    10 tokens (   10.00 ms per token,   100.00 tokens per second)\n       eval time =    1000.00 ms /    20 tokens (   50.00 ms per token,    20.00 tokens per second)\n       eval time =    1000.00 ms /    16 tokens (   62.50 ms per token,    16.00 tokens per second)\nprompt eval time =     100.00 ms /    10 tokens (   10.00 ms per token,   100.00 tokens per second)\n",
        )
        .unwrap();
        let m = LocalModel {
            base_url: String::new(),
            log,
            started: None,
        };
        assert_eq!(m.last_tokens_per_second(), Some(16.0));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
