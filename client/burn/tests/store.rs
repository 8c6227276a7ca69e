//! A whole module through a ferry node with burn-store's `ModuleStore`: every parameter of a
//! quantized model back bytes-exact (and as burnpack keeps it), filters and renaming, a missing,
//! extra, mis-shaped or unholdable tensor, a node gone halfway (the module left exactly as it
//! was), a collect over several connections (lanes), and a model applied from an embedded node
//! sharing the node's buffers.
// Test code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

mod support;
#[path = "../examples/shared/tiny_lm.rs"]
#[allow(dead_code)]
mod tiny_lm;

use std::collections::BTreeMap;

use burn_core as burn;
use burn_core::module::{Module, ModuleVisitor, Param, ParamId, Parameter};
use burn_core::tensor::{Bool, DType, Device, Int, Tensor, TensorData};
use burn_dispatch::{BackendTensor, DispatchKindConversion, DispatchTensor};
use burn_flex::{Flex, FlexTensor};
use burn_nn::{Linear, LinearConfig};
use burn_store::{ApplyError, BurnpackStore, KeyRemapper, ModuleStore, PathFilter};
use ferry_burn::{FerryStore, Missing, StoreError};
use ferry_client::{BlockingClient, Wait};
use ferry_proto::message::PathsDigest;
use ferry_proto::{IfExists, TensorKey};
use ferry_server::{DeviceSpec, Node, NodeConfig, Primitive, Replace, ServiceConfig};
use ferry_testkit::{BackgroundNode, Fault, proxy};
use support::{assert_same_params, params};
use tiny_lm::{Quantization, TinyLm, batch, quantized};

/// A node of one Flex device, served on loopback.
fn serve_flex() -> BackgroundNode {
    let config = NodeConfig {
        devices: vec![DeviceSpec::Flex],
        ..NodeConfig::light()
    };
    BackgroundNode::start(config, ServiceConfig::default(), None)
}

fn client(addr: &str) -> BlockingClient {
    BlockingClient::connect(addr).blocking().unwrap()
}

/// The tensors of the model `prefix`'s current version, by path.
fn model_tensors(admin: &mut BlockingClient, prefix: &str) -> BTreeMap<String, TensorData> {
    let manifest = admin.open_model(0, prefix).wait().unwrap();
    let tensors = manifest
        .tensors
        .iter()
        .map(|t| {
            let key = TensorKey::new(0, manifest.name_of(&t.path));
            (t.path.clone(), admin.get(&key).wait().unwrap())
        })
        .collect();
    admin.close_model(&manifest).wait().unwrap();
    tensors
}

/// Replaces the model `prefix` with a version of `tensors`, written by hand (a model whose
/// tensors another program made, missing, extra or mis-shaped ones included).
fn write_version(admin: &mut BlockingClient, prefix: &str, tensors: &BTreeMap<String, TensorData>) {
    let version = admin.begin_model(0, prefix, true).wait().unwrap();
    for (path, data) in tensors {
        let key = TensorKey::new(0, format!("{prefix}/.v{version}/{path}"));
        admin.put(&key, data).wait().unwrap();
    }
    let paths = tensors.keys().map(String::as_str);
    admin
        .commit_model(0, prefix, version, paths, Vec::new())
        .wait()
        .unwrap();
}

#[test]
fn every_parameter_of_a_quantized_model_arrives_bytes_exact_as_burnpack_keeps_it() {
    let node = serve_flex();
    let device = Device::flex();
    for quantization in [Quantization::PerTensor, Quantization::PerBlock] {
        let sent = quantized(TinyLm::new(&device), quantization);
        let sent_params = params(&sent);
        let quantized_count = sent_params
            .values()
            .filter(|d| matches!(d.dtype(), burn_core::tensor::DType::QFloat(_)))
            .count();
        assert_eq!(
            quantized_count, 4,
            "{quantization:?}: both linear layers quantized"
        );

        let prefix = format!("{quantization:?}");
        let mut store = FerryStore::connected(client(&node.addr), 0, &prefix);
        store.collect_from(&sent).unwrap();
        let mut received = TinyLm::new(&device);
        let result = store.apply_to(&mut received).unwrap();
        assert_eq!(
            result.applied.len(),
            sent_params.len(),
            "{quantization:?}: {result}"
        );
        assert!(result.missing.is_empty() && result.unused.is_empty() && result.errors.is_empty());
        assert_same_params(&params(&received), &sent_params);

        // burn-store's own file store, through memory, keeps exactly the same.
        let mut pack = BurnpackStore::from_bytes(None);
        pack.collect_from(&sent).unwrap();
        let mut from_pack = TinyLm::new(&device);
        pack.apply_to(&mut from_pack).unwrap();
        assert_same_params(&params(&from_pack), &params(&received));

        // And the model computes exactly what the sender's does.
        let tokens = batch(2, 7, &device);
        let want = sent.forward(tokens.clone()).into_data();
        let got = received.forward(tokens).into_data();
        assert_eq!(got.dtype(), want.dtype());
        assert!(
            got.as_bytes() == want.as_bytes(),
            "{quantization:?}: forward differs"
        );

        // The store's listing is the node's, names as the module's paths.
        let mut keys = store.keys().unwrap();
        keys.sort();
        assert_eq!(keys, sent_params.keys().cloned().collect::<Vec<_>>());
    }
}

/// A parameter of every kind, and views: f32 and F16 floats, an integer, a bool, a transposed
/// tensor and a slice of a larger one.
#[derive(Module, Debug)]
struct Mixed {
    linear: Linear,
    half: Param<Tensor<2>>,
    steps: Param<Tensor<1, Int>>,
    mask: Param<Tensor<2, Bool>>,
    transposed: Param<Tensor<2>>,
    narrowed: Param<Tensor<1>>,
}

fn param<T: Parameter>(tensor: T) -> Param<T> {
    Param::initialized(ParamId::new(), tensor)
}

