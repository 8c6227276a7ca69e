//! A log line per kind of refusal, bounded in rate: one line per [`INTERVAL`], carrying how many
//! refusals went unlogged since the last. A peer that is refused over and over (guessing tokens,
//! flooding sockets, sending garbage) is refused every time, but cannot fill the node's log or
//! disk: every line a connection can cause before its hello goes through one of these, and so
//! does every line a welcomed client can cause per request by failing it.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferry_proto::Untrusted;

/// The shortest time between two log lines of one [`RefusalLog`].
pub const INTERVAL: Duration = Duration::from_secs(1);

/// A log of refusals bounded in rate: one line per interval, carrying how many went unlogged.
pub struct RefusalLog {
    /// Where the refusal happened (the hello's token, the TLS handshake, the accept).
    stage: &'static str,
    /// What the line says.
    message: &'static str,
    /// When the last line was written: milliseconds since the process's first refusal, plus one;
    /// 0 for never.
    last_ms: AtomicU64,
    /// Refusals since the last line.
    unlogged: AtomicU64,
}

impl RefusalLog {
    /// A log of refusals at `stage`, each line saying `message`, that has written nothing yet.
    pub const fn new(stage: &'static str, message: &'static str) -> Self {
        RefusalLog {
            stage,
            message,
            last_ms: AtomicU64::new(0),
            unlogged: AtomicU64::new(0),
        }
    }

    /// Notes one refusal of `peer`, with `detail` (what it called itself, or why its
    /// certificate failed; escaped, as the peer chose it): logged if none was this interval.
    pub fn note(&self, peer: &str, detail: &str) {
        self.note_of(Some(peer), detail);
    }

    /// Notes one refused or failed request, with `detail` (escaped and truncated, as for
    /// [`note`](Self::note)), where the request's span names the peer.
    pub fn note_in_request(&self, detail: &str) {
        self.note_of(None, detail);
    }

    fn note_of(&self, peer: Option<&str>, detail: &str) {
        static EPOCH: OnceLock<Instant> = OnceLock::new();
        let now = EPOCH
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_millis() as u64
            + 1;
        let last = self.last_ms.load(Ordering::Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= INTERVAL.as_millis() as u64;
        // One thread wins the line for this interval; the others count.
        if due
            && self
                .last_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let unlogged = self.unlogged.swap(0, Ordering::Relaxed);
            match peer {
                Some(peer) => tracing::warn!(
                    peer = %peer,
                    stage = self.stage,
                    detail = %Untrusted(detail),
                    refused_since_last_line = unlogged,
                    "{}",
                    self.message
                ),
                None => tracing::warn!(
                    stage = self.stage,
                    detail = %Untrusted(detail),
                    refused_since_last_line = unlogged,
                    "{}",
                    self.message
                ),
            }
        } else {
            self.unlogged.fetch_add(1, Ordering::Relaxed);
        }
    }
}
