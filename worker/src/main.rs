//! Thin binary shim for cynode-worker: the command line ([`cli`]) over the library.

mod cli;

fn main() {
    match cli::main() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("cynode-worker: {e:#}");
            std::process::exit(1);
        }
    }
}
