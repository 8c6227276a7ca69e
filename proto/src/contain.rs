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
    /// How many [`contained`] calls this thread is inside.
    static CONTAINING: Cell<u32> = const { Cell::new(0) };
}

/// Makes the process's panic hook quiet for a panic that [`contained`] turns into an error (its
/// caller reports the message, as an error, where it matters): a device probing what it holds
/// meets hundreds of them at start, and each would print a message and a backtrace to stderr.
/// Every other panic goes to the hook that was installed before, as it did.
fn quiet_contained_panics() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if CONTAINING.with(Cell::get) == 0 {
                previous(info);
            }
        }));
    });
}

/// Counts the calling thread as inside [`contained`] while it lives.
struct Containing;

impl Containing {
    fn enter() -> Containing {
        CONTAINING.with(|c| c.set(c.get() + 1));
        Containing
    }
}

impl Drop for Containing {
    fn drop(&mut self) {
        CONTAINING.with(|c| c.set(c.get().saturating_sub(1)));
    }
}

/// Runs `f`; a panic under it becomes [`Panicked`] with its message, and prints nothing.
///
/// Nothing `f` touched is used again when it panicked (the callers drop or rebuild it), which is
/// why asserting unwind safety is sound here.
pub fn contained<T>(f: impl FnOnce() -> T) -> Result<T, Panicked> {
    quiet_contained_panics();
    let _inside = Containing::enter();
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
