//! What travels in and out of a device worker: a tensor to register ([`Payload`]: host bytes
//! that [`Arrived`], or a [`NativeTensor`] from a worker of the same backend), a tensor handed
//! out for a copy or a move ([`Exported`]), and a tensor's bytes on the host for sending
//! ([`HostBytes`]).

use std::any::Any;
use std::sync::Arc;

use burn_backend::{DType, TensorData};
use ferry_backend::SharedPayload;
use ferry_io::connection::{ChunkChecksums, Known, SealedRegion};

use crate::device::{HashState, KnownHash, Reservation};

/// A backend primitive handed between two workers of the same backend (the native path).
pub(crate) struct NativeTensor {
    pub(super) primitive: Box<dyn Any + Send>,
    pub(super) dtype: DType,
    pub(super) shape: Vec<usize>,
    pub(super) bytes: u64,
    pub(super) content_hash: HashState,
}

impl NativeTensor {
    /// A primitive an application hands in: its content hash is unknown, so the worker computes
    /// it (from the registered bytes in place where it can read them, before registering
    /// otherwise), as for a put.
    pub(crate) fn handed_in<B: burn_backend::Backend>(
        primitive: crate::Primitive<B>,
        dtype: DType,
        shape: Vec<usize>,
        bytes: u64,
    ) -> Self {
        Self {
            primitive: Box::new(primitive),
            dtype,
            shape,
            bytes,
            content_hash: HashState::Computing,
        }
    }

    /// The primitive, where it is one of backend `B`.
    pub(crate) fn into_primitive<B: burn_backend::Backend>(self) -> Option<crate::Primitive<B>> {
        self.primitive
            .downcast::<crate::Primitive<B>>()
            .ok()
            .map(|primitive| *primitive)
    }
}

impl std::fmt::Debug for NativeTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeTensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish()
    }
}

/// Host bytes that arrived, to register.
#[derive(Debug)]
pub(crate) struct Arrived {
    /// The tensor, validated against the byte-length rule.
    pub(crate) data: TensorData,
    /// What is known of its content hash.
    pub(crate) hash: KnownHash,
    /// The sealed shared-memory region the bytes lie in, where it was kept.
    pub(crate) region: Option<SealedRegion>,
    /// Their chunk checksums, where the receive checked every one (none otherwise).
    pub(crate) checksums: ChunkChecksums,
}

impl Arrived {
    /// Bytes with nothing known about them yet.
    pub(crate) fn new(data: TensorData) -> Self {
        Self {
            data,
            hash: KnownHash::Unknown,
            region: None,
            checksums: ChunkChecksums::default(),
        }
    }
}

/// What a worker registers.
#[derive(Debug)]
pub(crate) enum Payload {
    /// Host bytes: `from_data` on the target.
    Data(Arrived),
    /// A primitive from a worker of the same backend: `*_to_device` on the target.
    Native(NativeTensor),
}

/// A tensor's bytes on the host, for sending; counted in its device's budget for as long as
/// they live, even if the tensor is removed meanwhile.
pub(crate) enum HostBytes {
    /// Shared with the registered tensor (no copy); the `Arc` keeps them alive even if the
    /// tensor is removed meanwhile, and nothing writes to a buffer that is shared. The tensor's
    /// own reservation is held with them, so a removed tensor's memory stays counted until the
    /// last send of it ends.
    Shared {
        /// The registered tensor's payload.
        payload: SharedPayload,
        /// The sealed shared-memory region holding the same payload, where the tensor arrived
        /// in one and it was kept.
        region: Option<Arc<SealedRegion>>,
        /// The payload's chunk checksums, filled by the first send that computes them.
        checksums: Arc<ChunkChecksums>,
        /// The tensor's room in the budget, held until the send ends.
        _held: Arc<Reservation>,
    },
    /// Read out with `into_data`: a copy, with its own reservation.
    Owned {
        /// The copy.
        data: TensorData,
        /// The copy's room in the budget, held until the send ends.
        _held: Reservation,
    },
}

impl HostBytes {
    /// The payload, as the slices it lies in (to be sent end to end).
    pub(crate) fn parts(&self) -> Vec<&[u8]> {
        match self {
            HostBytes::Shared { payload, .. } => [&payload.values[..], &payload.tail[..]]
                .into_iter()
                .filter(|p| !p.is_empty())
                .collect(),
            HostBytes::Owned { data, .. } => vec![data.as_bytes()],
        }
    }

    /// What is known of the payload already: the sealed region it lies in, if it was kept, and
    /// its chunk checksums, once a send computed them (the registered tensor never changes).
    pub(crate) fn known(&self) -> Known<'_> {
        match self {
            HostBytes::Shared {
                region, checksums, ..
            } => Known {
                region: region.as_deref(),
                checksums: Some(checksums.as_ref()),
            },
            HostBytes::Owned { .. } => Known::default(),
        }
    }

    /// Whether these are the registered tensor's own bytes, lent without a copy (so that sending
    /// them in parts costs no more than sending them whole).
    pub(crate) fn lent(&self) -> bool {
        matches!(self, HostBytes::Shared { .. })
    }

    /// The payload's length.
    pub(crate) fn len(&self) -> usize {
        match self {
            HostBytes::Shared { payload, .. } => payload.len(),
            HostBytes::Owned { data, .. } => data.as_bytes().len(),
        }
    }
}

impl std::fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostBytes::Shared { payload, .. } => {
                write!(f, "HostBytes::Shared({} bytes)", payload.len())
            }
            HostBytes::Owned { data, .. } => {
                write!(f, "HostBytes::Owned({} bytes)", data.as_bytes().len())
            }
        }
    }
}

/// What a worker hands out for a copy or a move.
#[derive(Debug)]
pub(crate) enum Exported {
    /// Host bytes (`into_data`), counted in the source device's budget while they live.
    Data(TensorData, Reservation),
    /// The primitive itself (a cheap clone of the handle).
    Native(NativeTensor),
}