impl Mixed {
    /// Values that differ with `seed`.
    fn new(device: &Device, seed: f32) -> Self {
        let floats = |n: usize| (0..n).map(|i| seed + i as f32 * 0.25).collect::<Vec<f32>>();
        let half = TensorData::new(floats(6), [2, 3]).convert_dtype(DType::F16);
        Self {
            linear: LinearConfig::new(4, 3).init(device),
            half: param(Tensor::from_data(half, (device, DType::F16))),
            steps: param(Tensor::from_data(
                TensorData::new(vec![seed as i64, -1, 7], [3]),
                device,
            )),
            mask: param(Tensor::from_data(
                TensorData::new(vec![seed > 1.0, true, false, seed < 1.0], [2, 2]),
                device,
            )),
            transposed: param(
                Tensor::from_data(TensorData::new(floats(12), [3, 4]), device).transpose(),
            ),
            narrowed: param(Tensor::from_data(TensorData::new(floats(8), [8]), device).slice(2..6)),
        }
    }
}

#[test]
fn a_collect_sends_every_kind_of_parameter_as_burn_store_reads_it() {
    let node = serve_flex();
    let device = Device::flex();
    let sent = Mixed::new(&device, 2.0);
    let sent_params = params(&sent);
    let before = buffers(&sent);
    let holders_before = holders(&sent);
    FerryStore::connected(client(&node.addr), 0, "mixed")
        .collect_from(&sent)
        .unwrap();
    // The buffers the collect shared are the module's alone again once it returned: the
    // parameters' own writes copy nothing on its account.
    assert_eq!(holders(&sent), holders_before);

    // The node holds exactly what burn-store's collect reads: dtype, shape and bytes.
    assert_same_params(
        &model_tensors(&mut client(&node.addr), "mixed"),
        &sent_params,
    );
    // The sender's parameters are where they were and as they were.
    assert_eq!(buffers(&sent), before);
    assert_same_params(&params(&sent), &sent_params);

    let mut received = Mixed::new(&device, 0.5);
    let result = FerryStore::connected(client(&node.addr), 0, "mixed")
        .apply_to(&mut received)
        .unwrap();
    assert_eq!(result.applied.len(), sent_params.len(), "{result}");
    assert_same_params(&params(&received), &sent_params);
}

/// A tensor the node refuses in the middle of a batch (an F16 parameter for an NdArray device,
/// which holds no F16) fails the collect with that refusal, whatever went before and after it
/// in the batch, and leaves nothing: no model, no tensor on the device.
#[test]
fn a_tensor_refused_mid_batch_fails_the_collect_and_leaves_nothing() {
    let config = NodeConfig {
        devices: vec![DeviceSpec::Flex, DeviceSpec::NdArray],
        ..NodeConfig::light()
    };
    let node = BackgroundNode::start(config, ServiceConfig::default(), None);
    let sent = Mixed::new(&Device::flex(), 2.0);
    let error = FerryStore::connected(client(&node.addr), 1, "mixed")
        .collect_from(&sent)
        .unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(error, StoreError::NotCollected { .. }) && message.contains("F16"),
        "{message}"
    );
    let mut admin = client(&node.addr);
    assert!(admin.open_model(1, "mixed").wait().is_err(), "no model");
    let left = admin.list(Some(1)).wait().unwrap();
    assert!(left.is_empty(), "nothing left on the device: {left:?}");
}

/// Two layers of one shape, for renaming one into the other.
#[derive(Module, Debug)]
struct Pair {
    left: Linear,
    right: Linear,
}

impl Pair {
    fn new(device: &Device) -> Self {
        Self {
            left: LinearConfig::new(8, 8).init(device),
            right: LinearConfig::new(8, 8).init(device),
        }
    }
}

#[test]
fn a_filter_sends_and_applies_only_what_it_matches_and_a_remapper_renames() {
    let node = serve_flex();
    let device = Device::flex();
    let sent = Pair::new(&device);
    let sent_params = params(&sent);

    // Only the left layer is sent.
    let left_only = PathFilter::new().with_regex(r"^left\.");
    let mut store = FerryStore::connected(client(&node.addr), 0, "filtered").with_filter(left_only);
    store.collect_from(&sent).unwrap();
    let mut keys = store.keys().unwrap();
    keys.sort();
    assert_eq!(keys, ["left.bias", "left.weight"]);

    // The filter is asked before a parameter is touched, over a connection and into an
    // embedded node alike: a lazy parameter it leaves out stays uninitialized.
    let (runtime, embedded_node) = embedded(vec![DeviceSpec::Flex]);
    for into_embedded in [false, true] {
        let lazy = Pair::new(&device);
        let left_only = PathFilter::new().with_regex(r"^left\.");
        if into_embedded {
            FerryStore::embedded(embedded_node.clone(), runtime.handle().clone(), 0, "lazy")
                .with_filter(left_only)
                .collect_from(&lazy)
                .unwrap();
        } else {
            FerryStore::connected(client(&node.addr), 0, "lazy")
                .with_filter(left_only)
                .collect_from(&lazy)
                .unwrap();
        }
        assert!(
            lazy.left.weight.is_initialized() && !lazy.right.weight.is_initialized(),
            "embedded: {into_embedded}"
        );
    }

    // The whole pair is sent; applied with the layers' names swapped.
    let mut store = FerryStore::connected(client(&node.addr), 0, "pair");
    store.collect_from(&sent).unwrap();
    let swap = KeyRemapper::new()
        .add_pattern(r"^left\.", "tmp.")
        .unwrap()
        .add_pattern(r"^right\.", "left.")
        .unwrap()
        .add_pattern(r"^tmp\.", "right.")
        .unwrap();
    let mut swapped = Pair::new(&device);
    let result = FerryStore::connected(client(&node.addr), 0, "pair")
        .remap(swap)
        .apply_to(&mut swapped)
        .unwrap();
    assert_eq!(result.applied.len(), 4, "{result}");
    let got = params(&swapped);
    for (from, to) in [("left", "right"), ("right", "left")] {
        for part in ["weight", "bias"] {
            let (got, want) = (
                &got[&format!("{to}.{part}")],
                &sent_params[&format!("{from}.{part}")],
            );
            assert!(
                got.as_bytes() == want.as_bytes(),
                "{to}.{part} holds {from}.{part}"
            );
        }
    }

    // Applied through a filter: the right layer keeps its own values, counted as skipped.
    let mut target = Pair::new(&device);
    let before = params(&target);
    let result = FerryStore::connected(client(&node.addr), 0, "pair")
        .with_filter(PathFilter::new().with_regex(r"^left\."))
        .apply_to(&mut target)
        .unwrap();
    assert_eq!(result.applied.len(), 2, "{result}");
    assert_eq!(result.skipped, ["right.bias", "right.weight"]);
    let after = params(&target);
    assert!(after["left.weight"].as_bytes() == sent_params["left.weight"].as_bytes());
    assert!(after["right.weight"].as_bytes() == before["right.weight"].as_bytes());
}

