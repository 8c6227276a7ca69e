//! A device's memory budget: the bytes and tensor slots it may hand out ([`DeviceLimits`]), and
//! the claims on it ([`Reservation`], [`TensorSlot`]) that give their share back when dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::IfExists;
use crate::error::NodeError;

/// What a registered tensor costs beyond its payload, charged to its device's budget: the
/// description, the map entries, the backend's tensor and allocator rounding (about 4 KiB each
/// was measured resident for small tensors), so that a budget bounds many tiny tensors as well
/// as a few large ones.
pub const TENSOR_OVERHEAD: u64 = 4096;

/// The share of a device's budget that host copies made to send (gets and fetches from a backend
/// that cannot lend its bytes: NdArray) may hold at once: readers that stall their sends can hold
/// no more than this, so the rest stays for writers.
pub const SENDING_SHARE_PERCENT: u64 = 50;

/// What bounds a device's memory: its budget in bytes and the most tensors it holds.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DeviceLimits {
    /// Bytes of tensors (with their overhead), transfers in flight and copies being sent.
    pub(crate) memory: Option<u64>,
    /// Registered tensors.
    pub(crate) tensors: Option<u64>,
}

/// A device's memory budget: bytes registered (each tensor with its [`TENSOR_OVERHEAD`]), bytes
/// reserved for transfers in flight, and host copies read out of it for sending; and the number
/// of tensors it may hold.
///
/// Invariant: `used <= limit`, `sending <= sending_limit` (a share of `limit`, and counted in
/// `used` too) and `tensors <= max_tensors` at every instant, whatever the interleaving: each is
/// claimed by compare-and-swap before the memory it stands for exists, and given back only when
/// it is gone (its reservation dropped).
#[derive(Debug)]
pub(crate) struct Budget {
    device: u32,
    limit: Option<u64>,
    sending_limit: Option<u64>,
    max_tensors: Option<u64>,
    used: AtomicU64,
    sending: AtomicU64,
    tensors: AtomicU64,
}

impl Budget {
    pub(super) fn new(device: u32, limits: DeviceLimits) -> Self {
        Self {
            device,
            limit: limits.memory,
            sending_limit: limits
                .memory
                .map(|limit| share(limit, SENDING_SHARE_PERCENT)),
            max_tensors: limits.tensors,
            used: AtomicU64::new(0),
            sending: AtomicU64::new(0),
            tensors: AtomicU64::new(0),
        }
    }

    /// Claims room for a tensor of `bytes` (with its overhead), or says what is short. Claimed
    /// before a single byte is received, so many clients together cannot push a device past
    /// its budget. A tensor that may not replace another ([`IfExists::Refuse`]) is refused at
    /// once by a device already at its tensor cap (the slot itself is claimed when the tensor
    /// is registered under a new name).
    pub(crate) fn reserve_tensor(
        self: &Arc<Self>,
        bytes: u64,
        existing: IfExists,
    ) -> Result<Reservation, NodeError> {
        let charged = bytes
            .checked_add(TENSOR_OVERHEAD)
            .ok_or(NodeError::TensorTooLarge {
                bytes,
                limit: u64::MAX - TENSOR_OVERHEAD,
            })?;
        if existing == IfExists::Refuse
            && let Some(limit) = self.max_tensors
            && self.tensors.load(Ordering::Acquire) >= limit
        {
            return Err(self.too_many_tensors());
        }
        self.reserve_copy(charged)
    }

    /// One of the device's tensor slots, for a tensor registered under a new name; held by the
    /// registered tensor.
    pub(super) fn claim_slot(self: &Arc<Self>) -> Result<TensorSlot, NodeError> {
        claim(&self.tensors, 1, self.max_tensors).map_err(|_| self.too_many_tensors())?;
        Ok(TensorSlot {
            budget: self.clone(),
        })
    }

    fn too_many_tensors(&self) -> NodeError {
        NodeError::TooManyTensors {
            device: self.device,
            limit: self.max_tensors.unwrap_or(u64::MAX),
        }
    }

    /// Claims room for a host copy of `bytes` read out of the device (to send, or to hand to
    /// another device), held for as long as the copy lives.
    pub(crate) fn reserve_copy(self: &Arc<Self>, bytes: u64) -> Result<Reservation, NodeError> {
        self.claim_bytes(bytes)?;
        Ok(Reservation {
            budget: self.clone(),
            bytes,
            sending: false,
        })
    }

