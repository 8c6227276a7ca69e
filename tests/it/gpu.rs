//! GPU devices on Mesa's software adapters (OpenGL on llvmpipe, Vulkan on lavapipe; `.ci/run`
//! installs what is missing): every sample put to a GPU device and read back, bit-exact where
//! its measured table says it holds the dtype and refused before any byte moves where not;
//! copies between a CPU and a GPU device both ways; a node-to-node pull into a GPU device; and a
//! GPU device that cannot open, refused at start with its name.

use ferry_client::ErrorCode;
use std::time::Duration;

use ferry_proto::TensorKey;
use ferry_proto::TransferPath;
use ferry_server::{DeviceSpec, Node, NodeConfig};
use ferry_testkit::copy_keys;
use ferry_testkit::samples;
use ferry_testkit::{assert_same, code_of, how, start_with};

/// The matrix through `spec` (device 1, beside a flex device 0): put, get, and flex <-> GPU
/// copies both ways. Returns how many samples the device held.
async fn the_matrix_through(spec: &str) -> usize {
    let node = start_with(&["flex", spec]).await;
    let mut client = node.client().await;
    let table = client.holds(1).await.unwrap();
    let stats = client.stat().await.unwrap();
    assert!(
        stats.devices[1].holds_exact > 0,
        "{spec}: {:?}",
        stats.devices[1]
    );
    let holder = node.node.device(1).unwrap().holds().clone();
    let (mut held, mut refused) = (0, 0);
    for sample in samples::full_matrix().into_iter().chain(ragged_scales()) {
        let data = &sample.data;
        let says = holder.check(&data.dtype(), data.shape().as_slice());
        let name = &sample.name;
        let put = client.put(&TensorKey::new(1, name), data).await;
        let key = TensorKey::new(1, name);
        match says {
            Ok(()) => {
                put.unwrap_or_else(|e| panic!("{spec}: put {name}: {e}"));
                let back = client.get(&key).await;
                let back = back.unwrap_or_else(|e| panic!("{spec}: get {name}: {e}"));
                assert_same(&back, data, name);
                // GPU -> flex and back: the host round trip, both ways.
                let on_cpu = client.copy(&key, &TensorKey::new(0, "back")).await.unwrap();
                assert_eq!(on_cpu.path, TransferPath::RoundTrip, "{name}");
                assert_same(&client.get(&on_cpu.key).await.unwrap(), data, name);
                let again = client
                    .copy(&on_cpu.key, &TensorKey::new(1, "again"))
                    .await
                    .unwrap_or_else(|e| panic!("{spec}: flex -> gpu {name}: {e}"));
                assert_same(&client.get(&again.key).await.unwrap(), data, name);
                for key in [key, on_cpu.key, again.key] {
                    client.delete(&key).await.unwrap();
                }
                held += 1;
            }
            Err(_) => {
                assert_eq!(code_of(put), ErrorCode::UnsupportedDType, "{spec}: {name}");
                // Refused from flex as well, and nothing registered.
                client.put(&TensorKey::new(0, name), data).await.unwrap();
                let copied = client
                    .copy(&TensorKey::new(0, name), &TensorKey::new(0, name).on(1))
                    .await;
                assert_eq!(code_of(copied), ErrorCode::UnsupportedDType, "{name}");
                client.delete(&TensorKey::new(0, name)).await.unwrap();
                refused += 1;
            }
        }
    }
    assert!(client.list(None).await.unwrap().is_empty());
    // The table the node tells is the one it checks by.
    let exact = table.iter().filter(|p| p.refused.is_none()).count();
    assert_eq!(exact, holder.counts().1);
    assert!(held > 0 && held + refused == samples::full_matrix().len() + ragged_scales().len());
    node.shutdown().await;
    held
}

