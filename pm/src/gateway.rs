//! The sandbox agents' MCP gateway, its policy half: job tokens and the tool allowlist.
//! (The MCP endpoint that serves the tools is `mcp::gateway`.)
//!
//! - A token is minted by the PM for one job that lists tools in its
//!   `context.mcp_tools`, and bound to its tenant, session, task, job and those tools
//!   ([`Grant`]); it is revoked when the job ends, and expires by itself after the
//!   job's deadline in any case.
//! - Only the token's sha256 is kept: the registry, its `Debug` and any log line name
//!   a token by nothing that could be replayed. [`JobToken`] is the one place the secret
//!   lives; its `Debug` and `Display` are redacted.
//! - [`decide`] is the allowlist: `artifact.put|get|list`, `skills.list|get`,
//!   `web.fetch`, `web.search`, `api.call`, `help.*`; never `db.*`, `node.*`,
//!   `sandbox.*` or a skill write, whatever the job's context asks for.
//! - Calls are audited per job ([`AuditEntry`]: tool, outcome, bytes; for `web.fetch`,
//!   `web.search` and `api.call` also host, port and decision) and handed to the
//!   driver with the revocation, which records them in the session's history (the driver
//!   owns the session record while its job runs; a second writer would break its
//!   optimistic versions).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::Serialize;
use sha2::{Digest, Sha256};

/// What a job token allows: one job of one task of one session of one tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub tenant: String,
    pub session_id: String,
    pub task_id: String,
    pub job_id: String,
    /// The job's skill: its declared `egress` narrows where `web.fetch` may go.
    pub skill_id: String,
    /// The tools the job's `context.mcp_tools` lists: the only ones its token may call
    /// (on top of [`decide`]'s allowlist).
    pub tools: Vec<String>,
}

impl Grant {
    /// Whether the job listed `tool` in its `context.mcp_tools`.
    pub fn lists(&self, tool: &str) -> bool {
        self.tools.iter().any(|t| t == tool)
    }
}

/// The secret a job's node-side gateway endpoint presents. Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct JobToken(String);

impl JobToken {
    /// The secret, for the one place that sends it (the Worker API request).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobToken(<redacted>)")
    }
}

/// Why a token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Never minted here, or revoked (its job ended).
    #[error("unknown or revoked gateway token")]
    Unknown,
    /// Past its deadline.
    #[error("expired gateway token")]
    Expired,
}

/// One gateway call, as the session's history records it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct AuditEntry {
    pub tool: String,
    /// `ok`, `refused` or `error`.
    pub outcome: String,
    /// Bytes the call moved (artifact bytes in or out, reply size).
    pub bytes: u64,
    /// The reason of a refusal (cut to [`MAX_DETAIL_BYTES`]).
    pub detail: Option<String>,
    /// `web.fetch` and `api.call`: the destination (host, or `route:<name>` before the
    /// route is known), its port, and `allowed` or `denied`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision: Option<String>,
}

/// An artifact a job put through the gateway, verified, waiting to join the session
/// when the job ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutArtifact {
    pub path: String,
    pub sha256: String,
    pub size_bytes: u64,
    pub location: String,
}

struct Entry {
    grant: Grant,
    expires: Instant,
    audit: Vec<AuditEntry>,
    artifacts: Vec<PutArtifact>,
    /// `artifact.put`s admitted so far, and their bytes ([`Tokens::admit_put`]).
    puts: usize,
    put_bytes: u64,
}

/// What a job left behind when its token was revoked.
#[derive(Debug, Default)]
pub struct Revoked {
    pub audit: Vec<AuditEntry>,
    pub artifacts: Vec<PutArtifact>,
}

/// Bound on the audit entries kept for one job (later calls are counted, not listed).
pub const MAX_AUDIT_PER_JOB: usize = 2000;
/// Most `artifact.put`s one job may make (each becomes an artifact of the session, and
/// the PM's model is shown the session's artifacts every turn).
pub const MAX_PUTS_PER_JOB: usize = 64;
/// Most bytes one job may put through `artifact.put`, all puts together.
pub const MAX_PUT_BYTES_PER_JOB: u64 = 64 << 20;
/// Longest `detail` an audit entry (and a refusal) keeps: the rest of a hostile
/// request's echo (a 12 MiB path or field name) is cut.
pub const MAX_DETAIL_BYTES: usize = 300;
/// What the audit and the log name a call whose tool name is not a tool name.
pub const INVALID_TOOL: &str = "<invalid>";

/// `s` cut to at most `max` bytes on a character boundary, `…` marking a cut.
pub fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut i = max.saturating_sub('…'.len_utf8());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    format!("{}…", &s[..i])
}

