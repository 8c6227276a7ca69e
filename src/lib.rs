//! ferry-suite: the workspace's integration tests (`tests/`), benchmarks (`benches/`) and the
//! README's and docs' examples as doc tests; no library of its own (the harness they share is
//! ferry-testkit, in `tests/testkit/`).

/// The README's and the docs' Rust examples, compiled and run as doc tests
/// (`cargo test -p ferry-suite --doc`), so that they cannot rot.
#[cfg(doctest)]
mod docs_examples {
    #[doc = include_str!("../README.md")]
    mod readme {}
    #[doc = include_str!("../docs/library.md")]
    mod library {}
    #[doc = include_str!("../docs/deployment.md")]
    mod deployment {}
    #[doc = include_str!("../docs/node.md")]
    mod node {}
    #[doc = include_str!("../docs/cli.md")]
    mod cli {}
    #[doc = include_str!("../docs/security.md")]
    mod security {}
    #[doc = include_str!("../docs/same-host.md")]
    mod same_host {}
    #[doc = include_str!("../docs/gpu.md")]
    mod gpu {}
    #[doc = include_str!("../docs/cluster.md")]
    mod cluster {}
    #[doc = include_str!("../docs/benchmarks.md")]
    mod benchmarks {}
}
