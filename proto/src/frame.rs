//! The frame: a 16-byte header (magic, version, kind, flags, body length, crc32c) and a body.
//!
//! Check-then-parse, as in mini-redis: [`check`] looks at buffered bytes and answers "not enough
//! yet" (`Ok(None)`) or the frame's full length, refusing a body over the configured maximum
//! before anything is allocated; [`parse`] then takes exactly that many bytes off the buffer.

use bytes::{Buf, Bytes, BytesMut};

use crate::error::FrameError;

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"FRRY";
/// The protocol major version this build speaks; peers of another major are refused.
pub const PROTOCOL_VERSION: u8 = 1;
/// The protocol minor version: what this build adds within the major. Two peers of different
/// minors talk as of the lower one (`control`, PROTOCOL.md §4).
pub const PROTOCOL_MINOR: u16 = 11;
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 16;
/// Bytes before the payload in a chunk body: the payload's offset in the tensor.
pub const CHUNK_PREFIX_LEN: usize = 8;
/// The default maximum body a peer accepts (a control message or a chunk).
pub const DEFAULT_MAX_BODY: usize = 16 << 20;
/// Bytes in a region frame's body.
pub const REGION_BODY_LEN: usize = 12;
/// The default tensor payload bytes per chunk frame.
pub const DEFAULT_CHUNK_SIZE: usize = 4 << 20;

/// What a frame's body holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// A control message (bincode, see `PROTOCOL.md`).
    Control = 1,
    /// A piece of a tensor payload: `u64` offset, then raw bytes.
    Chunk = 2,
    /// A whole tensor payload in a shared-memory region whose file descriptor travels with the
    /// frame (`SCM_RIGHTS` on a Unix socket); the body is a [`RegionDescriptor`]. Coded 4, not
    /// 3: the checksum covers the body only, so every kind code differs from every other in at
    /// least two bits and no single flipped header bit turns one kind into another.
    Region = 4,
}

impl TryFrom<u8> for FrameKind {
    type Error = FrameError;
    fn try_from(kind: u8) -> Result<Self, FrameError> {
        match kind {
            1 => Ok(Self::Control),
            2 => Ok(Self::Chunk),
            4 => Ok(Self::Region),
            kind => Err(FrameError::UnknownKind { kind }),
        }
    }
}

/// A decoded, structurally valid frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the body holds.
    pub kind: FrameKind,
    /// Reserved; must be 0 in this version.
    pub flags: u16,
    /// Body length in bytes.
    pub body_len: u32,
    /// crc32c of the body.
    pub checksum: u32,
}

impl FrameHeader {
    /// The header of a frame of `kind` around `body`.
    pub fn for_body(kind: FrameKind, body: &[u8]) -> Self {
        Self::for_parts(kind, &[body])
    }

    /// The header of a frame whose body is `parts` laid end to end (sent without joining them).
    ///
    /// # Panics
    /// If the parts add up to more than `u32::MAX` bytes; callers size bodies far below that.
    pub fn for_parts(kind: FrameKind, parts: &[&[u8]]) -> Self {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let checksum = parts
            .iter()
            .fold(0, |crc, part| crc32c::crc32c_append(crc, part));
        Self {
            kind,
            flags: 0,
            body_len: u32::try_from(len).expect("frame bodies are sized far below 4 GiB"),
            checksum,
        }
    }

