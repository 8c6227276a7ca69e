//! Every dtype and quantization scheme of the sample matrix moved between the process's CPU
//! devices (Flex and NdArray, both ways): bit-exact where the target's measured table says it
//! holds the dtype, and otherwise an error naming the dtype and the device, never a panic.
// Test code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]
#![cfg(feature = "ndarray")]

mod support;

use burn_tensor::{Device, Tensor, TensorData};
use ferry_burn::{MoveError, TryToDevice};
use ferry_server::BackendKind;
use ferry_testkit::samples::full_matrix;
use support::moved;

#[test]
fn every_dtype_moves_between_flex_and_ndarray_bit_exact_or_is_refused_by_name() {
    let flex_holds = BackendKind::Flex.measured_holds().unwrap();
    let ndarray_holds = BackendKind::NdArray.measured_holds().unwrap();
    let flex = Device::flex();
    #[allow(deprecated)] // NdArray is the second CPU backend ferry serves.
    let ndarray = Device::ndarray();
    let (mut moves, mut refusals) = (0, 0);
    for sample in full_matrix() {
        let (dtype, shape) = (sample.data.dtype(), sample.data.shape().to_vec());
        if !(1..=3).contains(&shape.len()) {
            continue;
        }
        for (from, from_holds, to, to_holds) in [
            (&flex, &flex_holds, &ndarray, &ndarray_holds),
            (&ndarray, &ndarray_holds, &flex, &flex_holds),
        ] {
            // Only what the source holds can be a tensor there to begin with.
            if from_holds.check(&dtype, &shape).is_err() {
                continue;
            }
            // The tensor as the source made it (a backend may store a dtype its own way).
            let (source, outcome) = moved(sample.data.clone(), from, to);
            let dtype = source.dtype();
            match (to_holds.check(&dtype, &shape), outcome) {
                (Ok(()), Ok(arrived)) => {
                    assert_eq!(arrived.dtype(), dtype, "{}", sample.name);
                    assert_eq!(arrived.shape().to_vec(), shape, "{}", sample.name);
                    assert!(
                        arrived.as_bytes() == source.as_bytes(),
                        "{}: {from:?} -> {to:?} changed the bytes",
                        sample.name
                    );
                    moves += 1;
                }
                (
                    Err(_),
                    Err(MoveError::NotHeld {
                        dtype: named,
                        device,
                        ..
                    }),
                ) => {
                    assert_eq!(named, ferry_proto::dtype_name(&dtype), "{}", sample.name);
                    assert_eq!(device, format!("{to:?}"), "{}", sample.name);
                    refusals += 1;
                }
                (expected, outcome) => panic!(
                    "{}: {from:?} -> {to:?}: table says {expected:?}, move gave {:?}",
                    sample.name,
                    outcome.map(|d| d.dtype())
                ),
            }
        }
    }
    eprintln!("{moves} moves bit-exact, {refusals} refused by name");
    assert!(moves > 50, "{moves} moves");
    assert!(refusals > 10, "{refusals} refusals");
}

#[test]
fn a_move_to_the_tensors_own_device_keeps_it() {
    let device = Device::flex();
    let tensor = Tensor::<2>::from_data(
        TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2]),
        &device,
    );
    let moved = tensor.clone().try_to_device(&device).unwrap();
    assert!(moved.into_data().as_bytes() == tensor.into_data().as_bytes());
}

#[test]
fn a_quantized_tensor_the_target_cannot_hold_is_refused_with_its_dtype_and_the_device() {
    use burn_tensor::quantization::{QuantScheme, QuantStore, QuantValue};
    let q4 = QuantScheme::default()
        .with_value(QuantValue::Q4S)
        .with_store(QuantStore::Native);
    let tensor =
        Tensor::<2>::from_data(TensorData::new(vec![0.5f32; 64], [2, 32]), &Device::flex())
            .quantize_dynamic(&q4);
    #[allow(deprecated)]
    let error = tensor.try_to_device(&Device::ndarray()).unwrap_err();
    let message = error.to_string();
    assert!(matches!(error, MoveError::NotHeld { .. }), "{message}");
    assert!(
        message.contains("Q4S") && message.contains("NdArray"),
        "{message}"
    );
}
