//! What each device measured it holds bit-exact (`HoldsTable`), checked sample by sample against
//! the real backends and against the table ferry kept by hand before: where it says yes, the
//! backend gives the same dtype, shape and bytes back; where it says no, it does not (or panics).
// NdArray is deprecated upstream and still one of the node's two CPU backends.
#![allow(deprecated)]

use burn_backend::quantization::{
    QuantMode, QuantScheme, QuantStore, QuantValue, ScaleDtype, quantizable,
};
use burn_backend::{Backend, BoolStore, DType};
use burn_flex::{Flex, FlexDevice};
use burn_ndarray::{NdArray, NdArrayDevice};
use ferry_client::HeldProbe;
use ferry_proto::TensorKey;
use ferry_proto::{TensorData, dtype_name};
use ferry_server::BackendKind;
use ferry_server::Primitive;
use ferry_testkit::samples;

/// Whether `device` gives `data` back exactly (a panic inside the backend counts as no).
fn round_trips<B: Backend>(data: &TensorData, device: &B::Device) -> bool {
    let back = Primitive::<B>::from_data(data.clone(), device).and_then(|p| p.to_data());
    back.is_ok_and(|back| {
        back.dtype() == data.dtype()
            && back.shape() == data.shape()
            && back.as_bytes() == data.as_bytes()
    })
}

/// The table ferry kept by hand before devices measured their own (`../shared/BURN-FACTS.md`),
/// kept here only to check the probe against: a probe that disagrees with it has found a change
/// in Burn, or a bug in the probe.
fn hand_table(kind: BackendKind, dtype: &DType, shape: &[usize]) -> bool {
    match (kind, dtype) {
        (BackendKind::Flex, DType::QFloat(scheme)) => {
            scheme.store == QuantStore::Native
                && quantizable(scheme)
                && !(scheme.block_size().is_some() && shape.contains(&0))
        }
        (BackendKind::Flex, _) => true,
        (
            BackendKind::NdArray,
            DType::F64
            | DType::F32
            | DType::I64
            | DType::I32
            | DType::I16
            | DType::I8
            | DType::U64
            | DType::U32
            | DType::U16
            | DType::U8
            | DType::Bool(BoolStore::Native),
        ) => true,
        (BackendKind::NdArray, DType::QFloat(scheme)) => {
            matches!(scheme.value, QuantValue::Q8F | QuantValue::Q8S)
                && scheme.store == QuantStore::Native
                && scheme.mode == QuantMode::Symmetric
                && quantizable(scheme)
                && !(scheme.block_size().is_some() && shape.contains(&0))
        }
        (BackendKind::NdArray, _) => false,
        (BackendKind::Wgpu, _) => panic!("no hand-kept table for a GPU: its adapter decides"),
    }
}

#[test]
fn each_devices_measured_table_agrees_with_the_backend_and_the_old_hand_kept_table() {
    let mut checked = 0;
    let mut disagreements = Vec::new();
    let flex = BackendKind::Flex.measured_holds().unwrap();
    let ndarray = BackendKind::NdArray.measured_holds().unwrap();
    for sample in samples::full_matrix() {
        let data = &sample.data;
        let (dtype, shape) = (data.dtype(), data.shape().as_slice().to_vec());
        let actual = [
            (
                BackendKind::Flex,
                &flex,
                round_trips::<Flex>(data, &FlexDevice),
            ),
            (
                BackendKind::NdArray,
                &ndarray,
                round_trips::<NdArray>(data, &NdArrayDevice::Cpu),
            ),
        ];
        for (kind, table, held) in actual {
            let measured = table.check(&dtype, &shape);
            let by_hand = hand_table(kind, &dtype, &shape);
            if measured.is_ok() != held || by_hand != held {
                disagreements.push(format!(
                    "{} on {kind}: the measured table says {}, the hand-kept one {}, the \
                     backend {}",
                    sample.name,
                    measured.map_or_else(|why| format!("no ({why})"), |()| "yes".into()),
                    if by_hand { "yes" } else { "no" },
                    if held {
                        "gives it back exactly"
                    } else {
                        "does not"
                    },
                ));
            }
            checked += 1;
        }
    }
    assert!(
        disagreements.is_empty(),
        "{} of {checked} disagree:\n{}",
        disagreements.len(),
        disagreements.join("\n")
    );
    // Every dtype the wire knows was among them.
    let dtypes: std::collections::BTreeSet<String> = samples::full_matrix()
        .iter()
        .map(|s| dtype_name(&s.data.dtype()))
        .collect();
    assert!(dtypes.len() >= ferry_proto::dtype::PLAIN_DTYPES.len());
    // The probe measured every family it keys by, and each table says what it holds.
    // Flex holds every probe but a block scheme on a scalar, which Burn cannot quantize (there
    // is no probe tensor to make): 7 block families (5 block dtypes, 2 with a per-tensor level)
    // per value type and mode.
    let (probed, exact) = flex.counts();
    assert_eq!(probed, 4 * 250, "every key on each of 4 classes of shape");
    let block_scalars = 7 * 9 * 2;
    assert_eq!(exact, probed - block_scalars, "Flex");
    let (probed_nd, exact_nd) = ndarray.counts();
    assert_eq!(probed_nd, probed);
    assert!(
        exact_nd > 10 && exact_nd < probed,
        "NdArray holds {exact_nd} of {probed}"
    );
}

