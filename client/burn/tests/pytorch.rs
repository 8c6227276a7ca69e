//! A PyTorch checkpoint on a node, applied to the equivalent Burn model with burn-store's
//! `PyTorchToBurnAdapter`: a `.safetensors` file as PyTorch writes it (linear weights
//! `[out, in]`, norms' `weight`/`bias`, a batch norm's running statistics and its step count)
//! is put on a node as `ferry put` puts it, then applied from an embedded node and over a
//! connection; every parameter arrives bit-exact (dtype and bytes), transposed where PyTorch
//! transposes. Without the adapter the apply is refused and the model, its running state
//! included, is left as it was; `BurnToPyTorchAdapter` puts the model back in PyTorch's layout.
// Test code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::Path;

use burn_core as burn;
use burn_core::module::Module;
use burn_core::tensor::{DType, Device, TensorData};
use burn_nn::{BatchNorm, BatchNormConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn_store::{BurnToPyTorchAdapter, ModuleStore, PyTorchToBurnAdapter};
use ferry_burn::{FerryStore, StoreError};
use ferry_client::BlockingClient;
use ferry_proto::IfExists;
use ferry_proto::message::PathsDigest;
use ferry_server::{DeviceSpec, Node, NodeConfig, Replace, Service, ServiceConfig};
use safetensors::{Dtype, tensor::TensorView};

/// The Burn model equivalent to PyTorch's
/// `Sequential(fc1=Linear(4, 6), norm=LayerNorm(6), bn=BatchNorm1d(6), fc2=Linear(6, 3))`.
#[derive(Module, Debug)]
struct Net {
    fc1: Linear,
    norm: LayerNorm,
    bn: BatchNorm,
    fc2: Linear,
}

impl Net {
    fn new(device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(4, 6).init(device),
            norm: LayerNormConfig::new(6).init(device),
            bn: BatchNormConfig::new(6).init(device),
            fc2: LinearConfig::new(6, 3).init(device),
        }
    }

    /// Every parameter's data, by the path burn-store names it.
    fn params(&self) -> Vec<(&'static str, TensorData)> {
        vec![
            ("fc1.weight", self.fc1.weight.val().into_data()),
            (
                "fc1.bias",
                self.fc1.bias.as_ref().unwrap().val().into_data(),
            ),
            ("norm.gamma", self.norm.gamma.val().into_data()),
            (
                "norm.beta",
                self.norm.beta.as_ref().unwrap().val().into_data(),
            ),
            ("bn.gamma", self.bn.gamma.val().into_data()),
            ("bn.beta", self.bn.beta.val().into_data()),
            ("bn.running_mean", self.bn.running_mean.value().into_data()),
            ("bn.running_var", self.bn.running_var.value().into_data()),
            ("fc2.weight", self.fc2.weight.val().into_data()),
            (
                "fc2.bias",
                self.fc2.bias.as_ref().unwrap().val().into_data(),
            ),
        ]
    }
}

/// An f32 checkpoint tensor: `name`, PyTorch's shape, and its bytes (odd bit patterns among
/// them: a NaN with a payload, -0.0, a subnormal), each value distinct.
struct Stored {
    name: &'static str,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn stored(name: &'static str, shape: &[usize], seed: u32) -> Stored {
    let n: usize = shape.iter().product();
    let specials = [0x7fc0_1234_u32, 0x8000_0000, 0x0000_0001];
    let bytes = (0..n)
        .map(|i| match i {
            0..3 => specials[i],
            _ => f32::to_bits(seed as f32 + i as f32 / 64.0),
        })
        .flat_map(u32::to_le_bytes)
        .collect();
    Stored {
        name,
        shape: shape.to_vec(),
        bytes,
    }
}

/// The checkpoint PyTorch's `save_file(model.state_dict())` writes for [`Net`].
fn checkpoint() -> Vec<Stored> {
    vec![
        stored("fc1.weight", &[6, 4], 1),
        stored("fc1.bias", &[6], 2),
        stored("norm.weight", &[6], 3),
        stored("norm.bias", &[6], 4),
        stored("bn.weight", &[6], 5),
        stored("bn.bias", &[6], 6),
        stored("bn.running_mean", &[6], 7),
        stored("bn.running_var", &[6], 8),
        stored("fc2.weight", &[3, 6], 9),
        stored("fc2.bias", &[3], 10),
    ]
}

/// PyTorch's `[rows, cols]` f32 bytes as Burn's `[cols, rows]`.
fn transposed(bytes: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        for c in 0..cols {
            let (from, to) = ((r * cols + c) * 4, (c * rows + r) * 4);
            out[to..to + 4].copy_from_slice(&bytes[from..from + 4]);
        }
    }
    out
}

