//! The job template's rules and the environment it renders in.
//!
//! Escaping cannot be switched off. Every `{{ … }}` becomes exactly one JSON value:
//! - the formatter JSON-encodes every value it prints, whatever the auto-escape state and
//!   whether the value is marked safe (a `|safe` value, a captured `{% set %}` block, a
//!   macro's output, a `|tojson` string a later filter rewrote are all printed as one JSON
//!   string), so an input can never close a string or add a step;
//! - a template that names the `safe` filter or an `{% autoescape %}` block is refused,
//!   both by `skills validate` (when the package loads) and again when it renders (a
//!   package loaded without validation cannot bypass), and the `safe` filter is not in
//!   the environment at all.
//!
//! Rendering runs under a budget: at most [`FUEL`] template instructions (loops and
//! calls), at most [`MAX_RENDERED_BYTES`] of output, and at most [`RECURSION_LIMIT`]
//! nested calls or includes. Any excess stops the render at once with
//! [`TemplateError::Budget`].

use minijinja::{AutoEscape, Environment, ErrorKind, UndefinedBehavior, Value};

/// Template instructions one render may run: the built-in skills need a few hundred; a
/// render that would loop far longer stops here.
pub const FUEL: u64 = 1_000_000;
/// Largest rendered job (16 MiB).
pub const MAX_RENDERED_BYTES: usize = 16 * 1024 * 1024;
/// Deepest nesting of macro calls, includes and blocks.
pub const RECURSION_LIMIT: usize = 32;

/// Why a template may not be used, or did not render.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// The template switches escaping off at `line` (1-based).
    #[error("{construct} would switch off JSON escaping, so an input could add steps; templates may not use it")]
    Unescaped {
        line: usize,
        construct: &'static str,
    },
    /// The render went over its budget.
    #[error("render budget exceeded: {0}")]
    Budget(String),
    /// Any other template error, with its line when known.
    #[error("{0}")]
    Other(String),
}

/// The first construct of `source` that would switch escaping off: the `safe` filter
/// (`|safe`, `| safe`, `{% filter safe %}`) or an `{% autoescape … %}` block. The scan is
/// lexical and errs on the side of refusing (a `|safe` inside a comment counts too).
pub fn check_escaping(source: &str) -> Result<(), TemplateError> {
    let bytes = source.as_bytes();
    let line_at = |i: usize| source[..i].bytes().filter(|&b| b == b'\n').count() + 1;
    let word_at = |mut i: usize| -> (&str, usize) {
        while i < bytes.len()
            && (bytes[i].is_ascii_whitespace() || bytes[i] == b'-' || bytes[i] == b'+')
        {
            i += 1;
        }
        let start = i;
        while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
            i += 1;
        }
        (&source[start..i], i)
    };
    for (i, _) in source.match_indices('|') {
        if word_at(i + 1).0 == "safe" {
            return Err(TemplateError::Unescaped {
                line: line_at(i),
                construct: "the `safe` filter",
            });
        }
    }
    for (i, _) in source.match_indices("{%") {
        let (tag, end) = word_at(i + 2);
        if tag == "autoescape" {
            return Err(TemplateError::Unescaped {
                line: line_at(i),
                construct: "an `{% autoescape %}` block",
            });
        }
        if tag == "filter" && word_at(end).0 == "safe" {
            return Err(TemplateError::Unescaped {
                line: line_at(i),
                construct: "the `safe` filter",
            });
        }
    }
    Ok(())
}

/// The environment job templates compile and render in (see the module doc).
pub fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_auto_escape_callback(|_| AutoEscape::Json);
    env.set_formatter(json_formatter);
    env.remove_filter("safe");
    env.set_undefined_behavior(UndefinedBehavior::Strict);
    env.set_recursion_limit(RECURSION_LIMIT);
    env.set_fuel(Some(FUEL));
    env
}

/// Prints every value as one JSON value, a safe string as a JSON string.
fn json_formatter(
    out: &mut minijinja::Output,
    _state: &minijinja::State,
    value: &Value,
) -> Result<(), minijinja::Error> {
    let plain;
    let value = match value.as_str() {
        Some(s) if value.is_safe() => {
            plain = Value::from(s);
            &plain
        }
        _ => value,
    };
    let json = serde_json::to_string(value).map_err(|e| {
        minijinja::Error::new(ErrorKind::BadSerialization, "cannot print as JSON").with_source(e)
    })?;
    out.write_str(&json)
        .map_err(|_| minijinja::Error::new(ErrorKind::WriteFailure, "output refused"))
}

/// Checks `source`, then renders it with `ctx` under the budget.
pub fn render(source: &str, ctx: &serde_json::Value) -> Result<String, TemplateError> {
    check_escaping(source)?;
    let mut env = environment();
    env.add_template("job", source).map_err(describe)?;
    let tmpl = env.get_template("job").map_err(describe)?;
    let mut out = Bounded::default();
    let rendered = tmpl.render_captured_to(ctx, &mut out).map(drop);
    match rendered {
        Ok(()) => String::from_utf8(out.bytes)
            .map_err(|e| TemplateError::Other(format!("rendered text is not UTF-8: {e}"))),
        Err(_) if out.overflowed => Err(TemplateError::Budget(format!(
            "the rendered job is over {MAX_RENDERED_BYTES} bytes"
        ))),
        Err(e) => Err(describe(e)),
    }
}

fn describe(e: minijinja::Error) -> TemplateError {
    let at = e.line().map(|l| format!("line {l}: ")).unwrap_or_default();
    match e.kind() {
        ErrorKind::OutOfFuel => TemplateError::Budget(format!(
            "{at}more than {FUEL} template instructions (a loop that runs too long?)"
        )),
        ErrorKind::InvalidOperation if e.to_string().contains("recursion") => {
            TemplateError::Budget(format!("{at}nested deeper than {RECURSION_LIMIT} calls"))
        }
        _ => TemplateError::Other(format!("{at}{e}")),
    }
}

/// An output that refuses to grow past [`MAX_RENDERED_BYTES`].
#[derive(Default)]
struct Bounded {
    bytes: Vec<u8>,
    overflowed: bool,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > MAX_RENDERED_BYTES {
            self.overflowed = true;
            return Err(std::io::Error::other("rendered job too large"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_bypasses_are_found_with_their_line() {
        for (source, line) in [
            ("{{ x|safe }}", 1),
            ("a\n{{ x | safe }}", 2),
            ("{{ x|  safe() }}", 1),
            ("\n\n{% autoescape false %}{{ x }}{% endautoescape %}", 3),
            ("{%- autoescape true -%}{% endautoescape %}", 1),
            ("{% filter safe %}{{ x }}{% endfilter %}", 1),
            ("{%+ filter  safe %}{% endfilter %}", 1),
        ] {
            assert!(
                matches!(check_escaping(source), Err(TemplateError::Unescaped { line: l, .. }) if l == line),
                "{source}"
            );
        }
        for fine in [
            "{{ x|safety }}",
            "{{ x|default('safe') }}",
            "{% filter upper %}{{ x }}{% endfilter %}",
            "{\"mode\": \"autoescape\"}",
        ] {
            assert_eq!(check_escaping(fine), Ok(()), "{fine}");
        }
    }
}
