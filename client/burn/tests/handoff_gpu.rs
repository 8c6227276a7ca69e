//! The handoff on a wgpu device the program opened first (Mesa's software adapter here; `.ci/run`
//! installs it): a tensor handed to the node and back keeps its GPU buffer (the same cubecl
//! memory, not equal bytes), one that arrived by a put is the program's on its own device, a
//! model applied from the node computes on that device, and every dtype moved onto it either
//! arrives bit-exact or is refused by name (as the device's own measured table says).
// Test code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]
#![cfg(feature = "wgpu")]

mod support;
#[path = "../examples/shared/tiny_lm.rs"]
#[allow(dead_code)]
mod tiny_lm;

use burn_dispatch::backends::Cube;
use burn_dispatch::{BackendTensor, DispatchKindConversion, DispatchTensor};
use burn_store::ModuleStore;
use burn_tensor::{Device, DeviceKind, Tensor};
use ferry_burn::FerryStore;
use ferry_burn::NodeTensors;
use ferry_client::BlockingClient;
use ferry_proto::{DType, IfExists, TensorKey};
use ferry_server::{Node, Primitive};
use ferry_server::{NodeConfig, Service, ServiceConfig};
use ferry_testkit::devices;
use ferry_testkit::samples;
use ferry_testkit::start_with;
use support::params;
use tiny_lm::{Quantization, TinyLm, batch, quantized};

/// The cubecl memory a GPU tensor's values are in: two tensors that share it give one address.
fn memory_of<const D: usize>(tensor: &Tensor<D>) -> usize {
    let dispatch = tensor.clone().into_dispatch();
    let BackendTensor::Float(cube) =
        <DispatchTensor as DispatchKindConversion<Cube>>::try_into_backend(dispatch).unwrap()
    else {
        panic!("a plain float tensor");
    };
    std::ptr::from_ref(cube.handle.memory.descriptor()) as usize
}

