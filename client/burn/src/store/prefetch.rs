//! `Prefetch`: an apply's tensors fetched ahead of burn-store's Applier, in the order it draws
//! them, by a thread of their own (pipelined batches over the store's connection), with at most
//! a window of bytes fetched and not yet drawn.
//!
//! A draw takes a tensor that arrived, waits for one on its way, and fetches itself one the
//! thread has not reached (the thread then passes it by). So a draw never waits on room in the
//! window, which only draws make: the thread may stall on a full window (the Applier drew in
//! another order than expected, or skipped a tensor), the draws do not.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use burn_core::tensor::TensorData;
use ferry_proto::TensorKey;

use crate::StoreError;
use crate::store::window::Window;

/// The most tensors one batch asks for: one round trip for all of them, each handed over as it
/// arrives.
const MOST_PER_BATCH: usize = 8;

/// Where each answer of a batch goes as it arrives: its index in the batch, and the tensor or
/// why not.
pub(crate) type Each<'a> = dyn FnMut(usize, Result<TensorData, StoreError>) + 'a;

/// A tensor to fetch ahead: its key, and what it takes of the window.
#[derive(Debug, Clone)]
pub(crate) struct Ahead {
    pub(crate) key: TensorKey,
    pub(crate) bytes: u64,
}

/// Where one tensor is.
enum Slot {
    /// Not asked for yet.
    Queued,
    /// In the batch being fetched.
    InFlight,
    /// Arrived and not drawn: its bytes hold room in the window.
    Arrived(Result<TensorData, StoreError>),
    /// Drawn, taken over by a draw before the thread reached it, or left to its draw after a
    /// batch failed: a draw fetches it itself.
    Left,
}

struct Shared {
    /// Each tensor to fetch ahead, with its bytes.
    slots: Mutex<HashMap<TensorKey, (Slot, u64)>>,
    /// A tensor arrived, or a batch ended.
    changed: Condvar,
    window: Window,
}