    /// The 16 header bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4] = PROTOCOL_VERSION;
        out[5] = self.kind as u8;
        out[6..8].copy_from_slice(&self.flags.to_le_bytes());
        out[8..12].copy_from_slice(&self.body_len.to_le_bytes());
        out[12..16].copy_from_slice(&self.checksum.to_le_bytes());
        out
    }

    /// Decodes a header from its 16 bytes, checking magic, version, kind, flags and the body's
    /// size against `max_body`.
    pub fn decode(bytes: &[u8; HEADER_LEN], max_body: usize) -> Result<Self, FrameError> {
        let [
            m0,
            m1,
            m2,
            m3,
            version,
            kind,
            f0,
            f1,
            l0,
            l1,
            l2,
            l3,
            c0,
            c1,
            c2,
            c3,
        ] = *bytes;
        let magic = [m0, m1, m2, m3];
        if magic != MAGIC {
            return Err(FrameError::BadMagic { found: magic });
        }
        if version != PROTOCOL_VERSION {
            return Err(FrameError::UnsupportedVersion {
                found: version,
                supported: PROTOCOL_VERSION,
            });
        }
        let kind = FrameKind::try_from(kind)?;
        let flags = u16::from_le_bytes([f0, f1]);
        if flags != 0 {
            return Err(FrameError::UnknownFlags { flags });
        }
        let body_len = u32::from_le_bytes([l0, l1, l2, l3]);
        if body_len as u64 > max_body as u64 {
            return Err(FrameError::TooLarge {
                len: body_len.into(),
                max: max_body as u64,
            });
        }
        Ok(Self {
            kind,
            flags,
            body_len,
            checksum: u32::from_le_bytes([c0, c1, c2, c3]),
        })
    }

    /// Checks `body` against the header's checksum.
    pub fn verify(&self, body: &[u8]) -> Result<(), FrameError> {
        self.verify_crc(crc32c::crc32c(body))
    }

    /// Checks a checksum computed elsewhere (for a body read in pieces) against the header's.
    pub fn verify_crc(&self, actual: u32) -> Result<(), FrameError> {
        if actual != self.checksum {
            return Err(FrameError::ChecksumMismatch {
                expected: self.checksum,
                actual,
            });
        }
        Ok(())
    }
}

/// A whole frame, its checksum verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// What the body holds.
    pub kind: FrameKind,
    /// The body.
    pub body: Bytes,
}

/// A chunk frame's body, split into its offset and the payload bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Where the payload starts in the tensor's bytes.
    pub offset: u64,
    /// The payload bytes.
    pub data: Bytes,
}

impl Frame {
    /// Reads the body of a chunk frame.
    pub fn into_chunk(self) -> Result<Chunk, FrameError> {
        let mut body = self.body;
        if body.len() < CHUNK_PREFIX_LEN {
            return Err(FrameError::ShortChunk { len: body.len() });
        }
        let offset = body.get_u64_le();
        Ok(Chunk { offset, data: body })
    }
}

/// What a region frame declares about the shared-memory region that travels with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionDescriptor {
    /// The payload's length: the region's exact size.
    pub len: u64,
    /// crc32c of the payload.
    pub crc32c: u32,
}

impl RegionDescriptor {
    /// The frame body: `u64` length, `u32` crc32c, little-endian.
    pub fn encode(&self) -> [u8; REGION_BODY_LEN] {
        let mut out = [0u8; REGION_BODY_LEN];
        out[..8].copy_from_slice(&self.len.to_le_bytes());
        out[8..].copy_from_slice(&self.crc32c.to_le_bytes());
        out
    }

    /// Reads a region frame's body, which must be exactly [`REGION_BODY_LEN`] bytes.
    pub fn decode(body: &[u8]) -> Result<Self, FrameError> {
        let bytes: &[u8; REGION_BODY_LEN] = body
            .try_into()
            .map_err(|_| FrameError::BadRegionBody { len: body.len() })?;
        let (len, crc) = bytes.split_at(8);
        let len: [u8; 8] = len
            .try_into()
            .map_err(|_| FrameError::BadRegionBody { len: body.len() })?;
        let crc: [u8; 4] = crc
            .try_into()
            .map_err(|_| FrameError::BadRegionBody { len: body.len() })?;
        Ok(Self {
            len: u64::from_le_bytes(len),
            crc32c: u32::from_le_bytes(crc),
        })
    }

    /// The whole region frame (header and body).
    pub fn frame(&self) -> Vec<u8> {
        encode(FrameKind::Region, &self.encode())
    }
}

