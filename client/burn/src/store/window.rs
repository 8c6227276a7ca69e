//! `Window`: a bound on the bytes of host copies in flight between the thread that reads a
//! module's tensors off their device and the threads that send them (one per connection), or
//! between the thread that fetches an apply's tensors ahead and the Applier that draws them.

use std::sync::{Condvar, Mutex, PoisonError};

/// Bytes taken out of a fixed allowance; a take waits until the allowance has room. One
/// tensor larger than the whole allowance is let through alone, so a model always moves.
pub(crate) struct Window {
    limit: u64,
    state: Mutex<State>,
    changed: Condvar,
}

struct State {
    in_flight: u64,
    closed: bool,
}

impl Window {
    pub(crate) fn new(limit: u64) -> Self {
        Self {
            limit,
            state: Mutex::new(State {
                in_flight: 0,
                closed: false,
            }),
            changed: Condvar::new(),
        }
    }

    /// Waits for room for `bytes`; false once the window is closed (a sender stopped).
    pub(crate) fn take(&self, bytes: u64) -> bool {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if state.closed {
                return false;
            }
            let fits = state.in_flight.saturating_add(bytes) <= self.limit;
            if state.in_flight == 0 || fits {
                state.in_flight = state.in_flight.saturating_add(bytes);
                return true;
            }
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Takes room for `bytes` only if there is some now (or nothing is in flight); false
    /// otherwise, and once the window is closed.
    pub(crate) fn try_take(&self, bytes: u64) -> bool {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let fits = state.in_flight.saturating_add(bytes) <= self.limit;
        if state.closed || !(state.in_flight == 0 || fits) {
            return false;
        }
        state.in_flight = state.in_flight.saturating_add(bytes);
        true
    }

    /// Whether the window was closed (a sender left): what takes no room asks only this.
    pub(crate) fn is_closed(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .closed
    }

    /// Gives `bytes` back (their copy was sent and dropped).
    pub(crate) fn give(&self, bytes: u64) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.in_flight = state.in_flight.saturating_sub(bytes);
        self.changed.notify_all();
    }

    /// Wakes and refuses every take to come: a sender stopped.
    pub(crate) fn close(&self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.closed = true;
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::Window;

    #[test]
    fn a_tensor_larger_than_the_window_goes_alone() {
        let window = Window::new(10);
        assert!(window.take(25));
        window.give(25);
        assert!(window.take(6));
        assert!(window.take(4));
        assert!(!window.try_take(1), "full: no room now");
        window.give(4);
        assert!(window.try_take(1));
        window.close();
        assert!(!window.take(1), "a closed window refuses");
        assert!(!window.try_take(0), "a closed window refuses");
    }

    #[test]
    fn a_take_waits_for_room() {
        let window = std::sync::Arc::new(Window::new(10));
        assert!(window.take(8));
        let waiter = {
            let window = window.clone();
            std::thread::spawn(move || window.take(8))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!waiter.is_finished(), "16 bytes do not fit in 10");
        window.give(8);
        assert!(waiter.join().unwrap());
    }
}