/// Where the node's tensor under `key` keeps its values.
async fn node_memory(node: &Node, key: &TensorKey) -> usize {
    let (_, primitive) = node.primitive::<Cube>(key).await.unwrap();
    let Primitive::Float(cube) = primitive else {
        panic!("a plain float tensor");
    };
    std::ptr::from_ref(cube.handle.memory.descriptor()) as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_on_the_programs_wgpu_device_is_handed_over_on_the_gpu() {
    // The program opens the software adapter first (Burn registers a device on first use);
    // the node then embeds that very device.
    let device = Device::wgpu(DeviceKind::Cpu);
    let data = samples::plain(DType::F32, &[64, 96], 1);
    let weights = Tensor::<2>::from_data(data.clone(), &device);
    let node = start_with(&["wgpu:cpu"]).await;

    let key = TensorKey::new(0, "encoder.w");
    node.node
        .insert_tensor(&key, &weights, IfExists::Refuse)
        .await
        .unwrap();
    assert_eq!(
        node_memory(&node.node, &key).await,
        memory_of(&weights),
        "the node holds the program's own GPU buffer"
    );
    let back: Tensor<2> = node.node.tensor(&key).await.unwrap();
    assert_eq!(
        memory_of(&back),
        memory_of(&weights),
        "handed back, the same buffer"
    );
    assert_eq!(back.device(), device);
    assert!(back.clone().into_data().as_bytes() == data.as_bytes());

    // A tensor that arrived by a put is the program's, on its device, and computes there.
    let mut client = node.client().await;
    let other = TensorKey::new(0, "decoder.w");
    client.put(&other, &data).await.unwrap();
    let arrived: Tensor<2> = node.node.tensor(&other).await.unwrap();
    assert_eq!(arrived.device(), device);
    let sum = (arrived + weights.clone()).into_data();
    let twice = (weights.clone() * 2.0).into_data();
    assert!(
        sum.as_bytes() == twice.as_bytes(),
        "x + x == 2x, on the GPU"
    );

    // Taken: handed over and unregistered.
    let taken: Tensor<2> = node.node.take_tensor(&key).await.unwrap();
    assert_eq!(memory_of(&taken), memory_of(&weights));
    assert!(node.node.describe(&key).await.is_err());
}

#[test]
fn a_quantized_model_sent_to_a_worker_nodes_gpu_is_applied_there_sharing_its_buffers() {
    // The worker: opens its GPU (the software adapter) first, then embeds a node on it, served.
    let device = Device::wgpu(DeviceKind::Cpu);
    let _opened = Tensor::<1>::zeros([1], &device);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let node = {
        let _entered = runtime.enter();
        Node::start(NodeConfig {
            devices: devices(&["wgpu:cpu"]),
            ..NodeConfig::light()
        })
        .unwrap()
    };
    let service = runtime
        .block_on(Service::bind(
            node.clone(),
            "127.0.0.1:0".parse().unwrap(),
            ServiceConfig::default(),
        ))
        .unwrap();
    let addr = service.local_addr().unwrap();
    runtime.spawn(service.run(std::future::pending()));

    // The coordinator, on its CPU: a quantized model, sent whole.
    let sent = quantized(TinyLm::new(&Device::flex()), Quantization::PerTensor);
    let link = BlockingClient::connect(addr).blocking().unwrap();
    FerryStore::connected(link, 0, "model")
        .collect_from(&sent)
        .unwrap();

    // The worker applies it from its node: each parameter handed over on the GPU.
    let mut model = TinyLm::new(&device);
    let result = FerryStore::embedded(node.clone(), runtime.handle().clone(), 0, "model")
        .apply_to(&mut model)
        .unwrap();
    assert_eq!(result.applied.len(), 7, "{result}");
    let (got, want) = (params(&model), params(&sent));
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (path, want) in &want {
        assert_eq!(got[path].dtype(), want.dtype(), "{path}");
        assert!(got[path].as_bytes() == want.as_bytes(), "{path}: bytes");
    }
    let gamma = model.norm.gamma.val();
    assert_eq!(gamma.device(), device);
    let held = node.open_model(0, "model").unwrap();
    let on_node = runtime.block_on(node_memory(&node, &held.key("norm.gamma")));
    assert_eq!(memory_of(&gamma), on_node, "the node's own GPU buffer");
    // A quantized weight too: its values are the node's own GPU buffer.
    let weight = model.hidden.weight.val().into_dispatch();
    let BackendTensor::Quantized(q) =
        <DispatchTensor as DispatchKindConversion<Cube>>::try_into_backend(weight).unwrap()
    else {
        panic!("a quantized weight");
    };
    let key = held.key("hidden.weight");
    let (_, primitive) = runtime.block_on(node.primitive::<Cube>(&key)).unwrap();
    let Primitive::Quantized(on_node) = primitive else {
        panic!("a quantized tensor on the node");
    };
    assert!(
        std::ptr::eq(
            q.handle.memory.descriptor(),
            on_node.handle.memory.descriptor()
        ),
        "the quantized weight is the node's own GPU buffer"
    );

    // Burn 0.22.1's GPU kernels do not compute with a natively stored Q8S tensor (cubek-quant:
    // "Q8S is not supported for native quantization"), so the model that runs there is the
    // same one unquantized, sent and applied the same way.
    let plain = TinyLm::new(&Device::flex());
    let link = BlockingClient::connect(addr).blocking().unwrap();
    FerryStore::connected(link, 0, "plain")
        .collect_from(&plain)
        .unwrap();
    let mut model = TinyLm::new(&device);
    FerryStore::embedded(node.clone(), runtime.handle().clone(), 0, "plain")
        .apply_to(&mut model)
        .unwrap();
    let logits = model.forward(batch(2, 5, &device));
    assert_eq!(logits.dims(), [2, 5, tiny_lm::VOCAB]);
}

#[test]
fn every_dtype_moved_onto_the_gpu_arrives_bit_exact_or_is_refused_by_name() {
    use ferry_burn::MoveError;
    use ferry_server::BackendKind;
    let gpu = Device::wgpu(DeviceKind::Cpu);
    let flex = Device::flex();
    let flex_holds = BackendKind::Flex.measured_holds().unwrap();
    let (mut moves, mut refusals) = (0, Vec::new());
    for sample in ferry_testkit::samples::full_matrix() {
        let shape = sample.data.shape().to_vec();
        if !(1..=3).contains(&shape.len())
            || flex_holds.check(&sample.data.dtype(), &shape).is_err()
        {
            continue;
        }
        // Decided by the GPU's table before a byte moves: a natively stored sub-byte scheme,
        // which cubecl cannot even be asked about without a panic, is refused by name.
        let (source, outcome) = support::moved(sample.data.clone(), &flex, &gpu);
        match outcome {
            Ok(arrived) => {
                assert_eq!(arrived.dtype(), source.dtype(), "{}", sample.name);
                assert_eq!(arrived.shape().to_vec(), shape, "{}", sample.name);
                assert!(
                    arrived.as_bytes() == source.as_bytes(),
                    "{}: the move changed the bytes",
                    sample.name
                );
                moves += 1;
            }
            Err(MoveError::NotHeld { dtype, device, .. }) => {
                assert_eq!(dtype, ferry_proto::dtype_name(&source.dtype()));
                assert_eq!(device, format!("{gpu:?}"));
                refusals.push(dtype);
            }
            Err(other) => panic!("{}: {other}", sample.name),
        }
    }
    eprintln!("{moves} moves bit-exact, refused: {refusals:?}");
    assert!(moves > 20, "{moves} moves");
    assert!(
        refusals.iter().any(|d| d.contains("Q4S")),
        "the GPU holds no native Q4S: {refusals:?}"
    );
}