impl Shared {
    fn slots(&self) -> MutexGuard<'_, HashMap<TensorKey, (Slot, u64)>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What a draw does about a tensor, decided under the lock.
enum Draw {
    Take(Result<TensorData, StoreError>, u64),
    Wait,
    FetchItself,
}

/// Tensors being fetched ahead of their draws; dropped, it stops the thread (a batch under way
/// is read to its end) and frees what was not drawn.
pub(crate) struct Prefetch {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Prefetch {
    /// Starts fetching `ahead`, in that order, at most `window` bytes of them arrived and not
    /// drawn (one larger tensor alone), through `fetch_each(keys, each)`: one pipelined batch,
    /// each answer handed to `each` as it arrives.
    pub(crate) fn start<F>(ahead: Vec<Ahead>, window: u64, mut fetch_each: F) -> Self
    where
        F: FnMut(&[TensorKey], &mut Each<'_>) -> Result<(), StoreError> + Send + 'static,
    {
        let shared = Arc::new(Shared {
            slots: Mutex::new(
                ahead
                    .iter()
                    .map(|a| (a.key.clone(), (Slot::Queued, a.bytes)))
                    .collect(),
            ),
            changed: Condvar::new(),
            window: Window::new(window),
        });
        let on_thread = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ferry-prefetch".into())
            .spawn(move || {
                let _leave = LeaveOnExit(&on_thread);
                fetch_ahead(&on_thread, &ahead, &mut fetch_each);
            })
            .ok();
        Self { shared, thread }
    }

    /// The tensor under `key` if it was fetched ahead (waiting for it where it is on its way);
    /// `None`: the caller fetches it itself.
    pub(crate) fn take(&self, key: &TensorKey) -> Option<Result<TensorData, StoreError>> {
        let mut slots = self.shared.slots();
        loop {
            let draw = match slots.get_mut(key) {
                None => return None,
                Some((Slot::InFlight, _)) => Draw::Wait,
                Some((slot, bytes)) => match std::mem::replace(slot, Slot::Left) {
                    Slot::Arrived(answer) => Draw::Take(answer, *bytes),
                    // Not reached yet (the thread passes it by now), or left: fetched here.
                    _ => Draw::FetchItself,
                },
            };
            match draw {
                Draw::Take(answer, bytes) => {
                    drop(slots);
                    self.shared.window.give(bytes);
                    return Some(answer);
                }
                Draw::FetchItself => return None,
                Draw::Wait => {
                    slots = self
                        .shared
                        .changed
                        .wait(slots)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        self.shared.window.close();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Leaves whatever the thread had in flight to its draws as the thread ends, however it ends
/// (a panic in a fetch included): no draw waits for a tensor nobody is fetching.
struct LeaveOnExit<'a>(&'a Shared);

impl Drop for LeaveOnExit<'_> {
    fn drop(&mut self) {
        let mut slots = self.0.slots();
        for (slot, _) in slots.values_mut() {
            if matches!(slot, Slot::InFlight) {
                *slot = Slot::Left;
            }
        }
        drop(slots);
        self.0.changed.notify_all();
    }
}

/// The thread: batches of the tensors not yet drawn, in order, each begun once the window has
/// room for its first tensor (and holding only the others there is room for now).
fn fetch_ahead<F>(shared: &Shared, ahead: &[Ahead], fetch_each: &mut F)
where
    F: FnMut(&[TensorKey], &mut Each<'_>) -> Result<(), StoreError>,
{
    let mut next = 0;
    while next < ahead.len() {
        let mut batch: Vec<&Ahead> = Vec::with_capacity(MOST_PER_BATCH);
        while let Some(tensor) = ahead.get(next).filter(|_| batch.len() < MOST_PER_BATCH) {
            let room = if batch.is_empty() {
                shared.window.take(tensor.bytes)
            } else {
                shared.window.try_take(tensor.bytes)
            };
            if !room {
                break;
            }
            next += 1;
            let mut slots = shared.slots();
            match slots.get_mut(&tensor.key) {
                Some((slot @ Slot::Queued, _)) => {
                    *slot = Slot::InFlight;
                    batch.push(tensor);
                }
                // A draw took it over.
                _ => {
                    drop(slots);
                    shared.window.give(tensor.bytes);
                }
            }
        }
        if batch.is_empty() {
            // The window closed (the apply ended), or every tensor left was taken over.
            return;
        }
        let keys: Vec<TensorKey> = batch.iter().map(|t| t.key.clone()).collect();
        let fetched = fetch_each(&keys, &mut |i, answer| {
            if let Some(key) = keys.get(i) {
                let mut slots = shared.slots();
                if let Some((slot, _)) = slots.get_mut(key) {
                    *slot = Slot::Arrived(answer);
                }
                shared.changed.notify_all();
            }
        });
        // A batch that failed: the first tensor it did not bring (the one being read) carries
        // why, to its draw; the others are left to their draws. Nothing more is fetched ahead
        // over a connection that failed.
        let mut why = fetched.err();
        let stop = why.is_some();
        let mut slots = shared.slots();
        let mut freed = 0;
        for tensor in &batch {
            if let Some((slot @ Slot::InFlight, bytes)) = slots.get_mut(&tensor.key) {
                match why.take() {
                    Some(error) => *slot = Slot::Arrived(Err(error)),
                    None => {
                        *slot = Slot::Left;
                        freed += *bytes;
                    }
                }
            }
        }
        drop(slots);
        shared.window.give(freed);
        shared.changed.notify_all();
        if stop {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ahead(n: usize, bytes: u64) -> Vec<Ahead> {
        (0..n)
            .map(|i| Ahead {
                key: TensorKey::new(0, format!("t{i}")),
                bytes,
            })
            .collect()
    }

    fn data(i: usize) -> TensorData {
        TensorData::new(vec![i as f32; 4], [4])
    }

    fn index_of(key: &TensorKey) -> usize {
        key.name[1..].parse().unwrap()
    }

    /// Drawn in the order fetched, once the first batch is in: it comes from the thread, every
    /// batch holds at most the window, and every draw gets its own tensor, fetched ahead or (a
    /// draw that came before the thread reached it) by itself.
    #[test]
    fn tensors_drawn_in_order_come_fetched_ahead_within_the_window() {
        let (batches, batch_in) = std::sync::mpsc::channel();
        let prefetch = Prefetch::start(ahead(40, 16), 64, move |keys, each| {
            assert!(keys.len() <= 4, "at most the window's 64 bytes: {keys:?}");
            for (i, key) in keys.iter().enumerate() {
                each(i, Ok(data(index_of(key))));
            }
            let _ = batches.send(keys.len());
            Ok(())
        });
        assert_eq!(
            batch_in.recv().unwrap(),
            4,
            "the first batch fills the window"
        );
        let mut ahead_of_draw = 0;
        for i in 0..40 {
            let key = TensorKey::new(0, format!("t{i}"));
            let got = match prefetch.take(&key) {
                Some(got) => {
                    ahead_of_draw += 1;
                    got.unwrap()
                }
                None => data(i),
            };
            assert_eq!(got, data(i));
        }
        assert!(ahead_of_draw >= 4, "{ahead_of_draw}");
        assert!(prefetch.take(&TensorKey::new(0, "other")).is_none());
    }

    /// Drawn in another order than fetched, with a window of one tensor: a draw of a tensor the
    /// thread has not reached takes it over (the thread passes it by), and nothing waits
    /// forever.
    #[test]
    fn a_draw_out_of_order_fetches_itself_and_never_waits_on_the_window() {
        let prefetch = Prefetch::start(ahead(10, 16), 16, move |keys, each| {
            for (i, key) in keys.iter().enumerate() {
                each(i, Ok(data(index_of(key))));
            }
            Ok(())
        });
        let mut fetched_here = 0;
        for i in (0..10).rev() {
            let key = TensorKey::new(0, format!("t{i}"));
            match prefetch.take(&key) {
                Some(got) => assert_eq!(got.unwrap(), data(i)),
                None => fetched_here += 1,
            }
        }
        assert!(fetched_here >= 8, "the thread holds one at a time");
        drop(prefetch);
    }

    /// A batch that fails: what it brought is handed to the draws as it came (a refusal too),
    /// the first tensor it did not bring carries why, and the others are left to their draws.
    #[test]
    fn a_failed_batch_leaves_its_tensors_to_their_draws() {
        let (failing, failed) = std::sync::mpsc::channel();
        let prefetch = Prefetch::start(ahead(6, 1), 1 << 20, move |keys, each| {
            each(0, Ok(data(index_of(&keys[0]))));
            let refused = ferry_client::ClientError::OutOfStep;
            each(1, Err(StoreError::Client(refused)));
            let _ = failing.send(());
            Err(StoreError::Client(ferry_client::ClientError::Unexpected(
                "the connection broke".into(),
            )))
        });
        failed.recv().unwrap();
        let take = |i: usize| prefetch.take(&TensorKey::new(0, format!("t{i}")));
        assert_eq!(take(0).unwrap().unwrap(), data(0));
        assert!(matches!(take(1), Some(Err(StoreError::Client(_)))));
        match take(2) {
            Some(Err(e)) => assert!(e.to_string().contains("the connection broke"), "{e}"),
            other => panic!("the batch's own error: {other:?}"),
        }
        for i in 3..6 {
            assert!(take(i).is_none(), "t{i} is its draw's to fetch");
        }
    }

    /// A fetch that panics on the thread: what it had in flight is left to the draws, which do
    /// not wait for it.
    #[test]
    fn a_panicking_fetch_leaves_its_tensors_to_their_draws() {
        let (started, fetching) = std::sync::mpsc::channel();
        let prefetch = Prefetch::start(ahead(3, 1), 1 << 20, move |_, _| {
            let _ = started.send(());
            panic!("a fetch that panics");
        });
        fetching.recv().unwrap();
        for i in 0..3 {
            assert!(prefetch.take(&TensorKey::new(0, format!("t{i}"))).is_none());
        }
    }
}