    /// Claims room for a host copy of `bytes` made to send to a peer, who decides how long it
    /// lives (a reader that stalls holds it until its payload deadline): within the budget and
    /// within the share of it such copies may hold together ([`SENDING_SHARE_PERCENT`]), so that
    /// readers cannot take the room writers need. Past that share the reader is told to try
    /// again (`Busy`); a writer is never refused for copies being sent beyond it.
    pub(crate) fn reserve_sending(self: &Arc<Self>, bytes: u64) -> Result<Reservation, NodeError> {
        // The budget first: a copy that could never fit it is refused as over budget, not as
        // one to try again.
        self.claim_bytes(bytes)?;
        if let Err(sending) = claim(&self.sending, bytes, self.sending_limit) {
            self.used.fetch_sub(bytes, Ordering::AcqRel);
            return Err(NodeError::SendingShareFull {
                device: self.device,
                bytes,
                sending,
                limit: self.sending_limit.unwrap_or(u64::MAX),
            });
        }
        Ok(Reservation {
            budget: self.clone(),
            bytes,
            sending: true,
        })
    }

    fn claim_bytes(&self, bytes: u64) -> Result<(), NodeError> {
        claim(&self.used, bytes, self.limit).map_err(|used| NodeError::OverBudget {
            device: self.device,
            bytes,
            available: self.limit.map_or(u64::MAX, |l| l.saturating_sub(used)),
            limit: self.limit.unwrap_or(u64::MAX),
        })
    }

    /// The budget, if any.
    pub(crate) fn limit(&self) -> Option<u64> {
        self.limit
    }

    /// Bytes claimed now: registered tensors with their overhead, transfers in flight and host
    /// copies being sent.
    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

/// `percent` of `limit`, rounded down, without overflow.
fn share(limit: u64, percent: u64) -> u64 {
    let share = u128::from(limit) * u128::from(percent) / 100;
    u64::try_from(share).unwrap_or(u64::MAX)
}

/// Adds `amount` to `counter` unless that would pass `limit` (or overflow); on refusal, the
/// counter's value seen.
fn claim(counter: &AtomicU64, amount: u64, limit: Option<u64>) -> Result<(), u64> {
    let mut now = counter.load(Ordering::Relaxed);
    loop {
        let next = now
            .checked_add(amount)
            .filter(|&next| limit.is_none_or(|limit| next <= limit))
            .ok_or(now)?;
        match counter.compare_exchange_weak(now, next, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return Ok(()),
            Err(seen) => now = seen,
        }
    }
}

/// Room claimed from a [`Budget`]; given back when dropped (a failed transfer, a removed tensor,
/// a send finished).
#[derive(Debug)]
pub(crate) struct Reservation {
    budget: Arc<Budget>,
    bytes: u64,
    /// Counted in the share of copies being sent too.
    sending: bool,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.sending {
            self.budget.sending.fetch_sub(self.bytes, Ordering::AcqRel);
        }
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// One of a device's tensor slots ([`DeviceLimits::tensors`]), held by a registered tensor: a
/// tensor that replaces another under its name takes the other's slot over, so a device at its
/// cap still accepts overwrites.
#[derive(Debug)]
pub(super) struct TensorSlot {
    budget: Arc<Budget>,
}

impl Drop for TensorSlot {
    fn drop(&mut self) {
        self.budget.tensors.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Threads racing to claim tensors, copies and copies to send, and to give them back, in a
    /// random order: at every instant the budget and the sending share hold, every refusal is
    /// one the counters explain, and everything comes back.
    #[test]
    fn racing_claims_never_pass_the_budget_or_the_sending_share() {
        const LIMIT: u64 = 100_000;
        let budget = Arc::new(Budget::new(
            0,
            DeviceLimits {
                memory: Some(LIMIT),
                tensors: None,
            },
        ));
        let sending_limit = share(LIMIT, SENDING_SHARE_PERCENT);
        std::thread::scope(|scope| {
            for seed in 0..4u64 {
                let budget = &budget;
                scope.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                    let mut held = Vec::new();
                    for _ in 0..20_000 {
                        let bytes = rng.random_range(1..20_000);
                        let claimed = match rng.random_range(0..4) {
                            0 => budget.reserve_sending(bytes),
                            1 => budget.reserve_copy(bytes),
                            2 => budget.reserve_tensor(bytes, IfExists::Replace),
                            _ => {
                                if !held.is_empty() {
                                    held.swap_remove(rng.random_range(0..held.len()));
                                }
                                continue;
                            }
                        };
                        match claimed {
                            Ok(reservation) => held.push(reservation),
                            Err(NodeError::OverBudget { .. })
                            | Err(NodeError::SendingShareFull { .. })
                            | Err(NodeError::TensorTooLarge { .. }) => {}
                            Err(other) => panic!("unexpected refusal: {other}"),
                        }
                        let (used, sending) = (
                            budget.used.load(Ordering::Acquire),
                            budget.sending.load(Ordering::Acquire),
                        );
                        assert!(used <= LIMIT, "{used} used");
                        assert!(sending <= sending_limit, "{sending} sending");
                    }
                });
            }
        });
        assert_eq!(budget.used(), 0);
        assert_eq!(budget.sending.load(Ordering::Acquire), 0);
    }
}
