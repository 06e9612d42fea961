//! Redaction of a route's secrets from what its upstream answers: an upstream that reflects
//! request headers (an echo service, many error pages) would otherwise hand the credential
//! the holder added back to the caller. Every occurrence of a secret, in a header value or
//! anywhere in the body, becomes [`REDACTED`].
//!
//! The secrets of a route are its header values, each in full, and, for a value of the
//! form `<scheme> <credentials>` (`Bearer …`, `Basic …`, `token …`), the credentials alone
//! when they are at least [`MIN_PART`] bytes: a reflection that re-encodes the space
//! (`Bearer%20…`) or drops the scheme still shows the credentials. A secret re-encoded
//! beyond that (base64 of it, another case, escapes inside it) is not recognised.
//!
//! [`Redactor::redact`] does a whole buffer; [`Redactor::stream`] a body that arrives in
//! pieces, a secret split across two of them included: it holds back only a tail that is
//! the start of some secret (at most the longest secret's length less one byte) until the
//! next piece or the end says whether it is one.

use std::borrow::Cow;

use aho_corasick::{AhoCorasick, MatchKind};

/// What a secret is replaced with.
pub const REDACTED: &[u8] = b"<redacted>";

/// The shortest credential part (after a `<scheme> `) redacted on its own.
pub const MIN_PART: usize = 8;

/// Whether a route answer's `Content-Encoding` is anything but `identity`: a compressed
/// body could carry a secret past the redactor, and is refused.
pub fn is_compressed(headers: &reqwest::header::HeaderMap) -> bool {
    headers
        .get_all(reqwest::header::CONTENT_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .any(|c| !c.is_empty() && !c.eq_ignore_ascii_case(b"identity"))
}

/// The secrets of one route (or none), ready to be searched for.
#[derive(Clone, Default)]
pub struct Redactor {
    /// `None`: no secret.
    matcher: Option<AhoCorasick>,
    /// The secrets, for the streaming hold-back.
    secrets: Vec<Vec<u8>>,
}

impl std::fmt::Debug for Redactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the values.
        f.debug_struct("Redactor")
            .field("secrets", &self.secrets.len())
            .finish()
    }
}

impl Redactor {
    /// The redactor for credential header `values`: each in full, and the credentials of a
    /// `<scheme> <credentials>` value when at least [`MIN_PART`] bytes. Empty values are
    /// ignored.
    pub fn new<I, B>(values: I) -> Redactor
    where
        I: IntoIterator<Item = B>,
        B: AsRef<[u8]>,
    {
        let mut secrets: Vec<Vec<u8>> = Vec::new();
        for v in values {
            let v = v.as_ref();
            if v.is_empty() {
                continue;
            }
            secrets.push(v.to_vec());
            if let Some(sp) = v.iter().position(|b| *b == b' ') {
                let part = v[sp..].trim_ascii();
                if part.len() >= MIN_PART {
                    secrets.push(part.to_vec());
                }
            }
        }
        secrets.sort();
        secrets.dedup();
        if secrets.is_empty() {
            return Redactor::default();
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&secrets)
            // Only a pattern set beyond the automaton's size limits fails; a few header
            // values never are.
            .ok();
        Redactor { matcher, secrets }
    }

    /// Whether there is nothing to redact.
    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
    }

    /// `bytes` with every secret replaced by [`REDACTED`] (borrowed when none is there).
    pub fn redact<'b>(&self, bytes: &'b [u8]) -> Cow<'b, [u8]> {
        let Some(m) = &self.matcher else {
            return Cow::Borrowed(bytes);
        };
        let mut found = m.find_iter(bytes).peekable();
        if found.peek().is_none() {
            return Cow::Borrowed(bytes);
        }
        let mut out = Vec::with_capacity(bytes.len());
        let mut pos = 0;
        for hit in found {
            out.extend_from_slice(&bytes[pos..hit.start()]);
            out.extend_from_slice(REDACTED);
            pos = hit.end();
        }
        out.extend_from_slice(&bytes[pos..]);
        Cow::Owned(out)
    }

    /// A redactor for one body arriving in pieces.
    pub fn stream(&self) -> StreamRedactor<'_> {
        StreamRedactor {
            redactor: self,
            held: Vec::new(),
        }
    }

    /// Where the undecided tail of `buf` starts: the longest suffix that is a proper
    /// prefix of some secret (`buf.len()` when there is none).
    fn undecided(&self, buf: &[u8]) -> usize {
        let longest = self.secrets.iter().map(Vec::len).max().unwrap_or(0);
        let most = buf.len().min(longest.saturating_sub(1));
        for k in (1..=most).rev() {
            let tail = &buf[buf.len() - k..];
            if self
                .secrets
                .iter()
                .any(|s| s.len() > k && s.starts_with(tail))
            {
                return buf.len() - k;
            }
        }
        buf.len()
    }
}

/// One body's redaction: [`StreamRedactor::push`] each piece as it comes, then
/// [`StreamRedactor::finish`].
#[derive(Debug)]
pub struct StreamRedactor<'a> {
    redactor: &'a Redactor,
    /// The tail not yet decided (a possible start of a secret).
    held: Vec<u8>,
}

