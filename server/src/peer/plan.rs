//! A pull's decisions, as pure functions of what it knows: what an attempt asks its source for,
//! how the answer comes in (whole or in stripes), how many helper connections a striped pull
//! opens, and whether a failure is retried (after what wait) or ends the pull (when its content
//! hash is checked is `ferry_io::hash_plan`'s). [`Pull`](super::pull::Pull) and the stripe fetchers carry them out; nothing
//! here does I/O.

use std::ops::Range;
use std::time::Duration;

use ferry_proto::message::FETCH_RANGE_MINOR;

use crate::node::{PullConfig, Striping};

/// What an attempt asks its source for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Request {
    /// The whole tensor from its first byte: nothing admitted yet.
    Whole,
    /// The first `len` bytes of the content hash's input only: nothing admitted yet, from a
    /// source that answers in parts. A tensor that fits the stripe comes whole, a larger one over
    /// several connections from there on.
    FirstStripe {
        /// The stripe length.
        len: u64,
    },
    /// The rest of a tensor an earlier attempt admitted, from payload byte `from` on (which may
    /// be 0: that attempt admitted it and dropped before its first byte).
    Resume {
        /// The bytes the receiver holds.
        from: u64,
    },
}

/// What a connection's hello said of its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Source {
    /// The source's protocol minor: [`FETCH_RANGE_MINOR`] and later answer in parts.
    pub(super) node_minor: u16,
    /// Whether the link passes payloads in shared memory (a peer of this host): one region
    /// beats any number of connections.
    pub(super) shared_memory: bool,
}

/// What the next attempt asks for: the rest where the receiver holds `received` bytes from
/// earlier attempts (`None` before any admitted the tensor), else the first stripe where
/// `striping` spreads and `source` can answer in parts over sockets, else the whole tensor.
pub(super) fn request(received: Option<u64>, striping: Striping, source: Source) -> Request {
    if let Some(from) = received {
        return Request::Resume { from };
    }
    if striping.spreads() && source.node_minor >= FETCH_RANGE_MINOR && !source.shared_memory {
        return Request::FirstStripe {
            len: striping.stripe_len().get(),
        };
    }
    Request::Whole
}

/// How the bytes that follow an answer come in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Receive {
    /// Every byte still due follows on this connection.
    Payload,
    /// The source answered the first stripe only: the rest comes over several connections.
    Stripes,
}

/// How the bytes `answered` (payload offsets) of a tensor of `byte_len` bytes come in.
pub(super) fn receive(answered: &Range<u64>, byte_len: u64) -> Receive {
    if answered.end < byte_len {
        Receive::Stripes
    } else {
        Receive::Payload
    }
}

/// How many helper connections a striped pull opens beside its own, `waiting` stripes left for
/// at most `connections` in all: never one more than there are stripes for it.
pub(super) fn helper_connections(connections: usize, waiting: usize) -> usize {
    connections.saturating_sub(1).min(waiting.saturating_sub(1))
}

/// How an attempt failed: `W` says why a transient failure happened, `E` is the error a fatal
/// one fails the pull with.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Failure<W, E> {
    /// The connection dropped, closed, went silent or the source was busy: worth reconnecting
    /// and resuming.
    Transient(W),
    /// Anything else: no retry mends it.
    Fatal(E),
}

/// What follows a failed attempt.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum AfterFailure<W, E> {
    /// Reconnect after `wait`: reconnection number `attempt` (from 1).
    Retry {
        /// The reconnections made once this one is.
        attempt: u32,
        /// The backoff before it.
        wait: Duration,
        /// Why the attempt failed.
        why: W,
    },
    /// A transient failure with every retry spent: the pull fails, `retries` reconnections made.
    GiveUp {
        /// The reconnections made.
        retries: u32,
        /// Why the last attempt failed.
        why: W,
    },
    /// A fatal failure: the pull fails with its error.
    Fail(E),
}

