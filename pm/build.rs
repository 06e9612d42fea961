//! Rebuilds cynode-pm when the built-in skills or the default policy change: both are
//! embedded in the binary (`include_dir!` and `include_str!`).

fn main() {
    println!("cargo:rerun-if-changed=../skills");
    println!("cargo:rerun-if-changed=../policies");
}