#[test]
fn a_missing_extra_or_mis_shaped_tensor_is_reported_and_a_refused_apply_changes_nothing() {
    let node = serve_flex();
    let device = Device::flex();
    let sent = Pair::new(&device);
    let mut store = FerryStore::connected(client(&node.addr), 0, "m");
    store.collect_from(&sent).unwrap();
    let mut admin = client(&node.addr);

    // Missing: refused whole by default, the target untouched.
    let whole = model_tensors(&mut admin, "m");
    let mut tensors = whole.clone();
    tensors.remove("right.bias");
    write_version(&mut admin, "m", &tensors);
    let mut target = Pair::new(&device);
    let before = params(&target);
    let Err(StoreError::NotApplied(result)) = store.apply_to(&mut target) else {
        panic!("a missing tensor refuses the apply");
    };
    assert_eq!(
        result
            .missing
            .iter()
            .map(|(p, _)| p.as_str())
            .collect::<Vec<_>>(),
        ["right.bias"]
    );
    assert_same_params(&params(&target), &before);
    // ... and allowed on request: the rest applied, the missing one kept.
    let mut store = FerryStore::connected(client(&node.addr), 0, "m").missing(Missing::Allow);
    let result = store.apply_to(&mut target).unwrap();
    assert_eq!(result.applied.len(), 3);
    let after = params(&target);
    assert!(after["right.bias"].as_bytes() == before["right.bias"].as_bytes());
    assert!(after["left.weight"].as_bytes() == params(&sent)["left.weight"].as_bytes());

    // Extra: reported unused, the rest applied.
    let extra = TensorData::new(vec![1.0f32; 4], [4]);
    let mut tensors = whole.clone();
    tensors.insert("middle.weight".into(), extra);
    write_version(&mut admin, "m", &tensors);
    let result = store.apply_to(&mut Pair::new(&device)).unwrap();
    assert_eq!(result.unused, ["middle.weight"]);

    // Mis-shaped: an error in the result, and nothing applied at all.
    let wrong = TensorData::new(vec![0.5f32; 32], [4, 8]);
    let mut tensors = whole.clone();
    tensors.insert("left.weight".into(), wrong);
    write_version(&mut admin, "m", &tensors);
    let mut target = Pair::new(&device);
    let before = params(&target);
    let Err(StoreError::NotApplied(result)) = store.apply_to(&mut target) else {
        panic!("a mis-shaped tensor refuses the apply");
    };
    assert!(
        matches!(&result.errors[..], [ApplyError::ShapeMismatch { path, .. }] if path == "left.weight"),
        "{result}"
    );
    assert_same_params(&params(&target), &before);

    // Of another kind (an int tensor for a float parameter): refused, never read.
    let ints = TensorData::new(vec![7i32; 64], [8, 8]);
    let mut tensors = whole.clone();
    tensors.insert("left.weight".into(), ints);
    write_version(&mut admin, "m", &tensors);
    let Err(StoreError::NotApplied(result)) = store.apply_to(&mut target) else {
        panic!("an int tensor refuses the apply");
    };
    assert!(
        matches!(&result.errors[..], [ApplyError::DTypeMismatch { .. }]),
        "{result}"
    );
    assert_same_params(&params(&target), &before);
}

/// A model of many layers, so a connection cut partway leaves some fetched and some not.
#[derive(Module, Debug)]
struct Deep {
    layers: Vec<Linear>,
}

impl Deep {
    fn new(device: &Device) -> Self {
        Self {
            layers: (0..8)
                .map(|_| LinearConfig::new(128, 128).init(device))
                .collect(),
        }
    }
}

#[test]
fn a_node_gone_halfway_through_an_apply_leaves_the_module_exactly_as_it_was() {
    let node = serve_flex();
    let device = Device::flex();
    let sent = Deep::new(&device);
    FerryStore::connected(client(&node.addr), 0, "deep")
        .collect_from(&sent)
        .unwrap();

    // In front of the node, a proxy that dies after about half the model's bytes.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let model_bytes: usize = params(&sent).values().map(|d| d.as_bytes().len()).sum();
    let upstream = node.addr.parse().unwrap();
    let cut = runtime.block_on(proxy(upstream, Fault::DieAfter(model_bytes / 2)));
    let through_proxy = BlockingClient::connect(cut)
        .shared_memory(ferry_client::SharedMemory::Decline)
        .blocking()
        .unwrap();

    let mut target = Deep::new(&device);
    let before = params(&target);
    let Err(StoreError::NotApplied(result)) =
        FerryStore::connected(through_proxy, 0, "deep").apply_to(&mut target)
    else {
        panic!("a node gone halfway refuses the apply");
    };
    assert!(!result.errors.is_empty(), "{result}");
    assert!(
        result
            .errors
            .iter()
            .all(|e| matches!(e, ApplyError::LoadError { .. })),
        "{result}"
    );
    assert!(
        !result.applied.is_empty(),
        "the cut came partway: some tensors had arrived ({result})"
    );
    assert_same_params(&params(&target), &before);
}