/// The longest wait between two reconnections.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// The wait before reconnection number `attempt` (from 1): `first`, doubled with each further
/// one, at most [`MAX_BACKOFF`].
pub(super) fn backoff(first: Duration, attempt: u32) -> Duration {
    let doubling = 1u32 << attempt.saturating_sub(1).min(16);
    first.saturating_mul(doubling).min(MAX_BACKOFF)
}

/// How often and after what waits a pull, or one of its stripe connections, reconnects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RetryPolicy {
    /// The reconnections allowed after transient failures.
    pub(super) retries: u32,
    /// The wait before the first; it doubles with each further one.
    pub(super) first_backoff: Duration,
}

/// A reconnection to make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Retry {
    /// Its number (from 1): the reconnections made once it is.
    pub(super) attempt: u32,
    /// The backoff before it.
    pub(super) wait: Duration,
}

impl RetryPolicy {
    /// The policy a node's pull configuration sets.
    pub(super) fn of(pulls: &PullConfig) -> RetryPolicy {
        RetryPolicy {
            retries: pulls.retries,
            first_backoff: pulls.retry_backoff,
        }
    }

    /// The reconnection after `made` of them, or `None` once every retry is spent.
    pub(super) fn retry(&self, made: u32) -> Option<Retry> {
        (made < self.retries).then(|| {
            let attempt = made + 1;
            Retry {
                attempt,
                wait: backoff(self.first_backoff, attempt),
            }
        })
    }

