//! Burn calls that fail by panicking, run so that the panic comes back as an error: one bad
//! tensor must never take a device worker, a node or a CLI mid-batch down with it.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;

use thiserror::Error;

/// A call that panicked, with the panic's message.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{message}")]
pub struct Panicked {
    /// What the panic said (`"unknown panic"` when it carried no text).
    pub message: String,
}

thread_local! {
    /// How many [`QuietPanics`] guards this thread holds.
    static QUIET: Cell<u32> = const { Cell::new(0) };
}

/// While it lives, a panic on this thread prints nothing: for code that expects many panics and
/// turns each into an error with [`contained`] (a device probing what its backend holds meets
/// hundreds at start; each would print a message and a backtrace). Any other panic, and every
/// panic on other threads, goes to the hook installed before, as it did.
pub struct QuietPanics(());

impl QuietPanics {
    /// Quiets this thread's panics until the guard drops.
    pub fn enter() -> QuietPanics {
        static INSTALLED: Once = Once::new();
        // Replacing the hook is refused on a thread that is panicking: then nothing is quieted.
        if !std::thread::panicking() {
            INSTALLED.call_once(|| {
                let previous = std::panic::take_hook();
                std::panic::set_hook(Box::new(move |info| {
                    if QUIET.with(Cell::get) == 0 {
                        previous(info);
                    }
                }));
            });
        }
        QUIET.with(|c| c.set(c.get() + 1));
        QuietPanics(())
    }
}

impl Drop for QuietPanics {
    fn drop(&mut self) {
        QUIET.with(|c| c.set(c.get().saturating_sub(1)));
    }
}

/// Runs `f`; a panic under it becomes [`Panicked`] with its message (the process's panic hook
/// still reports it, with its location, unless a [`QuietPanics`] guard is held).
///
/// Nothing `f` touched is used again when it panicked (the callers drop or rebuild it), which is
/// why asserting unwind safety is sound here.
pub fn contained<T>(f: impl FnOnce() -> T) -> Result<T, Panicked> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| Panicked {
        message: payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_comes_back_with_its_message() {
        assert_eq!(contained(|| 7), Ok(7));
        let formatted = contained(|| -> u8 { panic!("bad {}", "dtype") });
        assert_eq!(formatted.unwrap_err().message, "bad dtype");
        let literal = contained(|| -> u8 { panic!("literal") });
        assert_eq!(literal.unwrap_err().message, "literal");
        let opaque = contained(|| -> u8 { std::panic::panic_any(3u32) });
        assert_eq!(opaque.unwrap_err().message, "unknown panic");
    }
}