/// What each Burn parameter must hold: the checkpoint's bytes, linear weights transposed.
fn expected(checkpoint: &[Stored]) -> HashMap<&'static str, (Vec<usize>, Vec<u8>)> {
    let burn_name = |name: &'static str| match name {
        "norm.weight" => "norm.gamma",
        "norm.bias" => "norm.beta",
        "bn.weight" => "bn.gamma",
        "bn.bias" => "bn.beta",
        other => other,
    };
    checkpoint
        .iter()
        .map(|t| match (t.name, t.shape.as_slice()) {
            ("fc1.weight" | "fc2.weight", &[rows, cols]) => {
                (t.name, (vec![cols, rows], transposed(&t.bytes, rows, cols)))
            }
            _ => (burn_name(t.name), (t.shape.clone(), t.bytes.clone())),
        })
        .collect()
}

/// Writes the checkpoint as PyTorch's safetensors does (with its `num_batches_tracked`, which
/// Burn has no parameter for).
fn write_checkpoint(path: &Path, checkpoint: &[Stored]) {
    let steps = 7i64.to_le_bytes();
    let mut views: Vec<(String, TensorView<'_>)> = checkpoint
        .iter()
        .map(|t| {
            let view = TensorView::new(Dtype::F32, t.shape.clone(), &t.bytes).unwrap();
            (t.name.to_string(), view)
        })
        .collect();
    views.push((
        "bn.num_batches_tracked".into(),
        TensorView::new(Dtype::I64, vec![], &steps).unwrap(),
    ));
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path).unwrap();
}

/// A node in this process with one Flex device, holding the checkpoint under `torch/` as
/// `ferry put model.safetensors NODE/0` with that prefix puts it (ferry-files' `read_tensors`,
/// each tensor under `PREFIX/NAME`); and the runtime it runs on.
fn node_holding_the_checkpoint(checkpoint: &[Stored]) -> (tokio::runtime::Runtime, Node) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write_checkpoint(&file, checkpoint);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let node = {
        let _entered = runtime.enter();
        Node::start(NodeConfig {
            devices: vec![DeviceSpec::Flex],
            ..NodeConfig::light()
        })
        .unwrap()
    };
    put_model(&runtime, &node, &file);
    (runtime, node)
}

/// The file's tensors as the model `torch` on device 0: a version written and committed whole,
/// as `ferry put FILE NODE/0 --model torch` puts it (replacing the model where there is one).
fn put_model(runtime: &tokio::runtime::Runtime, node: &Node, file: &std::path::Path) {
    let tensors = ferry_files::read_tensors(file).unwrap();
    runtime.block_on(async {
        let writer = node.begin_model(0, "torch", Replace::Allow).unwrap();
        for (name, data) in &tensors {
            node.insert(&writer.key(name), data.clone(), IfExists::Refuse)
                .await
                .unwrap();
        }
        let sent = PathsDigest::of(tensors.iter().map(|(name, _)| name.as_str()));
        writer.commit(Some(sent), Default::default()).await.unwrap();
    });
}

/// Every parameter of `net` holds what `expected` says, dtype F32, bytes exact.
fn assert_applied(net: &Net, expected: &HashMap<&'static str, (Vec<usize>, Vec<u8>)>) {
    for (path, data) in net.params() {
        let (shape, bytes) = &expected[path];
        assert_eq!(data.dtype(), DType::F32, "{path}: dtype");
        assert_eq!(data.shape().to_vec(), *shape, "{path}: shape");
        assert!(data.as_bytes() == bytes.as_slice(), "{path}: bytes differ");
    }
}

fn assert_whole(result: &burn_store::ApplyResult) {
    assert_eq!(result.applied.len(), 10, "{result}");
    assert!(
        result.errors.is_empty() && result.missing.is_empty(),
        "{result}"
    );
    assert_eq!(result.unused, ["bn.num_batches_tracked"], "{result}");
}

#[test]
fn a_pytorch_checkpoint_applies_from_an_embedded_node_bit_exact() {
    let checkpoint = checkpoint();
    let (runtime, node) = node_holding_the_checkpoint(&checkpoint);
    let device = Device::flex();
    let mut net = Net::new(&device);
    let result = FerryStore::embedded(node, runtime.handle().clone(), 0, "torch")
        .with_from_adapter(PyTorchToBurnAdapter)
        .apply_to(&mut net)
        .unwrap();
    assert_whole(&result);
    assert_applied(&net, &expected(&checkpoint));
}

#[test]
fn a_pytorch_checkpoint_applies_over_a_connection_bit_exact() {
    let checkpoint = checkpoint();
    let (runtime, node) = node_holding_the_checkpoint(&checkpoint);
    let service = runtime
        .block_on(Service::bind(
            node,
            "127.0.0.1:0".parse().unwrap(),
            ServiceConfig::default(),
        ))
        .unwrap();
    let addr = service.local_addr().unwrap().to_string();
    runtime.spawn(service.run(std::future::pending::<()>()));
    let client = BlockingClient::connect(&addr).blocking().unwrap();
    let device = Device::flex();
    let mut net = Net::new(&device);
    let result = FerryStore::connected(client, 0, "torch")
        .with_from_adapter(PyTorchToBurnAdapter)
        .apply_to(&mut net)
        .unwrap();
    assert_whole(&result);
    assert_applied(&net, &expected(&checkpoint));
}

