//! `Connection`: reads and writes ferry frames on a byte stream, and nothing else.
//!
//! Shared by the client, the node's sessions, and the node's own pulls from a peer. Control
//! frames go through a read buffer (check-then-parse); a tensor payload is read straight from
//! the socket into the receiver's preallocated buffer, so the bytes are copied once.

use std::time::Duration;

use bytes::{Buf, BytesMut};
use ferry_proto::frame::{self, CHUNK_PREFIX_LEN, FrameHeader, FrameKind, HEADER_LEN};
use ferry_proto::{
    FrameError, ProtoError, Request, Response, StreamError, TensorAssembler, control,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};

/// Bytes of a payload read and checksummed at a time (fits in L2 alongside everything else).
const CHECKSUM_PIECE: usize = 256 * 1024;

/// Why a connection failed.
#[derive(Debug, thiserror::Error)]
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
    /// How long a peer may stay silent in the middle of a frame or payload.
    pub idle_timeout: Duration,
    /// Payload bytes per chunk frame sent.
    pub chunk_size: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_body: frame::DEFAULT_MAX_BODY,
            idle_timeout: Duration::from_secs(30),
            chunk_size: frame::DEFAULT_CHUNK_SIZE,
        }
    }
}

/// Frames over a byte stream (TCP, a Unix socket, an in-memory pipe in tests).
#[derive(Debug)]
pub struct Connection<S> {
    stream: BufWriter<S>,
    buffer: BytesMut,
    limits: ConnectionLimits,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Connection<S> {
    /// Wraps `stream`.
    pub fn new(stream: S, limits: ConnectionLimits) -> Self {
        Self {
            stream: BufWriter::new(stream),
            buffer: BytesMut::with_capacity(64 * 1024),
            limits,
        }
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
            read.await?
        };
        Ok(n > 0)
    }

    /// The next whole frame, or `None` when the peer closed cleanly between frames.
    pub async fn read_frame(&mut self) -> Result<Option<ferry_proto::Frame>, ConnectionError> {
        loop {
            if let Some(frame) = frame::parse(&mut self.buffer, self.limits.max_body)? {
                return Ok(Some(frame));
            }
            if let Some(head) = self.buffer.first_chunk::<HEADER_LEN>() {
                // A valid header whose body is within the maximum: make room for it once.
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
            Some(frame) if frame.kind == FrameKind::Control => {
                Ok(Some(control::decode_request(&frame.body)?))
            }
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
                Ok(control::decode_response(&frame.body)?)
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

    /// Reads chunk frames into `assembler` until the whole payload has arrived. Each chunk's
    /// payload goes straight into its place in the preallocated buffer and counts only once its
    /// checksum matches.
    pub async fn read_payload(
        &mut self,
        assembler: &mut TensorAssembler,
    ) -> Result<(), ConnectionError> {
        while !assembler.is_complete() {
            self.fill_to(HEADER_LEN).await?;
            let head = self
                .buffer
                .first_chunk::<HEADER_LEN>()
                .ok_or(FrameError::TruncatedFrame)?;
            let header = FrameHeader::decode(head, self.limits.max_body)?;
            if header.kind != FrameKind::Chunk {
                return Err(ConnectionError::UnexpectedFrame {
                    expected: "chunk",
                    got: header.kind,
                });
            }
            let body_len = header.body_len as usize;
            let len = body_len
                .checked_sub(CHUNK_PREFIX_LEN)
                .ok_or(FrameError::ShortChunk { len: body_len })?;
            self.fill_to(HEADER_LEN + CHUNK_PREFIX_LEN).await?;
            self.buffer.advance(HEADER_LEN);
            let offset_bytes = self.buffer.get_u64_le().to_le_bytes();
            let offset = u64::from_le_bytes(offset_bytes);
            let slot = assembler.slot(offset, len)?;
            let buffered = self.buffer.len().min(len);
            slot[..buffered].copy_from_slice(&self.buffer[..buffered]);
            self.buffer.advance(buffered);
            let mut crc = crc32c::crc32c_append(crc32c::crc32c(&offset_bytes), &slot[..buffered]);
            // Read the rest in cache-sized pieces and checksum each while it is still hot, so
            // the payload costs one pass over memory rather than two.
            for piece in slot[buffered..].chunks_mut(CHECKSUM_PIECE) {
                let idle = self.limits.idle_timeout;
                match tokio::time::timeout(idle, self.stream.read_exact(piece)).await {
                    Err(_) => return Err(ConnectionError::IdleTimeout(idle)),
                    Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        return Err(ConnectionError::Closed);
                    }
                    Ok(result) => {
                        result?;
                    }
                }
                crc = crc32c::crc32c_append(crc, piece);
            }
            header.verify_crc(crc)?;
            assembler.commit(offset, len)?;
        }
        Ok(())
    }

    /// Writes a request and flushes.
    pub async fn write_request(&mut self, request: &Request) -> Result<(), ConnectionError> {
        self.write_frame(&control::encode_request(request)).await
    }

    /// Writes a response and flushes.
    pub async fn write_response(&mut self, response: &Response) -> Result<(), ConnectionError> {
        self.write_frame(&control::encode_response(response)).await
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

    /// Writes `payload` as chunk frames and flushes. The payload is written from where it lies;
    /// only the 24-byte prefix of each chunk is built.
    pub async fn write_payload(&mut self, payload: &[u8]) -> Result<(), ConnectionError> {
        self.write_payload_from(payload, 0).await
    }

    /// Writes `payload` from byte `start` on (a resumed transfer), as chunk frames whose offsets
    /// count from the payload's start, and flushes.
    pub async fn write_payload_from(
        &mut self,
        payload: &[u8],
        start: usize,
    ) -> Result<(), ConnectionError> {
        let rest = payload.get(start..).unwrap_or_default();
        let idle = self.limits.idle_timeout;
        for (offset, piece) in frame::chunks(rest, self.limits.chunk_size) {
            let offset = offset + start as u64;
            let write = async {
                self.stream
                    .write_all(&frame::chunk_prefix(offset, piece))
                    .await?;
                self.stream.write_all(piece).await
            };
            // Each chunk must get out within the idle timeout: a reader that stalls is dropped.
            tokio::time::timeout(idle, write)
                .await
                .map_err(|_| ConnectionError::IdleTimeout(idle))??;
        }
        tokio::time::timeout(idle, self.stream.flush())
            .await
            .map_err(|_| ConnectionError::IdleTimeout(idle))??;
        Ok(())
    }
}
