//! `Connection`: reads and writes ferry frames on a byte stream, and nothing else.
//!
//! Shared by the client, the node's sessions, and the node's own pulls from a peer. Control
//! frames go through a read buffer (check-then-parse); a tensor payload is read straight from
//! the socket into the receiver's preallocated buffer, so the bytes are copied once. On a Unix
//! socket where both sides agreed to it, a payload travels instead as one shared-memory region
//! (a region frame with the region's file descriptor), and the bytes are not copied through the
//! socket at all.

use std::time::Duration;

use bytes::{Buf, BytesMut};
use ferry_proto::frame::{
    self, CHUNK_PREFIX_LEN, FrameHeader, FrameKind, HEADER_LEN, REGION_BODY_LEN, RegionDescriptor,
};
use ferry_proto::{FrameError, ProtoError, Request, Response, StreamError, control};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};

use crate::assembler::TensorAssembler;
use crate::transport::Transport;

/// Payloads smaller than this go as chunks by default even where regions are agreed: creating,
/// sealing and mapping a region costs more than copying a few pages through the socket.
pub const DEFAULT_REGION_MIN: usize = 256 * 1024;

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
            idle_timeout: Duration::from_secs(30),
            chunk_size: frame::DEFAULT_CHUNK_SIZE,
            region_min: DEFAULT_REGION_MIN,
            min_rate: DEFAULT_MIN_RATE,
        }
    }
}

/// What a receiver does with a payload that arrives as a shared-memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionUse {
    /// Map it, and let the descriptor go once mapped (a client reading a tensor).
    Map,
    /// Keep the sealed region (a payload of at least [`KEEP_REGION_MIN`] bytes), to pass the
    /// tensor on without a copy.
    Keep,
    /// Keep it, and leave its content hash to be verified later by whoever registers it: the
    /// seals vouch that the bytes cannot change, so the check need not hold up the answer (a
    /// pull between nodes of one host). The assembler's hash, if any, is not computed.
    KeepUnhashed,
}

/// How a payload travelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadRoute {
    /// As chunk frames through the socket.
    Chunks,
    /// As one shared-memory region.
    Region,
}

impl PayloadRoute {
    /// The name used in logs and `stat`.
    pub fn as_str(self) -> &'static str {
        match self {
            PayloadRoute::Chunks => "chunks",
            PayloadRoute::Region => "shm",
        }
    }
}

