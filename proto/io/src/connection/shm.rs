//! The shared-memory route: on a Unix socket where both sides agreed to it, a payload travels as
//! one sealed region (a region frame with the region's file descriptor) instead of as chunks.
//! Here: when a region is made or kept, sending one (a kept region passed on, or a new copy),
//! and checking and adopting one that arrives.

use bytes::Buf;
use ferry_proto::frame::{FrameHeader, HEADER_LEN, REGION_BODY_LEN, RegionDescriptor};
use ferry_proto::{FrameError, StreamError};
use tokio::io::AsyncWriteExt;

use super::{Connection, ConnectionError};
use crate::assembler::TensorAssembler;
use crate::transport::Transport;

#[cfg(target_os = "linux")]
use ferry_memory::region::OutgoingRegion;
#[cfg(target_os = "linux")]
pub use ferry_memory::region::SealedRegion;

/// Payloads smaller than this go as chunks by default even where regions are agreed: creating,
/// sealing and mapping a region costs more than copying a few pages through the socket.
pub const DEFAULT_REGION_MIN: usize = 256 * 1024;

/// New regions a connection sends while its peer has not read everything before them, at most
/// (in bytes; one region is always allowed to a peer that has).
pub const UNREAD_REGION_BYTES: usize = 64 << 20;

/// Regions of payloads at least this large are kept by a receiver that asks for it: below it a
/// copy into a new region is cheap, and a kept region holds a file descriptor per tensor.
pub const KEEP_REGION_MIN: usize = 4 << 20;

/// What a receiver does with a payload that arrives as a shared-memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionUse {
    /// Map it, and let the descriptor go once mapped (a client reading a tensor).
    Map,
    /// Keep the sealed region (a payload of at least [`KEEP_REGION_MIN`] bytes), to pass the
    /// tensor on without a copy.
    Keep,
}

/// Whether this build can move payloads through shared memory (Linux `memfd`).
pub const fn shared_memory_supported() -> bool {
    cfg!(target_os = "linux")
}

impl<S: Transport> Connection<S> {
    /// Takes a region frame off the buffer, claims the descriptor that came with it, and adopts
    /// the region as the whole payload once it passes every check.
    pub(super) async fn read_region(
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

    /// Records whether the peer had read everything sent so far, as a new answer begins (a
    /// payload that follows the answer is then judged by it, not by the answer itself): a
    /// client may pipeline requests and leave answers unread.
    pub(super) fn note_peer_progress(&mut self) {
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

    /// Sends a payload that is due a region (shared memory agreed, sent from its start, large
    /// enough) as one: the kept region it lies in, passed on as it is, else a new copy. `false`
    /// where neither went, and the payload is to go as chunks.
    pub(super) async fn write_region(
        &mut self,
        parts: &[&[u8]],
        total: usize,
        kept: Option<&SealedRegion>,
    ) -> Result<bool, ConnectionError> {
        let kept = kept
            .filter(|r| r.descriptor().len == total as u64)
            .map(|r| r.share().map(|fd| (r.descriptor(), fd)));
        match kept {
            Some(Ok((descriptor, fd))) => {
                self.send_region(descriptor, fd).await?;
                return Ok(true);
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
                    return Ok(true);
                }
                Err(error) => {
                    tracing::warn!(%error, bytes = total, "no shared-memory region; sending chunks");
                }
            }
        }
        Ok(false)
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

/// Checks and maps a region (a few system calls, whatever its size) and makes it the payload,
/// unhashed: its handoff stays O(1) ([`crate::hash_plan`]).
#[cfg(target_os = "linux")]
async fn adopt_region(
    fd: std::os::fd::OwnedFd,
    declared: RegionDescriptor,
    assembler: &mut TensorAssembler,
    regions: RegionUse,
) -> Result<Option<SealedRegion>, ConnectionError> {
    let expected = assembler.meta().byte_len();
    let keep = regions == RegionUse::Keep && expected >= KEEP_REGION_MIN;
    let (bytes, kept) = ferry_memory::region::adopt(fd, declared, expected, keep)?;
    assembler.adopt(bytes)?;
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

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use crate::assembler::{BufferFrom, HashUse};
    use crate::connection::{ConnectionLimits, PayloadRoute};
    use crate::transport::UnixTransport;
    use ferry_proto::TensorData;
    use ferry_proto::tensor::{content_hash, into_parts};

    /// A payload that comes whole as a sealed region is not hashed at its handoff, whatever its
    /// receiver hashes for: the handoff stays O(1), and the hash is settled (or verified by the
    /// device) by whoever needs it.
    #[tokio::test]
    async fn a_region_is_never_hashed_at_its_handoff() {
        // Over a megabyte: received in chunks, it would be hashed on a trailing thread.
        let n = 2 << 20;
        let data = TensorData::new((0..n).map(|i| (i % 239) as u8).collect::<Vec<_>>(), [n]);
        let (meta, payload) = into_parts(data).unwrap();
        let truth = content_hash(&meta, &payload);
        for (hash_use, regions) in [
            (HashUse::Record, RegionUse::Keep),
            (HashUse::Record, RegionUse::Map),
            (HashUse::Check, RegionUse::Keep),
            (HashUse::Skip, RegionUse::Map),
        ] {
            let (a, b) = tokio::net::UnixStream::pair().unwrap();
            let limits = ConnectionLimits {
                region_min: 1,
                ..ConnectionLimits::default()
            };
            let mut writer = Connection::new(UnixTransport::new(a), limits);
            let mut reader = Connection::new(UnixTransport::new(b), limits);
            writer.set_shared_memory(true);
            reader.set_shared_memory(true);
            let mut assembler =
                TensorAssembler::new(meta.clone(), u64::MAX, BufferFrom::Fresh, hash_use).unwrap();
            let parts = [&payload[..]];
            let (sent, received) = tokio::join!(
                writer.write_payload_parts(&parts, 0),
                reader.read_payload_keeping(&mut assembler, regions),
            );
            assert_eq!(sent.unwrap(), PayloadRoute::Region, "{hash_use:?}");
            assert_eq!(received.unwrap().0, PayloadRoute::Region);
            let assembled = assembler.finish().unwrap();
            assert_eq!(assembled.hash, None, "{hash_use:?} {regions:?}");
            assert_eq!(assembled.data.as_bytes(), &payload[..]);
            assert_eq!(content_hash(&meta, assembled.data.as_bytes()), truth);
        }
    }
}
