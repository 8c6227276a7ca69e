//! An embedded node's tensors handed to and from a Burn program: the same buffer, never a copy
//! (the storage itself is compared, not only the bytes), every kind, and the refusals (another
//! kind, another rank, another backend) that leave the node as it was.
// Test code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

use burn_dispatch::{BackendTensor, DispatchKindConversion, DispatchTensor};
use burn_flex::{Flex, FlexTensor};
use burn_tensor::kind::Basic;
use burn_tensor::quantization::{QuantScheme, QuantStore, QuantValue};
use burn_tensor::{Bool, Device, Float, Int, Tensor, TensorData};
use ferry_burn::{HandoffError, NodeTensors};
use ferry_client::Client;
use ferry_proto::{IfExists, TensorKey};
use ferry_server::{BackendKind, Node, NodeError, Primitive};
use ferry_testkit::samples;
use ferry_testkit::start_with;

/// Where a Flex tensor's values lie: two tensors that share a buffer have the same address.
fn values_of<const D: usize, K: Basic>(tensor: &Tensor<D, K>) -> *const u8 {
    let dispatch = tensor.clone().into_dispatch();
    let flex: FlexTensor =
        match <DispatchTensor as DispatchKindConversion<Flex>>::try_into_backend(dispatch).unwrap()
        {
            BackendTensor::Float(t) | BackendTensor::Int(t) | BackendTensor::Bool(t) => t,
            BackendTensor::Quantized(q) => q.tensor().clone(),
            #[allow(unreachable_patterns)]
            _ => panic!("not a plain Flex tensor"),
        };
    flex.bytes().as_ptr()
}

/// Where the node's registered tensor under `key` keeps its values.
async fn node_values(node: &Node, key: &TensorKey) -> *const u8 {
    let (_, primitive) = node.primitive::<Flex>(key).await.unwrap();
    let flex = match primitive {
        Primitive::Float(t) | Primitive::Int(t) | Primitive::Bool(t) => t,
        Primitive::Quantized(q) => q.tensor().clone(),
    };
    flex.bytes().as_ptr()
}

