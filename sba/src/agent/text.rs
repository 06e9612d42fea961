//! The one cut of the agent's text: what goes into the prompt, the observations and the
//! tool results is bounded in bytes, on a character boundary, with a note of what was cut.

/// `s` cut to `max` bytes on a character boundary, with a note of what was cut.
pub(crate) fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}\n[... {} bytes cut]", &s[..end], s.len() - end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_keeps_char_boundaries() {
        assert_eq!(cut("héllo", 2), "h\n[... 5 bytes cut]");
    }
}
