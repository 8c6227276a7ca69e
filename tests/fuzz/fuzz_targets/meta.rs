//! Meta validation and the byte-length rule, checked against Burn itself: a meta the rule
//! accepts, with a payload whose scales are canonical, on a dtype and shape the Flex `holds`
//! table accepts, must go into a Flex tensor and come back byte for byte without a panic;
//! everything else must be refused with a typed error.
#![no_main]

use burn_std::TensorData;
use ferry_io::{BufferFrom, HashUse, TensorAssembler};
use ferry_proto::dtype::{WireDType, WireQuantScheme};
use ferry_proto::{TensorMeta, WireMeta};
use ferry_server::BackendKind;
use ferry_server::Primitive;
use libfuzzer_sys::fuzz_target;

/// Payloads above this are skipped for the Burn round trip (the rule itself is still checked).
const ROUND_TRIP_MAX: usize = 1 << 16;

fuzz_target!(|data: &[u8]| {
    // Layout: rank, dims (u8 each), dtype tag, 6 scheme codes, block rank, block dims,
    // declared length (u16), then payload bytes.
    let mut bytes = data.iter().copied();
    let mut next = || bytes.next().unwrap_or(0);
    let rank = next() % 7;
    let shape: Vec<u64> = (0..rank).map(|_| u64::from(next() % 40)).collect();
    let tag = next();
    let codes: Vec<u8> = (0..6).map(|_| next()).collect();
    let block_rank = next() % 7;
    let block_size: Vec<u8> = (0..block_rank).map(|_| next() % 17).collect();
    let declared = u64::from(u16::from_le_bytes([next(), next()]));
    let consumed = 1 + rank as usize + 1 + 6 + 1 + block_rank as usize + 2;
    let payload = data.get(consumed..).unwrap_or_default();
    let quant = (tag == ferry_proto::dtype::tag::QFLOAT).then(|| WireQuantScheme {
        value: codes[0],
        store: codes[1],
        packing_dim: codes[2],
        mode: codes[3],
        tensor_scale: codes[4],
        block_scale: codes[5],
        block_size,
    });
    let wire = WireMeta {
        shape,
        dtype: WireDType { tag, quant },
        byte_len: declared,
    };
    let Ok(meta) = TensorMeta::try_from(&wire) else {
        return;
    };
    assert_eq!(
        meta.byte_len() as u64,
        declared,
        "accepted only with the exact length"
    );
    let len = meta.byte_len();
    if len > ROUND_TRIP_MAX {
        return;
    }
    // The payload: fuzz bytes, repeated to the declared length.
    let filled: Vec<u8> = if payload.is_empty() {
        vec![0; len]
    } else {
        payload.iter().copied().cycle().take(len).collect()
    };
    let mut assembler =
        TensorAssembler::new(meta.clone(), u64::MAX, BufferFrom::Fresh, HashUse::Skip)
            .expect("small");
    if len > 0 {
        assembler.accept(0, &filled).expect("in order, in bounds");
    }
    // A payload whose stored scales Burn would not give back unchanged is refused here, with
    // its typed error (the first finding of this target); everything else must reach Flex.
    let tensor: TensorData = match assembler.finish() {
        Ok(assembled) => assembled.data,
        Err(ferry_proto::ProtoError::Meta(ferry_proto::MetaError::NonCanonicalScale {
            ..
        })) => {
            return;
        }
        Err(other) => panic!("a complete, valid payload was refused: {other}"),
    };
    if BackendKind::Flex
        .measured_holds()
        .expect("a CPU backend")
        .check(&meta.dtype(), meta.shape())
        .is_err()
    {
        return;
    }
    let device = burn_flex::FlexDevice;
    let primitive = Primitive::<burn_flex::Flex>::from_data(tensor, &device)
        .unwrap_or_else(|e| panic!("Flex refused what `holds` and the rule accept: {meta:?}: {e}"));
    let back = primitive
        .to_data()
        .unwrap_or_else(|e| panic!("Flex failed to give back {meta:?}: {e}"));
    assert_eq!(back.dtype(), meta.dtype(), "dtype after Flex");
    assert_eq!(back.shape().as_slice(), meta.shape(), "shape after Flex");
    assert!(back.as_bytes() == &filled[..], "bytes after Flex: {meta:?}");
});
