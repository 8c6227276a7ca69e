//! The only module that touches bincode: control messages to and from frame bodies.
//!
//! bincode 2 is pinned and unmaintained, so it stays behind these four functions. The
//! configuration is fixed-width little-endian integers (documented byte for byte in
//! `PROTOCOL.md`), with a decode limit so a lying length prefix cannot make it allocate.

use bincode::config::{Configuration, Fixint, Limit, LittleEndian};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::FrameError;
use crate::frame::{self, DEFAULT_MAX_BODY, FrameKind};
use crate::message::{Request, Response};

const CONFIG: Configuration<LittleEndian, Fixint, Limit<DEFAULT_MAX_BODY>> =
    bincode::config::standard()
        .with_little_endian()
        .with_fixed_int_encoding()
        .with_limit::<DEFAULT_MAX_BODY>();

/// The body of a control frame: `message` encoded, and no larger than any peer accepts (a
/// message this side cannot send is an error here, never an empty or truncated frame there).
fn encode_body<T: Serialize>(message: &T) -> Result<Vec<u8>, FrameError> {
    let body = bincode::serde::encode_to_vec(message, CONFIG)
        .map_err(|e| FrameError::Unencodable(e.to_string()))?;
    if body.len() > DEFAULT_MAX_BODY {
        return Err(FrameError::TooLarge {
            len: body.len() as u64,
            max: DEFAULT_MAX_BODY as u64,
        });
    }
    Ok(body)
}

fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    let (message, used) = bincode::serde::decode_from_slice(body, CONFIG)
        .map_err(|e| FrameError::Malformed(e.to_string()))?;
    if used != body.len() {
        return Err(FrameError::Malformed(format!(
            "{} trailing bytes after the message",
            body.len() - used
        )));
    }
    Ok(message)
}

/// A whole control frame carrying `request`.
pub fn encode_request(request: &Request) -> Result<Vec<u8>, FrameError> {
    Ok(frame::encode(FrameKind::Control, &encode_body(request)?))
}

/// A whole control frame carrying `response`.
pub fn encode_response(response: &Response) -> Result<Vec<u8>, FrameError> {
    Ok(frame::encode(FrameKind::Control, &encode_body(response)?))
}

/// The request in a control frame's body.
pub fn decode_request(body: &[u8]) -> Result<Request, FrameError> {
    decode_body(body)
}

/// The response in a control frame's body.
pub fn decode_response(body: &[u8]) -> Result<Response, FrameError> {
    decode_body(body)
}