fn q8s() -> QuantScheme {
    QuantScheme::default()
        .with_value(QuantValue::Q8S)
        .with_store(QuantStore::Native)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_handed_in_and_out_keeps_its_buffer_for_every_kind() {
    let node = start_with(&["flex"]).await;
    let device = Device::flex();
    let weights = Tensor::<2>::from_data(
        samples::plain(burn_tensor::DType::F32, &[64, 96], 1),
        &device,
    );
    let quantized = weights.clone().quantize_dynamic(&q8s());
    let ids = Tensor::<1, Int>::from_ints([3, 1, 4, 1, 5, 9], &device);
    let mask = Tensor::<2, Bool>::from_data(
        TensorData::new(vec![true, false, true, true], [2, 2]),
        &device,
    );

    async fn round<const D: usize, K: Basic + 'static>(node: &Node, name: &str, t: Tensor<D, K>) {
        let key = TensorKey::new(0, name);
        let at = values_of(&t);
        let before = t.clone().into_data();
        let desc = node
            .insert_tensor(&key, &t, IfExists::Refuse)
            .await
            .unwrap();
        assert_eq!(desc.bytes as usize, before.as_bytes().len(), "{name}");
        assert_eq!(
            node_values(node, &key).await,
            at,
            "{name}: registered without a copy"
        );
        let back: Tensor<D, K> = node.tensor(&key).await.unwrap();
        assert_eq!(values_of(&back), at, "{name}: handed out without a copy");
        assert_eq!(back.dtype(), before.dtype(), "{name}");
        assert_eq!(back.into_data().as_bytes(), before.as_bytes(), "{name}");
        // Served to the network like any other tensor, bit-exact.
        assert_eq!(
            node.get(&key).await.unwrap().as_bytes(),
            before.as_bytes(),
            "{name}"
        );
    }
    round(&node.node, "weights", weights).await;
    round(&node.node, "weights.q8s", quantized).await;
    round(&node.node, "ids", ids).await;
    round(&node.node, "mask", mask).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_put_over_the_network_reaches_the_program_without_a_host_copy() {
    let node = start_with(&["flex"]).await;
    let mut client = Client::connect(node.addr).await.unwrap();
    let key = TensorKey::new(0, "encoder.q");
    let data = samples::quantized(&q8s(), &[256, 256], 7);
    client.put(&key, &data).await.unwrap();
    let got: Tensor<2, Float> = node.node.tensor(&key).await.unwrap();
    assert_eq!(values_of(&got), node_values(&node.node, &key).await);
    assert_eq!(got.into_data().as_bytes(), data.as_bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_programs_writes_never_reach_the_nodes_tensor() {
    let node = start_with(&["flex"]).await;
    let key = TensorKey::new(0, "w");
    let data = samples::plain(burn_tensor::DType::F32, &[8, 8], 3);
    node.node
        .insert(&key, data.clone(), IfExists::Refuse)
        .await
        .unwrap();
    let mine: Tensor<2> = node.node.tensor(&key).await.unwrap();
    // An in-place write on a shared buffer: Flex copies it first.
    let written = mine.slice_assign([0..1, 0..8], Tensor::zeros([1, 8], &Device::flex()));
    assert_eq!(
        written.into_data().as_slice::<f32>().unwrap()[..8],
        [0.0; 8]
    );
    assert_eq!(
        node.node.get(&key).await.unwrap().as_bytes(),
        data.as_bytes()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_hands_the_tensor_over_and_a_refusal_leaves_it_registered() {
    let node = start_with(&["flex", "ndarray"]).await;
    let key = TensorKey::new(0, "w");
    let data = samples::plain(burn_tensor::DType::F32, &[4, 4], 5);
    node.node
        .insert(&key, data.clone(), IfExists::Refuse)
        .await
        .unwrap();

    let as_int = node.node.take_tensor::<2, Int>(&key).await;
    assert!(
        matches!(as_int, Err(HandoffError::Kind { asked: "Int", .. })),
        "{as_int:?}"
    );
    let as_rank3 = node.node.take_tensor::<3, Float>(&key).await;
    assert!(
        matches!(as_rank3, Err(HandoffError::Rank { asked: 3, .. })),
        "{as_rank3:?}"
    );
    assert!(
        node.node.describe(&key).await.is_ok(),
        "refused, and still registered"
    );

    let taken: Tensor<2> = node.node.take_tensor(&key).await.unwrap();
    assert_eq!(taken.into_data().as_bytes(), data.as_bytes());
    assert!(matches!(
        node.node.describe(&key).await,
        Err(NodeError::NotFound(_))
    ));

    // The NdArray device's backend has no handoff: nothing is handed either way, and the
    // error names the device and its backend.
    let other = TensorKey::new(1, "w");
    let refused = node
        .node
        .insert_tensor(
            &other,
            &Tensor::<1>::from_floats([1.0, 2.0], &Device::flex()),
            IfExists::Refuse,
        )
        .await;
    assert!(
        matches!(
            refused,
            Err(HandoffError::NoHandoff {
                device: 1,
                backend: BackendKind::NdArray
            })
        ),
        "{refused:?}"
    );
    node.node
        .insert(&other, data, IfExists::Refuse)
        .await
        .unwrap();
    let out = node.node.tensor::<2, Float>(&other).await;
    assert!(
        matches!(
            out,
            Err(HandoffError::NoHandoff {
                device: 1,
                backend: BackendKind::NdArray
            })
        ),
        "{out:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_in_tensor_is_hashed_by_the_node_from_its_own_bytes() {
    let node = start_with(&["flex"]).await;
    let key = TensorKey::new(0, "w");
    let data = samples::plain(burn_tensor::DType::F32, &[32, 32], 9);
    let tensor = Tensor::<2>::from_data(data.clone(), &Device::flex());
    node.node
        .insert_tensor(&key, &tensor, IfExists::Refuse)
        .await
        .unwrap();
    let meta = ferry_proto::tensor::meta_of(&data).unwrap();
    let truth = ferry_proto::tensor::content_hash(&meta, data.as_bytes());
    let mut verified = None;
    for _ in 0..500 {
        verified = node
            .node
            .describe(&key)
            .await
            .unwrap()
            .content_hash
            .verified();
        if verified.is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(verified, Some(truth));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_view_is_counted_at_the_buffer_it_keeps_alive() {
    use ferry_server::{NodeConfig, NodeLimits, ServiceConfig};
    // Room for 1 MiB and its bookkeeping: a 64 KiB slice of a 4 MiB tensor keeps 4 MiB alive.
    let node = ferry_testkit::start(
        NodeConfig {
            devices: ferry_testkit::devices(&["flex"]),
            limits: NodeLimits {
                memory_limit: Some((1 << 20) + ferry_server::TENSOR_OVERHEAD),
                ..NodeLimits::default()
            },
            ..NodeConfig::light()
        },
        ServiceConfig::default(),
    )
    .await;
    let whole = Tensor::<2>::from_data(
        samples::plain(burn_tensor::DType::F32, &[1024, 1024], 4),
        &Device::flex(),
    );
    let view = whole.clone().slice([0..16, 0..1024]);
    let refused = node
        .node
        .insert_tensor(&TensorKey::new(0, "view"), &view, IfExists::Refuse)
        .await;
    assert!(
        matches!(&refused, Err(HandoffError::Node(e)) if e.to_string().contains("budget")),
        "{refused:?}"
    );
    // Made whole (its own 64 KiB), it fits.
    let own = Tensor::<2>::from_data(view.into_data(), &Device::flex());
    node.node
        .insert_tensor(&TensorKey::new(0, "view"), &own, IfExists::Refuse)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primitive_under_another_kind_than_its_dtype_is_refused() {
    let node = start_with(&["flex"]).await;
    let float = Tensor::<1>::from_floats([1.0, 2.0], &Device::flex());
    let dispatch = float.into_dispatch();
    let BackendTensor::Float(flex) =
        <DispatchTensor as DispatchKindConversion<Flex>>::try_into_backend(dispatch).unwrap()
    else {
        panic!("a float");
    };
    let refused = node
        .node
        .insert_primitive(
            &TensorKey::new(0, "w"),
            Primitive::<Flex>::Int(flex),
            IfExists::Refuse,
        )
        .await;
    assert!(refused.is_err_and(|e| e.to_string().contains("another kind")));
    assert!(node.node.list(Some(0)).await.unwrap().is_empty());
}

/// A take racing a replace of the same key: whichever wins, no value is lost or handed out
/// twice. The take removes only the version it handed out; a replacement that landed first is
/// what it takes, one that landed after stays registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_racing_a_replace_loses_no_value() {
    let node = start_with(&["flex"]).await;
    let key = TensorKey::new(0, "w");
    let device = Device::flex();
    let (mut took_first, mut took_second, mut refused) = (0, 0, 0);
    for round in 0..200 {
        let first = Tensor::<1>::from_floats([round as f32, 0.0], &device);
        let second = Tensor::<1>::from_floats([round as f32, 1.0], &device);
        node.node
            .insert_tensor(&key, &first, IfExists::Replace)
            .await
            .unwrap();
        let (taken, replaced) = tokio::join!(
            node.node.take_tensor::<1, Float>(&key),
            node.node.insert_tensor(&key, &second, IfExists::Replace),
        );
        replaced.unwrap();
        let left = node.node.tensor::<1, Float>(&key).await;
        let bytes = |t: Tensor<1>| t.into_data().as_bytes().to_vec();
        let (first, second) = (bytes(first), bytes(second));
        match taken {
            // The first value taken: the second stays.
            Ok(t) if bytes(t.clone()) == first => {
                took_first += 1;
                assert_eq!(bytes(left.unwrap()), second, "round {round}");
            }
            // The second value taken: nothing stays.
            Ok(t) => {
                took_second += 1;
                assert_eq!(bytes(t), second, "round {round}");
                assert!(left.is_err(), "round {round}: taken and still there");
            }
            // Replaced between the handout and the removal: nothing removed, the second stays.
            Err(HandoffError::Node(NodeError::Changed(_))) => {
                refused += 1;
                assert_eq!(bytes(left.unwrap()), second, "round {round}");
            }
            Err(other) => panic!("round {round}: {other}"),
        }
    }
    assert_eq!(took_first + took_second + refused, 200);
}
