//! Which content hash a receive computes, when, and who compares it with what: every such
//! decision of a put, a pull and a read, as pure functions tested by one table each. The
//! assembler, the connection, a pull and a device's registration only carry them out.
//!
//! The rules, in one place:
//! - a put is hashed as it arrives where the device cannot lend its registered bytes to a later
//!   hash, or where it goes into a model version (whose commit needs every hash), else answered
//!   first and hashed after, off the answer's path; a pull is hashed as it arrives, to be
//!   checked; a read (a client's get) is not hashed;
//! - chunk checksums are checked unless the whole payload's hash is computed to be checked;
//! - a payload that comes whole as a sealed region is never hashed at its handoff (which stays
//!   O(1)): a pull's region is registered under the granted hash and verified by the device;
//! - a device trusts a hash the node computed over the very bytes, verifies a stated one, and
//!   computes a missing one: later, from the registered bytes, where it can read them in place.

use crate::connection::PayloadRoute;

/// Why a tensor is received: what decides the content hash its receiver computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A client's put to a node's device.
    Put {
        /// Whether the device can lend the registered tensor's bytes to a hash computed after
        /// the put is answered (Flex, plain dtypes).
        device_lends_bytes: bool,
        /// Whether the tensor goes into a model version, whose commit needs every hash: no
        /// later than the commit, so as the bytes arrive, while they are in cache.
        into_model: bool,
    },
    /// A node's pull from a peer, checked against the hash the grant states.
    Pull,
    /// A copy for the caller (a client's get): the connection's checks suffice.
    Read,
}

/// What a receiver computes the content hash for, as the bytes arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashUse {
    /// Nothing: no hash while receiving.
    Skip,
    /// Recorded as the tensor's hash (a put, which has none to compare it with): chunk
    /// checksums still catch noise on a link in clear, each checked while its piece is in
    /// cache, and the hash trails a chunk behind, so the bytes are read from memory once.
    Record,
    /// Compared with a hash the receiver trusts (a pull's grant) before the bytes are used: it
    /// catches whatever a chunk checksum would, so none is checked, and each byte is read once
    /// after the kernel wrote it, by the hash.
    Check,
}

impl HashUse {
    /// The hash a receive for `purpose` computes.
    pub fn for_purpose(purpose: Purpose) -> Self {
        match purpose {
            // Hashing as it arrived made a 256 MiB put's answer a third to a half later on a
            // 2-core machine (the hash's CPU on the answer's path): where the device can lend
            // the registered bytes, the hash runs after, at a lower priority.
            Purpose::Put {
                device_lends_bytes: true,
                into_model: false,
            } => Self::Skip,
            // Elsewhere a later hash would take a pass of its own over the bytes (a GPU, NdArray,
            // a repacked quantized layout), and a model version's commit waits for every hash:
            // hashed while the bytes are in cache, a chunk behind on a thread of its own.
            Purpose::Put { .. } => Self::Record,
            Purpose::Pull => Self::Check,
            Purpose::Read => Self::Skip,
        }
    }

    /// Whether each chunk's checksum is checked as it arrives (on a link that does not
    /// authenticate every byte itself): unless the whole payload's hash is computed to be
    /// checked, which catches whatever they would.
    pub fn checks_chunks(self) -> bool {
        self != Self::Check
    }
}

/// Who compares a pulled tensor's bytes with the hash its grant states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PulledCheck {
    /// Chunks: hashed as they arrived; the hash is settled and compared with the grant before
    /// the capability is released (bytes that are not the ones granted never use it up), and
    /// the tensor registered under the hash computed.
    BeforeRelease,
    /// A sealed region from a peer of this host (its bytes cannot change): registered under the
    /// granted hash, which the device verifies off the critical path.
    ByDevice,
}

/// When a pulled payload that came by `route` is checked.
pub fn pulled_check(route: PayloadRoute) -> PulledCheck {
    match route {
        PayloadRoute::Chunks => PulledCheck::BeforeRelease,
        PayloadRoute::Region => PulledCheck::ByDevice,
    }
}

/// What a node knows of a tensor's content hash when it hands the tensor to a device (the
/// node's own `KnownHash`, without the hash).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashKnown {
    /// Nothing (a put answered first, an embedding program's insert, a host round trip).
    Unknown,
    /// Computed by the node over the very bytes it hands over, as they arrived.
    Computed,
    /// Stated by the node the bytes came from.
    Stated,
}

/// What a device does with the hash it is handed, at registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtRegister {
    /// Registered as verified, as is.
    Trust,
    /// Registered as stated, verified later from the registered bytes.
    VerifyLater,
    /// Verified from the bytes before registering.
    VerifyNow,
    /// Registered as being computed, from the registered bytes, later.
    ComputeLater,
    /// Computed from the bytes before registering.
    ComputeNow,
}

/// What a device does with `known` at registration, where it can (`lends_bytes`) or cannot
/// read the registered tensor's bytes in place afterwards: later only without a second host copy.
pub fn at_register(known: HashKnown, lends_bytes: bool) -> AtRegister {
    match (known, lends_bytes) {
        (HashKnown::Computed, _) => AtRegister::Trust,
        (HashKnown::Stated, true) => AtRegister::VerifyLater,
        (HashKnown::Stated, false) => AtRegister::VerifyNow,
        (HashKnown::Unknown, true) => AtRegister::ComputeLater,
        (HashKnown::Unknown, false) => AtRegister::ComputeNow,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_use_table() {
        let put = |device_lends_bytes, into_model| Purpose::Put {
            device_lends_bytes,
            into_model,
        };
        let table = [
            (put(true, false), HashUse::Skip, true),
            (put(false, false), HashUse::Record, true),
            (put(true, true), HashUse::Record, true),
            (put(false, true), HashUse::Record, true),
            (Purpose::Pull, HashUse::Check, false),
            (Purpose::Read, HashUse::Skip, true),
        ];
        for (purpose, hash_use, checks_chunks) in table {
            assert_eq!(HashUse::for_purpose(purpose), hash_use, "{purpose:?}");
            assert_eq!(hash_use.checks_chunks(), checks_chunks, "{hash_use:?}");
        }
    }

    #[test]
    fn pulled_check_table() {
        let table = [
            (PayloadRoute::Chunks, PulledCheck::BeforeRelease),
            (PayloadRoute::Region, PulledCheck::ByDevice),
        ];
        for (route, want) in table {
            assert_eq!(pulled_check(route), want, "{route:?}");
        }
    }

    #[test]
    fn at_register_table() {
        let table = [
            (HashKnown::Computed, true, AtRegister::Trust),
            (HashKnown::Computed, false, AtRegister::Trust),
            (HashKnown::Stated, true, AtRegister::VerifyLater),
            (HashKnown::Stated, false, AtRegister::VerifyNow),
            (HashKnown::Unknown, true, AtRegister::ComputeLater),
            (HashKnown::Unknown, false, AtRegister::ComputeNow),
        ];
        for (known, lends, want) in table {
            assert_eq!(at_register(known, lends), want, "{known:?} lends={lends}");
        }
    }
}
