//! The only module that touches bincode: control messages to and from frame bodies, as of the
//! peer's protocol minor.
//!
//! bincode 2 is pinned and unmaintained, so it stays behind these functions. The configuration
//! is fixed-width little-endian integers (documented byte for byte in `PROTOCOL.md`), with a
//! decode limit so a lying length prefix cannot make it allocate.
//!
//! Two peers of different minors talk as of the lower one (PROTOCOL.md §4): the wire of a minor
//! never changes once released, and a peer of it refuses bytes it does not expect, so the side
//! that speaks the higher minor adapts. It encodes for the peer's minor (fields added later left
//! out, error codes mapped to ones the peer knows, messages the peer lacks refused here) and
//! decodes what the peer sends with defaults for the fields it lacks. A peer minor above this
//! build's counts as this build's: that peer adapts to us. `Hello` and `Welcome` are frozen, so
//! the handshake decodes before either side knows the other's minor.

use std::borrow::Cow;

use bincode::config::{Configuration, Fixint, Limit, LittleEndian};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::FrameError;
use crate::frame::{self, DEFAULT_MAX_BODY, FrameKind, PROTOCOL_MINOR};
use crate::growable;
use crate::message::{Request, Response};

const CONFIG: Configuration<LittleEndian, Fixint, Limit<DEFAULT_MAX_BODY>> =
    bincode::config::standard()
        .with_little_endian()
        .with_fixed_int_encoding()
        .with_limit::<DEFAULT_MAX_BODY>();

/// The minor a message travels as: the peer's, or this build's if the peer's is higher.
fn wire_minor(peer_minor: u16) -> u16 {
    peer_minor.min(PROTOCOL_MINOR)
}

/// The body of a control frame: `message` encoded as of `minor`, and no larger than any peer
/// accepts (a message this side cannot send is an error here, never an empty or truncated
/// frame there).
fn encode_body<T: Serialize>(message: &T, minor: u16) -> Result<Vec<u8>, FrameError> {
    let body = growable::as_of(minor, || bincode::serde::encode_to_vec(message, CONFIG))
        .map_err(|e| FrameError::Unencodable(e.to_string()))?;
    if body.len() > DEFAULT_MAX_BODY {
        return Err(FrameError::TooLarge {
            len: body.len() as u64,
            max: DEFAULT_MAX_BODY as u64,
        });
    }
    Ok(body)
}

/// The message in `body`, as of `minor`, which must take the whole body.
fn decode_body<T: DeserializeOwned>(body: &[u8], minor: u16) -> Result<T, FrameError> {
    let (message, used) =
        growable::as_of(minor, || bincode::serde::decode_from_slice(body, CONFIG))
            .map_err(|e| FrameError::Malformed(e.to_string()))?;
    if used != body.len() {
        return Err(FrameError::Malformed(format!(
            "{} trailing bytes after the message",
            body.len() - used
        )));
    }
    Ok(message)
}

/// `Ok` if a peer of minor `minor` has the message `what`, added in minor `since`.
fn known_to(what: &'static str, since: u16, minor: u16) -> Result<(), FrameError> {
    if since > minor {
        return Err(FrameError::NewerThanPeer {
            what,
            since,
            peer: minor,
        });
    }
    Ok(())
}

/// A whole control frame carrying `request` for a peer of minor `peer_minor`; refused
/// ([`FrameError::NewerThanPeer`]) for a request that peer does not know.
pub fn encode_request_for(request: &Request, peer_minor: u16) -> Result<Vec<u8>, FrameError> {
    let minor = wire_minor(peer_minor);
    known_to(request.name(), request.since_minor(), minor)?;
    Ok(frame::encode(
        FrameKind::Control,
        &encode_body(request, minor)?,
    ))
}

