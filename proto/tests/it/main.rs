//! ferry-proto's integration tests, one binary: golden wire vectors, property tests of the
//! codecs, peers of two minors, and every dtype and scheme against the real Burn backends.
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

mod backends;
mod golden;
mod minors;
mod props;