    /// What follows an attempt that failed so, `made` reconnections into the pull.
    pub(super) fn after<W, E>(&self, failure: Failure<W, E>, made: u32) -> AfterFailure<W, E> {
        match failure {
            Failure::Fatal(error) => AfterFailure::Fail(error),
            Failure::Transient(why) => match self.retry(made) {
                Some(Retry { attempt, wait }) => AfterFailure::Retry { attempt, wait, why },
                None => AfterFailure::GiveUp { retries: made, why },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use ferry_proto::stripes::StripeLen;

    use super::*;

    const MIB: u64 = 1 << 20;

    fn striping(connections: usize) -> Striping {
        Striping::new(connections, StripeLen::DEFAULT)
    }

    fn source(node_minor: u16, shared_memory: bool) -> Source {
        Source {
            node_minor,
            shared_memory,
        }
    }

    #[test]
    fn request_table() {
        let first = Request::FirstStripe {
            len: StripeLen::DEFAULT.get(),
        };
        let old = FETCH_RANGE_MINOR - 1;
        let new = FETCH_RANGE_MINOR;
        // received, connections, source minor, shared memory -> request
        let table = [
            // Nothing admitted yet: the first stripe where striping spreads and the source
            // answers in parts over sockets, else the whole tensor.
            (None, 4, new, false, first),
            (None, 4, new + 1, false, first),
            (None, 2, new, false, first),
            (None, 1, new, false, Request::Whole),
            (None, 4, old, false, Request::Whole),
            (None, 4, new, true, Request::Whole),
            (None, 1, old, true, Request::Whole),
            // Admitted by an earlier attempt: resumed where it stopped, never striped anew.
            (Some(0), 4, new, false, Request::Resume { from: 0 }),
            (
                Some(5 * MIB),
                4,
                new,
                false,
                Request::Resume { from: 5 * MIB },
            ),
            (Some(7), 1, old, true, Request::Resume { from: 7 }),
        ];
        for (received, connections, minor, shm, want) in table {
            let got = request(received, striping(connections), source(minor, shm));
            assert_eq!(
                got, want,
                "received {received:?}, {connections} connections, minor {minor}, shm {shm}"
            );
        }
        let short = Striping::new(3, StripeLen::new(MIB).expect("a valid stripe length"));
        assert_eq!(
            request(None, short, source(new, false)),
            Request::FirstStripe { len: MIB }
        );
    }

    #[test]
    fn receive_table() {
        // answered, byte_len -> how the rest comes
        let table = [
            (0..16 * MIB, 40 * MIB, Receive::Stripes),
            (0..40 * MIB - 1, 40 * MIB, Receive::Stripes),
            (0..40 * MIB, 40 * MIB, Receive::Payload),
            (0..10, 10, Receive::Payload),
            (0..0, 0, Receive::Payload),
            (3..10, 10, Receive::Payload),
        ];
        for (answered, byte_len, want) in table {
            assert_eq!(
                receive(&answered, byte_len),
                want,
                "{answered:?} of {byte_len}"
            );
        }
    }

    #[test]
    fn helper_table() {
        // connections, stripes waiting -> helpers
        let table = [
            (1, 10, 0),
            (4, 10, 3),
            (4, 4, 3),
            (4, 3, 2),
            (4, 2, 1),
            (4, 1, 0),
            (4, 0, 0),
            (16, 100, 15),
        ];
        for (connections, waiting, want) in table {
            assert_eq!(
                helper_connections(connections, waiting),
                want,
                "{connections} connections, {waiting} stripes"
            );
        }
    }

    #[test]
    fn backoff_table() {
        let ms = Duration::from_millis;
        // first, attempt -> wait
        let table = [
            (ms(100), 0, ms(100)),
            (ms(100), 1, ms(100)),
            (ms(100), 2, ms(200)),
            (ms(100), 3, ms(400)),
            (ms(100), 9, ms(25_600)),
            (ms(100), 10, MAX_BACKOFF),
            (ms(100), u32::MAX, MAX_BACKOFF),
            (ms(0), 5, ms(0)),
            (Duration::from_secs(60), 1, MAX_BACKOFF),
            (Duration::MAX, 2, MAX_BACKOFF),
        ];
        for (first, attempt, want) in table {
            assert_eq!(
                backoff(first, attempt),
                want,
                "{first:?}, attempt {attempt}"
            );
        }
    }

    #[test]
    fn after_failure_table() {
        let ms = Duration::from_millis;
        let policy = |retries| RetryPolicy {
            retries,
            first_backoff: ms(100),
        };
        let transient = || Failure::<&str, &str>::Transient("dropped");
        let fatal = || Failure::<&str, &str>::Fatal("refused");
        let retry = |attempt, wait| AfterFailure::Retry {
            attempt,
            wait,
            why: "dropped",
        };
        let give_up = |retries| AfterFailure::GiveUp {
            retries,
            why: "dropped",
        };
        // allowed retries, failure, retries made -> what follows
        let table = [
            (3, transient(), 0, retry(1, ms(100))),
            (3, transient(), 1, retry(2, ms(200))),
            (3, transient(), 2, retry(3, ms(400))),
            (3, transient(), 3, give_up(3)),
            (0, transient(), 0, give_up(0)),
            (
                u32::MAX,
                transient(),
                u32::MAX - 1,
                retry(u32::MAX, MAX_BACKOFF),
            ),
            // A fatal failure fails the pull whatever retries are left.
            (3, fatal(), 0, AfterFailure::Fail("refused")),
            (3, fatal(), 2, AfterFailure::Fail("refused")),
            (0, fatal(), 0, AfterFailure::Fail("refused")),
        ];
        for (retries, failure, made, want) in table {
            let what = format!("{failure:?} with {made} of {retries} retries made");
            assert_eq!(policy(retries).after(failure, made), want, "{what}");
        }
    }

    #[test]
    fn retry_follows_the_configuration() {
        let pulls = PullConfig {
            retries: 2,
            retry_backoff: Duration::from_millis(50),
            ..PullConfig::default()
        };
        let policy = RetryPolicy::of(&pulls);
        let retry = |attempt, ms| {
            Some(Retry {
                attempt,
                wait: Duration::from_millis(ms),
            })
        };
        assert_eq!(policy.retry(0), retry(1, 50));
        assert_eq!(policy.retry(1), retry(2, 100));
        assert_eq!(policy.retry(2), None);
    }
}
