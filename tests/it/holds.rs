//! `BackendKind::holds`, the node's table of what each backend stores bit-exact, checked dtype by
//! dtype and scheme by scheme against the real backends: where it says yes, the backend gives the
//! same dtype, shape and bytes back; where it says no, it does not (or it panics).
// NdArray is deprecated upstream and still one of the node's two CPU backends.
#![allow(deprecated)]

use burn_backend::Backend;
use burn_flex::{Flex, FlexDevice};
use burn_ndarray::{NdArray, NdArrayDevice};
use ferry::proto::{TensorData, dtype_name};
use ferry::samples;
use ferry::server::BackendKind;
use ferry::server::Primitive;

/// Whether `device` gives `data` back exactly (a panic inside the backend counts as no).
fn round_trips<B: Backend>(data: &TensorData, device: &B::Device) -> bool {
    let back = Primitive::<B>::from_data(data.clone(), device).and_then(|p| p.to_data());
    back.is_ok_and(|back| {
        back.dtype() == data.dtype()
            && back.shape() == data.shape()
            && back.as_bytes() == data.as_bytes()
    })
}

#[test]
fn the_holds_table_agrees_with_each_backend_for_every_dtype_and_scheme() {
    let mut checked = 0;
    let mut disagreements = Vec::new();
    for sample in samples::full_matrix() {
        let data = &sample.data;
        let actual = [
            (BackendKind::Flex, round_trips::<Flex>(data, &FlexDevice)),
            (
                BackendKind::NdArray,
                round_trips::<NdArray>(data, &NdArrayDevice::Cpu),
            ),
        ];
        for (kind, held) in actual {
            let said = kind.holds(&data.dtype(), data.shape().as_slice());
            if said.is_ok() != held {
                disagreements.push(format!(
                    "{} on {kind}: the table says {}, the backend {}",
                    sample.name,
                    said.map_or_else(|why| format!("no ({why})"), |()| "yes".into()),
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
    assert!(dtypes.len() >= ferry::proto::dtype::PLAIN_DTYPES.len());
}
