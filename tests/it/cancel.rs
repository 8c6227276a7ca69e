//! Calls cancelled half-way (a dropped future): a node-to-node copy or move stopped between its
//! pulls, a download stopped in the middle of its payload, and a put spread over lanes' tasks; a move whose target goes away
//! half-way; and copies and puts over several connections, one of them failed. The invariant: a
//! connection whose exchange did not finish refuses every later call (`OutOfStep`) instead of
//! reading another call's answer as its own; the nodes hold only whole tensors, a move never loses
//! one, new connections carry on, and a copy that loses its connection still reports what it did.

use std::time::Duration;

use ferry_client::{Client, ClientError, IfExists, InterruptedCopy, Lane, NodeCopy, Transfer};
use ferry_proto::{DType, ErrorCode, TensorData, TensorKey};
use ferry_testkit::samples;
use ferry_testkit::{Fault, TestNode, assert_same, proxy, start_with};

/// How many tensors a cancelled copy is asked to move, and how large each is: large enough
/// that the copy is still running when it is cancelled after its first pull.
const TENSORS: usize = 12;
const SHAPE: [usize; 2] = [1024, 2048];

/// The tensors the copies move and the puts send: `TENSORS` of `SHAPE`, on device 0.
fn batch() -> Vec<(TensorKey, TensorData)> {
    (0..TENSORS)
        .map(|i| {
            let key = TensorKey::new(0, format!("layer{i}.w"));
            (key, samples::plain(DType::F32, &SHAPE, i as u64))
        })
        .collect()
}

/// Puts the tensors the copies move on `node`'s device 0.
async fn fill(node: &TestNode) -> Vec<(TensorKey, TensorData)> {
    let tensors = batch();
    let mut client = node.client().await;
    for answer in client.put_batch(&tensors).await.unwrap() {
        answer.unwrap();
    }
    tensors
}

/// Where a cancellation cuts a copy: once the target registered a tensor, or (a move) once the
/// source deleted one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    AfterALanding,
    AfterASourceDelete,
}

