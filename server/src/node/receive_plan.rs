//! Which receive pool a node makes at start: a pure plan from the configuration, the devices and
//! the machine's memory ([`plan`]), then the one call that reserves it ([`reserve`]).
//!
//! The plan is what `ferry-server` and an embedded [`Node`](crate::Node) both get from
//! [`ReceiveBuffers::Elastic`] (the default): new memory costs the kernel the zeroing of every
//! page, more than the network copy into it, so a node keeps receive memory ready (touched)
//! before tensors arrive, and a fresh node that holds tensors in host memory makes a quarter of
//! its pool ready for a first model.

use std::time::Duration;

use ferry_backend::DeviceSpec;
use ferry_memory::Pool;
use ferry_memory::pool::{AtStart, Readiness, SpareCheck, Touching};

use crate::node::{ReadyMemory, ReceiveBuffers};

/// What an elastic pool keeps ready unless told otherwise.
pub const DEFAULT_READY: u64 = 256 << 20;
/// What an elastic pool keeps ready ahead of the receives while tensors arrive: enough that a
/// receive rarely waits for a page, little enough that the last tensor leaves little touched for
/// nothing.
const AHEAD: usize = 64 << 20;
/// How long without a receive before an elastic pool gives its ready memory back to the idle
/// amount.
const IDLE_AFTER: Duration = Duration::from_secs(30);
/// How long a freshly started node keeps its start amount ready for a first tensor.
const START_KEPT_FOR: Duration = Duration::from_secs(600);

/// The receive pool a node makes at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PoolPlan {
    /// None: receives go to new (or recycled) memory, a shared-memory region, or a pool the
    /// caller reserved itself.
    Nothing,
    /// This many bytes reserved and touched at start, kept.
    Reserved(usize),
    /// An elastic pool of `capacity` bytes of address space, `readiness` of it kept ready.
    Elastic {
        /// Address space reserved; what is resident is what is drawn plus what is kept ready.
        capacity: usize,
        /// What is kept ready, and when.
        readiness: Readiness,
    },
}

/// Why a node's receive buffers cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReceivePlanError {
    /// A reserved pool larger than this machine can address.
    #[error("a receive pool of {0} bytes is larger than this machine's memory")]
    TooLarge(u64),
}

/// Whether any of `devices` draws receive buffers from a pool: Flex devices keep them as their
/// tensors' memory, GPU devices stage through them; NdArray takes only plain allocations over
/// without a copy.
fn draws_from_a_pool(devices: &[DeviceSpec]) -> bool {
    devices.iter().any(|d| !matches!(d, DeviceSpec::NdArray))
}

/// Whether any of `devices` keeps its tensors in the pool's buffers (Flex), rather than staging
/// through them (GPU).
fn holds_tensors_in_the_pool(devices: &[DeviceSpec]) -> bool {
    devices.iter().any(|d| matches!(d, DeviceSpec::Flex))
}

/// The pool `buffers` asks for on a node hosting `devices` with a per-device `memory_limit`, on
/// a machine of `machine_bytes` of memory. An elastic pool spans up to the memory limit or half
/// the machine; it keeps [`DEFAULT_READY`] (or what [`ReadyMemory::Kept`] says) ready, and a node
/// with a Flex device and no amount given makes a quarter of the pool ready at start for its
/// first tensors (a model), until the first arrives or for 10 minutes, while half the machine's
/// memory is free.
pub(crate) fn plan(
    buffers: &ReceiveBuffers,
    devices: &[DeviceSpec],
    memory_limit: Option<u64>,
    machine_bytes: u64,
) -> Result<PoolPlan, ReceivePlanError> {
    match buffers {
        ReceiveBuffers::Fresh | ReceiveBuffers::Pool(_) | ReceiveBuffers::Shareable { .. } => {
            Ok(PoolPlan::Nothing)
        }
        ReceiveBuffers::Reserved(0) => Ok(PoolPlan::Nothing),
        ReceiveBuffers::Reserved(bytes) => usize::try_from(*bytes)
            .map(PoolPlan::Reserved)
            .map_err(|_| ReceivePlanError::TooLarge(*bytes)),
        ReceiveBuffers::Elastic(_) if !draws_from_a_pool(devices) => Ok(PoolPlan::Nothing),
        ReceiveBuffers::Elastic(ready) => {
            let half = machine_bytes / 2;
            let limit = memory_limit.map_or(half, |m| m.min(half));
            let capacity = usize::try_from(limit).unwrap_or(usize::MAX);
            let asked = match ready {
                ReadyMemory::ForAModel => DEFAULT_READY,
                ReadyMemory::Kept(bytes) => *bytes,
            };
            let idle = usize::try_from(asked).unwrap_or(usize::MAX).min(capacity);
            // A GPU device's staging is reused tensor after tensor: the idle amount serves it.
            let at_start = match ready {
                ReadyMemory::ForAModel if holds_tensors_in_the_pool(devices) => AtStart {
                    bytes: capacity / 4,
                    kept_for: START_KEPT_FOR,
                    spare: SpareCheck::HalfFree,
                },
                _ => AtStart::IDLE,
            };
            Ok(PoolPlan::Elastic {
                capacity,
                readiness: Readiness {
                    idle,
                    ahead: AHEAD.min(capacity),
                    idle_after: IDLE_AFTER,
                    touching: Touching::InIdleTime,
                    at_start,
                },
            })
        }
    }
}

