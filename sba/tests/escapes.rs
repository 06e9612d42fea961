//! escapes tests
