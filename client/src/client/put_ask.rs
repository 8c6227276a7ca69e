//! How an upload asks to send its payload: after the node's `Ready`, or at once (an eager put),
//! decided per tensor by a pure function.

use ferry_io::PayloadRoute;
use ferry_proto::message::{EAGER_PUT_MAX_BYTES, EAGER_PUT_MINOR};
use ferry_proto::{Request, TensorMeta};

/// Whether a put's payload waits for the node's go-ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PutAsk {
    /// `Request::Put`: the payload goes once the node answered `Ready`, one round trip after
    /// the request; a refusal costs no payload.
    AfterReady,
    /// `Request::PutEager`: the payload follows the request at once, as chunk frames; a refused
    /// one was sent for nothing, so only small payloads go so.
    Eager,
}

impl PutAsk {
    /// How a payload of `byte_len` bytes is asked for, to a node of protocol minor `node_minor`,
    /// where a whole payload of that length would travel by `route`: eagerly where the node
    /// knows eager puts, the payload is small enough for one ([`EAGER_PUT_MAX_BYTES`]), and it
    /// would go as chunk frames anyway (a payload due as a shared-memory region keeps its
    /// region: the node reads an eager payload as chunks only).
    pub(super) fn for_payload(node_minor: u16, byte_len: u64, route: PayloadRoute) -> Self {
        let eager = node_minor >= EAGER_PUT_MINOR
            && byte_len <= EAGER_PUT_MAX_BYTES
            && route == PayloadRoute::Chunks;
        if eager { Self::Eager } else { Self::AfterReady }
    }

    /// The request that asks so.
    pub(super) fn request(
        self,
        device: u32,
        name: Option<String>,
        meta: &TensorMeta,
        overwrite: bool,
    ) -> Request {
        let meta = meta.to_wire();
        match self {
            Self::AfterReady => Request::Put {
                device,
                name,
                meta,
                overwrite,
            },
            Self::Eager => Request::PutEager {
                device,
                name,
                meta,
                overwrite,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Eager only to a node that knows it, for a payload of at most the limit that would go as
    /// chunks.
    #[test]
    fn eager_only_where_it_saves_a_round_trip_for_little() {
        use PayloadRoute::{Chunks, Region};
        use PutAsk::{AfterReady, Eager};
        let max = EAGER_PUT_MAX_BYTES;
        let table = [
            (EAGER_PUT_MINOR, 0, Chunks, Eager),
            (EAGER_PUT_MINOR, 24, Chunks, Eager),
            (EAGER_PUT_MINOR, max, Chunks, Eager),
            (EAGER_PUT_MINOR + 1, max, Chunks, Eager),
            (EAGER_PUT_MINOR, max + 1, Chunks, AfterReady),
            (EAGER_PUT_MINOR, u64::MAX, Chunks, AfterReady),
            (EAGER_PUT_MINOR, 1 << 20, Region, AfterReady),
            (EAGER_PUT_MINOR - 1, 24, Chunks, AfterReady),
            (0, 24, Chunks, AfterReady),
        ];
        for (minor, len, route, expected) in table {
            assert_eq!(
                PutAsk::for_payload(minor, len, route),
                expected,
                "minor {minor}, {len} bytes, {route:?}"
            );
        }
    }
}