#[cfg(feature = "ndarray")]
#[test]
fn a_dtype_the_parameters_device_cannot_hold_is_an_error_before_a_byte_moves() {
    use burn_core::tensor::quantization::{QuantScheme, QuantStore, QuantValue};
    let node = serve_flex();
    // Q4S: Flex holds it, NdArray does not (its q_from_data panics on it).
    let q4 = QuantScheme::default()
        .with_value(QuantValue::Q4S)
        .with_store(QuantStore::Native);
    let flex = Device::flex();
    let mut sent = Pair::new(&flex);
    sent.left.weight = sent.left.weight.map(|w| w.quantize_dynamic(&q4));
    FerryStore::connected(client(&node.addr), 0, "q4")
        .collect_from(&sent)
        .unwrap();

    #[allow(deprecated)] // NdArray is the second CPU backend ferry serves.
    let mut target = Pair::new(&Device::ndarray());
    let before = params(&target);
    let Err(StoreError::NotApplied(result)) =
        FerryStore::connected(client(&node.addr), 0, "q4").apply_to(&mut target)
    else {
        panic!("an unholdable dtype refuses the apply");
    };
    let [ApplyError::LoadError { path, message }] = &result.errors[..] else {
        panic!("one load error: {result}");
    };
    assert_eq!(path, "left.weight");
    assert!(message.contains("cannot hold"), "{message}");
    assert_same_params(&params(&target), &before);
}

/// `of` each float parameter's Flex tensor (a plain one: anything else panics), by path.
fn each_flex_float<M: Module, T>(module: &M, of: fn(&FlexTensor) -> T) -> BTreeMap<String, T> {
    struct Each<T> {
        path: Vec<String>,
        of: fn(&FlexTensor) -> T,
        found: BTreeMap<String, T>,
    }
    impl<T> ModuleVisitor for Each<T> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let dispatch = param.val().into_dispatch();
            let backend =
                <DispatchTensor as DispatchKindConversion<Flex>>::try_into_backend(dispatch)
                    .unwrap();
            let BackendTensor::Float(flex) = backend else {
                panic!("a plain float parameter");
            };
            self.found.insert(self.path.join("."), (self.of)(&flex));
        }
    }
    let mut visitor = Each {
        path: Vec::new(),
        of,
        found: BTreeMap::new(),
    };
    module.visit(&mut visitor);
    visitor.found
}

/// Where each Flex parameter's values lie, by path.
fn buffers<M: Module>(module: &M) -> BTreeMap<String, usize> {
    each_flex_float(module, |flex| flex.bytes().as_ptr() as usize)
}

/// How many hold each float parameter's Flex buffer, by path (each count with the one handle
/// the count itself takes).
fn holders<M: Module>(module: &M) -> BTreeMap<String, usize> {
    each_flex_float(module, |flex| {
        std::sync::Arc::strong_count(&flex.data_arc())
    })
}

#[test]
fn a_model_applied_from_an_embedded_node_shares_the_nodes_buffers() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let config = NodeConfig {
        devices: vec![DeviceSpec::Flex],
        ..NodeConfig::light()
    };
    let node = {
        let _entered = runtime.enter();
        Node::start(config).unwrap()
    };
    let device = Device::flex();
    let sent = TinyLm::new(&device);
    let mut store = FerryStore::embedded(node.clone(), runtime.handle().clone(), 0, "lm");
    // Collected with no copy: the node shares the module's buffers.
    store.collect_from(&sent).unwrap();
    let mut received = TinyLm::new(&device);
    let result = store.apply_to(&mut received).unwrap();
    assert_eq!(result.applied.len(), 7, "{result}");
    assert_same_params(&params(&received), &params(&sent));

    let node_buffers: BTreeMap<String, usize> = buffers(&sent)
        .keys()
        .map(|path| {
            let key = node.open_model(0, "lm").unwrap().key(path);
            let (_, primitive) = runtime.block_on(node.primitive::<Flex>(&key)).unwrap();
            let Primitive::Float(flex) = primitive else {
                panic!("a float tensor");
            };
            (path.clone(), flex.bytes().as_ptr() as usize)
        })
        .collect();
    assert_eq!(
        buffers(&sent),
        node_buffers,
        "the node holds the module's own buffers"
    );
    assert_eq!(
        buffers(&received),
        node_buffers,
        "the applied model reads the node's buffers"
    );

    // A write by the model copies first: the node's tensor stays as it was. The parameter's
    // tensor (whose buffer the node's tensor shares) is written, and the write goes to a copy.
    let key = node.open_model(0, "lm").unwrap().key("hidden.weight");
    let before = runtime.block_on(node.get(&key)).unwrap();
    let weight = received.hidden.weight.val();
    drop(received);
    let dispatch = weight.into_dispatch();
    let BackendTensor::Float(mut flex) =
        <DispatchTensor as DispatchKindConversion<Flex>>::try_into_backend(dispatch).unwrap()
    else {
        panic!("a plain float parameter");
    };
    for value in flex.storage_mut::<f32>() {
        *value += 1.0;
    }
    assert_ne!(
        flex.bytes().as_ptr() as usize,
        node_buffers["hidden.weight"],
        "the write went to a copy"
    );
    let after = runtime.block_on(node.get(&key)).unwrap();
    assert!(
        after.as_bytes() == before.as_bytes(),
        "the node's bytes are its own"
    );
    let written: Vec<f32> = bytemuck::cast_slice(flex.bytes()).to_vec();
    let original: Vec<f32> = bytemuck::cast_slice(before.as_bytes()).to_vec();
    assert!(
        written.iter().zip(&original).all(|(w, o)| *w == *o + 1.0),
        "the model's copy holds its write"
    );
}

#[test]
fn a_store_refuses_on_an_async_tasks_thread_and_works_from_spawn_blocking() {
    let node = serve_flex();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let device = Device::flex();
    let sent = Pair::new(&device);
    FerryStore::connected(client(&node.addr), 0, "async")
        .collect_from(&sent)
        .unwrap();

    let mut store = FerryStore::connected(client(&node.addr), 0, "async");
    let outcome = runtime.block_on(async { store.apply_to(&mut Pair::new(&device)) });
    assert!(
        matches!(outcome, Err(StoreError::InsideRuntime)),
        "{outcome:?}"
    );

    // From spawn_blocking (a thread with the runtime's context, driving none of it): applied.
    let applied = runtime
        .block_on(runtime.spawn_blocking(move || {
            let mut target = Pair::new(&Device::flex());
            store.apply_to(&mut target).map(|_| target)
        }))
        .unwrap()
        .unwrap();
    assert_same_params(&params(&applied), &params(&sent));
}