/// Looks at buffered bytes: `Ok(None)` when a whole frame is not there yet, else its header and
/// total length. An invalid header is an error as soon as its 16 bytes are in.
pub fn check(buf: &[u8], max_body: usize) -> Result<Option<(FrameHeader, usize)>, FrameError> {
    let Some(head) = buf.first_chunk::<HEADER_LEN>() else {
        return Ok(None);
    };
    let header = FrameHeader::decode(head, max_body)?;
    let total = HEADER_LEN + header.body_len as usize;
    Ok((buf.len() >= total).then_some((header, total)))
}

/// Takes one whole frame off the front of `buf`, verified, or `Ok(None)` if it is not all there.
/// The body shares `buf`'s allocation: no copy.
pub fn parse(buf: &mut BytesMut, max_body: usize) -> Result<Option<Frame>, FrameError> {
    let Some((header, total)) = check(buf, max_body)? else {
        return Ok(None);
    };
    let mut frame = buf.split_to(total);
    frame.advance(HEADER_LEN);
    let body = frame.freeze();
    header.verify(&body)?;
    Ok(Some(Frame {
        kind: header.kind,
        body,
    }))
}

/// A whole frame (header and body) around `body`, in one buffer.
pub fn encode(kind: FrameKind, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&FrameHeader::for_body(kind, body).encode());
    out.extend_from_slice(body);
    out
}

/// The header and offset prefix of a chunk frame carrying `payload` at `offset`; a writer sends
/// these 24 bytes and then `payload` itself, so the tensor's bytes are never copied to frame them.
pub fn chunk_prefix(offset: u64, payload: &[u8]) -> [u8; HEADER_LEN + CHUNK_PREFIX_LEN] {
    chunk_prefix_parts(offset, &[payload])
}

/// [`chunk_prefix`] for a chunk whose payload lies in several slices, sent one after another.
pub fn chunk_prefix_parts(offset: u64, payload: &[&[u8]]) -> [u8; HEADER_LEN + CHUNK_PREFIX_LEN] {
    let offset_bytes = offset.to_le_bytes();
    let mut parts: Vec<&[u8]> = Vec::with_capacity(payload.len() + 1);
    parts.push(&offset_bytes);
    parts.extend_from_slice(payload);
    let header = FrameHeader::for_parts(FrameKind::Chunk, &parts);
    let mut out = [0u8; HEADER_LEN + CHUNK_PREFIX_LEN];
    out[..HEADER_LEN].copy_from_slice(&header.encode());
    out[HEADER_LEN..].copy_from_slice(&offset_bytes);
    out
}

/// The prefix of a chunk frame of `len` payload bytes at `offset` whose body checksum (over the
/// offset bytes and the payload, as [`chunk_prefix_parts`] computes it) is already known.
///
/// # Panics
/// If `len` is over `u32::MAX` bytes less the prefix; callers size chunks far below that.
pub fn chunk_prefix_checked(
    offset: u64,
    len: usize,
    checksum: u32,
) -> [u8; HEADER_LEN + CHUNK_PREFIX_LEN] {
    let body_len = len
        .checked_add(CHUNK_PREFIX_LEN)
        .and_then(|l| u32::try_from(l).ok())
        .expect("chunks are sized far below 4 GiB");
    let header = FrameHeader {
        kind: FrameKind::Chunk,
        flags: 0,
        body_len,
        checksum,
    };
    let mut out = [0u8; HEADER_LEN + CHUNK_PREFIX_LEN];
    out[..HEADER_LEN].copy_from_slice(&header.encode());
    out[HEADER_LEN..].copy_from_slice(&offset.to_le_bytes());
    out
}

/// The body checksum of the chunk frame a prefix starts (its header's last four bytes).
pub fn prefix_checksum(prefix: &[u8; HEADER_LEN + CHUNK_PREFIX_LEN]) -> u32 {
    u32::from_le_bytes([prefix[12], prefix[13], prefix[14], prefix[15]])
}

