//! ferry-proto's integration tests, one binary: golden wire vectors, property tests of the
//! codecs, and every dtype and scheme against the real Burn backends.

mod backends;
mod golden;
mod props;