/// A whole control frame carrying `response` for a peer of minor `peer_minor`: an error code
/// that peer does not know goes as the closest one it does ([`ErrorCode::as_of`]), and a
/// response it does not know is refused ([`FrameError::NewerThanPeer`]).
///
/// [`ErrorCode::as_of`]: crate::ErrorCode::as_of
pub fn encode_response_for(response: &Response, peer_minor: u16) -> Result<Vec<u8>, FrameError> {
    let minor = wire_minor(peer_minor);
    let (what, since) = response_since(response);
    known_to(what, since, minor)?;
    let response = match response {
        Response::Error(reply) if reply.code.as_of(minor) != reply.code => {
            let mut reply = reply.clone();
            reply.code = reply.code.as_of(minor);
            Cow::Owned(Response::Error(reply))
        }
        _ => Cow::Borrowed(response),
    };
    Ok(frame::encode(
        FrameKind::Control,
        &encode_body(&*response, minor)?,
    ))
}

/// The request in a control frame's body, from a peer of minor `peer_minor` (fields it lacks at
/// their defaults). A request that minor does not have is refused
/// ([`FrameError::NewerThanPeer`]): the peer could only have sent it by breaking its own minor,
/// and no answer to it could be encoded for that minor.
pub fn decode_request_from(body: &[u8], peer_minor: u16) -> Result<Request, FrameError> {
    let minor = wire_minor(peer_minor);
    let request: Request = decode_body(body, minor)?;
    known_to(request.name(), request.since_minor(), minor)?;
    Ok(request)
}

/// The response in a control frame's body, from a peer of minor `peer_minor` (fields it lacks at
/// their defaults). A response or an error code that minor does not have is refused
/// ([`FrameError::NewerThanPeer`]), as the peer could not have sent it by its own minor's rules.
pub fn decode_response_from(body: &[u8], peer_minor: u16) -> Result<Response, FrameError> {
    let minor = wire_minor(peer_minor);
    let response: Response = decode_body(body, minor)?;
    let (what, since) = response_since(&response);
    known_to(what, since, minor)?;
    if let Response::Error(reply) = &response {
        known_to("an error code", reply.code.since_minor(), minor)?;
    }
    Ok(response)
}

/// [`encode_request_for`] a peer of this build's minor.
pub fn encode_request(request: &Request) -> Result<Vec<u8>, FrameError> {
    encode_request_for(request, PROTOCOL_MINOR)
}

/// [`encode_response_for`] a peer of this build's minor.
pub fn encode_response(response: &Response) -> Result<Vec<u8>, FrameError> {
    encode_response_for(response, PROTOCOL_MINOR)
}

/// [`decode_request_from`] a peer of this build's minor.
pub fn decode_request(body: &[u8]) -> Result<Request, FrameError> {
    decode_request_from(body, PROTOCOL_MINOR)
}

/// [`decode_response_from`] a peer of this build's minor.
pub fn decode_response(body: &[u8]) -> Result<Response, FrameError> {
    decode_response_from(body, PROTOCOL_MINOR)
}

/// A response's name and the minor that added it.
fn response_since(response: &Response) -> (&'static str, u16) {
    // Every variant by name, so that a variant added later cannot default to minor 0.
    match response {
        Response::Welcome(_) => ("welcome", 0),
        Response::Stored(_) => ("stored", 0),
        Response::Tensor { .. } => ("tensor", 0),
        Response::Deleted(_) => ("deleted", 0),
        Response::Listing(_) => ("listing", 0),
        Response::Stats(_) => ("stats", 0),
        Response::Error(_) => ("error", 0),
        Response::Ready => ("ready", 0),
        Response::Identity { .. } => ("identity", 0),
        Response::Capability { .. } => ("capability", 0),
        Response::Released => ("released", 0),
        Response::Page { .. } => ("page", 3),
        Response::Holds { .. } => ("holds", 5),
        Response::TensorPart { .. } => ("tensor-part", crate::message::FETCH_RANGE_MINOR),
        Response::Arrived(_) => ("arrived", crate::message::WAIT_MINOR),
        Response::ModelBegun { .. } => ("model-begun", crate::message::WAIT_MINOR),
        Response::Model(_) => ("model", crate::message::WAIT_MINOR),
        Response::Models(_) => ("models", crate::message::WAIT_MINOR),
    }
}
