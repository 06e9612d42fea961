//! Bearer-token authentication with tenants: a tokens file maps each token to a tenant
//! (`TOKEN TENANT` per line, `#` comments), and every request carries one. Tokens are
//! compared in constant time; a tenant sees only its own sessions and artifacts.

use std::path::Path;

use crate::settings_file::FileError;
use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use subtle::ConstantTimeEq;

use super::problem::Problem;
use super::AppState;

/// The token → tenant table.
#[derive(Clone, Default)]
pub struct Tokens {
    entries: Vec<(Vec<u8>, String)>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens")
            .field(
                "tenants",
                &self.entries.iter().map(|e| &e.1).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// What is wrong with an API tokens file.
#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    #[error("line {0}: expected `TOKEN TENANT`")]
    Line(usize),
    #[error("line {0}: the token is shorter than 16 characters")]
    Short(usize),
    #[error("no tokens")]
    Empty,
}

impl Tokens {
    /// Reads `TOKEN TENANT` lines; a token shorter than 16 characters is refused.
    pub fn load(path: &Path) -> Result<Tokens, FileError<TokensError>> {
        crate::settings_file::load("API tokens file", path, Self::parse)
    }

    pub fn parse(text: &str) -> Result<Tokens, TokensError> {
        let mut entries = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut parts = line.split_whitespace();
            let (Some(token), Some(tenant), None) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(TokensError::Line(n + 1));
            };
            if token.len() < 16 {
                return Err(TokensError::Short(n + 1));
            }
            entries.push((token.as_bytes().to_vec(), tenant.to_string()));
        }
        if entries.is_empty() {
            return Err(TokensError::Empty);
        }
        Ok(Tokens { entries })
    }

    /// The tenant of `token`; every entry is compared so timing reveals nothing.
    pub fn tenant(&self, token: &str) -> Option<&str> {
        let mut found = None;
        for (t, tenant) in &self.entries {
            if bool::from(t.as_slice().ct_eq(token.as_bytes())) {
                found = Some(tenant.as_str());
            }
        }
        found
    }
}

/// The authenticated tenant of a request.
#[derive(Debug, Clone)]
pub struct Tenant(pub String);

impl FromRequestParts<Arc<AppState>> for Tenant {
    type Rejection = Problem;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, Self::Rejection> {
        let token = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(Problem::unauthorized)?;
        state
            .tokens
            .tenant(token.trim())
            .map(|t| Tenant(t.to_string()))
            .ok_or_else(Problem::unauthorized)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_map_to_tenants_and_bad_files_are_refused() {
        let t =
            Tokens::parse("# comment\naaaaaaaaaaaaaaaa1 acme\nbbbbbbbbbbbbbbbb2 globex\n").unwrap();
        assert_eq!(t.tenant("aaaaaaaaaaaaaaaa1"), Some("acme"));
        assert_eq!(t.tenant("bbbbbbbbbbbbbbbb2"), Some("globex"));
        assert_eq!(t.tenant("aaaaaaaaaaaaaaaa"), None);
        assert!(Tokens::parse("short acme").is_err());
        assert!(Tokens::parse("aaaaaaaaaaaaaaaa1").is_err());
        assert!(Tokens::parse("").is_err());
    }
}
