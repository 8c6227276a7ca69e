//! What a node registers, seen from inside: the content hash a tensor is registered under (a
//! hash its source stated, recomputed; a put's, computed), the index dedup reads, and the bytes a
//! source sends straight from a registered tensor. These go through the node's internal steps
//! (admission, registration with a stated hash, the hash index, host bytes), which no embedder can
//! reach; `tests/it` checks the same paths from outside, through real pulls.

use std::time::Duration;

use burn_backend::{DType, TensorData};
use ferry_backend::DeviceSpec;
use ferry_proto::{ContentHash, IfExists, NodeStats, TensorKey};

use crate::device::{Arrived, HashState, HostBytes, KnownHash, TensorDesc};
use crate::node::{Node, NodeConfig};

/// A node hosting `devices`.
fn node(devices: &[DeviceSpec]) -> Node {
    Node::start(NodeConfig {
        devices: devices.to_vec(),
        ..NodeConfig::light()
    })
    .unwrap()
}

/// An f32 tensor of `shape` whose values follow from `seed`.
fn plain_f32(shape: &[usize], seed: u64) -> TensorData {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n as u64)
        .map(|i| {
            (i.wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(97))
                % 100_003) as f32
        })
        .collect();
    TensorData::new(values, shape.to_vec())
}

/// The content hash of `data`, as nodes compute and state it.
fn hash_of(data: &TensorData) -> ContentHash {
    let meta = ferry_proto::tensor::meta_of(data).unwrap();
    ferry_proto::tensor::content_hash(&meta, data.as_bytes())
}

/// Registers `data` under `name` on `device` as bytes that arrived with `hash`, through
/// admission and registration as a receiver does.
async fn register(
    node: &Node,
    device: u32,
    name: &str,
    data: TensorData,
    hash: KnownHash,
) -> TensorDesc {
    let arrived = Arrived {
        data,
        hash,
        region: None,
        checksums: Default::default(),
    };
    register_arrived(node, device, name, arrived).await
}

/// Registers `arrived` under `name` on `device`, through admission and registration.
async fn register_arrived(node: &Node, device: u32, name: &str, arrived: Arrived) -> TensorDesc {
    let meta = ferry_proto::tensor::meta_of(&arrived.data).unwrap();
    let admission = node
        .admit(
            device,
            name,
            &meta.dtype(),
            meta.shape(),
            meta.byte_len() as u64,
            IfExists::Refuse,
        )
        .unwrap();
    node.register(admission, arrived).await.unwrap()
}

