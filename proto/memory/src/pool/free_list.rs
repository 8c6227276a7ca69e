//! The pool's free ranges: the ready and the untouched list ([`FreeList`], best-fit and
//! coalesced), what the background threads hold meanwhile ([`Free`]), and which end of a list
//! they take from ([`Side`]).

use std::collections::BTreeMap;
use std::time::Instant;

use super::GRANULE;

/// The free ranges: ready (touched) and untouched, and when a buffer was last drawn.
#[derive(Debug)]
pub(super) struct Free {
    pub(super) ready: FreeList,
    pub(super) untouched: FreeList,
    /// Bytes the touching thread took out of the untouched list, not yet listed ready.
    pub(super) touching: usize,
    /// Bytes the releasing thread took out of the ready list, not yet listed untouched.
    pub(super) releasing: usize,
    pub(super) last_take: Option<Instant>,
}

/// Free ranges by offset (offset -> length), coalesced: no two touch.
#[derive(Debug, Default)]
pub(super) struct FreeList {
    ranges: BTreeMap<usize, usize>,
    pub(super) free: usize,
}

impl FreeList {
    /// The smallest free range that holds `len` bytes, split from its start.
    pub(super) fn take(&mut self, len: usize) -> Option<usize> {
        let (&offset, &range) = self
            .ranges
            .iter()
            .filter(|(_, r)| **r >= len)
            .min_by_key(|(_, r)| **r)?;
        self.ranges.remove(&offset);
        if range > len {
            self.ranges.insert(offset + len, range - len);
        }
        self.free -= len;
        Some(offset)
    }

    /// Gives `[offset, offset + len)` back, merged with its free neighbours.
    pub(super) fn give(&mut self, mut offset: usize, mut len: usize) {
        // Whole granules only: a range edge inside a page would let advice on a free range
        // (which the kernel applies to whole pages) reach a neighbouring buffer.
        debug_assert!(offset.is_multiple_of(GRANULE) && len.is_multiple_of(GRANULE));
        self.free += len;
        if let Some((&before, &before_len)) = self.ranges.range(..offset).next_back()
            && before + before_len == offset
        {
            self.ranges.remove(&before);
            offset = before;
            len += before_len;
        }
        if let Some(after_len) = self.ranges.remove(&(offset + len)) {
            len += after_len;
        }
        self.ranges.insert(offset, len);
    }

    pub(super) fn largest(&self) -> usize {
        self.ranges.values().copied().max().unwrap_or(0)
    }

    /// Up to `len` bytes (granule multiples) from the start of the lowest free range, or from
    /// the end of the highest: `(offset, bytes)`.
    pub(super) fn take_piece(&mut self, len: usize, side: Side) -> Option<(usize, usize)> {
        debug_assert_eq!(len % GRANULE, 0);
        if len == 0 {
            return None;
        }
        let (&offset, &range) = match side {
            Side::Lowest => self.ranges.iter().next()?,
            Side::Highest => self.ranges.iter().next_back()?,
        };
        let piece = range.min(len);
        self.ranges.remove(&offset);
        self.free -= piece;
        let (taken, rest) = match side {
            Side::Lowest => (offset, offset + piece),
            Side::Highest => (offset + range - piece, offset),
        };
        if range > piece {
            self.ranges.insert(rest, range - piece);
        }
        Some((taken, piece))
    }
}

/// Which end of a free list the background thread takes a piece from: it touches upward from
/// the lowest untouched range and releases downward from the highest ready one, so that ready
/// memory gathers at the mapping's start.
#[derive(Clone, Copy)]
pub(super) enum Side {
    Lowest,
    Highest,
}