/// Whether this build can move payloads through shared memory (Linux `memfd`).
pub const fn shared_memory_supported() -> bool {
    cfg!(target_os = "linux")
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
        }
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
    /// checksum matches. Where shared memory was agreed, the whole payload may come instead as
    /// one region, which is checked and adopted.
    pub async fn read_payload(
        &mut self,
        assembler: &mut TensorAssembler,
    ) -> Result<PayloadRoute, ConnectionError> {
        self.read_payload_keeping(assembler, RegionUse::Map)
            .await
            .map(|(route, _)| route)
    }

    /// [`read_payload`](Self::read_payload), keeping (with `keep`) the region a payload of at
    /// least [`KEEP_REGION_MIN`] bytes came in, so that whoever registers the tensor can pass it
    /// on through shared memory without copying it ([`write_payload_known`](Self::write_payload_known)).
    ///
    /// The whole payload must arrive within [`ConnectionLimits::payload_deadline`].
    pub async fn read_payload_keeping(
        &mut self,
        assembler: &mut TensorAssembler,
        regions: RegionUse,
    ) -> Result<(PayloadRoute, Option<SealedRegion>), ConnectionError> {
        let bytes = assembler.meta().byte_len() as u64;
        match self.limits.payload_deadline(bytes) {
            None => self.read_payload_unbounded(assembler, regions).await,
            Some(deadline) => {
                tokio::time::timeout(deadline, self.read_payload_unbounded(assembler, regions))
                    .await
                    .map_err(|_| ConnectionError::PayloadDeadline { bytes, deadline })?
            }
        }
    }

    async fn read_payload_unbounded(
        &mut self,
        assembler: &mut TensorAssembler,
        regions: RegionUse,
    ) -> Result<(PayloadRoute, Option<SealedRegion>), ConnectionError> {
        while !assembler.is_complete() {
            self.fill_to(HEADER_LEN).await?;
            let head = self
                .buffer
                .first_chunk::<HEADER_LEN>()
                .ok_or(FrameError::TruncatedFrame)?;
            let header = FrameHeader::decode(head, self.limits.max_body)?;
            match header.kind {
                FrameKind::Chunk => {}
                FrameKind::Region => {
                    let kept = self.read_region(header, assembler, regions).await?;
                    return Ok((PayloadRoute::Region, kept));
                }
                FrameKind::Control => {
                    return Err(ConnectionError::UnexpectedFrame {
                        expected: "chunk",
                        got: header.kind,
                    });
                }
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
        Ok((PayloadRoute::Chunks, None))
    }

    /// Takes a region frame off the buffer, claims the descriptor that came with it, and adopts
    /// the region as the whole payload once it passes every check.
    async fn read_region(
        &mut self,
        header: FrameHeader,
        assembler: &mut TensorAssembler,
        regions: RegionUse,
    ) -> Result<Option<SealedRegion>, ConnectionError> {
        let refuse = |reason: &str| {
            ConnectionError::from(StreamError::RegionRefused {
                reason: reason.to_string(),
            })
        };
        if !self.shared_memory {
            return Err(refuse("shared memory was not agreed on this connection"));
        }
        if header.body_len as usize != REGION_BODY_LEN {
            return Err(FrameError::BadRegionBody {
                len: header.body_len as usize,
            }
            .into());
        }
        self.fill_to(HEADER_LEN + REGION_BODY_LEN).await?;
        self.buffer.advance(HEADER_LEN);
        let body = self.buffer.split_to(REGION_BODY_LEN);
        header.verify(&body)?;
        let declared = RegionDescriptor::decode(&body)?;
        // The descriptor came with the frame's bytes (or before them), so it is queued by now.
        let fd = self
            .stream
            .get_mut()
            .take_fd()
            .ok_or_else(|| refuse("a region frame came without its file descriptor"))?;
        if assembler.received() != 0 {
            return Err(refuse("a region must carry the whole payload"));
        }
        adopt_region(fd, declared, assembler, regions).await
    }

    /// Writes a request and flushes.
    pub async fn write_request(&mut self, request: &Request) -> Result<(), ConnectionError> {
        // A payload after a request (a put) is read by a node that serves requests in order:
        // it never leaves a region unread, whatever this side pipelines.
        self.peer_behind = false;
        self.unread_region_bytes = 0;
        self.write_frame(&control::encode_request(request)?).await
    }

    /// Writes a response and flushes.
    pub async fn write_response(&mut self, response: &Response) -> Result<(), ConnectionError> {
        self.note_peer_progress();
        self.write_frame(&control::encode_response(response)?).await
    }

    /// Records whether the peer had read everything sent so far, as a new answer begins (a
    /// payload that follows the answer is then judged by it, not by the answer itself): a
    /// client may pipeline requests and leave answers unread.
    fn note_peer_progress(&mut self) {
        let unread = self.stream.get_ref().unread_by_peer();
        self.peer_behind = unread.is_some_and(|n| n > 0) || !self.stream.buffer().is_empty();
        if !self.peer_behind {
            self.unread_region_bytes = 0;
        }
    }

    /// Whether a new region of `len` bytes may be made for the answer being sent: always where
    /// the peer had read everything before it; otherwise only while the new regions it has not
    /// read stay under [`UNREAD_REGION_BYTES`] (a pipelining client reading its answers in
    /// order keeps its regions; one that reads nothing pins little).
    fn may_make_region(&mut self, len: usize) -> bool {
        let outstanding = self.unread_region_bytes.saturating_add(len);
        let allowed = !self.peer_behind || outstanding <= UNREAD_REGION_BYTES;
        if allowed {
            self.unread_region_bytes = outstanding;
        }
        allowed
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

    /// Writes `payload` and flushes: as one shared-memory region where that was agreed and the
    /// payload is large enough to gain from it, else as chunk frames written from where the
    /// payload lies (only the 24-byte prefix of each chunk is built).
    pub async fn write_payload(&mut self, payload: &[u8]) -> Result<PayloadRoute, ConnectionError> {
        self.write_payload_parts(&[payload], 0).await
    }

    /// Writes `payload` from byte `start` on (a resumed transfer), as chunk frames whose offsets
    /// count from the payload's start, or (from the start only) as one region; flushes.
    pub async fn write_payload_from(
        &mut self,
        payload: &[u8],
        start: usize,
    ) -> Result<PayloadRoute, ConnectionError> {
        self.write_payload_parts(&[payload], start).await
    }

    /// [`write_payload_from`](Self::write_payload_from) for a payload that lies in several
    /// slices (a quantized tensor's values and its scales, kept apart by the backend), sent as
    /// if laid end to end, without joining them.
    pub async fn write_payload_parts(
        &mut self,
        parts: &[&[u8]],
        start: usize,
    ) -> Result<PayloadRoute, ConnectionError> {
        self.write_payload_known(parts, start, Known::default())
            .await
    }

    /// [`write_payload_parts`](Self::write_payload_parts) for a payload that never changes, with
    /// what is already known of it: where a region is due and the payload lies in a kept
    /// region, that one is passed on as it is, with no copy at all; chunk checksums computed by
    /// an earlier send with the same chunk size are reused rather than computed again.
    ///
    /// The whole payload must be written within [`ConnectionLimits::payload_deadline`]: a peer
    /// that stops reading cannot pin the payload's memory for ever.
    pub async fn write_payload_known(
        &mut self,
        parts: &[&[u8]],
        start: usize,
        known: Known<'_>,
    ) -> Result<PayloadRoute, ConnectionError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let bytes = total.saturating_sub(start) as u64;
        match self.limits.payload_deadline(bytes) {
            None => self.write_payload_unbounded(parts, start, known).await,
            Some(deadline) => {
                tokio::time::timeout(deadline, self.write_payload_unbounded(parts, start, known))
                    .await
                    .map_err(|_| ConnectionError::PayloadDeadline { bytes, deadline })?
            }
        }
    }

    async fn write_payload_unbounded(
        &mut self,
        parts: &[&[u8]],
        start: usize,
        known: Known<'_>,
    ) -> Result<PayloadRoute, ConnectionError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if self.shared_memory && start == 0 && total >= self.limits.region_min.max(1) {
            let kept = known
                .region
                .filter(|r| r.descriptor().len == total as u64)
                .map(|r| r.share().map(|fd| (r.descriptor(), fd)));
            match kept {
                Some(Ok((descriptor, fd))) => {
                    self.send_region(descriptor, fd).await?;
                    return Ok(PayloadRoute::Region);
                }
                Some(Err(error)) => {
                    tracing::warn!(%error, bytes = total, "kept region not shareable; copying");
                }
                None => {}
            }
            // A new region is a whole copy of the payload that the kernel pins until the peer
            // reads its frame, and a peer that pipelines requests without reading could have
            // one made per request: bounded by what the peer has not read. Chunks instead wait
            // on the socket like any bytes.
            // A region that cannot be made (out of descriptors or memory, a kernel that refuses
            // memfds) costs nothing on the wire yet: send chunks instead.
            if self.may_make_region(total) {
                match make_region(parts, total).await {
                    Ok((descriptor, fd)) => {
                        self.send_region(descriptor, fd).await?;
                        return Ok(PayloadRoute::Region);
                    }
                    Err(error) => {
                        tracing::warn!(%error, bytes = total, "no shared-memory region; sending chunks");
                    }
                }
            }
        }
        let idle = self.limits.idle_timeout;
        let chunk = self.limits.chunk_size.max(1);
        let mut offset = start.min(total);
        let cached = known.checksums.and_then(|c| c.for_chunk_size(chunk));
        // A whole send with nothing cached yet records what it computes, for the next one.
        let mut computed =
            (offset == 0 && cached.is_none() && known.checksums.is_some()).then(Vec::new);
        while offset < total {
            let end = offset.saturating_add(chunk).min(total);
            let pieces = frame::slices_in(parts, offset..end);
            let known_crc = cached
                .as_ref()
                .filter(|_| offset.is_multiple_of(chunk))
                .and_then(|crcs| crcs.get(offset / chunk));
            let prefix = match known_crc {
                Some(&crc) => frame::chunk_prefix_checked(offset as u64, end - offset, crc),
                None => frame::chunk_prefix_parts(offset as u64, &pieces),
            };
            if let Some(crcs) = &mut computed {
                crcs.push(frame::prefix_checksum(&prefix));
            }
            let write = async {
                self.stream.write_all(&prefix).await?;
                for piece in &pieces {
                    self.stream.write_all(piece).await?;
                }
                Ok::<(), std::io::Error>(())
            };
            // Each chunk must get out within the idle timeout: a reader that stalls is dropped.
            tokio::time::timeout(idle, write)
                .await
                .map_err(|_| ConnectionError::IdleTimeout(idle))??;
            offset = end;
        }
        tokio::time::timeout(idle, self.stream.flush())
            .await
            .map_err(|_| ConnectionError::IdleTimeout(idle))??;
        if let (Some(crcs), Some(cache)) = (computed, known.checksums) {
            cache.remember(chunk, crcs);
        }
        Ok(PayloadRoute::Chunks)
    }

    /// Sends a sealed region's frame with its descriptor.
    async fn send_region(
        &mut self,
        descriptor: RegionDescriptor,
        fd: std::os::fd::OwnedFd,
    ) -> Result<(), ConnectionError> {
        // Bytes still buffered go first; the descriptor then rides with the region frame.
        let idle = self.limits.idle_timeout;
        tokio::time::timeout(idle, self.stream.flush())
            .await
            .map_err(|_| ConnectionError::IdleTimeout(idle))??;
        self.stream.get_mut().attach_fd(fd)?;
        self.write_frame(&descriptor.frame()).await
    }
}

