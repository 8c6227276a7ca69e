//! Typed errors for everything that can be wrong with bytes from outside.

use thiserror::Error;

/// A dtype or quantization scheme that cannot be decoded from its wire codes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DTypeError {
    /// A code that names nothing in this protocol version.
    #[error("unknown {field} code {code}")]
    UnknownCode {
        /// Which field carried it.
        field: &'static str,
        /// The code received.
        code: u8,
    },
    /// A quantized dtype without its scheme.
    #[error("a quantized dtype arrived without its quantization scheme")]
    MissingScheme,
    /// A plain dtype that carries a scheme.
    #[error("dtype tag {tag} is not quantized but carries a quantization scheme")]
    UnexpectedScheme {
        /// The tag received.
        tag: u8,
    },
    /// A native store that names a packing dimension.
    #[error("a native quant store has no packing dim, got {dim}")]
    NativeStoreWithPackingDim {
        /// The dimension received.
        dim: usize,
    },
    /// More block dimensions than Burn can hold.
    #[error("a block size has at most 5 dims, got {dims}")]
    BlockTooManyDims {
        /// How many were received.
        dims: usize,
    },
    /// A block extent of zero (Burn would divide by it).
    #[error("block size {extents:?} has a zero extent")]
    ZeroBlockExtent {
        /// The extents received.
        extents: Vec<u8>,
    },
    /// A block size with a leading 1, which Burn would silently drop.
    #[error("block size {extents:?} is not canonical: it starts with 1")]
    NonCanonicalBlockSize {
        /// The extents received.
        extents: Vec<u8>,
    },
    /// Block extents given with no block scale level.
    #[error("block size {extents:?} given without a block scale dtype")]
    BlockSizeWithoutLevel {
        /// The extents received.
        extents: Vec<u8>,
    },
    /// A block scale level with no extents.
    #[error("a block scale level needs a block size")]
    EmptyBlockSize,
}

/// A tensor description whose shape, dtype and byte length do not describe a valid tensor.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum MetaError {
    /// A stored scale in an encoding Burn would not give back (it would come back as other
    /// bytes, so the tensor could not be returned bit-exact).
    #[error(
        "{dtype}: scale {index} is stored as {code:02x?}, which Burn does not give back unchanged (not the canonical encoding of its value)"
    )]
    NonCanonicalScale {
        /// The dtype.
        dtype: String,
        /// Which scale.
        index: u64,
        /// Its stored bytes.
        code: Vec<u8>,
    },
    /// The dtype codes are invalid.
    #[error(transparent)]
    DType(#[from] DTypeError),
    /// More dimensions than ferry accepts.
    #[error("tensor rank {rank} exceeds the maximum of {max}")]
    RankTooLarge {
        /// Rank received.
        rank: usize,
        /// The limit.
        max: usize,
    },
    /// A dimension that does not fit this platform's `usize`.
    #[error("dimension {dim} does not fit in memory on this platform")]
    DimTooLarge {
        /// The dimension received.
        dim: u64,
    },
    /// Element count or byte size overflows.
    #[error("shape {shape:?} of {dtype} overflows: its byte size cannot be represented")]
    SizeOverflow {
        /// The shape.
        shape: Vec<usize>,
        /// The dtype, readable.
        dtype: String,
    },
    /// A packing dimension at or past the tensor's rank.
    #[error("packing dim {dim} is out of range for shape {shape:?} (rank {rank})")]
    PackedDimOutOfRange {
        /// The packing dim.
        dim: usize,
        /// The shape.
        shape: Vec<usize>,
        /// Its rank.
        rank: usize,
    },
    /// A packed sub-byte layout where Burn's length formula and its readers disagree.
    #[error(
        "{dtype} on shape {shape:?} is a packed layout Burn cannot read back consistently \
         ({reason}); re-quantize with a native store"
    )]
    AmbiguousPackedLayout {
        /// The dtype, readable.
        dtype: String,
        /// The shape.
        shape: Vec<usize>,
        /// Why.
        reason: &'static str,
    },
    /// A block with more dims than the tensor it tiles.
    #[error("block size {block:?} has more dims than shape {shape:?}")]
    BlockRankExceedsShape {
        /// The block extents.
        block: Vec<u8>,
        /// The shape.
        shape: Vec<usize>,
    },
    /// The declared byte length is not what shape and dtype imply.
    #[error("tensor of shape {shape:?} and dtype {dtype} must be {expected} bytes, got {actual}")]
    ByteLenMismatch {
        /// The shape.
        shape: Vec<usize>,
        /// The dtype, readable.
        dtype: String,
        /// What shape and dtype imply.
        expected: u64,
        /// What was declared or received.
        actual: u64,
    },
    /// A buffer provided to receive into is not the payload's length.
    #[error("a buffer of {len} bytes was provided for a payload of {expected} bytes")]
    BufferLength {
        /// The buffer's length.
        len: u64,
        /// The payload's.
        expected: u64,
    },
    /// The receiver could not allocate the tensor's buffer.
    #[error("cannot allocate {bytes} bytes for the tensor")]
    AllocationFailed {
        /// Its byte length.
        bytes: u64,
    },
    /// A tensor larger than the receiver accepts.
    #[error("tensor of {bytes} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Its byte length.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
}