/// The job tokens of this process, by the sha256 of the token.
#[derive(Default)]
pub struct Tokens {
    entries: Mutex<HashMap<String, Entry>>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.entries.lock().map(|e| e.len()).unwrap_or(0);
        f.debug_struct("Tokens").field("live", &n).finish()
    }
}

fn digest(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// The process's token registry.
pub fn tokens() -> &'static Tokens {
    static T: OnceLock<Tokens> = OnceLock::new();
    T.get_or_init(Tokens::default)
}

impl Tokens {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // A panic while holding the lock leaves plain data: keep using it.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Mints a token for `grant`, valid for `ttl` unless revoked first. A job already
    /// holding a token (a resumed session) gets a new one and the old one is revoked.
    pub fn mint(&self, grant: Grant, ttl: Duration) -> JobToken {
        let token = JobToken(format!(
            "cgw_{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        ));
        let mut e = self.lock();
        e.retain(|_, v| v.grant.job_id != grant.job_id && v.expires > Instant::now());
        e.insert(
            digest(&token.0),
            Entry {
                grant,
                expires: Instant::now() + ttl,
                audit: Vec::new(),
                artifacts: Vec::new(),
                puts: 0,
                put_bytes: 0,
            },
        );
        token
    }

    /// The grant of a live token.
    pub fn check(&self, token: &str) -> Result<Grant, TokenError> {
        let mut e = self.lock();
        let key = digest(token);
        match e.get(&key) {
            None => Err(TokenError::Unknown),
            Some(v) if v.expires <= Instant::now() => {
                e.remove(&key);
                Err(TokenError::Expired)
            }
            Some(v) => Ok(v.grant.clone()),
        }
    }

    /// Records a call of `job_id`'s token.
    pub fn audit(&self, job_id: &str, entry: AuditEntry) {
        if let Some(v) = self.lock().values_mut().find(|v| v.grant.job_id == job_id) {
            if v.audit.len() < MAX_AUDIT_PER_JOB {
                v.audit.push(entry);
            }
        }
    }

    /// Counts an `artifact.put` of `size` bytes by `job_id` against its caps
    /// ([`MAX_PUTS_PER_JOB`], [`MAX_PUT_BYTES_PER_JOB`]) before anything is stored; the
    /// reason when it is over them (or the job holds no live token).
    pub fn admit_put(&self, job_id: &str, size: u64) -> Result<(), String> {
        let mut e = self.lock();
        let Some(v) = e.values_mut().find(|v| v.grant.job_id == job_id) else {
            return Err("artifact.put: the job holds no live gateway token".into());
        };
        if v.puts >= MAX_PUTS_PER_JOB {
            return Err(format!(
                "artifact.put: this job has made {MAX_PUTS_PER_JOB} puts, the most one job may; nothing was stored"
            ));
        }
        if v.put_bytes + size > MAX_PUT_BYTES_PER_JOB {
            return Err(format!(
                "artifact.put: {size} more bytes would take this job past {MAX_PUT_BYTES_PER_JOB} bytes of puts; nothing was stored"
            ));
        }
        v.puts += 1;
        v.put_bytes += size;
        Ok(())
    }

    /// Keeps an artifact `job_id` put, for the session when the job ends.
    pub fn put_artifact(&self, job_id: &str, a: PutArtifact) {
        if let Some(v) = self.lock().values_mut().find(|v| v.grant.job_id == job_id) {
            v.artifacts.retain(|x| x.path != a.path);
            v.artifacts.push(a);
        }
    }

    /// The artifacts `job_id` put so far.
    pub fn artifacts_of(&self, job_id: &str) -> Vec<PutArtifact> {
        self.lock()
            .values()
            .find(|v| v.grant.job_id == job_id)
            .map(|v| v.artifacts.clone())
            .unwrap_or_default()
    }

    /// Revokes `job_id`'s token (its job ended): what it recorded comes back once.
    pub fn revoke_job(&self, job_id: &str) -> Revoked {
        let mut e = self.lock();
        let mut out = Revoked::default();
        e.retain(|_, v| {
            if v.grant.job_id == job_id {
                out.audit.append(&mut v.audit);
                out.artifacts.append(&mut v.artifacts);
                false
            } else {
                true
            }
        });
        out
    }
}

/// The tools a gateway ever offers.
pub const TOOLS: &[&str] = &[
    "artifact.put",
    "artifact.get",
    "artifact.list",
    "skills.list",
    "skills.get",
    "web.fetch",
    "web.search",
    "api.call",
    "help.tools",
];

/// The decision on a tool name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Allowed,
    /// Never offered to a sandbox (`db.*`, `node.*`, `sandbox.*`, skill writes, or
    /// anything else not on the allowlist).
    Forbidden(String),
}

/// Whether a sandbox may call `tool`.
pub fn decide(tool: &str) -> Decision {
    for prefix in ["db.", "node.", "sandbox."] {
        if tool.starts_with(prefix) {
            return Decision::Forbidden(format!(
                "`{tool}`: {prefix}* tools are never offered to a sandbox"
            ));
        }
    }
    if tool.starts_with("skills.") && !matches!(tool, "skills.list" | "skills.get") {
        return Decision::Forbidden(format!("`{tool}`: skills are read-only from a sandbox"));
    }
    if TOOLS.contains(&tool) || (tool.starts_with("help.") && tool.len() > 5) {
        Decision::Allowed
    } else {
        Decision::Forbidden(format!("`{tool}` is not a gateway tool"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(job: &str) -> Grant {
        Grant {
            tenant: "acme".into(),
            session_id: "s-1".into(),
            task_id: "t1".into(),
            job_id: job.into(),
            skill_id: "gw".into(),
            tools: vec!["skills.get".into()],
        }
    }

    #[test]
    fn a_token_grants_its_job_until_revoked_or_expired() {
        let t = Tokens::default();
        let tok = t.mint(grant("j1"), Duration::from_secs(60));
        assert_eq!(t.check(tok.expose()), Ok(grant("j1")));
        // Forged: the right shape, never minted; and a prefix of the real one.
        let forged = format!("cgw_{}", "0".repeat(64));
        assert_eq!(t.check(&forged), Err(TokenError::Unknown));
        assert_eq!(t.check(&tok.expose()[..20]), Err(TokenError::Unknown));
        t.audit(
            "j1",
            AuditEntry {
                tool: "skills.list".into(),
                outcome: "ok".into(),
                bytes: 10,
                ..Default::default()
            },
        );
        let r = t.revoke_job("j1");
        assert_eq!(r.audit.len(), 1);
        assert_eq!(t.check(tok.expose()), Err(TokenError::Unknown));

        let short = t.mint(grant("j2"), Duration::ZERO);
        assert_eq!(t.check(short.expose()), Err(TokenError::Expired));
        assert_eq!(t.check(short.expose()), Err(TokenError::Unknown));
    }

    #[test]
    fn a_job_may_put_64_artifacts_and_64_mib() {
        let t = Tokens::default();
        let _tok = t.mint(grant("j1"), Duration::from_secs(60));
        let mut refused = Vec::new();
        for i in 0..100 {
            match t.admit_put("j1", 1) {
                Ok(()) => t.put_artifact(
                    "j1",
                    PutArtifact {
                        path: format!("p{i}.txt"),
                        sha256: "00".into(),
                        size_bytes: 1,
                        location: "x".into(),
                    },
                ),
                Err(why) => refused.push((i, why)),
            }
        }
        assert_eq!(refused.len(), 36);
        assert_eq!(refused[0].0, 64, "the 65th put is the first refused");
        assert!(refused[0].1.contains("64 puts"), "{}", refused[0].1);
        assert_eq!(t.artifacts_of("j1").len(), 64);
        assert_eq!(t.revoke_job("j1").artifacts.len(), 64);

        let _tok = t.mint(grant("j2"), Duration::from_secs(60));
        assert!(t.admit_put("j2", 60 << 20).is_ok());
        let why = t.admit_put("j2", 5 << 20).unwrap_err();
        assert!(why.contains("bytes of puts"), "{why}");
        assert!(t.admit_put("j2", 4 << 20).is_ok());
        // A job without a live token puts nothing.
        assert!(t.admit_put("j3", 1).is_err());
    }

    #[test]
    fn a_new_token_for_the_same_job_revokes_the_old_one() {
        let t = Tokens::default();
        let a = t.mint(grant("j1"), Duration::from_secs(60));
        let b = t.mint(grant("j1"), Duration::from_secs(60));
        assert_ne!(a, b);
        assert_eq!(t.check(a.expose()), Err(TokenError::Unknown));
        assert_eq!(t.check(b.expose()), Ok(grant("j1")));
    }

    #[test]
    fn the_secret_is_never_in_debug_output() {
        let t = Tokens::default();
        let tok = t.mint(grant("j1"), Duration::from_secs(60));
        let shown = format!("{tok:?} {t:?} {:?}", t.check(tok.expose()));
        assert!(!shown.contains(tok.expose()), "{shown}");
        assert!(!shown.contains(&tok.expose()[4..20]), "{shown}");
    }

    #[test]
    fn the_allowlist_never_offers_db_node_sandbox_or_skill_writes() {
        for ok in TOOLS.iter().copied().chain(["help.artifact.put"]) {
            assert_eq!(decide(ok), Decision::Allowed, "{ok}");
        }
        for bad in [
            "db.query",
            "node.exec",
            "sandbox.spawn",
            "skills.put",
            "skills.delete",
            "help.",
            "artifact.delete",
            "sessions.create",
            "",
        ] {
            assert!(matches!(decide(bad), Decision::Forbidden(_)), "{bad}");
        }
    }
}
