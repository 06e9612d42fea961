//! Command output on stdout that survives a reader going away: `cynode-pm … | head`
//! ends quietly instead of panicking in `println!`.
//!
//! Only the command line prints through here; `serve`'s sockets never do, and SIGPIPE
//! stays ignored process-wide, so a client closing its connection is an error of that
//! connection, not the end of the service.

use std::io::{ErrorKind, Write};

/// Exit status when stdout was closed by its reader: 0, as for a complete run (the reader
/// had what it wanted), and as `git`, `rg` and friends do; a script's `set -o pipefail`
/// then does not fail on `| head`.
pub const EXIT_STDOUT_CLOSED: i32 = 0;

/// Prints `args` and a newline to stdout. When stdout's reader is gone (EPIPE) the
/// process exits at once with [`EXIT_STDOUT_CLOSED`] and no message; another write error
/// (a full disk) exits 2 with one line on stderr.
pub fn line(args: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let written = out
        .write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
    if let Err(e) = written {
        std::process::exit(exit_status(&e));
    }
}

/// The status a failed write to stdout ends the command with (and says why on stderr
/// unless the reader simply went away).
fn exit_status(e: &std::io::Error) -> i32 {
    if e.kind() == ErrorKind::BrokenPipe {
        EXIT_STDOUT_CLOSED
    } else {
        eprintln!("cynode-pm: cannot write to stdout: {e}");
        2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_reader_is_a_quiet_success_and_other_errors_are_not() {
        let gone = std::io::Error::from(ErrorKind::BrokenPipe);
        assert_eq!(exit_status(&gone), 0);
        let full = std::io::Error::from_raw_os_error(28); // ENOSPC
        assert_eq!(exit_status(&full), 2);
    }
}
