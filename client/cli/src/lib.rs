//! The `ferry` command line's library: tensor files (`.bpk` and `.safetensors`) read and written
//! bit-exact. The commands themselves are the binary's (`src/main.rs`, `src/commands/`).

pub mod files;
