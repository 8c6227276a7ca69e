//! Connections that have not said hello yet, oldest first, each with the address it is counted
//! under. At the connection limit the node closes the oldest of them to make room for a
//! newcomer, and at an address's limit the oldest of that address's, so sockets that never speak
//! cannot keep out a client that does (not even one on the same address, such as another local
//! user on loopback): each holds its slot until the hello deadline at most, and only until
//! someone else needs it once the node or its address is full. A connection is closed only once
//! it has been silent a moment ([`AwaitingHello::new`]'s grace): a client whose hello is on its
//! way is not closed for a newcomer, however fast newcomers come.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

/// The queue of connections waiting for their peer's hello.
#[derive(Debug)]
pub(super) struct AwaitingHello {
    queue: Mutex<VecDeque<Waiting>>,
    next: AtomicU64,
    /// How long a connection has been waiting at least before it is closed to make room.
    grace: Duration,
}

/// One connection in the queue.
#[derive(Debug)]
struct Waiting {
    id: u64,
    /// The address it is counted under (`None`: a Unix socket, counted under none).
    address: Option<IpAddr>,
    /// When it was queued.
    since: Instant,
    evict: oneshot::Sender<()>,
}

/// A connection's place in the queue, left when dropped (its peer said hello, or it ended).
#[derive(Debug)]
pub(super) struct Place {
    queue: Arc<AwaitingHello>,
    id: u64,
    /// Completes when the connection is to close to make room (or the service is gone).
    pub(super) evicted: oneshot::Receiver<()>,
}

impl AwaitingHello {
    /// An empty queue whose connections are closed to make room only once they have waited
    /// `grace` for their hello (closed at once where that is zero).
    pub(super) fn new(grace: Duration) -> Self {
        Self {
            queue: Mutex::new(VecDeque::new()),
            next: AtomicU64::new(0),
            grace,
        }
    }

    /// Tells `waiting` to close, now or once it has waited the grace (if it says hello first,
    /// its place is gone and the word with it).
    fn evict(&self, waiting: Waiting) {
        let at = waiting.since + self.grace;
        if Instant::now() >= at {
            let _ = waiting.evict.send(());
            return;
        }
        tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            let _ = waiting.evict.send(());
        });
    }

    fn queue(&self) -> MutexGuard<'_, VecDeque<Waiting>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a new connection, counted under `address`, last.
    pub(super) fn enter(self: &Arc<Self>, address: Option<IpAddr>) -> Place {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (evict, evicted) = oneshot::channel();
        self.queue().push_back(Waiting {
            id,
            address,
            since: Instant::now(),
            evict,
        });
        Place {
            queue: self.clone(),
            id,
            evicted,
        }
    }

    /// Tells the connection that has waited longest for its hello to close; `false` when none
    /// is waiting.
    pub(super) fn evict_oldest(&self) -> bool {
        // A place whose connection is already gone takes its own entry with it, so the first
        // entry is a live one (or its receiver is being dropped now, which frees a slot anyway).
        let oldest = self.queue().pop_front();
        match oldest {
            Some(waiting) => {
                self.evict(waiting);
                true
            }
            None => false,
        }
    }

    /// Tells the connection counted under `address` that has waited longest for its hello to
    /// close; `false` when none of that address is waiting.
    pub(super) fn evict_oldest_from(&self, address: IpAddr) -> bool {
        let oldest = {
            let mut queue = self.queue();
            let Some(at) = queue.iter().position(|w| w.address == Some(address)) else {
                return false;
            };
            queue.remove(at)
        };
        match oldest {
            Some(waiting) => {
                self.evict(waiting);
                true
            }
            None => false,
        }
    }

    /// How many wait.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.queue().len()
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut queue = self.queue.queue();
        if let Some(at) = queue.iter().position(|w| w.id == self.id) {
            queue.remove(at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_waiting_connection_is_evicted_and_places_leave_when_dropped() {
        let queue = Arc::new(AwaitingHello::new(Duration::ZERO));
        let mut first = queue.enter(None);
        let second = queue.enter(None);
        let mut third = queue.enter(None);
        drop(second);
        assert_eq!(queue.len(), 2);
        assert!(queue.evict_oldest());
        assert_eq!(first.evicted.try_recv(), Ok(()));
        assert!(third.evicted.try_recv().is_err(), "not evicted yet");
        drop(first);
        assert_eq!(queue.len(), 1);
        drop(third);
        assert!(!queue.evict_oldest(), "nobody waits");
    }

    #[test]
    fn at_an_address_limit_the_oldest_waiting_of_that_address_is_evicted() {
        let queue = Arc::new(AwaitingHello::new(Duration::ZERO));
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let mut of_b = queue.enter(Some(b));
        let mut first_of_a = queue.enter(Some(a));
        let mut second_of_a = queue.enter(Some(a));
        let mut unix = queue.enter(None);
        assert!(queue.evict_oldest_from(a));
        assert_eq!(first_of_a.evicted.try_recv(), Ok(()));
        assert!(
            of_b.evicted.try_recv().is_err(),
            "another address keeps its place"
        );
        assert!(
            unix.evicted.try_recv().is_err(),
            "a Unix socket is of no address"
        );
        assert!(second_of_a.evicted.try_recv().is_err(), "not evicted yet");
        drop(second_of_a);
        assert!(!queue.evict_oldest_from(a), "none of that address waits");
        assert_eq!(queue.len(), 2);
    }
}
