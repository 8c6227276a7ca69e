//! `Connection`: reads and writes ferry frames on a byte stream, and nothing else. Here: the
//! connection itself, its limits and errors, and frames and control messages (requests and
//! responses); payloads are in `payload`, the shared-memory route in `shm`, the sender's cache
//! of what it knows of a payload in `checksums`, a payload read to be dropped in `discarded`.
//!
//! Shared by the client, the node's sessions, and the node's own pulls from a peer. Control
//! frames go through a read buffer (check-then-parse); a tensor payload is read straight from
//! the socket into the receiver's preallocated buffer, so the bytes are copied once. On a Unix
//! socket where both sides agreed to it, a payload travels instead as one shared-memory region
//! (a region frame with the region's file descriptor), and the bytes are not copied through the
//! socket at all.

mod checksums;
mod discarded;
mod payload;
mod shm;

use std::time::Duration;

use bytes::BytesMut;
use ferry_proto::frame::{self, FrameHeader, FrameKind, HEADER_LEN};
use ferry_proto::{
    FrameError, PROTOCOL_MINOR, ProtoError, Request, Response, StreamError, control,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};

use crate::transport::Transport;

pub use checksums::{ChunkChecksums, Known, ReceivedChecksums};
pub use payload::{ChunkSink, PayloadRoute};
pub use shm::{
    DEFAULT_REGION_MIN, KEEP_REGION_MIN, RegionUse, SealedRegion, UNREAD_REGION_BYTES,
    shared_memory_supported,
};

/// Why a connection failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectionError {
    /// The socket failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The peer broke the protocol.
    #[error(transparent)]
    Proto(#[from] ProtoError),
    /// The peer went quiet in the middle of a frame or a payload.
    #[error("peer sent nothing for {0:?} in the middle of a frame")]
    IdleTimeout(Duration),
    /// The peer closed the connection in the middle of a frame or a payload.
    #[error("connection closed in the middle of a frame or tensor payload")]
    Closed,
    /// A whole payload took longer than its deadline (the idle timeout plus its length at the
    /// minimum rate): a peer that trickles bytes cannot hold a buffer and its budget for ever.
    #[error("a payload of {bytes} bytes took longer than its deadline of {deadline:?}")]
    PayloadDeadline {
        /// The payload's length.
        bytes: u64,
        /// How long it was given.
        deadline: Duration,
    },
    /// The peer sent a frame of the wrong kind at this point.
    #[error("expected a {expected} frame, got a {got:?} frame")]
    UnexpectedFrame {
        /// What was expected.
        expected: &'static str,
        /// What came.
        got: FrameKind,
    },
}

impl From<FrameError> for ConnectionError {
    fn from(e: FrameError) -> Self {
        ConnectionError::Proto(e.into())
    }
}

impl From<StreamError> for ConnectionError {
    fn from(e: StreamError) -> Self {
        ConnectionError::Proto(e.into())
    }
}

/// Limits a connection keeps.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// The largest frame body accepted.
    pub max_body: usize,
    /// The largest control frame body accepted (a request or an answer), checked from its
    /// header before the body is read: a node takes requests of a few KiB at most, so a peer
    /// cannot make it hold a large control frame (a client takes answers of any size up to
    /// `max_body`: a page of a listing is large).
    pub max_control_body: usize,
    /// How long a peer may stay silent in the middle of a frame or payload.
    pub idle_timeout: Duration,
    /// Payload bytes per chunk frame sent.
    pub chunk_size: usize,
    /// Where shared memory was agreed, payloads of at least this many bytes (and at least one)
    /// are sent as a region; smaller ones go as chunks, which is cheaper for a few pages.
    pub region_min: usize,
    /// The slowest a whole payload may move, in bytes per second: a payload must be sent or
    /// received within the idle timeout plus its length at this rate ([`payload_deadline`]),
    /// or the connection is dropped. Zero for no whole-payload deadline.
    ///
    /// [`payload_deadline`]: ConnectionLimits::payload_deadline
    pub min_rate: u64,
}

/// The default [`ConnectionLimits::min_rate`]: 1 MiB/s, far below any working link, far above
/// a peer that sends a byte now and then to keep a reservation.
pub const DEFAULT_MIN_RATE: u64 = 1 << 20;