/// A frame that cannot be accepted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The first bytes are not ferry's magic.
    #[error("not a ferry frame (bad magic {found:02x?})")]
    BadMagic {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// A protocol major version this build does not speak.
    #[error("peer speaks ferry protocol version {found}, this build speaks {supported}")]
    UnsupportedVersion {
        /// The version found.
        found: u8,
        /// The version supported.
        supported: u8,
    },
    /// A frame kind this build does not know.
    #[error("unknown frame kind {kind}")]
    UnknownKind {
        /// The kind found.
        kind: u8,
    },
    /// Flag bits this build does not know.
    #[error("unknown frame flags {flags:#06x}")]
    UnknownFlags {
        /// The flags found.
        flags: u16,
    },
    /// A body larger than the configured maximum, refused before any allocation.
    #[error("frame body of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// The declared length.
        len: u64,
        /// The maximum.
        max: u64,
    },
    /// The body does not match its checksum.
    #[error("frame checksum mismatch: header says {expected:#010x}, body gives {actual:#010x}")]
    ChecksumMismatch {
        /// From the header.
        expected: u32,
        /// Computed.
        actual: u32,
    },
    /// A control body that does not decode.
    #[error("malformed control message: {0}")]
    Malformed(String),
    /// A control message this side could not encode (it is never sent).
    #[error("control message could not be encoded: {0}")]
    Unencodable(String),
    /// A message the peer's protocol minor does not have (a request, response or error code
    /// added in a later minor): never sent to that peer, and refused from it.
    #[error("{what} needs protocol minor {since}; the peer speaks minor {peer}")]
    NewerThanPeer {
        /// The message, by name.
        what: &'static str,
        /// The minor that added it.
        since: u16,
        /// The peer's minor.
        peer: u16,
    },
    /// A chunk body too short to hold its offset.
    #[error("chunk frame of {len} bytes is too short for its offset field")]
    ShortChunk {
        /// The body length.
        len: usize,
    },
    /// A region frame body of the wrong length.
    #[error("region frame body of {len} bytes, expected 12")]
    BadRegionBody {
        /// The body length.
        len: usize,
    },
    /// The connection closed in the middle of a frame.
    #[error("connection closed in the middle of a frame")]
    TruncatedFrame,
}

/// A chunked tensor payload that does not add up.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum StreamError {
    /// A chunk that does not start where the previous one ended.
    #[error("chunk at offset {offset} arrived, expected offset {expected}")]
    OutOfOrder {
        /// The chunk's offset.
        offset: u64,
        /// Where the next chunk should start.
        expected: u64,
    },
    /// A chunk that runs past the declared byte length.
    #[error("chunk at offset {offset} of {len} bytes runs past the declared {total} bytes")]
    PastEnd {
        /// The chunk's offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The declared length.
        total: u64,
    },
    /// An empty chunk, which would let a peer stall a stream without progress.
    #[error("empty chunk at offset {offset}")]
    EmptyChunk {
        /// The chunk's offset.
        offset: u64,
    },
    /// The stream ended before all declared bytes arrived.
    #[error("tensor stream ended after {received} of {total} bytes")]
    Incomplete {
        /// Bytes received.
        received: u64,
        /// Bytes declared.
        total: u64,
    },
    /// A shared-memory region whose size is not the declared payload's.
    #[error("shared-memory region of {len} bytes for a payload of {total} bytes")]
    RegionSize {
        /// The region's size.
        len: u64,
        /// The declared payload length.
        total: u64,
    },
    /// A region frame where no region may come (not agreed, not a Unix socket, a resumed
    /// payload), or one without its file descriptor.
    #[error("shared-memory region refused: {reason}")]
    RegionRefused {
        /// Why.
        reason: String,
    },
    /// An eager put (`Request::PutEager`) announcing more than an eager payload may hold.
    #[error("an eager put of {len} bytes, over the {max} bytes an eager put may send")]
    EagerTooLarge {
        /// The payload length it announced.
        len: u64,
        /// The most an eager put may send (`EAGER_PUT_MAX_BYTES`).
        max: u64,
    },
}

/// Any wire-level failure.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// See [`DTypeError`].
    #[error(transparent)]
    DType(#[from] DTypeError),
    /// See [`MetaError`].
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// See [`FrameError`].
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// See [`StreamError`].
    #[error(transparent)]
    Stream(#[from] StreamError),
}
