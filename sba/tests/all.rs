//! Black-box tests of the `cynode-sba` binary: real processes, real files, real sockets.

mod harness;

mod escapes;
mod failures;
mod limits;
mod modes;
mod steps;