/// This machine's memory, in bytes.
pub(crate) fn machine_bytes() -> u64 {
    let machine = rustix::system::sysinfo();
    u64::from(machine.mem_unit).saturating_mul(machine.totalram)
}

/// Makes the pool `plan` says, logging what it took.
pub(crate) fn reserve(plan: PoolPlan) -> std::io::Result<Option<Pool>> {
    let started = std::time::Instant::now();
    match plan {
        PoolPlan::Nothing => Ok(None),
        PoolPlan::Reserved(bytes) => {
            let pool = Pool::reserve(bytes).map_err(std::io::Error::other)?;
            tracing::info!(
                bytes = pool.capacity(),
                ms = started.elapsed().as_millis() as u64,
                "receive pool reserved and touched"
            );
            Ok(Some(pool))
        }
        PoolPlan::Elastic {
            capacity,
            readiness,
        } => {
            let pool = Pool::elastic(capacity, readiness).map_err(std::io::Error::other)?;
            tracing::info!(
                bytes = pool.capacity(),
                ready_at_start = readiness.at_start.bytes.max(readiness.idle),
                ready_idle = readiness.idle,
                ready_ahead = readiness.ahead,
                "elastic receive pool reserved; making memory ready in the background"
            );
            Ok(Some(pool))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn spec(s: &str) -> DeviceSpec {
        s.parse().unwrap()
    }

    fn elastic(ready: ReadyMemory) -> ReceiveBuffers {
        ReceiveBuffers::Elastic(ready)
    }

    /// Receive buffers, devices, memory limit -> (capacity, idle, start amount) of an elastic
    /// plan, or none.
    type Case = (
        ReceiveBuffers,
        Vec<DeviceSpec>,
        Option<u64>,
        Option<(u64, u64, u64)>,
    );

    /// (buffers, devices, memory limit, machine) -> (capacity, idle, start amount) of an
    /// elastic plan, or none.
    #[test]
    fn the_plan_follows_the_devices_the_budget_and_the_machine() {
        let flex = || vec![spec("flex"), spec("flex")];
        let cases: Vec<Case> = vec![
            // The default on a 24 GiB machine: half of it, 256 MiB idle, a quarter at start.
            (
                ReceiveBuffers::default(),
                flex(),
                None,
                Some((12 * GIB, 256 << 20, 3 * GIB)),
            ),
            // A budget below half the machine bounds it.
            (
                ReceiveBuffers::default(),
                flex(),
                Some(2 * GIB),
                Some((2 * GIB, 256 << 20, GIB / 2)),
            ),
            // A budget above half the machine does not raise it.
            (
                ReceiveBuffers::default(),
                flex(),
                Some(100 * GIB),
                Some((12 * GIB, 256 << 20, 3 * GIB)),
            ),
            // An amount given: kept from the start, no start amount.
            (
                elastic(ReadyMemory::Kept(2 * GIB)),
                flex(),
                None,
                Some((12 * GIB, 2 * GIB, 0)),
            ),
            // An amount above the pool: the pool's size.
            (
                elastic(ReadyMemory::Kept(8 * GIB)),
                flex(),
                Some(GIB),
                Some((GIB, GIB, 0)),
            ),
            // A GPU stages through the pool: the idle amount only.
            (
                ReceiveBuffers::default(),
                vec![spec("gl:cpu")],
                None,
                Some((12 * GIB, 256 << 20, 0)),
            ),
            (
                ReceiveBuffers::default(),
                vec![spec("vulkan:0"), spec("flex")],
                None,
                Some((12 * GIB, 256 << 20, 3 * GIB)),
            ),
            // NdArray alone draws from no pool.
            (
                ReceiveBuffers::default(),
                vec![spec("ndarray"), spec("ndarray")],
                None,
                None,
            ),
            (ReceiveBuffers::Fresh, flex(), None, None),
            (ReceiveBuffers::Reserved(0), flex(), None, None),
            (
                ReceiveBuffers::Shareable { min_bytes: 1 },
                flex(),
                None,
                None,
            ),
        ];
        for (buffers, devices, limit, expected) in cases {
            let got = match plan(&buffers, &devices, limit, 24 * GIB).unwrap() {
                PoolPlan::Nothing => None,
                PoolPlan::Elastic {
                    capacity,
                    readiness,
                } => {
                    assert_eq!(readiness.touching, Touching::InIdleTime);
                    Some((
                        capacity as u64,
                        readiness.idle as u64,
                        readiness.at_start.bytes as u64,
                    ))
                }
                other => panic!("{other:?}"),
            };
            assert_eq!(got, expected, "{buffers:?} on {devices:?} under {limit:?}");
        }
    }

    #[test]
    fn a_reserved_pool_is_reserved_as_asked() {
        assert_eq!(
            plan(
                &ReceiveBuffers::Reserved(GIB),
                &[spec("ndarray")],
                None,
                8 * GIB
            ),
            Ok(PoolPlan::Reserved(GIB as usize))
        );
    }

    #[test]
    fn the_default_is_an_elastic_pool_ready_for_a_model() {
        assert!(matches!(
            ReceiveBuffers::default(),
            ReceiveBuffers::Elastic(ReadyMemory::ForAModel)
        ));
    }
}