impl ConnectionLimits {
    /// How long a payload of `bytes` may take as a whole; `None` where there is no such limit.
    pub fn payload_deadline(&self, bytes: u64) -> Option<Duration> {
        if self.min_rate == 0 {
            return None;
        }
        let at_rate = Duration::from_secs_f64(bytes as f64 / self.min_rate as f64);
        Some(self.idle_timeout.saturating_add(at_rate))
    }
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_body: frame::DEFAULT_MAX_BODY,
            max_control_body: frame::DEFAULT_MAX_BODY,
            idle_timeout: Duration::from_secs(30),
            chunk_size: frame::DEFAULT_CHUNK_SIZE,
            region_min: DEFAULT_REGION_MIN,
            min_rate: DEFAULT_MIN_RATE,
        }
    }
}

/// Frames over a byte stream (TCP, a Unix socket, an in-memory pipe in tests).
#[derive(Debug)]
pub struct Connection<S> {
    stream: BufWriter<S>,
    buffer: BytesMut,
    limits: ConnectionLimits,
    /// Both sides agreed that payloads may travel as shared-memory regions.
    shared_memory: bool,
    /// The peer had not read everything sent before the last answer this side began.
    peer_behind: bool,
    /// Bytes of new regions sent since the peer was last seen to have read everything.
    unread_region_bytes: usize,
    /// The protocol minor control messages are written and read as (PROTOCOL.md §4): this
    /// build's until the handshake learns the peer's (`Hello` and `Welcome` read the same at
    /// every minor).
    peer_minor: u16,
}

impl<S: Transport> Connection<S> {
    /// Wraps `stream`.
    pub fn new(stream: S, limits: ConnectionLimits) -> Self {
        Self {
            stream: BufWriter::new(stream),
            buffer: BytesMut::with_capacity(64 * 1024),
            limits,
            shared_memory: false,
            peer_behind: false,
            unread_region_bytes: 0,
            peer_minor: PROTOCOL_MINOR,
        }
    }

    /// The peer's protocol minor as the handshake learned it, at most this build's: control
    /// messages are written for it and read from it.
    pub fn peer_minor(&self) -> u16 {
        self.peer_minor
    }

    /// Talks as of the peer's protocol minor `minor` from now on (the handshake sets it from
    /// `Hello` or `Welcome`); a minor above this build's counts as this build's.
    pub fn set_peer_minor(&mut self, minor: u16) {
        self.peer_minor = minor.min(PROTOCOL_MINOR);
    }

    /// Whether this connection could move payloads through shared memory, if both sides agree.
    pub fn can_share_memory(&self) -> bool {
        shared_memory_supported() && self.stream.get_ref().passes_fds()
    }

    /// Lets payloads travel as shared-memory regions, both ways (after the handshake agreed on
    /// it). Refused (stays off) where the stream cannot carry descriptors.
    pub fn set_shared_memory(&mut self, on: bool) {
        self.shared_memory = on && self.can_share_memory();
    }

    /// Whether payloads may travel as shared-memory regions.
    pub fn shared_memory(&self) -> bool {
        self.shared_memory
    }

    /// The limits in force.
    pub fn limits(&self) -> ConnectionLimits {
        self.limits
    }

    /// Changes the limits (after a handshake agreed on others).
    pub fn set_limits(&mut self, limits: ConnectionLimits) {
        self.limits = limits;
    }

    /// The underlying stream.
    pub fn get_ref(&self) -> &S {
        self.stream.get_ref()
    }

    /// The underlying stream, mutably (bytes written to it directly bypass the write buffer).
    pub fn get_mut(&mut self) -> &mut S {
        self.stream.get_mut()
    }

    /// Reads more bytes into the buffer. Between frames it waits as long as it takes; in the
    /// middle of one the peer must make progress within the idle timeout. `Ok(false)` on a close.
    async fn fill(&mut self, mid_frame: bool) -> Result<bool, ConnectionError> {
        let read = self.stream.read_buf(&mut self.buffer);
        let n = if mid_frame {
            let idle = self.limits.idle_timeout;
            tokio::time::timeout(idle, read)
                .await
                .map_err(|_| ConnectionError::IdleTimeout(idle))??
        } else {
            match read.await {
                Ok(n) => n,
                // A TLS peer that closes its socket without a `close_notify` (a client dropped
                // between requests) reads as an unexpected end of file. Between frames that is a
                // close like any other: frames delimit themselves, so nothing can have been cut
                // off (in the middle of a frame it stays an error).
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => 0,
                Err(e) => return Err(e.into()),
            }
        };
        Ok(n > 0)
    }

