//! The dtype and quantization-scheme decoder: any codes either give a `DType` that encodes back
//! to the same codes, or a typed error.
#![no_main]

use burn_std::DType;
use ferry_proto::dtype::{WireDType, WireQuantScheme};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&tag, rest)) = data.split_first() else {
        return;
    };
    // Six codes, then up to eight block extents (more than the five allowed, on purpose).
    let quant = match rest {
        [value, store, packing_dim, mode, tensor_scale, block_scale, block @ ..] => {
            Some(WireQuantScheme {
                value: *value,
                store: *store,
                packing_dim: *packing_dim,
                mode: *mode,
                tensor_scale: *tensor_scale,
                block_scale: *block_scale,
                block_size: block.iter().take(8).copied().collect(),
            })
        }
        _ => None,
    };
    let wire = WireDType { tag, quant };
    if let Ok(dtype) = DType::try_from(&wire) {
        let again = WireDType::from(dtype);
        assert_eq!(
            DType::try_from(&again).ok(),
            Some(dtype),
            "a decoded dtype encodes and decodes to itself"
        );
        let _ = ferry_proto::dtype_name(&dtype);
    }
});