/// A whole chunk frame in one buffer (for tests and small payloads).
pub fn encode_chunk(offset: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = chunk_prefix(offset, payload).to_vec();
    out.extend_from_slice(payload);
    out
}

/// The slices of `parts` (laid end to end) that cover `range`, in order.
pub fn slices_in<'a>(parts: &[&'a [u8]], range: std::ops::Range<usize>) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let mut base = 0usize;
    for part in parts {
        let end = base + part.len();
        let from = range.start.max(base);
        let to = range.end.min(end);
        if from < to {
            out.push(&part[from - base..to - base]);
        }
        base = end;
    }
    out
}

/// Where `len` bytes of a payload arriving at `offset` end, if they may come now: they start at
/// `expected` (where the bytes before ended), are not empty, and end by `end` (the payload's,
/// or its stripe's, last byte): the one rule every receiver of chunks holds them to, checked
/// before any of their bytes is read.
pub fn next_chunk_end(
    offset: u64,
    len: usize,
    expected: u64,
    end: u64,
) -> Result<u64, crate::StreamError> {
    use crate::StreamError;
    if offset != expected {
        return Err(StreamError::OutOfOrder { offset, expected });
    }
    if len == 0 {
        return Err(StreamError::EmptyChunk { offset });
    }
    offset
        .checked_add(len as u64)
        .filter(|&chunk_end| chunk_end <= end)
        .ok_or(StreamError::PastEnd {
            offset,
            len: len as u64,
            total: end,
        })
}

