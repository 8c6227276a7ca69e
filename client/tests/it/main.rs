//! ferry-client's integration tests, one binary.

mod files;
