//! The control messages: one enum of requests, one of responses, with their meaning.
//!
//! These are what a body of a control frame holds; `control` turns them into bytes. A request
//! that carries a tensor (`Put`, `PutEager`) and a response that does (`Tensor`) are followed on the same
//! connection by chunk frames covering exactly `meta.byte_len` bytes, in order.
//!
//! One concept per file: the tensor key and name rule (`key`), the handshake (`handshake`), the
//! requests (`request`), the responses (`response`), the error codes (`error_code`) and the
//! statistics that grow by minor (`stats`), models' manifests (`model`). Everything is re-exported here.

mod error_code;
mod handshake;
mod key;
mod model;
mod request;
mod response;
mod stats;

pub use error_code::{ErrorCode, ErrorReply};
pub use handshake::{Hello, Welcome};
pub use key::{MAX_NAME_LEN, NameError, TensorKey, validate_name};
pub use model::{ManifestEntry, ModelManifest, ModelSummary, PathsDigest};
pub use request::{
    DELETE_IF_MINOR, EAGER_PUT_MAX_BYTES, EAGER_PUT_MINOR, FETCH_RANGE_MINOR, MAX_WAIT_MS, Request,
    WAIT_MINOR, WaitFor,
};
pub use response::{HeldDtype, Response, TensorInfo};
pub use stats::{DeviceStats, LOAD_MINOR, NodeStats};