/// Copies a payload into a new sealed region, a piece at a time, yielding between pieces so
/// other sessions on this thread get their turn.
async fn make_region(
    parts: &[&[u8]],
    total: usize,
) -> std::io::Result<(RegionDescriptor, std::os::fd::OwnedFd)> {
    let mut region = OutgoingRegion::new(total)?;
    for part in parts {
        for piece in part.chunks(REGION_PIECE) {
            region.append(piece)?;
            tokio::task::yield_now().await;
        }
    }
    let descriptor = region.seal()?;
    let fd = region
        .into_fd()
        .ok_or_else(|| std::io::Error::other("region not sealed"))?;
    Ok((descriptor, fd))
}

/// Payload bytes copied into a region between yields.
const REGION_PIECE: usize = 8 << 20;

#[cfg(target_os = "linux")]
use crate::region::OutgoingRegion;
#[cfg(target_os = "linux")]
pub use crate::region::SealedRegion;

/// Where shared memory does not exist, no region is ever kept.
#[cfg(not(target_os = "linux"))]
#[derive(Debug)]
pub enum SealedRegion {}

#[cfg(not(target_os = "linux"))]
impl SealedRegion {
    fn descriptor(&self) -> RegionDescriptor {
        match *self {}
    }
    fn share(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        match *self {}
    }
}

