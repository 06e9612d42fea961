//! Integration tests of cynode-worker.
