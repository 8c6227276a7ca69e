//! `BlockingClient` and `NodeCopy::run_blocking` on a thread that drives a runtime: a typed
//! `ClientError::InsideRuntime`, never tokio's panic; from `spawn_blocking` they still block.

use ferry::client::{BlockingClient, ClientError, TensorKey};
use ferry::testing::{how, start_with};

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
    let listed = client.list(None);
    assert!(
        matches!(listed, Err(ClientError::InsideRuntime)),
        "a call inside a runtime: {listed:?}"
    );
    let mut target = tokio::task::spawn_blocking(move || BlockingClient::connect(addr).blocking())
        .await
        .unwrap()
        .unwrap();
    let copy = how(&addr.to_string(), 0).node_copy(&[TensorKey::new(0, "absent")]);
    let copied = copy.run_blocking(&mut client, &mut target);
    assert!(
        matches!(copied, Err(ClientError::InsideRuntime)),
        "a blocking copy inside a runtime: {copied:?}"
    );

    // Refused before anything was sent: the connection is still in step, and a thread that may
    // block uses it.
    let listed = tokio::task::spawn_blocking(move || client.list(None))
        .await
        .unwrap()
        .unwrap();
    assert!(listed.is_empty());
    drop(target);
    node.shutdown().await;
}