/// A node of one Flex device, served on loopback and on a Unix socket (`unix:PATH`) in a
/// temporary directory, kept while the node is used.
fn serve_flex_on_a_unix_socket_too() -> (BackgroundNode, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let config = NodeConfig {
        devices: vec![DeviceSpec::Flex],
        ..NodeConfig::light()
    };
    let node = BackgroundNode::start(
        config,
        ServiceConfig::default(),
        Some(&dir.path().join("node.sock")),
    );
    let unix = node.unix.clone().unwrap();
    (node, unix, dir)
}

/// A connection over the node's Unix socket that sends every payload through shared memory:
/// what it carried shows in the node's `shm_payloads_received`.
fn through_shared_memory(unix: &str) -> BlockingClient {
    BlockingClient::connect(unix)
        .limits(ferry_client::ConnectionLimits {
            region_min: 1,
            ..Default::default()
        })
        .blocking()
        .unwrap()
}

/// A collect over a store's connection and two lanes: the tensors are dealt to the three in
/// turn (the lanes' share came through shared memory, the first connection's over TCP), and
/// the model comes back bytes-exact over a single connection.
#[test]
fn a_model_collected_over_lanes_is_dealt_to_each_and_arrives_bytes_exact() {
    let (node, unix, _dir) = serve_flex_on_a_unix_socket_too();
    let device = Device::flex();
    let sent = quantized(TinyLm::new(&device), Quantization::PerTensor);
    let sent_params = params(&sent);
    let lanes = vec![through_shared_memory(&unix), through_shared_memory(&unix)];
    FerryStore::connected(client(&node.addr), 0, "laned")
        .with_lanes(lanes)
        .unwrap()
        .collect_from(&sent)
        .unwrap();

    let mut stat = client(&node.addr);
    let over_lanes = (0..sent_params.len()).filter(|i| i % 3 != 0).count();
    assert_eq!(
        stat.stat().wait().unwrap().shm_payloads_received,
        over_lanes as u64,
        "tensor i went over connection i % 3: the lanes carried two in three"
    );
    let mut received = TinyLm::new(&device);
    let result = FerryStore::connected(client(&node.addr), 0, "laned")
        .apply_to(&mut received)
        .unwrap();
    assert_eq!(result.applied.len(), sent_params.len(), "{result}");
    assert_same_params(&params(&received), &sent_params);
}

/// A lane that reaches another node is refused when it is given, before anything is sent.
#[test]
fn a_lane_to_another_node_is_refused() {
    let (node, other) = (serve_flex(), serve_flex());
    let refused = FerryStore::connected(client(&node.addr), 0, "m")
        .with_lanes(vec![client(&node.addr), client(&other.addr)]);
    assert!(
        matches!(refused, Err(StoreError::LaneToAnotherNode { .. })),
        "{refused:?}"
    );
    for at in [&node, &other] {
        assert!(client(&at.addr).list(Some(0)).wait().unwrap().is_empty());
    }
}

/// A lane through a proxy that passes `frames` frames from the node (its `Welcome` first,
/// then the answer to `with_lanes`' check), then cuts it; and the runtime the proxy runs on,
/// to be kept while the lane is used.
fn lane_cut_after(
    node: &BackgroundNode,
    frames: usize,
) -> (BlockingClient, tokio::runtime::Runtime) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let cut = runtime.block_on(proxy(
        node.addr.parse().unwrap(),
        Fault::CutAfterFrames(frames),
    ));
    (BlockingClient::connect(cut).blocking().unwrap(), runtime)
}

/// A collect whose lane fails during it (cut at its first put) fails with that lane's error,
/// every sender stopping; the version it wrote is given up, nothing of it kept. The failed lane
/// is dropped: the next collect goes over the store's connection and the other lane, whole.
#[test]
fn a_collect_whose_lane_fails_stops_with_its_error_and_the_next_goes_on_without_it() {
    let node = serve_flex();
    let device = Device::flex();
    let sent = Deep::new(&device);
    let sent_params = params(&sent);
    // Welcome, `with_lanes`' identity, the collect's identity check; the cut takes the first
    // put's `Ready`.
    let (cut, _proxy) = lane_cut_after(&node, 3);
    let lanes = vec![cut, client(&node.addr)];
    let mut store = FerryStore::connected(client(&node.addr), 0, "cut")
        .with_lanes(lanes)
        .unwrap();
    let failed = store.collect_from(&sent);
    assert!(
        matches!(&failed, Err(StoreError::NotCollected { cause, .. }) if matches!(**cause, StoreError::Client(_))),
        "{failed:?}"
    );
    // The version was given up: no model, and nothing of it is left on the node.
    let mut check = client(&node.addr);
    assert!(
        check.open_model(0, "cut").wait().is_err(),
        "no model from a failed collect"
    );
    for _ in 0..200 {
        if check.list(Some(0)).wait().unwrap().is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(
        check.list(Some(0)).wait().unwrap(),
        [],
        "nothing of it left"
    );

    store.collect_from(&sent).unwrap();
    let mut received = Deep::new(&device);
    let result = FerryStore::connected(client(&node.addr), 0, "cut")
        .apply_to(&mut received)
        .unwrap();
    assert_eq!(result.applied.len(), sent_params.len(), "{result}");
    assert_same_params(&params(&received), &sent_params);
}

/// A lane the node closed before a collect (cut at the collect's identity check, as a node
/// closes a connection idle past its keepalive) is dropped and the collect goes on without it:
/// every tensor arrives, and the lane left carried its share.
#[test]
fn a_lane_closed_before_a_collect_is_dropped_and_the_collect_goes_on() {
    let (node, unix, _dir) = serve_flex_on_a_unix_socket_too();
    let device = Device::flex();
    let sent = Deep::new(&device);
    let sent_params = params(&sent);
    // Welcome and `with_lanes`' identity pass; the collect's identity check is cut.
    let (cut, _proxy) = lane_cut_after(&node, 2);
    let lanes = vec![cut, through_shared_memory(&unix)];
    FerryStore::connected(client(&node.addr), 0, "closed")
        .with_lanes(lanes)
        .unwrap()
        .collect_from(&sent)
        .unwrap();
    let mut stat = client(&node.addr);
    let over_the_lane = (0..sent_params.len()).filter(|i| i % 2 == 1).count();
    assert_eq!(
        stat.stat().wait().unwrap().shm_payloads_received,
        over_the_lane as u64,
        "tensor i went over connection i % 2 of the two left"
    );
    let mut received = Deep::new(&device);
    let result = FerryStore::connected(client(&node.addr), 0, "closed")
        .apply_to(&mut received)
        .unwrap();
    assert_eq!(result.applied.len(), sent_params.len(), "{result}");
    assert_same_params(&params(&received), &sent_params);
}

/// A node in this process with `devices`, and the runtime it runs on.
fn embedded(devices: Vec<DeviceSpec>) -> (tokio::runtime::Runtime, Node) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let node = {
        let _entered = runtime.enter();
        Node::start(NodeConfig {
            devices,
            ..NodeConfig::light()
        })
        .unwrap()
    };
    (runtime, node)
}

