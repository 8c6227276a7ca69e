//! A whole module moved between the process's CPU devices with `TryModuleToDevice`: a model
//! with Q8S-quantized linear weights, a batch norm's running state and an integer parameter
//! arrives bit-exact (Flex to NdArray and back, Flex to Flex); a parameter of a dtype the target
//! cannot hold is an error naming its path and dtype, never a panic, and nothing moves.
// Test code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

mod support;

use burn_core as burn;
use burn_core::module::{Module, Param, ParamId, Quantizer};
use burn_core::tensor::quantization::{
    Calibration, QuantScheme, QuantStore, QuantValue, ScaleDtype,
};
use burn_core::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use ferry_burn::TryModuleToDevice;
use support::{assert_same_params, params};

/// Quantized linear layers, a batch norm and a step counter.
#[derive(Module, Debug)]
struct Small {
    first: Linear,
    norm: BatchNorm,
    second: Linear,
    steps: Param<Tensor<1, Int>>,
}

/// Q8S, native store: one scale per tensor, or one per block of 32 values.
fn q8s(per_block: bool) -> QuantScheme {
    let scheme = QuantScheme::default()
        .with_value(QuantValue::Q8S)
        .with_store(QuantStore::Native);
    if per_block {
        scheme.per_block([32], ScaleDtype::F32)
    } else {
        scheme
    }
}

fn small(device: &Device, per_block: bool) -> Small {
    let mut quantizer = Quantizer::new(Calibration::MinMax, q8s(per_block));
    Small {
        first: LinearConfig::new(32, 64)
            .init(device)
            .quantize_weights(&mut quantizer),
        norm: BatchNormConfig::new(64).init(device),
        second: LinearConfig::new(64, 32)
            .init(device)
            .quantize_weights(&mut quantizer),
        steps: Param::initialized(
            ParamId::new(),
            Tensor::from_data(TensorData::new(vec![3i64, -1, 7], [3]), device),
        ),
    }
}

fn assert_quantized(module: &Small) {
    for weight in [&module.first.weight, &module.second.weight] {
        assert!(matches!(weight.val().dtype(), DType::QFloat(_)));
    }
}

#[test]
fn a_quantized_model_moves_to_its_own_backend_bit_exact() {
    let flex = Device::flex();
    for per_block in [false, true] {
        let model = small(&flex, per_block);
        assert_quantized(&model);
        let moved = model.try_module_to_device(&flex).unwrap();
        assert_same_params(&params(&moved), &params(&model));
        assert_eq!(moved.devices(), vec![flex.clone()]);
    }
}

#[cfg(feature = "ndarray")]
#[test]
fn a_quantized_model_moves_flex_to_ndarray_and_back_bit_exact() {
    let flex = Device::flex();
    #[allow(deprecated)] // NdArray is the second CPU backend ferry serves.
    let ndarray = Device::ndarray();
    for per_block in [false, true] {
        let model = small(&flex, per_block);
        let sent = params(&model);
        let there = model.try_module_to_device(&ndarray).unwrap();
        assert_eq!(
            there.devices(),
            vec![ndarray.clone()],
            "per block: {per_block}"
        );
        assert_quantized(&there);
        assert_same_params(&params(&there), &sent);
        let back = there.try_module_to_device(&flex).unwrap();
        assert_eq!(back.devices(), vec![flex.clone()]);
        assert_same_params(&params(&back), &sent);
    }
}

/// A linear layer, and a half-precision parameter after it.
#[cfg(feature = "ndarray")]
#[derive(Module, Debug)]
struct Mixed {
    linear: Linear,
    norm: BatchNorm,
    half: Param<Tensor<2>>,
}

#[cfg(feature = "ndarray")]
#[test]
fn a_dtype_the_target_cannot_hold_is_an_error_naming_the_parameter_and_nothing_moves() {
    use ferry_burn::MoveError;
    let flex = Device::flex();
    #[allow(deprecated)]
    let ndarray = Device::ndarray();
    let data = TensorData::new(vec![1.5f32; 12], [3, 4]).convert_dtype(DType::F16);
    let model = Mixed {
        linear: LinearConfig::new(4, 4).init(&flex),
        norm: BatchNormConfig::new(4).init(&flex),
        half: Param::initialized(ParamId::new(), Tensor::from_data(data, (&flex, DType::F16))),
    };
    let before = params(&model);
    let error = model.try_module_to_device(&ndarray).unwrap_err();
    let message = error.to_string();
    assert_eq!(error.path, "half", "{message}");
    assert_eq!(
        error.dtype,
        ferry_proto::dtype_name(&DType::F16),
        "{message}"
    );
    assert!(
        matches!(*error.source, MoveError::NotHeld { .. }),
        "{message}"
    );
    assert!(
        message.contains("\"half\"") && message.contains("F16") && message.contains("NdArray"),
        "{message}"
    );
    // Nothing moved, the running state (shared with clones) included.
    assert_eq!(model.devices(), vec![flex.clone()]);
    assert_eq!(model.norm.running_mean.value().device(), flex);
    assert_same_params(&params(&model), &before);

    // A quantized scheme NdArray cannot hold (Q4S) is refused so too.
    let q4 = QuantScheme::default()
        .with_value(QuantValue::Q4S)
        .with_store(QuantStore::Native);
    let mut quantizer = Quantizer::new(Calibration::MinMax, q4);
    let linear = LinearConfig::new(32, 8)
        .init(&flex)
        .quantize_weights(&mut quantizer);
    let error = linear.try_module_to_device(&ndarray).unwrap_err();
    assert_eq!(error.path, "weight", "{error}");
    assert!(error.to_string().contains("Q4S"), "{error}");
}
