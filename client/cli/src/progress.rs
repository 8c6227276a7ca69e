//! The progress bar of large transfers (on a terminal only).

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// Transfers over this many bytes show a progress bar (when stderr is a terminal).
const PROGRESS_THRESHOLD: u64 = 64 << 20;

pub(crate) fn progress(total: u64) -> Option<ProgressBar> {
    if total <= PROGRESS_THRESHOLD || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(total);
    if let Ok(style) =
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} {eta}")
    {
        bar.set_style(style);
    }
    Some(bar)
}