/// What a sender already knows of a payload that never changes (a registered tensor's).
#[derive(Debug, Clone, Copy, Default)]
pub struct Known<'a> {
    /// The sealed region the payload lies in, kept from when it arrived. The caller vouches
    /// that its bytes are exactly the payload's (a node keeps a region only while it is the
    /// registered tensor's own memory); only its length is checked here, and the receiver
    /// checks its crc32c.
    pub region: Option<&'a SealedRegion>,
    /// The payload's chunk checksums, once a send computed them.
    pub checksums: Option<&'a ChunkChecksums>,
}

/// The chunk checksums of a payload that never changes, computed by its first whole send and
/// reused by later sends with the same chunk size (a model served to many workers is
/// checksummed once). A stale entry could only make a receiver refuse a chunk, never accept a
/// wrong one; and a checksum taken once also catches a later change of the bytes in memory.
#[derive(Debug, Default)]
pub struct ChunkChecksums {
    known: std::sync::Mutex<Option<(usize, std::sync::Arc<Vec<u32>>)>>,
}

impl ChunkChecksums {
    fn for_chunk_size(&self, chunk: usize) -> Option<std::sync::Arc<Vec<u32>>> {
        let known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        known
            .as_ref()
            .filter(|(size, _)| *size == chunk)
            .map(|(_, crcs)| crcs.clone())
    }

    fn remember(&self, chunk: usize, crcs: Vec<u32>) {
        *self.known.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((chunk, std::sync::Arc::new(crcs)));
    }

    /// How many chunk checksums are known (for tests).
    pub fn len(&self) -> usize {
        let known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        known.as_ref().map_or(0, |(_, crcs)| crcs.len())
    }