impl StreamRedactor<'_> {
    /// Appends to `out` what of `piece` (after what was held) is decided, redacted; holds
    /// back a tail that may be the start of a secret.
    pub fn push(&mut self, piece: &[u8], out: &mut Vec<u8>) {
        let Some(m) = &self.redactor.matcher else {
            out.extend_from_slice(piece);
            return;
        };
        let joined;
        let buf: &[u8] = if self.held.is_empty() {
            piece
        } else {
            let mut j = std::mem::take(&mut self.held);
            j.extend_from_slice(piece);
            joined = j;
            &joined
        };
        let cut = self.redactor.undecided(buf);
        let mut pos = 0;
        // A match starting before `cut` is final: no longer secret can start there
        // (else the tail from there would be a proper prefix of it, and `cut` earlier).
        for hit in m.find_iter(buf) {
            if hit.start() >= cut {
                break;
            }
            out.extend_from_slice(&buf[pos..hit.start()]);
            out.extend_from_slice(REDACTED);
            pos = hit.end();
        }
        let keep = pos.max(cut);
        out.extend_from_slice(&buf[pos..keep]);
        self.held = buf[keep..].to_vec();
    }

    /// Appends to `out` the held tail, redacted: the body has ended.
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        let held = std::mem::take(&mut self.held);
        out.extend_from_slice(&self.redactor.redact(&held));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "Bearer s3cret-route-token-7f3a9c";

    fn whole(r: &Redactor, pieces: &[&[u8]]) -> Vec<u8> {
        let mut s = r.stream();
        let mut out = Vec::new();
        for p in pieces {
            s.push(p, &mut out);
        }
        s.finish(&mut out);
        out
    }

    #[test]
    fn every_occurrence_is_replaced() {
        let r = Redactor::new([b"SECRET-VALUE".as_slice()]);
        assert_eq!(
            r.redact(b"a-SECRET-VALUE-b-SECRET-VALUE").as_ref(),
            b"a-<redacted>-b-<redacted>"
        );
        assert!(matches!(r.redact(b"nothing here"), Cow::Borrowed(_)));
        let none = Redactor::new([b"".as_slice()]);
        assert!(none.is_empty());
        assert_eq!(none.redact(b"abc").as_ref(), b"abc");
        assert!(!format!("{r:?}").contains("SECRET"));
    }

    #[test]
    fn the_credentials_after_a_scheme_are_a_secret_too() {
        let r = Redactor::new([SECRET]);
        assert_eq!(
            r.redact(format!("x: {SECRET}; token=s3cret-route-token-7f3a9c;").as_bytes())
                .as_ref(),
            b"x: <redacted>; token=<redacted>;"
        );
        assert_eq!(
            r.redact(b"Bearer%20s3cret-route-token-7f3a9c").as_ref(),
            b"Bearer%20<redacted>"
        );
        // A short credential part is left to the whole value.
        let short = Redactor::new(["Basic abc"]);
        assert_eq!(short.redact(b"abc Basic abc").as_ref(), b"abc <redacted>");
    }

    #[test]
    fn a_secret_split_at_every_offset_across_two_pieces_is_redacted() {
        let r = Redactor::new([SECRET, "X-Other-Key-123456"]);
        let body = format!("{{\"headers\": {{\"Authorization\": \"{SECRET}\"}}, \"n\": 1}}");
        let want = r.redact(body.as_bytes()).into_owned();
        assert!(!String::from_utf8_lossy(&want).contains("s3cret"));
        for at in 0..=body.len() {
            let (a, b) = body.as_bytes().split_at(at);
            assert_eq!(whole(&r, &[a, b]), want, "split at {at}");
        }
        // And one byte at a time.
        let bytes: Vec<&[u8]> = body.as_bytes().chunks(1).collect();
        assert_eq!(whole(&r, &bytes), want);
    }

    #[test]
    fn only_a_possible_start_of_a_secret_is_held_back() {
        let r = Redactor::new([SECRET]);
        let mut s = r.stream();
        let mut out = Vec::new();
        s.push(b"no secret here\n", &mut out);
        assert_eq!(out, b"no secret here\n");
        out.clear();
        s.push(b"data: Bear", &mut out);
        assert_eq!(out, b"data: ");
        out.clear();
        s.push(b"ing up\n", &mut out);
        assert_eq!(out, b"Bearing up\n");
        out.clear();
        s.push(b"Bearer s3cret-route-tok", &mut out);
        assert_eq!(out, b"");
        s.finish(&mut out);
        // The body ended inside the secret: what came is no secret, and goes.
        assert_eq!(out, b"Bearer s3cret-route-tok");
    }

    #[test]
    fn overlapping_secrets_take_the_longest() {
        let r = Redactor::new(["abcdefgh", "abcdefgh12"]);
        assert_eq!(whole(&r, &[b"xabcdefgh1", b"2y"]), b"x<redacted>y");
        assert_eq!(whole(&r, &[b"xabcdefgh1"]), b"x<redacted>1");
        assert_eq!(whole(&r, &[b"xabcdefgh", b"1z"]), b"x<redacted>1z");
    }
}