#[test]
fn a_quantized_model_applied_from_an_embedded_node_is_handed_its_values_without_a_copy() {
    let (runtime, node) = embedded(vec![DeviceSpec::Flex]);
    let device = Device::flex();
    let sent = quantized(TinyLm::new(&device), Quantization::PerBlock);
    let mut store = FerryStore::embedded(node.clone(), runtime.handle().clone(), 0, "q");
    store.collect_from(&sent).unwrap();
    let mut received = TinyLm::new(&device);
    store.apply_to(&mut received).unwrap();
    assert_same_params(&params(&received), &params(&sent));

    // The quantized weight's values are the node's own buffer.
    let values = |tensor: Tensor<2>| {
        let dispatch = tensor.into_dispatch();
        let BackendTensor::Quantized(q) =
            <DispatchTensor as DispatchKindConversion<Flex>>::try_into_backend(dispatch).unwrap()
        else {
            panic!("a quantized tensor");
        };
        q.tensor().bytes().as_ptr() as usize
    };
    let key = node.open_model(0, "q").unwrap().key("hidden.weight");
    let (_, primitive) = runtime.block_on(node.primitive::<Flex>(&key)).unwrap();
    let Primitive::Quantized(on_node) = primitive else {
        panic!("a quantized tensor on the node");
    };
    assert_eq!(
        values(received.hidden.weight.val()),
        on_node.tensor().bytes().as_ptr() as usize
    );
}

#[test]
fn an_apply_from_an_embedded_node_checks_and_reports_as_burn_stores_applier_does() {
    let (runtime, node) = embedded(vec![DeviceSpec::Flex]);
    let device = Device::flex();
    let sent = Pair::new(&device);
    let store = || FerryStore::embedded(node.clone(), runtime.handle().clone(), 0, "p");
    store().collect_from(&sent).unwrap();

    // Through a filter: the rest skipped and kept.
    let mut target = Pair::new(&device);
    let before = params(&target);
    let result = store()
        .with_filter(PathFilter::new().with_regex(r"^left\."))
        .apply_to(&mut target)
        .unwrap();
    assert_eq!(result.applied.len(), 2, "{result}");
    assert_eq!(result.skipped, ["right.bias", "right.weight"]);
    assert!(params(&target)["right.weight"].as_bytes() == before["right.weight"].as_bytes());

    // Mis-shaped, of another kind, and missing: each refused, the module left as it was. A
    // version of such tensors, written by hand.
    let mut tensors: BTreeMap<String, TensorData> = params(&sent);
    tensors.remove("right.bias");
    tensors.insert(
        "left.weight".into(),
        TensorData::new(vec![0.5f32; 32], [4, 8]),
    );
    tensors.insert(
        "right.weight".into(),
        TensorData::new(vec![7i32; 64], [8, 8]),
    );
    tensors.insert(
        "middle.weight".into(),
        TensorData::new(vec![1.0f32; 4], [4]),
    );
    runtime.block_on(async {
        let writer = node.begin_model(0, "p", Replace::Allow).unwrap();
        for (path, data) in &tensors {
            node.insert(&writer.key(path), data.clone(), IfExists::Refuse)
                .await
                .unwrap();
        }
        let sent = PathsDigest::of(tensors.keys().map(String::as_str));
        writer.commit(Some(sent), BTreeMap::new()).await.unwrap();
    });
    let mut target = Pair::new(&device);
    let before = params(&target);
    let Err(StoreError::NotApplied(result)) = store().apply_to(&mut target) else {
        panic!("refused");
    };
    assert!(
        result
            .errors
            .iter()
            .any(|e| matches!(e, ApplyError::ShapeMismatch { path, .. } if path == "left.weight")),
        "{result}"
    );
    assert!(
        result
            .errors
            .iter()
            .any(|e| matches!(e, ApplyError::DTypeMismatch { path, .. } if path == "right.weight")),
        "{result}"
    );
    assert_eq!(
        result
            .missing
            .iter()
            .map(|(p, _)| p.as_str())
            .collect::<Vec<_>>(),
        ["right.bias"]
    );
    assert_eq!(result.unused, ["middle.weight"]);
    assert_same_params(&params(&target), &before);
}

#[cfg(feature = "ndarray")]
#[test]
fn an_embedded_node_on_ndarray_applies_to_a_flex_model_through_the_host() {
    // NdArray has no handoff: the tensors are read as data and built on the parameters' Flex
    // device, each checked against what Flex holds first.
    #[allow(deprecated)]
    let (runtime, node) = embedded(vec![DeviceSpec::NdArray]);
    let device = Device::flex();
    let sent = Pair::new(&device);
    let mut store = FerryStore::embedded(node.clone(), runtime.handle().clone(), 0, "n");
    store.collect_from(&sent).unwrap();
    let mut target = Pair::new(&device);
    store.apply_to(&mut target).unwrap();
    assert_same_params(&params(&target), &params(&sent));
}