/// Waits (5 s at most) until `node` has verified every content hash it was told or has to
/// compute, and returns its stats then.
async fn hashes_verified(node: &Node) -> NodeStats {
    for _ in 0..500 {
        let stats = node.stats().await.unwrap();
        if stats.hashes_pending == 0 {
            return stats;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("hashes still unverified after 5 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_false_stated_hash_is_replaced_by_the_computed_one_and_never_answers_dedup() {
    // Flex verifies after registering, NdArray (which cannot lend its bytes) before: the same
    // outcome on both.
    let node = node(&[DeviceSpec::Flex, DeviceSpec::NdArray]);
    let lie = ContentHash::from_digest([0; 32]);
    for device in [0u32, 1] {
        let data = plain_f32(&[64, 64], 3 + u64::from(device));
        let truth = hash_of(&data);
        let desc = register(&node, device, "w", data.clone(), KnownHash::Stated(lie)).await;
        if device == 0 {
            assert_eq!(
                desc.content_hash,
                HashState::Stated(lie),
                "registered under the stated hash"
            );
        } else {
            assert_eq!(
                desc.content_hash,
                HashState::Verified(truth),
                "checked before registering"
            );
        }
        // Whether asked before or after the verifier answered, the lie finds nothing.
        assert!(node.find_by_hash(lie).await.unwrap().is_none());
        let stats = hashes_verified(&node).await;
        assert_eq!(stats.hash_mismatches, 1 + u64::from(device));
        let key = TensorKey::new(device, "w");
        let held = node.describe(&key).await.unwrap();
        assert_eq!(held.content_hash, HashState::Verified(truth));
        let found = node.find_by_hash(truth).await.unwrap().unwrap();
        assert_eq!(found.key, key);
        let back = node.get(&found.key).await.unwrap();
        assert_eq!(back.as_bytes(), data.as_bytes(), "w");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dedup_check_waits_for_a_pending_verification() {
    let node = node(&[DeviceSpec::Flex]);
    // 64 MiB: hashing takes tens of milliseconds, so the check below comes while it runs.
    let data = plain_f32(&[4096, 4096], 5);
    let truth = hash_of(&data);
    let desc = register(&node, 0, "w", data, KnownHash::Stated(truth)).await;
    assert_eq!(desc.content_hash, HashState::Stated(truth));
    let found = node.find_by_hash(truth).await.unwrap().unwrap();
    assert_eq!(found.key, TensorKey::new(0, "w"));
    assert!(found.content_hash.is_verified(), "answered once verified");
    let stats = node.stats().await.unwrap();
    assert_eq!((stats.hashes_pending, stats.hash_mismatches), (0, 0));
}

/// Dedup looks tensors up by content hash through each worker's index, which follows every
/// registration (once its hash is computed), replacement and removal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_content_hash_index_follows_overwrites_and_removals() {
    let node = node(&[DeviceSpec::Flex, DeviceSpec::NdArray]);
    let (x, y) = (plain_f32(&[8, 8], 1), plain_f32(&[8, 8], 2));
    let found = async |hash: &ContentHash| node.find_by_hash(*hash).await.unwrap().map(|d| d.key);
    node.insert(&TensorKey::new(1, "w"), x.clone(), IfExists::Refuse)
        .await
        .unwrap();
    assert_eq!(found(&hash_of(&x)).await, Some(TensorKey::new(1, "w")));
    node.insert(&TensorKey::new(1, "w"), y.clone(), IfExists::Replace)
        .await
        .unwrap();
    assert_eq!(found(&hash_of(&x)).await, None, "replaced");
    assert_eq!(found(&hash_of(&y)).await, Some(TensorKey::new(1, "w")));
    node.insert(&TensorKey::new(0, "w2"), y.clone(), IfExists::Refuse)
        .await
        .unwrap();
    // A Flex device computes a new tensor's hash after registering it (NdArray, before): it is
    // indexed once computed.
    hashes_verified(&node).await;
    node.remove(&TensorKey::new(1, "w")).await.unwrap();
    assert_eq!(found(&hash_of(&y)).await, Some(TensorKey::new(0, "w2")));
    node.remove(&TensorKey::new(0, "w2")).await.unwrap();
    assert_eq!(found(&hash_of(&y)).await, None, "removed");
}

/// A source sends a Flex tensor straight from the registered tensor: the plain buffer, or a
/// quantized tensor's values followed by its scale bytes. Whichever way, the parts laid end to
/// end are exactly `into_data`'s bytes, for every probe tensor Flex holds (every plain dtype and
/// every scheme family, scalars and empty tensors among them); every plain one, and the
/// quantized ones of one scale level, go without a host copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_source_sends_from_the_registered_tensor_is_exactly_into_data() {
    let node = node(&[DeviceSpec::Flex]);
    let holds = node.holds(0).unwrap();
    let (mut checked, mut shared) = (0, 0);
    for (i, data) in crate::holds::probe_tensors().enumerate() {
        let (dtype, shape) = (data.dtype(), data.shape().as_slice().to_vec());
        // Only what a node accepts: valid on the wire (no block scheme on a scalar), and held.
        if ferry_proto::tensor::meta_of(data).is_err() || holds.check(&dtype, &shape).is_err() {
            continue;
        }
        let what = format!("{} on {shape:?}", ferry_proto::dtype_name(&dtype));
        let name = format!("p{i}");
        node.insert(&TensorKey::new(0, &name), data.clone(), IfExists::Refuse)
            .await
            .unwrap();
        let key = TensorKey::new(0, &name);
        let (_, meta, bytes) = node.read_host(&key).await.unwrap();
        assert_eq!(meta.byte_len(), data.as_bytes().len(), "{what}");
        assert_eq!(
            bytes.parts().concat(),
            data.as_bytes(),
            "{what}: the parts are into_data's bytes"
        );
        let single_level = match dtype {
            DType::QFloat(scheme) => {
                burn_backend::quantization::global_scale_dtype(&scheme).is_none()
            }
            _ => true,
        };
        let no_copy = matches!(bytes, HostBytes::Shared { .. });
        assert_eq!(no_copy, single_level, "{what}: sent without a host copy");
        shared += usize::from(no_copy);
        checked += 1;
        node.remove(&key).await.unwrap();
    }
    // The matrix exercises both kinds.
    assert!(
        shared > 40 && checked > shared,
        "{shared} of {checked} shared"
    );
}

/// Flex takes a received buffer over as the tensor's memory, quantized tensors of one scale
/// level included (built in place rather than by Flex's `q_from_data`, which copies any buffer
/// it cannot take over as a `Vec`): the registered tensor's bytes are the very bytes handed in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flex_device_registers_the_received_buffer_itself() {
    use burn_backend::quantization::{QuantScheme, QuantStore, QuantValue, ScaleDtype};
    let node = node(&[DeviceSpec::Flex]);
    let native = QuantScheme::default().with_store(QuantStore::Native);
    let quantized =
        |scheme: QuantScheme| crate::holds::quantized_probe(&scheme, vec![64, 64]).unwrap();
    let cases = [
        ("f32", plain_f32(&[64, 64], 1)),
        (
            "q8s",
            quantized(
                native
                    .with_value(QuantValue::Q8S)
                    .per_tensor(ScaleDtype::F32),
            ),
        ),
        (
            "q8s-block",
            quantized(
                native
                    .with_value(QuantValue::Q8S)
                    .per_block([32], ScaleDtype::F16),
            ),
        ),
        (
            "q4s-block",
            quantized(
                native
                    .with_value(QuantValue::Q4S)
                    .per_block([32], ScaleDtype::UE8M0),
            ),
        ),
    ];
    for (name, data) in cases {
        let expected = data.as_bytes().to_vec();
        let handed_in = data.as_bytes().as_ptr();
        node.insert(&TensorKey::new(0, name), data, IfExists::Refuse)
            .await
            .unwrap();
        let key = TensorKey::new(0, name);
        let (_, _, bytes) = node.read_host(&key).await.unwrap();
        assert_eq!(bytes.parts().concat(), expected, "{name}");
        let HostBytes::Shared { payload, .. } = &bytes else {
            panic!("{name}: not shared");
        };
        assert!(
            std::ptr::eq(payload.values.as_ptr(), handed_in),
            "{name}: the registered values are a copy"
        );
    }
}

/// A tensor registered with the chunk checksums its receive checked is sent on with them (not
/// computed again); one whose bytes a send reads from a copy is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checksums_a_tensor_arrived_with_go_with_its_bytes() {
    use ferry_io::connection::ChunkChecksums;
    let node = node(&[DeviceSpec::Flex]);
    let data = plain_f32(&[64, 64], 3);
    let crcs: Vec<u32> = (0..17).collect();
    let arrived = Arrived {
        data: data.clone(),
        hash: KnownHash::Unknown,
        region: None,
        checksums: ChunkChecksums::known(1000, crcs.clone()),
    };
    register_arrived(&node, 0, "w", arrived).await;
    let (_, _, bytes) = node.read_host(&TensorKey::new(0, "w")).await.unwrap();
    assert_eq!(bytes.parts().concat(), data.as_bytes());
    let HostBytes::Shared { checksums, .. } = &bytes else {
        panic!("a Flex f32 tensor is sent from its own bytes");
    };
    assert_eq!(checksums.len(), 17, "kept from the receive");
    assert_eq!(
        bytes.known().checksums.map(ChunkChecksums::len),
        Some(17),
        "and offered to the send"
    );

    // A quantized tensor's scales are rebuilt from the backend's own: its payload is not sent
    // as received, so none are kept.
    use burn_backend::quantization::{QuantScheme, QuantStore, QuantValue, ScaleDtype};
    let scheme = QuantScheme::default()
        .with_store(QuantStore::Native)
        .with_value(QuantValue::Q8S)
        .per_tensor(ScaleDtype::F32);
    let quantized = crate::holds::quantized_probe(&scheme, vec![64, 64]).unwrap();
    let arrived = Arrived {
        data: quantized.clone(),
        hash: KnownHash::Unknown,
        region: None,
        checksums: ChunkChecksums::known(1 << 20, vec![7]),
    };
    register_arrived(&node, 0, "q", arrived).await;
    let (_, _, bytes) = node.read_host(&TensorKey::new(0, "q")).await.unwrap();
    assert_eq!(bytes.parts().concat(), quantized.as_bytes());
    assert_eq!(
        bytes.known().checksums.map(ChunkChecksums::len),
        Some(0),
        "a payload with a rebuilt tail keeps none"
    );
}
