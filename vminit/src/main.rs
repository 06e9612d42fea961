//! `cynode-vminit`: PID 1 of a microvm guest (see [`cynode_vminit::guest`]).

fn main() {
    if std::process::id() != 1 {
        eprintln!("cynode-vminit: runs only as PID 1 of a microvm guest");
        std::process::exit(2);
    }
    cynode_vminit::guest::run()
}