    /// The next whole frame, or `None` when the peer closed cleanly between frames.
    pub async fn read_frame(&mut self) -> Result<Option<ferry_proto::Frame>, ConnectionError> {
        loop {
            if let Some(head) = self.buffer.first_chunk::<HEADER_LEN>() {
                // A valid header whose body is within the maximum for its kind: make room for
                // it once.
                let header = FrameHeader::decode(head, self.limits.max_body)?;
                let body_len = header.body_len as usize;
                if header.kind == FrameKind::Control && body_len > self.limits.max_control_body {
                    return Err(FrameError::TooLarge {
                        len: u64::from(header.body_len),
                        max: self.limits.max_control_body as u64,
                    }
                    .into());
                }
            }
            if let Some(frame) = frame::parse(&mut self.buffer, self.limits.max_body)? {
                return Ok(Some(frame));
            }
            if let Some(head) = self.buffer.first_chunk::<HEADER_LEN>() {
                let header = FrameHeader::decode(head, self.limits.max_body)?;
                let total = HEADER_LEN + header.body_len as usize;
                self.buffer.reserve(total.saturating_sub(self.buffer.len()));
            }
            let mid_frame = !self.buffer.is_empty();
            if !self.fill(mid_frame).await? {
                return if self.buffer.is_empty() {
                    Ok(None)
                } else {
                    Err(ConnectionError::Closed)
                };
            }
        }
    }

    /// The next frame, which must be a control frame carrying a request.
    pub async fn read_request(&mut self) -> Result<Option<Request>, ConnectionError> {
        match self.read_frame().await? {
            None => Ok(None),
            Some(frame) if frame.kind == FrameKind::Control => Ok(Some(
                control::decode_request_from(&frame.body, self.peer_minor)?,
            )),
            Some(frame) => Err(ConnectionError::UnexpectedFrame {
                expected: "control",
                got: frame.kind,
            }),
        }
    }

    /// The next frame, which must be a control frame carrying a response; a close is an error.
    pub async fn read_response(&mut self) -> Result<Response, ConnectionError> {
        match self.read_frame().await? {
            None => Err(ConnectionError::Closed),
            Some(frame) if frame.kind == FrameKind::Control => {
                Ok(control::decode_response_from(&frame.body, self.peer_minor)?)
            }
            Some(frame) => Err(ConnectionError::UnexpectedFrame {
                expected: "control",
                got: frame.kind,
            }),
        }
    }

    /// Makes sure at least `n` bytes are buffered, in the middle of a payload.
    async fn fill_to(&mut self, n: usize) -> Result<(), ConnectionError> {
        while self.buffer.len() < n {
            if !self.fill(true).await? {
                return Err(ConnectionError::Closed);
            }
        }
        Ok(())
    }

    /// Writes a request for the peer's minor and flushes; one the peer's minor lacks is refused
    /// ([`FrameError::NewerThanPeer`]) and nothing is written.
    pub async fn write_request(&mut self, request: &Request) -> Result<(), ConnectionError> {
        // A payload after a request (a put) is read by a node that serves requests in order:
        // it never leaves a region unread, whatever this side pipelines.
        self.peer_behind = false;
        self.unread_region_bytes = 0;
        let frame = control::encode_request_for(request, self.peer_minor)?;
        self.write_frame(&frame).await
    }

    /// Writes a response for the peer's minor and flushes (an error code it lacks goes as the
    /// closest one it knows); one the peer's minor lacks is refused
    /// ([`FrameError::NewerThanPeer`]) and nothing is written.
    pub async fn write_response(&mut self, response: &Response) -> Result<(), ConnectionError> {
        let frame = control::encode_response_for(response, self.peer_minor)?;
        self.note_peer_progress();
        self.write_frame(&frame).await
    }

    /// Writes already-encoded frame bytes and flushes.
    pub async fn write_frame(&mut self, bytes: &[u8]) -> Result<(), ConnectionError> {
        let idle = self.limits.idle_timeout;
        let write = async {
            self.stream.write_all(bytes).await?;
            self.stream.flush().await
        };
        // A peer that stops reading must not pin this side forever.
        tokio::time::timeout(idle, write)
            .await
            .map_err(|_| ConnectionError::IdleTimeout(idle))??;
        Ok(())
    }
}
