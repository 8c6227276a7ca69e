//! ferry-server's integration tests, one binary.

mod binary;
