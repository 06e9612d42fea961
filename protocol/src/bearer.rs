//! The one rule for a bearer token kept in a file, shared by the worker (its own token)
//! and the PM (the token it presents to each worker), which often read the same secret:
//! the token is the file's first line, trimmed. Anything after it (a comment, a second
//! line) is not part of the token.

/// The token a token file's `text` holds: its first line, trimmed.
pub fn token_in_file(text: &str) -> &str {
    text.lines().next().unwrap_or_default().trim()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_first_line_trimmed() {
        assert_eq!(super::token_in_file("  abc \n"), "abc");
        assert_eq!(super::token_in_file("abc\r\nsecond line"), "abc");
        assert_eq!(super::token_in_file(""), "");
        assert_eq!(super::token_in_file("\nabc"), "");
    }
}