/// Runs `copy` from `a` to `b` and drops it at `cut`, before the copy's end: a cancellation
/// half-way. Returns the two connections it ran on.
async fn cancel_half_way(
    a: &TestNode,
    b: &TestNode,
    copy: &NodeCopy,
    cut: Cut,
) -> (Client, Client) {
    let (mut source, mut target) = (a.client().await, b.client().await);
    {
        let run = copy.run(&mut source, &mut target);
        tokio::pin!(run);
        let reached = async {
            loop {
                let landed = b.node.list(Some(0)).await.unwrap().len();
                let left = a.node.list(Some(0)).await.unwrap().len();
                let there = match cut {
                    Cut::AfterALanding => landed >= 1,
                    Cut::AfterASourceDelete => left < TENSORS,
                };
                if there {
                    return landed;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::select! {
            answers = &mut run => panic!("the copy finished before it was cancelled: {answers:?}"),
            landed = reached => assert!(landed < TENSORS, "cancelled half-way, {landed} landed"),
        }
        // `run` is dropped here, in the middle of its exchanges.
    }
    (source, target)
}

/// Both connections of a cancelled copy refuse further calls, and say why.
async fn out_of_step(source: &mut Client, target: &mut Client) {
    for client in [source, target] {
        assert!(!client.in_step());
        let refused = client.stat().await;
        assert!(
            matches!(refused, Err(ClientError::OutOfStep)),
            "{refused:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_cancelled_half_way_leaves_both_connections_refusing_and_whole_tensors() {
    let (a, b) = (start_with(&["flex"]).await, start_with(&["flex"]).await);
    let tensors = fill(&a).await;
    let keys = tensors.iter().map(|(key, _)| key.clone());
    let copy = NodeCopy::new(a.addr.to_string()).tensors_to(keys, 0);
    let (mut source, mut target) = cancel_half_way(&a, &b, &copy, Cut::AfterALanding).await;
    out_of_step(&mut source, &mut target).await;
    drop((source, target));

    // What the target holds is whole, and the source kept everything.
    let (mut on_a, mut on_b) = (a.client().await, b.client().await);
    for info in on_b.list(Some(0)).await.unwrap() {
        let (_, wanted) = tensors.iter().find(|(k, _)| *k == info.key).unwrap();
        assert_same(&on_b.get(&info.key).await.unwrap(), wanted, &info.key.name);
    }
    assert_eq!(on_a.list(Some(0)).await.unwrap().len(), TENSORS);

    // New connections copy the rest (the cancelled grants hold up nothing), and use the
    // connection again afterwards.
    let rest = NodeCopy::new(a.addr.to_string())
        .tensors_to(tensors.iter().map(|(key, _)| key.clone()), 0)
        .if_exists(IfExists::Replace);
    for answer in rest.run(&mut on_a, &mut on_b).await.unwrap() {
        answer.unwrap();
    }
    for (key, data) in &tensors {
        assert_same(&on_b.get(key).await.unwrap(), data, &key.name);
    }
    assert!(on_a.in_step() && on_b.in_step());
    assert_eq!(
        on_a.stat().await.unwrap().devices[0].tensors,
        TENSORS as u64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_cancelled_half_way_loses_no_tensor() {
    let (a, b) = (start_with(&["flex"]).await, start_with(&["flex"]).await);
    let tensors = fill(&a).await;
    let keys = tensors.iter().map(|(key, _)| key.clone());
    let moving = NodeCopy::new(a.addr.to_string())
        .tensors_to(keys, 0)
        .transfer(Transfer::Move);
    let (mut source, mut target) = cancel_half_way(&a, &b, &moving, Cut::AfterASourceDelete).await;
    out_of_step(&mut source, &mut target).await;
    drop((source, target));

    // Every tensor is on one node at least, whole; one the source deleted is on the target.
    let (mut on_a, mut on_b) = (a.client().await, b.client().await);
    let mut deleted = 0;
    for (key, data) in &tensors {
        let (here, there) = (on_a.get(key).await, on_b.get(key).await);
        match (here, there) {
            (Ok(here), Ok(there)) => {
                assert_same(&here, data, &key.name);
                assert_same(&there, data, &key.name);
            }
            (Ok(here), Err(_)) => assert_same(&here, data, &key.name),
            (Err(_), Ok(there)) => {
                deleted += 1;
                assert_same(&there, data, &key.name);
            }
            (Err(a), Err(b)) => panic!("{key} lost: {a} / {b}"),
        }
    }
    assert!(
        (1..TENSORS).contains(&deleted),
        "cancelled between a source delete and the end: {deleted} deleted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_download_cancelled_mid_payload_leaves_the_connection_refusing() {
    let node = start_with(&["flex"]).await;
    let key = TensorKey::new(0, "w");
    // 64 MiB: far more than the socket holds, so the payload is still arriving when it is cut.
    let data = samples::plain(DType::F32, &[4096, 4096], 3);
    let mut client = node.client().await;
    client.put(&key, &data).await.unwrap();
    cut_mid_payload(&mut client, &key).await;
    assert!(!client.in_step());
    let refused = client.get(&key).await;
    assert!(
        matches!(refused, Err(ClientError::OutOfStep)),
        "{refused:?}"
    );
    // Another connection reads it whole.
    let mut again = node.client().await;
    assert_same(&again.get(&key).await.unwrap(), &data, "w");
}

/// A move whose target shuts down half-way (it finishes the pull in hand, then closes): the run
/// fails as `CopyInterrupted`, with an answer for each tensor moved before, in order, whose
/// sources are gone; every tensor it had no answer for is still on the source, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_whose_target_goes_away_reports_what_it_moved_and_keeps_the_rest() {
    let (a, b) = (start_with(&["flex"]).await, start_with(&["flex"]).await);
    let tensors = fill(&a).await;
    let keys: Vec<TensorKey> = tensors.iter().map(|(key, _)| key.clone()).collect();
    let moving = NodeCopy::new(a.addr.to_string())
        .tensors_to(keys.clone(), 0)
        .transfer(Transfer::Move);
    let (mut source, mut target) = (a.client().await, b.client().await);
    let run = moving.run(&mut source, &mut target);
    let (ran, ()) = tokio::join!(run, shut_down_after_a_landing(b));
    let Err(ClientError::CopyInterrupted(stopped)) = ran else {
        panic!("a move whose target went away: {ran:?}");
    };
    let InterruptedCopy {
        answered,
        unanswered,
        cause,
        ..
    } = *stopped;
    assert!(!unanswered.is_empty(), "stopped half-way: {cause}");
    assert_eq!(unanswered, keys[answered.len()..], "the rest, in order");
    // Pulls asked ahead reach a target that is shutting down: refused, not moved.
    let (moved, _) = moved_or_kept(&a, &answered, &tensors, |_, refused| {
        refused.code() == Some(ErrorCode::ShuttingDown)
    })
    .await;
    assert!(moved >= 1, "the pull in hand is answered: {answered:?}");
    // Not one tensor without an answer was deleted from the source (the first one's delete is
    // only asked once its pull is answered, and the source's connection stayed up).
    let mut on_a = a.client().await;
    for key in &unanswered {
        let (_, wanted) = tensors.iter().find(|(k, _)| k == key).unwrap();
        assert_same(&on_a.get(key).await.unwrap(), wanted, &key.name);
    }
    assert!(!source.in_step() && !target.in_step());
}

/// Starts a download of `key` (a tensor far larger than a socket holds) on `client` and drops it
/// once the node's description was read: inside its payload. The connection is then out of step.
async fn cut_mid_payload(client: &mut Client, key: &TensorKey) {
    let announced = std::sync::atomic::AtomicBool::new(false);
    let keys = [key.clone()];
    let download = client.get_batch_into(&keys, |_, _| {
        announced.store(true, std::sync::atomic::Ordering::SeqCst);
        None
    });
    tokio::pin!(download);
    let mid_payload = async {
        while !announced.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::task::yield_now().await;
        }
    };
    tokio::select! {
        biased;
        () = mid_payload => {}
        done = &mut download => panic!("the download finished before it was cut: {done:?}"),
    }
}

/// A copy over three lanes, one of them out of step before it starts (a download cut on it):
/// that lane is left out, the other two carry every tensor, and the answers come in order,
/// each tensor bit-exact on the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_over_lanes_leaves_a_lane_out_of_step_out_and_answers_in_order() {
    let (a, b) = (start_with(&["flex"]).await, start_with(&["flex"]).await);
    let tensors = fill(&a).await;
    let keys: Vec<TensorKey> = tensors.iter().map(|(key, _)| key.clone()).collect();
    let mut lanes = lanes_between(&a, &b, 3).await;
    // 64 MiB, far more than a socket holds, beside the copied ones (not among them).
    let big = TensorKey::new(0, "big");
    lanes[1]
        .source
        .put(&big, &samples::plain(DType::F32, &[4096, 4096], 4))
        .await
        .unwrap();
    cut_mid_payload(&mut lanes[1].source, &big).await;
    assert!(!lanes[1].in_step());
    let copy = NodeCopy::new(a.addr.to_string()).tensors_to(keys.clone(), 0);
    let answers = copy.run_in_lanes(&mut lanes).await;
    assert_eq!(answers.len(), TENSORS);
    let mut on_b = b.client().await;
    for ((answer, key), (_, data)) in answers.iter().zip(&keys).zip(&tensors) {
        let info = answer.as_ref().unwrap_or_else(|e| panic!("{key}: {e}"));
        assert_eq!(info.key, *key, "answers in order");
        assert_same(&on_b.get(key).await.unwrap(), data, &key.name);
    }
    assert!(lanes[0].in_step() && lanes[2].in_step());
}

/// A move over three lanes whose target shuts down half-way: one answer per tensor, in order;
/// each moved tensor's source is gone, and every tensor without a success (refused by the
/// target going down, or with no answer) is still on the source, whole: a lane's failure loses
/// no tensor and misreports none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_over_lanes_whose_target_goes_away_loses_and_misreports_nothing() {
    let (a, b) = (start_with(&["flex"]).await, start_with(&["flex"]).await);
    let tensors = fill(&a).await;
    let keys: Vec<TensorKey> = tensors.iter().map(|(key, _)| key.clone()).collect();
    let mut lanes = lanes_between(&a, &b, 3).await;
    let moving = NodeCopy::new(a.addr.to_string())
        .tensors_to(keys.clone(), 0)
        .transfer(Transfer::Move);
    let run = moving.run_in_lanes(&mut lanes);
    let (answers, ()) = tokio::join!(run, shut_down_after_a_landing(b));
    assert_eq!(answers.len(), TENSORS);
    let (moved, kept) = moved_or_kept(&a, &answers, &tensors, |key, why| {
        why.code() == Some(ErrorCode::ShuttingDown)
            || matches!(why, ClientError::NoAnswer { key: k, .. } if k == key)
    })
    .await;
    assert!(moved >= 1 && kept >= 1, "{moved} moved, {kept} kept");
}

/// The two ways to put a batch over lanes: one task sending for every lane
/// ([`PutBatch::lanes`](ferry_client::PutBatch::lanes)), or a task of its own for each
/// ([`Client::put_batch_spread`]). Both answer alike.
#[derive(Debug, Clone, Copy)]
enum LanesRun {
    OneTask,
    TaskEach,
}

/// `tensors` put over `lanes` the way `run` says: the lanes back, in order, and the answers.
async fn put_over(
    run: LanesRun,
    mut lanes: Vec<Client>,
    tensors: &[(TensorKey, TensorData)],
) -> (
    Vec<Client>,
    Vec<Result<ferry_proto::TensorInfo, ClientError>>,
) {
    match run {
        LanesRun::OneTask => {
            let (first, others) = lanes.split_first_mut().unwrap();
            let answers = first.put_batch(tensors).lanes(others).await;
            (lanes, answers)
        }
        LanesRun::TaskEach => {
            let shared = tensors.to_vec().into();
            Client::put_batch_spread(lanes, shared, ferry_client::IfExists::Refuse).await
        }
    }
}

/// A put over three connections, one of them out of step before it starts (a download cut on
/// it), and one tensor the node refuses (its key is taken): that connection is left out, the
/// other two carry every tensor, and the answers come in order, the refusal at its tensor's
/// place, each stored tensor bit-exact on the node; sent from one task or a task per lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_over_lanes_leaves_a_lane_out_of_step_out_and_answers_in_order() {
    for run in [LanesRun::OneTask, LanesRun::TaskEach] {
        a_lane_out_of_step_is_left_out(run).await;
    }
}

async fn a_lane_out_of_step_is_left_out(run: LanesRun) {
    let node = start_with(&["flex"]).await;
    let mut tensors = batch();
    let taken = TensorKey::new(0, "taken");
    tensors.insert(5, (taken.clone(), samples::plain(DType::F32, &[8], 99)));
    let mut lanes = Vec::new();
    for _ in 0..3 {
        lanes.push(node.client().await);
    }
    let before = samples::plain(DType::BF16, &[8], 98);
    lanes[0].put(&taken, &before).await.unwrap();
    // 64 MiB, far more than a socket holds.
    let big = TensorKey::new(0, "big");
    lanes[1]
        .put(&big, &samples::plain(DType::F32, &[4096, 4096], 4))
        .await
        .unwrap();
    cut_mid_payload(&mut lanes[1], &big).await;
    assert!(!lanes[1].in_step());
    let (lanes, answers) = put_over(run, lanes, &tensors).await;
    assert_eq!(answers.len(), tensors.len());
    assert_eq!(lanes.len(), 3, "{run:?}: every lane back");
    let mut check = node.client().await;
    for (answer, (key, data)) in answers.iter().zip(&tensors) {
        if *key == taken {
            let refused = answer.as_ref().unwrap_err();
            assert_eq!(refused.code(), Some(ErrorCode::AlreadyExists), "{refused}");
            assert_same(
                &check.get(key).await.unwrap(),
                &before,
                "the taken key's own",
            );
            continue;
        }
        let info = answer
            .as_ref()
            .unwrap_or_else(|e| panic!("{run:?}, {key}: {e}"));
        assert_eq!(info.key, *key, "{run:?}: answers in order");
        assert_same(&check.get(key).await.unwrap(), data, &key.name);
    }
    assert!(lanes[0].in_step() && !lanes[1].in_step() && lanes[2].in_step());
}

/// A put over three connections, one of which is cut: after the node's `Ready` and `Stored`
/// for two of its tensors (the cut takes the third's `Ready`: its payload never goes), or after
/// the second's `Ready` (the cut takes its `Stored`: its payload went out whole). That
/// connection keeps the answers it had; the tensor whose payload went out is answered
/// `NoAnswer`, may have been stored, and was; every later one `NoAnswer`, not put, and was not;
/// the other two connections carry theirs. Every answer in order, every stored tensor
/// bit-exact; sent from one task or a task per lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_over_lanes_whose_connection_fails_keeps_its_answers_and_the_others_go_on() {
    // Frames passed before the cut (the `Welcome` first), the cut connection's tensors it
    // answered, and the one left in doubt.
    let cases = [(1 + 2 * 2, 2, None), (1 + 2 + 1, 1, Some(1))];
    for run in [LanesRun::OneTask, LanesRun::TaskEach] {
        for (frames, answered, in_doubt) in cases {
            a_cut_lane_keeps_its_answers(run, frames, answered, in_doubt).await;
        }
    }
}

async fn a_cut_lane_keeps_its_answers(
    run: LanesRun,
    frames: usize,
    answered: usize,
    in_doubt: Option<usize>,
) {
    let node = start_with(&["flex"]).await;
    let tensors = batch();
    let cut = proxy(node.addr, Fault::CutAfterFrames(frames)).await;
    let lanes = vec![
        node.client().await,
        Client::connect(cut.to_string()).await.unwrap(),
        node.client().await,
    ];
    let (lanes, answers) = put_over(run, lanes, &tensors).await;
    assert_eq!(answers.len(), TENSORS);
    assert_eq!(lanes.len(), 3, "{run:?}: every lane back");
    let mut check = node.client().await;
    for (i, (answer, (key, data))) in answers.iter().zip(&tensors).enumerate() {
        // Tensor i went over connection i % 3, as its (i / 3)th.
        let (lane, turn) = (i % 3, i / 3);
        if lane == 1 && turn >= answered {
            let stored = Some(turn) == in_doubt;
            let said = if stored { "no answer" } else { "not put" };
            assert!(
                matches!(answer, Err(ClientError::NoAnswer { key: k, reason })
                    if k == key && reason.starts_with(said)
                        && reason.contains("may have been stored") == stored),
                "{run:?}, {frames} frames, {key}: {answer:?}"
            );
            match check.get(key).await {
                Ok(held) if stored => assert_same(&held, data, &key.name),
                Err(e) if !stored => assert_eq!(e.code(), Some(ErrorCode::NotFound)),
                other => panic!("{run:?}, {frames} frames, {key}: {other:?}"),
            }
            continue;
        }
        let info = answer
            .as_ref()
            .unwrap_or_else(|e| panic!("{run:?}, {key}: {e}"));
        assert_eq!(info.key, *key, "answers in order");
        assert_same(&check.get(key).await.unwrap(), data, &key.name);
    }
    assert!(lanes[0].in_step() && !lanes[1].in_step() && lanes[2].in_step());
}

/// A put spread over three lanes' tasks (`Client::put_batch_spread`), dropped once the node holds
/// a tensor: the tasks stop with it (nothing more lands after a pause long enough for the rest
/// to have arrived), and the node holds only whole tensors of the batch, bit-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spread_put_dropped_half_way_stops_its_lanes_and_leaves_whole_tensors() {
    let node = start_with(&["flex"]).await;
    let tensors = batch();
    let mut lanes = Vec::new();
    for _ in 0..3 {
        lanes.push(node.client().await);
    }
    {
        let put = Client::put_batch_spread(lanes, tensors.clone().into(), IfExists::Refuse);
        tokio::pin!(put);
        let landed = async {
            while node.node.list(Some(0)).await.unwrap().is_empty() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::select! {
            answers = &mut put => panic!("the put finished before it was dropped: {:?}", answers.1),
            () = landed => {}
        }
        // `put` is dropped here, its lanes' tasks in the middle of their exchanges.
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let first = node.node.list(Some(0)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let then = node.node.list(Some(0)).await.unwrap();
    assert_eq!(
        first.len(),
        then.len(),
        "a lane went on sending after the drop"
    );
    assert!(
        then.len() < TENSORS,
        "every tensor landed: the drop came too late"
    );
    let mut check = node.client().await;
    for info in &then {
        let (_, data) = tensors
            .iter()
            .find(|(key, _)| *key == info.key)
            .unwrap_or_else(|| panic!("{} is not of the batch", info.key));
        assert_same(&check.get(&info.key).await.unwrap(), data, &info.key.name);
    }
}

/// Shuts `b` down once it holds a tensor on device 0: a target going away half-way through a
/// copy to it.
async fn shut_down_after_a_landing(b: TestNode) {
    let node = b.node.clone();
    while node.list(Some(0)).await.unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    b.shutdown().await;
}

/// Checks a move's answers, one per tensor of `tensors` in order, against its source `a`: each
/// success names its tensor and its source is gone; each failure is one `expected` allows, and
/// its tensor is still on the source, whole. Returns how many were moved and how many kept.
async fn moved_or_kept(
    a: &TestNode,
    answers: &[Result<ferry_proto::TensorInfo, ClientError>],
    tensors: &[(TensorKey, TensorData)],
    expected: impl Fn(&TensorKey, &ClientError) -> bool,
) -> (usize, usize) {
    let mut on_a = a.client().await;
    let (mut moved, mut kept) = (0, 0);
    for (answer, (key, data)) in answers.iter().zip(tensors) {
        match answer {
            Ok(info) => {
                assert_eq!(info.key, *key, "answers in order");
                let gone = on_a.get(key).await;
                assert!(gone.is_err(), "{key} moved: its source is gone");
                moved += 1;
            }
            Err(why) => {
                assert!(expected(key, why), "{key}: {why}");
                assert_same(&on_a.get(key).await.unwrap(), data, &key.name);
                kept += 1;
            }
        }
    }
    (moved, kept)
}

/// `n` lanes from `a` (the source) to `b` (the target), each its own pair of connections.
async fn lanes_between(a: &TestNode, b: &TestNode, n: usize) -> Vec<Lane> {
    let mut lanes = Vec::with_capacity(n);
    for _ in 0..n {
        lanes.push(Lane {
            source: a.client().await,
            target: b.client().await,
        });
    }
    lanes
}