/// Block schemes whose values fill whole 32-bit words while their scales may not (a GPU keeps the
/// scales in a buffer of their own): two UE8M0 scales, three F16 ones, three F32 ones.
fn ragged_scales() -> Vec<samples::Sample> {
    use burn_backend::quantization::{QuantScheme, QuantStore, QuantValue, ScaleDtype};
    let q8 = QuantScheme::default()
        .with_store(QuantStore::Native)
        .with_value(QuantValue::Q8S);
    [
        (ScaleDtype::UE8M0, vec![1, 32]),
        (ScaleDtype::F16, vec![1, 48]),
        (ScaleDtype::F32, vec![1, 48]),
    ]
    .into_iter()
    .map(|(scale, shape)| samples::Sample {
        name: format!("q-Q8S-block16-{scale:?}-{}x{}", shape[0], shape[1]),
        data: samples::quantized(&q8.per_block([16], scale), &shape, 11),
    })
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sample_through_an_opengl_software_device_bit_exact_or_refused() {
    let held = the_matrix_through("gl:cpu").await;
    assert!(held >= 10, "{held} held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sample_through_a_vulkan_software_device_bit_exact_or_refused() {
    let held = the_matrix_through("vulkan:cpu").await;
    assert!(held >= 10, "{held} held");
}

/// The same on the device `FERRY_GPU` names (a real GPU: `tests/gpu.sh` runs it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs FERRY_GPU=SPEC: run by tests/gpu.sh on a machine with a GPU"]
async fn every_sample_through_the_gpu_ferry_gpu_names() {
    let spec = std::env::var("FERRY_GPU").expect("FERRY_GPU names the GPU device to test");
    let held = the_matrix_through(&spec).await;
    println!(
        "{spec}: {held} of {} samples held",
        samples::full_matrix().len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_pulls_into_a_gpu_device_from_another_node() {
    let source = start_with(&["flex"]).await;
    let target = start_with(&["gl:cpu"]).await;
    let mut src = source.client().await;
    let mut dst = target.client().await;
    let data = samples::plain(ferry_proto::DType::F32, &[256, 1024], 3);
    src.put(&TensorKey::new(0, "w"), &data).await.unwrap();
    let addr = source.addr.to_string();
    let keys = [TensorKey::new(0, "w")];
    let answers = copy_keys(&mut src, &mut dst, &keys, &how(&addr, 0))
        .await
        .unwrap();
    let stored = answers.into_iter().next().unwrap().unwrap();
    assert_eq!(stored.path, TransferPath::Pull);
    assert_same(
        &dst.get(&stored.key).await.unwrap(),
        &data,
        "pulled to gl:cpu",
    );
    // And from the GPU device on to another node (which no longer holds the bytes: no dedup).
    src.delete(&keys[0]).await.unwrap();
    let target_addr = target.addr.to_string();
    let mut back = how(&target_addr, 0);
    back.dst_name = Some("returned".to_string());
    let answers = copy_keys(&mut dst, &mut src, std::slice::from_ref(&stored.key), &back)
        .await
        .unwrap();
    let returned = answers.into_iter().next().unwrap().unwrap();
    assert_eq!(returned.path, TransferPath::Pull);
    assert_same(
        &src.get(&returned.key).await.unwrap(),
        &data,
        "pulled from gl:cpu",
    );
    source.shutdown().await;
    target.shutdown().await;
}

/// A GPU device stages its receives through the node's pool: a put and a pull each draw a
/// buffer (a payload the pool cannot hold is a miss), which is back in the pool as soon as the
/// tensor is on the device, so an 8 MiB pool carries 18 MiB of tensors one after another; every
/// tensor reads back bit-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_device_stages_its_receives_through_the_pool_and_gives_each_buffer_back() {
    const MIB: usize = 1 << 20;
    let pool = ferry_memory::Pool::reserve(8 * MIB).unwrap();
    let node = ferry_testkit::start(
        NodeConfig {
            devices: ferry_testkit::devices(&["gl:cpu"]),
            receive_buffers: ferry_server::ReceiveBuffers::Pool(pool.clone()),
            ..NodeConfig::light()
        },
        ferry_server::ServiceConfig::default(),
    )
    .await;
    let source = start_with(&["flex"]).await;
    let mut client = node.client().await;
    let pool_is_whole = || async {
        ferry_testkit::eventually("the staging buffer back", Duration::from_secs(10), || {
            pool.free_bytes() == pool.capacity()
        })
        .await;
    };
    // 9 MiB: more than the pool holds, so fresh memory, counted.
    let over = samples::plain(ferry_proto::DType::F32, &[9 * MIB / 4], 30);
    client.put(&TensorKey::new(0, "over"), &over).await.unwrap();
    assert_eq!(pool.misses(), 1, "a GPU receive draws from the pool");
    let mut sent = vec![(TensorKey::new(0, "over"), over)];
    for i in 0..3 {
        let key = TensorKey::new(0, format!("w{i}"));
        let data = samples::plain(ferry_proto::DType::F32, &[6 * MIB / 4], 31 + i);
        client.put(&key, &data).await.unwrap();
        pool_is_whole().await;
        sent.push((key, data));
    }
    // A pull (hashed as it arrives) stages the same way.
    let pulled = samples::plain(ferry_proto::DType::BF16, &[3 * MIB], 40);
    let mut src = source.client().await;
    src.put(&TensorKey::new(0, "pulled"), &pulled)
        .await
        .unwrap();
    let addr = source.addr.to_string();
    let answers = copy_keys(
        &mut src,
        &mut client,
        &[TensorKey::new(0, "pulled")],
        &how(&addr, 0),
    )
    .await
    .unwrap();
    let stored = answers.into_iter().next().unwrap().unwrap();
    assert_eq!(stored.path, TransferPath::Pull);
    pool_is_whole().await;
    sent.push((stored.key, pulled));
    assert_eq!(pool.misses(), 1, "every other receive drew from the pool");
    for (key, data) in &sent {
        assert_same(&client.get(key).await.unwrap(), data, &key.name);
    }
    node.shutdown().await;
    source.shutdown().await;
}

/// A tensor one element larger than the adapter's largest buffer is refused before any byte
/// moves, whichever way it comes (put, copy from a CPU device, pull from another node), and
/// nothing is registered; one exactly that large round-trips bit-exact. (cubecl itself would
/// accept the larger one and fail only at its first read: an acknowledged tensor no get returns.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_larger_than_the_adapters_largest_buffer_is_refused_before_bytes_move() {
    let node = start_with(&["flex", "gl:cpu"]).await;
    let source = start_with(&["flex"]).await;
    let largest = node.node.device(1).unwrap().largest_tensor();
    let largest = largest.expect("a GPU device states its largest buffer");
    let mut client = node.client().await;
    let stats = client.stat().await.unwrap();
    assert_eq!(stats.devices[1].largest_tensor, Some(largest));
    assert_eq!(stats.devices[0].largest_tensor, None, "host memory");
    let elements = usize::try_from(largest / 4).unwrap();
    let at_limit = samples::plain(ferry_proto::DType::F32, &[elements], 21);
    let over = samples::plain(ferry_proto::DType::F32, &[elements + 1], 22);
    assert_eq!(at_limit.as_bytes().len() as u64, largest);

    let put = client.put(&TensorKey::new(1, "over"), &over).await;
    let Err(ferry_client::ClientError::Node { code, message }) = put else {
        panic!("a tensor over the adapter's largest buffer was put: {put:?}");
    };
    assert_eq!(code, ErrorCode::LimitExceeded);
    assert!(message.contains(&largest.to_string()), "{message}");
    client.put(&TensorKey::new(0, "over"), &over).await.unwrap();
    let copied = client
        .copy(&TensorKey::new(0, "over"), &TensorKey::new(0, "over").on(1))
        .await;
    assert_eq!(code_of(copied), ErrorCode::LimitExceeded, "copy from flex");
    let mut src = source.client().await;
    src.put(&TensorKey::new(0, "over"), &over).await.unwrap();
    let addr = source.addr.to_string();
    let keys = [TensorKey::new(0, "over")];
    let pulled = copy_keys(&mut src, &mut client, &keys, &how(&addr, 1)).await;
    let pulled = pulled.unwrap().into_iter().next().unwrap();
    let Err(ferry_client::ClientError::Node { code, .. }) = pulled else {
        panic!("a pull over the adapter's largest buffer: {pulled:?}");
    };
    assert_eq!(code, ErrorCode::LimitExceeded, "pull from another node");
    assert!(
        client.list(Some(1)).await.unwrap().is_empty(),
        "nothing registered"
    );

    client
        .put(&TensorKey::new(1, "at-limit"), &at_limit)
        .await
        .unwrap();
    let back = client.get(&TensorKey::new(1, "at-limit")).await.unwrap();
    assert_same(
        &back,
        &at_limit,
        "a tensor as large as the adapter's largest buffer",
    );
    node.shutdown().await;
    source.shutdown().await;
}

#[test]
fn a_gpu_device_that_is_not_there_is_refused_at_start_with_its_name() {
    let spec: DeviceSpec = "vulkan:57".parse().unwrap();
    let refused = Node::start(NodeConfig {
        devices: vec![DeviceSpec::Flex, spec],
        ..NodeConfig::light()
    });
    let Err(refused) = refused else {
        panic!("a node started with a 57th discrete GPU");
    };
    let message = refused.to_string();
    assert!(
        message.contains("device 1") && message.contains("vulkan:57"),
        "{message}"
    );
    // A spec that names no device at all is refused when parsed.
    let bad = "wgpu:nine".parse::<DeviceSpec>().unwrap_err();
    assert!(bad.contains("wgpu:nine"), "{bad}");
    let cuda = "cuda:0".parse::<DeviceSpec>().unwrap_err();
    assert!(cuda.contains("CUDA"), "{cuda}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gpu_devices_move_tensors_natively() {
    let node = start_with(&["vulkan:cpu", "gl:cpu"]).await;
    let mut client = node.client().await;
    let plain = samples::plain(ferry_proto::DType::F32, &[64, 33], 5);
    let scheme = samples::schemes()
        .into_iter()
        .find(|(label, _)| label == "Q8S-tensor-F32")
        .unwrap()
        .1;
    let quantized = samples::quantized(&scheme, &[8, 64], 6);
    for (name, data) in [("plain", &plain), ("quantized", &quantized)] {
        client.put(&TensorKey::new(0, name), data).await.unwrap();
        let copied = client
            .copy(&TensorKey::new(0, name), &TensorKey::new(0, name).on(1))
            .await
            .unwrap();
        assert_eq!(
            copied.path,
            TransferPath::Native,
            "{name}: Burn's own to_device"
        );
        assert_same(&client.get(&copied.key).await.unwrap(), data, name);
        let back = format!("{name}.back");
        let moved = client
            .move_to(&copied.key, &TensorKey::new(0, &back))
            .await
            .unwrap();
        assert_same(&client.get(&moved.key).await.unwrap(), data, name);
    }
    // What Burn's GPU backend does not store bit-exact is refused before any byte moves, with
    // what the probe saw (a native bool is stored as another dtype there).
    let bools = samples::plain(
        ferry_proto::DType::Bool(ferry_proto::BoolStore::Native),
        &[4, 4],
        7,
    );
    let refused = client
        .put(&TensorKey::new(1, "bools"), &bools)
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("bool"), "{refused}");
    node.shutdown().await;
}