/// Which version an apply hands over, raced: a writer replaces the model over and over (each
/// version every tensor of one value, now and then one of the wrong shape) while the module is
/// applied from the embedded node again and again. Every apply either took one whole version
/// (every value of every parameter the same, at the parameter's shape), or refused and left the
/// module exactly as it was; both happen.
#[test]
fn an_embedded_apply_racing_replacements_takes_whole_versions_or_changes_nothing() {
    let (runtime, node) = embedded(vec![DeviceSpec::Flex]);
    let device = Device::flex();
    let store = || FerryStore::embedded(node.clone(), runtime.handle().clone(), 0, "raced");
    // Version `v` of the model: every tensor holds `v` (one of them mis-shaped, in a fifth of
    // the versions).
    let write = |node: &Node, handle: &tokio::runtime::Handle, v: f32, state: u64| {
        handle.block_on(async {
            let writer = node.begin_model(0, "raced", Replace::Allow).unwrap();
            let names = ["left.weight", "left.bias", "right.weight", "right.bias"];
            for (i, name) in names.into_iter().enumerate() {
                let mut shape = if name.ends_with("weight") {
                    vec![8, 8]
                } else {
                    vec![8]
                };
                if state.is_multiple_of(5) && (state / 5) % 4 == i as u64 {
                    shape[0] = 4; // a version with a tensor of the wrong shape
                }
                let n: usize = shape.iter().product();
                let data = TensorData::new(vec![v; n], shape);
                node.insert(&writer.key(name), data, IfExists::Refuse)
                    .await
                    .unwrap();
            }
            let sent = PathsDigest::of(names);
            writer.commit(Some(sent), BTreeMap::new()).await.unwrap();
        });
    };
    write(&node, runtime.handle(), 0.0, 1);
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    println!("seed {seed}");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (node, handle, stop) = (node.clone(), runtime.handle().clone(), stop.clone());
        std::thread::spawn(move || {
            let mut state = seed;
            let mut version = 1.0f32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                write(&node, &handle, version, state);
                version += 1.0;
            }
        })
    };
    let (mut applied, mut refused) = (0, 0);
    for _ in 0..150 {
        let mut target = Pair::new(&device);
        let before = params(&target);
        match store().apply_to(&mut target) {
            Ok(_) => {
                applied += 1;
                // One version, whole: every value of every parameter the same.
                let mut seen = std::collections::BTreeSet::new();
                for (path, data) in params(&target) {
                    assert_eq!(data.shape(), before[&path].shape(), "seed {seed}: {path}");
                    let values: Vec<f32> = data.try_to_vec().unwrap();
                    seen.extend(values.iter().map(|v| v.to_bits()));
                }
                assert_eq!(
                    seen.len(),
                    1,
                    "seed {seed}: parts of several versions applied"
                );
            }
            Err(StoreError::NotApplied(_)) => {
                refused += 1;
                assert_same_params(&params(&target), &before);
            }
            Err(e) => panic!("seed {seed}: {e}"),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    println!("{applied} applied whole, {refused} refused whole");
    assert!(
        applied > 0 && refused > 0,
        "seed {seed}: both outcomes raced"
    );
}

/// Errors say what happened: an unreachable node by its address; an apply from a prefix with no
/// model says there is nothing there; a refused apply lists why, never a success line; a collect
/// whose connection is cut names the node and says nothing of it was kept.
#[test]
fn errors_say_which_node_and_what_was_kept() {
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = free.local_addr().unwrap().to_string();
    drop(free);
    let unreachable = BlockingClient::connect(addr.as_str())
        .blocking()
        .unwrap_err();
    let message = unreachable.to_string();
    assert!(
        message.starts_with(&format!("cannot reach {addr}: ")),
        "{message}"
    );

    let node = serve_flex();
    let device = Device::flex();
    let nothing =
        FerryStore::connected(client(&node.addr), 0, "nope").apply_to(&mut Pair::new(&device));
    let message = nothing.unwrap_err().to_string();
    assert!(
        message.contains("nothing under nope on device 0"),
        "{message}"
    );

    let unbiased: Linear = LinearConfig::new(8, 8).with_bias(false).init(&device);
    FerryStore::connected(client(&node.addr), 0, "head")
        .collect_from(&unbiased)
        .unwrap();
    let mut biased: Linear = LinearConfig::new(8, 8).init(&device);
    let refused = FerryStore::connected(client(&node.addr), 0, "head").apply_to(&mut biased);
    let message = refused.unwrap_err().to_string();
    assert!(message.contains("no tensor for: bias"), "{message}");
    assert!(!message.contains("Successfully"), "{message}");

    let (cut, _proxy) = lane_cut_after(&node, 2);
    let cut_at = cut.endpoint().to_string();
    let failed = FerryStore::connected(cut, 0, "cut").collect_from(&Deep::new(&device));
    let message = failed.unwrap_err().to_string();
    assert!(
        message.contains(&format!(
            "of {cut_at}: version 0 was given up, nothing of it kept"
        )),
        "{message}"
    );
}

/// A refusal is matched by its code over either link, without digging: a second collect to a
/// prefix that holds a model is `AlreadyExists`, over a connection and into an embedded node.
#[test]
fn a_refusal_has_one_code_over_either_link() {
    use ferry_client::ErrorCode;
    let device = Device::flex();
    let model = Pair::new(&device);
    let node = serve_flex();
    FerryStore::connected(client(&node.addr), 0, "twice")
        .collect_from(&model)
        .unwrap();
    let again = FerryStore::connected(client(&node.addr), 0, "twice").collect_from(&model);
    assert_eq!(again.unwrap_err().code(), Some(ErrorCode::AlreadyExists));
    let (runtime, node) = embedded(vec![DeviceSpec::Flex]);
    let store = || FerryStore::embedded(node.clone(), runtime.handle().clone(), 0, "twice");
    store().collect_from(&model).unwrap();
    assert_eq!(
        store().collect_from(&model).unwrap_err().code(),
        Some(ErrorCode::AlreadyExists)
    );
}

/// A collect goes on to two replicas, relayed from the store's node: each applies the model
/// bytes-exact, and each tensor left the store's node once. A replica holding the model already
/// refuses it (no replace asked): the collect fails naming that replica alone, the other holding
/// the version; with replace asked, both take the next collect (the first from what it holds).
#[test]
fn a_collect_goes_on_to_every_replica_whole() {
    use ferry_burn::Replica;
    let (node, first, second) = (serve_flex(), serve_flex(), serve_flex());
    let device = Device::flex();
    let sent = quantized(TinyLm::new(&device), Quantization::PerTensor);
    let sent_params = params(&sent);
    write_version(&mut client(&second.addr), "lm", &BTreeMap::new());
    let replica = |addr: &str| Replica {
        addr: addr.to_string(),
        pulls: client(addr),
        grants: client(addr),
    };
    let served = |addr: &str| client(addr).stat().wait().unwrap().fetches_served;
    let mut store = FerryStore::connected(client(&node.addr), 0, "lm").with_replicas(
        &node.addr,
        vec![replica(&first.addr), replica(&second.addr)],
    );

    match store.collect_from(&sent) {
        Err(StoreError::NotReplicated {
            replicas, failed, ..
        }) => {
            assert_eq!(replicas, 2);
            assert_eq!(failed.len(), 1, "{failed:?}");
            assert_eq!(failed[0].addr, second.addr);
            assert_eq!(
                failed[0].cause.code(),
                Some(ferry_client::ErrorCode::AlreadyExists)
            );
        }
        other => panic!("a replica holding the model refuses it: {other:?}"),
    }
    let tensors = sent_params.len() as u64;
    assert_eq!(
        served(&node.addr),
        tensors,
        "each tensor left the store's node once"
    );
    let mut on_first = TinyLm::new(&device);
    FerryStore::connected(client(&first.addr), 0, "lm")
        .apply_to(&mut on_first)
        .unwrap();
    assert_same_params(&params(&on_first), &sent_params);

    let mut store = store.if_exists(IfExists::Replace);
    store.collect_from(&sent).unwrap();
    assert_eq!(
        served(&node.addr),
        tensors,
        "the first replica holds these very bytes already: nothing is fetched again"
    );
    for replica in [&first, &second] {
        let mut applied = TinyLm::new(&device);
        FerryStore::connected(client(&replica.addr), 0, "lm")
            .apply_to(&mut applied)
            .unwrap();
        assert_same_params(&params(&applied), &sent_params);
    }
}

/// Two coordinators replicate to the same two workers at once, round after round (each collects
/// a model of its own, replacing, to its own node, relayed on to both workers), while a reader
/// applies from the workers over and over: every apply takes one coordinator's model whole,
/// never parts of both, and after every round each worker holds one of the two whole. A
/// worker's version begun before the other coordinator's committed there is superseded
/// (`Changed`): that collect is `NotReplicated` for it, the worker keeping the newer model.
#[test]
fn stores_replicating_to_the_same_workers_at_once_leave_each_a_whole_model() {
    use ferry_burn::Replica;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let coordinators = [serve_flex(), serve_flex()];
    let workers = [serve_flex(), serve_flex()];
    let device = Device::flex();
    let models = [Deep::new(&device), Deep::new(&device)];
    let wanted: Vec<BTreeMap<String, TensorData>> = models.iter().map(params).collect();
    let which = |got: &BTreeMap<String, TensorData>| {
        wanted.iter().position(|want| {
            want.len() == got.len()
                && want.iter().all(|(path, data)| {
                    got.get(path).is_some_and(|g| {
                        g.dtype() == data.dtype()
                            && g.shape() == data.shape()
                            && g.as_bytes() == data.as_bytes()
                    })
                })
        })
    };
    let mut stores: Vec<_> = coordinators
        .iter()
        .map(|node| {
            let replicas = workers
                .iter()
                .map(|w| Replica {
                    addr: w.addr.to_string(),
                    pulls: client(&w.addr),
                    grants: client(&w.addr),
                })
                .collect();
            FerryStore::connected(client(&node.addr), 0, "m")
                .if_exists(IfExists::Replace)
                .with_replicas(&node.addr, replicas)
        })
        .collect();
    let stop = AtomicBool::new(false);
    let whole_applies = AtomicUsize::new(0);
    let superseded = AtomicUsize::new(0);
    /// Stops the reader however the rounds end (a failed assertion included), so that the
    /// scope that waits for it ends too.
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    std::thread::scope(|scope| {
        let _stop = StopOnDrop(&stop);
        let reader = scope.spawn(|| {
            let mut readers: Vec<_> = workers
                .iter()
                .map(|w| FerryStore::connected(client(&w.addr), 0, "m"))
                .collect();
            while !stop.load(Ordering::Relaxed) {
                for reader in &mut readers {
                    let mut target = Deep::new(&device);
                    match reader.apply_to(&mut target) {
                        Ok(_) => {
                            let got = params(&target);
                            assert!(which(&got).is_some(), "an apply mixed two models");
                            whole_applies.fetch_add(1, Ordering::Relaxed);
                        }
                        // Before the first round commits there is no model.
                        Err(e) if e.code() == Some(ferry_client::ErrorCode::NotFound) => {}
                        Err(e) => panic!("an apply from a worker: {e}"),
                    }
                }
            }
        });
        for round in 0..6 {
            std::thread::scope(|both| {
                for (store, model) in stores.iter_mut().zip(&models) {
                    let superseded = &superseded;
                    both.spawn(move || match store.collect_from(model) {
                        Ok(()) => {}
                        Err(StoreError::NotReplicated { failed, .. })
                            if failed.iter().all(|f| {
                                f.cause.code() == Some(ferry_client::ErrorCode::Changed)
                            }) =>
                        {
                            superseded.fetch_add(failed.len(), Ordering::Relaxed);
                        }
                        Err(e) => panic!("round {round}: {e}"),
                    });
                }
            });
            for worker in &workers {
                let mut target = Deep::new(&device);
                FerryStore::connected(client(&worker.addr), 0, "m")
                    .apply_to(&mut target)
                    .unwrap();
                assert!(
                    which(&params(&target)).is_some(),
                    "round {round}: a worker holds parts of both models"
                );
            }
        }
        stop.store(true, Ordering::Relaxed);
        reader.join().unwrap();
    });
    println!(
        "{} whole applies from the workers, {} replicated versions superseded",
        whole_applies.load(Ordering::Relaxed),
        superseded.load(Ordering::Relaxed)
    );
    assert!(whole_applies.load(Ordering::Relaxed) > 0);
}