#[test]
fn a_dtype_the_probe_never_measured_is_refused_with_its_reason() {
    let table = BackendKind::Flex.measured_holds().unwrap();
    let packed = QuantScheme::default()
        .with_value(QuantValue::Q4S)
        .with_store(QuantStore::PackedU32(0))
        .per_tensor(ScaleDtype::F32);
    let why = table.check(&DType::QFloat(packed), &[8, 8]).unwrap_err();
    assert!(why.contains("packed"), "{why}");
    let empty_blocks = QuantScheme::default()
        .with_value(QuantValue::Q8S)
        .with_store(QuantStore::Native)
        .per_block([16], ScaleDtype::F32);
    let why = table
        .check(&DType::QFloat(empty_blocks), &[0, 16])
        .unwrap_err();
    assert!(why.contains("empty"), "{why}");
    // NdArray's refusals say what the backend did.
    let why = BackendKind::NdArray
        .measured_holds()
        .unwrap()
        .check(&DType::F16, &[3])
        .unwrap_err();
    assert!(why.contains("backend"), "{why}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_tells_what_each_device_measured_and_refuses_by_it() {
    let node = ferry_testkit::start_with(&["flex", "ndarray"]).await;
    let mut client = node.client().await;
    let stats = client.stat().await.unwrap();
    for (device, kind) in [(0u32, BackendKind::Flex), (1, BackendKind::NdArray)] {
        let table = kind.measured_holds().unwrap();
        let told = client.holds(device).await.unwrap();
        let measured: Vec<HeldProbe> = table
            .entries()
            .map(|(dtype, shape, held)| HeldProbe {
                dtype,
                shape: shape.to_vec(),
                refused: match held {
                    ferry_server::holds::Held::Exact => None,
                    ferry_server::holds::Held::Refused(why) => Some(why.clone()),
                },
            })
            .collect();
        assert_eq!(told, measured, "device {device}'s table over the wire");
        let (probed, exact) = table.counts();
        let d = &stats.devices[device as usize];
        assert_eq!(
            (d.holds_measured as usize, d.holds_exact as usize),
            (probed, exact)
        );
        assert_eq!(told.iter().filter(|p| p.refused.is_none()).count(), exact);
    }
    // What NdArray's probe refused is refused before any byte moves, with the probe's reason.
    let half = samples::plain(DType::F16, &[4, 4], 1);
    let refused = client
        .put(&TensorKey::new(1, "half"), &half)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("f16") && refused.contains("Unsupported dtype F16"),
        "{refused}"
    );
    assert!(client.list(None).await.unwrap().is_empty());
    // A device that is not there, as for every request naming one.
    assert_eq!(
        ferry_testkit::code_of(client.holds(7).await),
        ferry_client::ErrorCode::BadRequest
    );
    node.shutdown().await;
}
