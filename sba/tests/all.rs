//! Black-box tests of the `cynode-sba` binary: real processes, real files, real sockets.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod harness;
mod model;

mod agent;
mod context;

mod escapes;
mod failures;
mod limits;
mod modes;
mod steps;
mod upstream;