/// Splits a payload into `(offset, bytes)` pieces of at most `chunk_size` bytes (at least one).
pub fn chunks(payload: &[u8], chunk_size: usize) -> impl Iterator<Item = (u64, &[u8])> {
    payload
        .chunks(chunk_size.max(1))
        .scan(0u64, |offset, piece| {
            let at = *offset;
            *offset += piece.len() as u64;
            Some((at, piece))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StreamError;

    /// In order, not empty, within the end; anything else refused with what was wrong.
    #[test]
    fn a_chunk_comes_next_not_empty_and_within_the_end() {
        let table = [
            ((0, 4, 0, 10), Ok(4)),
            ((4, 6, 4, 10), Ok(10)),
            ((100, 6, 100, 106), Ok(106)),
            (
                (5, 1, 4, 10),
                Err(StreamError::OutOfOrder {
                    offset: 5,
                    expected: 4,
                }),
            ),
            ((4, 0, 4, 10), Err(StreamError::EmptyChunk { offset: 4 })),
            (
                (4, 7, 4, 10),
                Err(StreamError::PastEnd {
                    offset: 4,
                    len: 7,
                    total: 10,
                }),
            ),
            (
                (u64::MAX, 1, u64::MAX, u64::MAX),
                Err(StreamError::PastEnd {
                    offset: u64::MAX,
                    len: 1,
                    total: u64::MAX,
                }),
            ),
        ];
        for ((offset, len, expected, end), want) in table {
            assert_eq!(
                next_chunk_end(offset, len, expected, end),
                want,
                "{len} bytes at {offset}, {expected} expected, end {end}"
            );
        }
    }

    #[test]
    fn a_known_checksum_makes_the_same_prefix() {
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let (head, tail) = payload.split_at(300);
        let computed = chunk_prefix_parts(4096, &[head, tail]);
        let known = chunk_prefix_checked(4096, payload.len(), prefix_checksum(&computed));
        assert_eq!(known, computed);
    }

    #[test]
    fn incomplete_is_a_normal_state() {
        let frame = encode(FrameKind::Control, b"hello");
        for cut in 0..frame.len() {
            let mut buf = BytesMut::from(&frame[..cut]);
            assert_eq!(parse(&mut buf, 64), Ok(None), "cut at {cut}");
            assert_eq!(buf.len(), cut, "nothing consumed");
        }
        let mut buf = BytesMut::from(&frame[..]);
        let parsed = parse(&mut buf, 64).unwrap().unwrap();
        assert_eq!(parsed.body, &b"hello"[..]);
        assert!(buf.is_empty());
    }

    #[test]
    fn oversized_body_is_refused_from_the_header_alone() {
        let frame = encode(FrameKind::Control, &[0u8; 100]);
        let mut buf = BytesMut::from(&frame[..HEADER_LEN]);
        assert_eq!(
            parse(&mut buf, 99),
            Err(FrameError::TooLarge { len: 100, max: 99 })
        );
    }

    #[test]
    fn corrupt_body_fails_its_checksum() {
        let mut frame = encode_chunk(0, b"payload");
        let last = frame.len() - 1;
        frame[last] ^= 1;
        let mut buf = BytesMut::from(&frame[..]);
        assert!(matches!(
            parse(&mut buf, 64),
            Err(FrameError::ChecksumMismatch { .. })
        ));
    }

    #[test]
    fn chunk_frames_carry_their_offset() {
        let frame = encode_chunk(1 << 40, b"abc");
        let mut buf = BytesMut::from(&frame[..]);
        let chunk = parse(&mut buf, 64).unwrap().unwrap().into_chunk().unwrap();
        assert_eq!(chunk.offset, 1 << 40);
        assert_eq!(chunk.data, &b"abc"[..]);
    }

    #[test]
    fn header_fields_are_checked() {
        let good = encode(FrameKind::Control, b"x");
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(matches!(
            parse(&mut BytesMut::from(&bad[..]), 64),
            Err(FrameError::BadMagic { .. })
        ));
        let mut bad = good.clone();
        bad[4] = 9;
        assert_eq!(
            parse(&mut BytesMut::from(&bad[..]), 64),
            Err(FrameError::UnsupportedVersion {
                found: 9,
                supported: PROTOCOL_VERSION
            })
        );
        let mut bad = good.clone();
        bad[5] = 7;
        assert_eq!(
            parse(&mut BytesMut::from(&bad[..]), 64),
            Err(FrameError::UnknownKind { kind: 7 })
        );
        let mut bad = good;
        bad[6] = 1;
        assert_eq!(
            parse(&mut BytesMut::from(&bad[..]), 64),
            Err(FrameError::UnknownFlags { flags: 1 })
        );
    }

    #[test]
    fn region_bodies_round_trip_and_refuse_other_lengths() {
        let region = RegionDescriptor {
            len: 1 << 33,
            crc32c: 0xdead_beef,
        };
        let mut buf = BytesMut::from(&region.frame()[..]);
        let frame = parse(&mut buf, 64).unwrap().unwrap();
        assert_eq!(frame.kind, FrameKind::Region);
        assert_eq!(RegionDescriptor::decode(&frame.body), Ok(region));
        assert_eq!(
            RegionDescriptor::decode(&[0; 11]),
            Err(FrameError::BadRegionBody { len: 11 })
        );
        assert_eq!(
            RegionDescriptor::decode(&[0; 13]),
            Err(FrameError::BadRegionBody { len: 13 })
        );
    }

    #[test]
    fn a_chunk_over_several_slices_is_the_chunk_of_their_concatenation() {
        let (a, b) = (&b"hello, "[..], &b"world"[..]);
        let joined = [a, b].concat();
        for range in [0..12, 3..9, 7..12, 0..7, 5..5] {
            let pieces = slices_in(&[a, b], range.clone());
            assert_eq!(pieces.concat(), &joined[range.clone()]);
            if !range.is_empty() {
                assert_eq!(
                    chunk_prefix_parts(range.start as u64, &pieces),
                    chunk_prefix(range.start as u64, &joined[range])
                );
            }
        }
    }

    #[test]
    fn chunking_covers_the_payload_once() {
        let payload: Vec<u8> = (0..10).collect();
        let pieces: Vec<_> = chunks(&payload, 4).collect();
        assert_eq!(
            pieces,
            vec![
                (0, &payload[0..4]),
                (4, &payload[4..8]),
                (8, &payload[8..10])
            ]
        );
        assert_eq!(chunks(&[], 4).count(), 0);
    }
}
