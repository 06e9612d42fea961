//! Thin binary shim for cynode-worker; the logic lives in the library (`cli`).

fn main() {
    match cynode_worker::cli::main() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("cynode-worker: {e:#}");
            std::process::exit(1);
        }
    }
}