#[test]
fn without_the_adapter_the_checkpoint_is_refused_and_the_model_left_as_it_was() {
    let checkpoint = checkpoint();
    let (runtime, node) = node_holding_the_checkpoint(&checkpoint);
    let device = Device::flex();
    let mut net = Net::new(&device);
    let before = net.params();
    let Err(StoreError::NotApplied(result)) =
        FerryStore::embedded(node, runtime.handle().clone(), 0, "torch").apply_to(&mut net)
    else {
        panic!("refused");
    };
    // The linear weights are the wrong way round, the norms' parameters not found.
    assert!(
        !result.errors.is_empty() && !result.missing.is_empty(),
        "{result}"
    );
    // The running statistics did apply to the copy, which shares them with the model (Burn's
    // `RunningState`): put back.
    assert!(
        result.applied.contains(&"bn.running_mean".to_string()),
        "{result}"
    );
    for ((path, now), (_, was)) in net.params().into_iter().zip(before) {
        assert!(now.as_bytes() == was.as_bytes(), "{path} changed");
    }
}

#[test]
fn a_model_collected_with_the_burn_to_pytorch_adapter_is_the_checkpoint_again() {
    let checkpoint = checkpoint();
    let (runtime, node) = node_holding_the_checkpoint(&checkpoint);
    let device = Device::flex();
    let store = || FerryStore::embedded(node.clone(), runtime.handle().clone(), 0, "torch");
    let mut net = Net::new(&device);
    store()
        .with_from_adapter(PyTorchToBurnAdapter)
        .apply_to(&mut net)
        .unwrap();
    FerryStore::embedded(node.clone(), runtime.handle().clone(), 0, "back")
        .with_to_adapter(BurnToPyTorchAdapter)
        .collect_from(&net)
        .unwrap();
    let back = node.open_model(0, "back").unwrap();
    for t in &checkpoint {
        let key = back.key(t.name);
        let data = runtime.block_on(node.get(&key)).unwrap();
        assert_eq!(data.dtype(), DType::F32, "{}", t.name);
        assert_eq!(data.shape().to_vec(), t.shape, "{}", t.name);
        assert!(
            data.as_bytes() == t.bytes.as_slice(),
            "{}: bytes differ",
            t.name
        );
    }
}

/// The check of what the parameter's device holds is made on the tensor as the adapter made
/// it: an F16 checkpoint is refused for a model on NdArray (which holds no F16), and applies
/// once an adapter casts it to F32.
#[cfg(feature = "ndarray")]
#[test]
fn a_dtype_the_device_cannot_hold_is_refused_unless_an_adapter_casts_it() {
    use burn_store::{FloatCastAdapter, ModuleAdapter};
    let halves: Vec<Stored> = checkpoint()
        .into_iter()
        .map(|t| Stored {
            bytes: t
                .bytes
                .chunks_exact(4)
                .flat_map(|b| {
                    let value = f32::from_le_bytes(b.try_into().unwrap());
                    burn_core::tensor::f16::from_f32(value).to_le_bytes()
                })
                .collect(),
            ..t
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("half.safetensors");
    let views: Vec<(String, TensorView<'_>)> = halves
        .iter()
        .map(|t| {
            let view = TensorView::new(Dtype::F16, t.shape.clone(), &t.bytes).unwrap();
            (t.name.to_string(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &file).unwrap();
    let (runtime, node) = node_holding_the_checkpoint(&[]);
    put_model(&runtime, &node, &file);
    #[allow(deprecated)] // NdArray is the second CPU backend ferry serves.
    let device = Device::ndarray();
    let store = || FerryStore::embedded(node.clone(), runtime.handle().clone(), 0, "torch");

    let mut net = Net::new(&device);
    let Err(StoreError::NotApplied(result)) = store()
        .with_from_adapter(PyTorchToBurnAdapter)
        .apply_to(&mut net)
    else {
        panic!("refused");
    };
    let message = format!("{:?}", result.errors);
    assert_eq!(result.errors.len(), 10, "{result}");
    assert!(
        message.contains("F16") && message.contains("fc1.weight"),
        "{message}"
    );

    let result = store()
        .with_from_adapter(PyTorchToBurnAdapter.chain(FloatCastAdapter::to(DType::F32)))
        .apply_to(&mut net)
        .unwrap();
    // The half file is the model's whole version: no `num_batches_tracked` in it.
    assert_eq!(result.applied.len(), 10, "{result}");
    assert!(result.errors.is_empty() && result.missing.is_empty() && result.unused.is_empty());
    let fc1 = net.fc1.weight.val().into_data();
    assert_eq!(
        (fc1.dtype(), fc1.shape().to_vec()),
        (DType::F32, vec![4, 6])
    );
}