    /// Whether none are known yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// New regions a connection sends while its peer has not read everything before them, at most
/// (in bytes; one region is always allowed to a peer that has).
pub const UNREAD_REGION_BYTES: usize = 64 << 20;

/// Regions of payloads at least this large are kept by a receiver that asks for it: below it a
/// copy into a new region is cheap, and a kept region holds a file descriptor per tensor.
pub const KEEP_REGION_MIN: usize = 4 << 20;

/// Checks and maps a region, and hashes it where the receiver wants the content hash, on a
/// blocking thread: mapping, checksumming and hashing a large region takes a while and must not
/// hold up the other connections a runtime thread serves.
#[cfg(target_os = "linux")]
async fn adopt_region(
    fd: std::os::fd::OwnedFd,
    declared: RegionDescriptor,
    assembler: &mut TensorAssembler,
    regions: RegionUse,
) -> Result<Option<SealedRegion>, ConnectionError> {
    let expected = assembler.meta().byte_len();
    let keep = regions != RegionUse::Map && expected >= KEEP_REGION_MIN;
    let hasher = assembler
        .take_hasher()
        .filter(|_| regions != RegionUse::KeepUnhashed);
    let (bytes, kept, hasher) = tokio::task::spawn_blocking(move || {
        let (bytes, kept) = crate::region::adopt(fd, declared, expected, keep)?;
        let hasher = hasher.map(|mut h| {
            h.update(&bytes);
            h
        });
        Ok::<_, StreamError>((bytes, kept, hasher))
    })
    .await
    .map_err(|e| std::io::Error::other(format!("region check task: {e}")))??;
    assembler.adopt_hashed(bytes, hasher)?;
    Ok(kept)
}

#[cfg(not(target_os = "linux"))]
struct OutgoingRegion;

#[cfg(not(target_os = "linux"))]
impl OutgoingRegion {
    fn new(_len: usize) -> std::io::Result<Self> {
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "shared-memory regions need Linux",
        ))
    }
    fn append(&mut self, _bytes: &[u8]) -> std::io::Result<()> {
        Ok(())
    }
    fn seal(&mut self) -> std::io::Result<RegionDescriptor> {
        Err(std::io::ErrorKind::Unsupported.into())
    }
    fn into_fd(self) -> Option<std::os::fd::OwnedFd> {
        None
    }
}

#[cfg(not(target_os = "linux"))]
async fn adopt_region(
    _fd: std::os::fd::OwnedFd,
    _declared: RegionDescriptor,
    _assembler: &mut TensorAssembler,
    _regions: RegionUse,
) -> Result<Option<SealedRegion>, ConnectionError> {
    Err(StreamError::RegionRefused {
        reason: "shared-memory regions need Linux".into(),
    }
    .into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_proto::{TensorData, tensor::into_parts};

    fn limits() -> ConnectionLimits {
        ConnectionLimits {
            chunk_size: 1000,
            ..ConnectionLimits::default()
        }
    }

    /// Sends `payload` with `known` through an in-memory pipe and reads it back.
    async fn send_and_receive(
        meta: &ferry_proto::TensorMeta,
        payload: &[u8],
        known: Known<'_>,
    ) -> Result<Vec<u8>, ConnectionError> {
        let (a, b) = tokio::io::duplex(1 << 16);
        let mut writer = Connection::new(a, limits());
        let mut reader = Connection::new(b, limits());
        let mut assembler = TensorAssembler::new(meta.clone(), 1 << 20).unwrap();
        let parts = [payload];
        let (sent, received) = tokio::join!(
            writer.write_payload_known(&parts, 0, known),
            reader.read_payload(&mut assembler),
        );
        sent?;
        received?;
        Ok(assembler.finish().unwrap().as_bytes().to_vec())
    }

    #[tokio::test]
    async fn chunk_checksums_are_computed_once_and_reused() {
        let data = TensorData::new((0..2500).map(|i| i as f32).collect::<Vec<_>>(), [2500]);
        let (meta, payload) = into_parts(data).unwrap();
        let checksums = ChunkChecksums::default();
        let known = Known {
            region: None,
            checksums: Some(&checksums),
        };
        assert_eq!(
            send_and_receive(&meta, &payload, known).await.unwrap(),
            &payload[..]
        );
        assert_eq!(checksums.len(), 10, "one per 1000-byte chunk");
        let first = checksums.for_chunk_size(1000).unwrap();
        assert_eq!(
            send_and_receive(&meta, &payload, known).await.unwrap(),
            &payload[..]
        );
        assert!(std::sync::Arc::ptr_eq(
            &first,
            &checksums.for_chunk_size(1000).unwrap()
        ));
        // Checksums that do not match the bytes (the bytes changed in memory since): refused.
        let mut wrong = first.to_vec();
        wrong[3] ^= 1;
        checksums.remember(1000, wrong);
        let refused = send_and_receive(&meta, &payload, known).await;
        assert!(
            matches!(
                refused,
                Err(ConnectionError::Proto(ferry_proto::ProtoError::Frame(
                    ferry_proto::FrameError::ChecksumMismatch { .. }
                )))
            ),
            "{refused:?}"
        );
    }
}
