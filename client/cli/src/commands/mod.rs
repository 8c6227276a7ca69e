//! One file per command of the `ferry` command line.

pub(crate) mod certs;
pub(crate) mod etcd_roles;
pub(crate) mod get;
pub(crate) mod health;
pub(crate) mod load;
pub(crate) mod ls;
pub(crate) mod model_copy;
pub(crate) mod put;
pub(crate) mod relay;
pub(crate) mod rm;
pub(crate) mod stat;
pub(crate) mod transfer;

/// Tensors per pipelined batch between two progress updates.
const BATCH: usize = 16;
