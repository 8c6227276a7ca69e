//! One receive buffer cut into disjoint pieces that go to different tasks (each filled by its own
//! connection, on whichever thread runs it), and joined back into the one buffer, with no copy,
//! once every piece is home.

use std::ops::{Deref, DerefMut, Range};
use std::ptr::NonNull;
use std::sync::Arc;

use burn_std::Bytes;

/// The buffer while it is cut: it lives as long as its last piece, and comes back whole only from
/// [`join`](Self::join).
#[derive(Debug)]
pub struct SplitBuffer {
    owner: Arc<Owner>,
    pieces: usize,
}

/// The buffer itself: never touched while a piece lives, except through the pieces' disjoint
/// ranges of its memory.
struct Owner {
    buf: std::cell::UnsafeCell<Bytes>,
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Owner")
    }
}

// SAFETY: `Bytes` is `Send` and `Sync`; the cell's content is reached only by `split` and `join`,
// each of which holds the only handle to the owner at that moment (`split` before any piece
// exists, `join` after `Arc::try_unwrap` proved none is left), and otherwise only through the
// pieces' disjoint ranges, each reached by one piece.
unsafe impl Sync for Owner {}

/// One piece of a [`SplitBuffer`]: the only way to its bytes while the buffer is cut.
pub struct BufferPiece {
    /// Keeps the buffer alive while the piece is.
    owner: Arc<Owner>,
    start: NonNull<u8>,
    range: Range<usize>,
}

// SAFETY: a piece is the only path to its bytes (the ranges are disjoint, and the owner is not
// touched while a piece lives), so moving it to another thread moves sole access with it.
unsafe impl Send for BufferPiece {}
// SAFETY: through `&BufferPiece` only shared reads of its bytes are possible.
unsafe impl Sync for BufferPiece {}

impl std::fmt::Debug for BufferPiece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BufferPiece({:?})", self.range)
    }
}

impl SplitBuffer {
    /// Cuts `buf` at `cuts`, which must tile it: in order, from 0 to its length, none empty.
    /// `Err` gives the buffer back where they do not.
    pub fn split(
        buf: Bytes,
        cuts: &[Range<usize>],
    ) -> Result<(SplitBuffer, Vec<BufferPiece>), Bytes> {
        let mut next = 0;
        for cut in cuts {
            if cut.start != next || cut.end <= cut.start {
                return Err(buf);
            }
            next = cut.end;
        }
        if next != buf.len() || cuts.is_empty() {
            return Err(buf);
        }
        let owner = Arc::new(Owner {
            buf: std::cell::UnsafeCell::new(buf),
        });
        // SAFETY: no piece exists yet and `owner` is the only handle: this is the one access to
        // the buffer until `join`.
        let base = unsafe { (*owner.buf.get()).as_mut_ptr() };
        let pieces = cuts
            .iter()
            .map(|range| BufferPiece {
                owner: Arc::clone(&owner),
                // SAFETY: `range.start < len`, so the pointer is within the allocation (and not
                // null, being derived from the buffer's own non-null pointer plus an offset in it).
                start: unsafe { NonNull::new_unchecked(base.add(range.start)) },
                range: range.clone(),
            })
            .collect();
        Ok((
            SplitBuffer {
                owner,
                pieces: cuts.len(),
            },
            pieces,
        ))
    }

    /// The buffer whole again, given every piece it was cut into; `None` (the buffer freed once
    /// the last piece is dropped) where a piece is missing or belongs to another buffer.
    pub fn join(self, pieces: Vec<BufferPiece>) -> Option<Bytes> {
        let all_mine = pieces.len() == self.pieces
            && pieces.iter().all(|p| Arc::ptr_eq(&p.owner, &self.owner));
        drop(pieces);
        if !all_mine {
            return None;
        }
        Arc::try_unwrap(self.owner)
            .ok()
            .map(|owner| owner.buf.into_inner())
    }
}

impl BufferPiece {
    /// Where the piece lies in the whole buffer.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }
}

impl Deref for BufferPiece {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the range lies in the buffer, which the `Arc` keeps alive; no other piece
        // reaches these bytes, and no `&mut` to them exists while `&self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.start.as_ptr(), self.range.len()) }
    }
}

impl DerefMut for BufferPiece {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference to these bytes.
        unsafe { std::slice::from_raw_parts_mut(self.start.as_ptr(), self.range.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buffer(len: usize) -> Bytes {
        Bytes::from_elems(vec![0u8; len])
    }

    /// Pieces filled on their own threads come back as the one buffer, every byte where its
    /// piece wrote it, at the same address (no copy).
    #[test]
    fn pieces_filled_apart_join_into_the_buffer() {
        let mut buf = buffer(10_000);
        let address = buf.as_mut_ptr() as usize;
        let cuts = [0..1, 1..4096, 4096..9000, 9000..10_000];
        let (split, pieces) = SplitBuffer::split(buf, &cuts).unwrap();
        let filled: Vec<BufferPiece> = pieces
            .into_iter()
            .enumerate()
            .map(|(i, mut piece)| {
                std::thread::spawn(move || {
                    piece.fill(i as u8 + 1);
                    piece
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        let mut whole = split.join(filled).unwrap();
        assert_eq!(whole.as_mut_ptr() as usize, address);
        for (i, cut) in cuts.iter().enumerate() {
            assert!(
                whole[cut.clone()].iter().all(|&b| b == i as u8 + 1),
                "{cut:?}"
            );
        }
    }

    #[test]
    fn cuts_must_tile_the_buffer() {
        for cuts in [
            vec![],
            std::iter::once(0..5).collect(),
            vec![0..5, 6..10],
            vec![0..5, 4..10],
            vec![0..0, 0..10],
            vec![0..10, 10..11],
        ] {
            assert!(SplitBuffer::split(buffer(10), &cuts).is_err(), "{cuts:?}");
        }
    }

    /// A piece missing (still out, or dropped) or another buffer's keeps the buffer from coming
    /// back; it is freed with the last piece.
    #[test]
    fn a_missing_or_foreign_piece_keeps_the_buffer_from_joining() {
        let (split, mut pieces) = SplitBuffer::split(buffer(8), &[0..4, 4..8]).unwrap();
        let out = pieces.pop().unwrap();
        assert!(split.join(pieces).is_none());
        drop(out);

        let (split, mut pieces) = SplitBuffer::split(buffer(8), &[0..4, 4..8]).unwrap();
        let (_other, mut foreign) = SplitBuffer::split(buffer(8), &[0..4, 4..8]).unwrap();
        pieces[1] = foreign.pop().unwrap();
        assert!(split.join(pieces).is_none());
    }
}
