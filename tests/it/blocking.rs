//! `BlockingClient` and `.wait()`: every call of `Client` blocks through it (puts and batches
//! over lanes, a `NodeCopy`); on a thread that drives a runtime each is refused with a typed
//! `ClientError::InsideRuntime`, never tokio's panic; from `spawn_blocking` they still block.

use ferry_client::{BlockingClient, ClientError, IfExists, PutTo, TensorData, TensorKey, Wait};
use ferry_proto::DType;
use ferry_testkit::samples;
use ferry_testkit::{how, start_with};

#[tokio::test]
async fn blocking_calls_inside_a_runtime_are_refused_with_a_typed_error() {
    let node = start_with(&["flex"]).await;
    let connected = BlockingClient::connect(node.addr).blocking();
    assert!(
        matches!(connected, Err(ClientError::InsideRuntime)),
        "connect inside a runtime: {connected:?}"
    );

    // Made where it may block, then called on the runtime's own thread.
    let addr = node.addr;
    let mut client = tokio::task::spawn_blocking(move || BlockingClient::connect(addr).blocking())
        .await
        .unwrap()
        .unwrap();
    let listed = client.list(None).wait();
    assert!(
        matches!(listed, Err(ClientError::InsideRuntime)),
        "a call inside a runtime: {listed:?}"
    );
    let mut target = tokio::task::spawn_blocking(move || BlockingClient::connect(addr).blocking())
        .await
        .unwrap()
        .unwrap();
    let copy = how(&addr.to_string(), 0).node_copy(&[TensorKey::new(0, "absent")]);
    let copied = copy.run(&mut client, &mut target).wait();
    assert!(
        matches!(copied, Err(ClientError::InsideRuntime)),
        "a blocking copy inside a runtime: {copied:?}"
    );

    // Refused before anything was sent: the connection is still in step, and a thread that may
    // block uses it.
    let listed = tokio::task::spawn_blocking(move || client.list(None).wait())
        .await
        .unwrap()
        .unwrap();
    assert!(listed.is_empty());
    drop(target);
    node.shutdown().await;
}

/// Every call of `Client` blocks through a `BlockingClient` with `.wait()`, the put builders
/// included: a put with its options, one to a name the node chooses, and a batch over two
/// connections (one answer per tensor, waited for as `Ok` of them). Inside a runtime each is
/// refused, typed, before anything is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_and_batches_over_lanes_wait_through_blocking_clients() {
    let node = start_with(&["flex"]).await;
    let addr = node.addr;
    let (mut first, mut other) = tokio::task::spawn_blocking(move || {
        let open = || BlockingClient::connect(addr).blocking().unwrap();
        (open(), open())
    })
    .await
    .unwrap();
    let model: Vec<(TensorKey, TensorData)> = (0..6)
        .map(|i| {
            let key = TensorKey::new(0, format!("w{i}"));
            (key, samples::plain(DType::F32, &[8], i))
        })
        .collect();

    let refused = first.put_batch(&model).lanes([&mut other]).wait();
    assert!(
        matches!(refused, Err(ClientError::InsideRuntime)),
        "a batch over lanes inside a runtime: {refused:?}"
    );
    let refused = first.put(&model[0].0, &model[0].1).wait();
    assert!(
        matches!(refused, Err(ClientError::InsideRuntime)),
        "a put inside a runtime: {refused:?}"
    );
    assert!(first.in_step() && other.in_step());

    tokio::task::spawn_blocking(move || {
        let answers = first.put_batch(&model).lanes([&mut other]).wait().unwrap();
        assert_eq!(answers.len(), model.len());
        for (answer, (key, data)) in answers.iter().zip(&model) {
            assert_eq!(answer.as_ref().unwrap().key, *key, "answers in order");
            assert_eq!(first.get(key).wait().unwrap().as_bytes(), data.as_bytes());
        }
        let (key, newer) = (&model[0].0, &model[1].1);
        let taken = first.put(key, newer).wait();
        assert!(taken.is_err(), "refused by default: {taken:?}");
        first
            .put(key, newer)
            .if_exists(IfExists::Replace)
            .wait()
            .unwrap();
        assert_eq!(first.get(key).wait().unwrap().as_bytes(), newer.as_bytes());
        let named = other.put(PutTo::Device(0), newer).wait().unwrap();
        assert_eq!(
            other.get(&named.key).wait().unwrap().as_bytes(),
            newer.as_bytes()
        );
    })
    .await
    .unwrap();
    node.shutdown().await;
}
