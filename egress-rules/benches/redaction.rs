//! What redacting a route's answer costs per byte: 256 MiB of JSON-like text in 16 KiB
//! pieces (a route body as reqwest hands it over), one route secret, no occurrence, against
//! a plain copy of the same pieces. `cargo bench -p cynode-egress --bench redaction`;
//! `BEARER=1` puts the scheme word in every line (each a candidate to verify), the worst
//! case. Figures: docs/PERFORMANCE.md, "Credentialed routes".

use std::time::Instant;

use cynode_egress::Redactor;

fn main() {
    let r = Redactor::new(["Bearer s3cret-route-token-7f3a9c"]);
    let line: &[u8] = if std::env::var_os("BEARER").is_some() {
        b"{\"id\": 12345, \"name\": \"Bearer of news\", \"tags\": [\"a\", \"b\"]}\n"
    } else {
        b"{\"id\": 12345, \"name\": \"Carrier of news\", \"tags\": [\"a\", \"b\"]}\n"
    };
    let mut piece = Vec::new();
    while piece.len() < 16 * 1024 {
        piece.extend_from_slice(line);
    }
    piece.truncate(16 * 1024);
    let pieces = 256 * 64;
    let mut out = Vec::with_capacity(32 * 1024);
    let t = Instant::now();
    for _ in 0..pieces {
        out.clear();
        out.extend_from_slice(std::hint::black_box(&piece));
        std::hint::black_box(&out);
    }
    let copy = t.elapsed();
    let mut s = r.stream();
    let t = Instant::now();
    for _ in 0..pieces {
        out.clear();
        s.push(std::hint::black_box(&piece), &mut out);
        std::hint::black_box(&out);
    }
    let redact = t.elapsed();
    let mib = (pieces * piece.len()) as f64 / (1024.0 * 1024.0);
    println!(
        "256 MiB: copy {:.0} MiB/s ({copy:?}), redact {:.0} MiB/s ({redact:?}), {:.2} ms per 100 MiB redacting",
        mib / copy.as_secs_f64(),
        mib / redact.as_secs_f64(),
        redact.as_secs_f64() * 1000.0 * 100.0 / mib
    );
}
