//! Work dealt over several connections (lanes) at once, answered per tensor in order: the one
//! mechanism under copies over lanes (`lanes.rs`) and puts over lanes (`put_lanes.rs`).

use std::future::Future;

use ferry_proto::{TensorInfo, TensorKey};
use futures_util::future::join_all;

use super::ClientError;

/// Deals `items` over the `lanes` still in step (`in_step`): item `i` to the `i % n`th of the
/// `n` used (so each gets large and small tensors alike), every lane's share run by `run` at
/// once, which answers each item of its share in order, or fewer. One answer per item, in
/// order; an item its lane gave no answer for is answered [`ClientError::NoAnswer`]. Where no
/// lane is in step, every item is answered so, with `none_in_step` as the reason.
pub(super) async fn deal<'l, 'i, L: 'l, T, Fut>(
    lanes: impl IntoIterator<Item = &'l mut L>,
    in_step: impl Fn(&L) -> bool,
    items: &'i [T],
    key_of: impl Fn(&T) -> &TensorKey,
    none_in_step: &str,
    run: impl Fn(&'l mut L, Vec<&'i T>) -> Fut,
) -> Vec<Result<TensorInfo, ClientError>>
where
    Fut: Future<Output = Vec<Result<TensorInfo, ClientError>>>,
{
    let mut usable: Vec<&mut L> = lanes.into_iter().filter(|lane| in_step(lane)).collect();
    let n = usable.len().min(items.len());
    usable.truncate(n);
    if n == 0 {
        return items
            .iter()
            .map(|item| no_answer(key_of(item), none_in_step))
            .collect();
    }
    let runs = usable
        .into_iter()
        .enumerate()
        .map(|(lane, on)| run(on, items.iter().skip(lane).step_by(n).collect()));
    in_dealt_order(items, join_all(runs).await, key_of)
}

/// The items dealt to `n` lanes (item `i` to lane `i % n`, see [`deal`]) answered in their own
/// order, from `answers`, each lane's answers to its share in order (`n` is their count).
pub(super) fn in_dealt_order<T>(
    items: &[T],
    answers: Vec<Vec<Result<TensorInfo, ClientError>>>,
    key_of: impl Fn(&T) -> &TensorKey,
) -> Vec<Result<TensorInfo, ClientError>> {
    let n = answers.len().max(1);
    let mut answers: Vec<_> = answers.into_iter().map(Vec::into_iter).collect();
    // Item i went to lane i % n, as its (i / n)th; every lane answers each of its own.
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            answers
                .get_mut(i % n)
                .and_then(Iterator::next)
                .unwrap_or_else(|| no_answer(key_of(item), "no answer: its lane gave none"))
        })
        .collect()
}

/// A tensor a lane gave no answer for, and why.
pub(super) fn no_answer(key: &TensorKey, reason: &str) -> Result<TensorInfo, ClientError> {
    Err(ClientError::NoAnswer {
        key: key.clone(),
        reason: reason.to_string(),
    })
}
