//! Connections that have not said hello yet, oldest first. At the connection limit the node
//! closes the oldest of them to make room for a newcomer, so sockets that never speak cannot keep
//! out a client that does: each holds its slot until the hello deadline at most, and only until
//! someone else needs it once the node is full.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

/// The queue of connections waiting for their peer's hello.
#[derive(Debug, Default)]
pub(super) struct AwaitingHello {
    queue: Mutex<VecDeque<(u64, oneshot::Sender<()>)>>,
    next: AtomicU64,
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
    fn queue(&self) -> MutexGuard<'_, VecDeque<(u64, oneshot::Sender<()>)>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a new connection, last.
    pub(super) fn enter(self: &Arc<Self>) -> Place {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (evict, evicted) = oneshot::channel();
        self.queue().push_back((id, evict));
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
        match self.queue().pop_front() {
            Some((_, evict)) => {
                let _ = evict.send(());
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
        if let Some(at) = queue.iter().position(|(id, _)| *id == self.id) {
            queue.remove(at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_waiting_connection_is_evicted_and_places_leave_when_dropped() {
        let queue = Arc::new(AwaitingHello::default());
        let mut first = queue.enter();
        let second = queue.enter();
        let mut third = queue.enter();
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
}
