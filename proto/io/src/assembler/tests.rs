//! The receiver's tests: order and bounds, the hash in line, on its own thread and taken
//! mid-way, and what comes whole.

use burn_std::{DType, TensorData};

use ferry_proto::frame::chunks;
use ferry_proto::tensor::{content_hash, into_parts};
use ferry_proto::{ContentHash, MetaError, StreamError, TensorMeta};

use super::{BufferFrom, HashUse, RunningHash, TRAILING_HASH_MIN, TensorAssembler};

#[test]
fn assembles_in_order_and_refuses_the_rest() {
    let data = TensorData::new((0..10).map(|i| i as f32).collect::<Vec<_>>(), [2, 5]);
    let (meta, payload) = into_parts(data.clone()).unwrap();
    let mut asm =
        TensorAssembler::new(meta.clone(), 1 << 20, BufferFrom::Fresh, HashUse::Record).unwrap();
    assert!(matches!(
        asm.accept(4, &payload[4..8]),
        Err(StreamError::OutOfOrder { .. })
    ));
    assert!(matches!(
        asm.accept(0, &[]),
        Err(StreamError::EmptyChunk { .. })
    ));
    for (offset, piece) in chunks(&payload, 12) {
        asm.accept(offset, piece).unwrap();
    }
    assert!(matches!(
        asm.accept(40, &[0]),
        Err(StreamError::PastEnd { .. })
    ));
    let back = asm.finish().unwrap();
    assert_eq!(back.hash, Some(content_hash(&meta, data.as_bytes())));
    let back = back.data;
    assert_eq!(back.as_bytes(), data.as_bytes());
    assert_eq!(back.dtype(), data.dtype());
    assert_eq!(back.shape(), data.shape());
}

#[test]
fn a_large_payload_hashed_on_its_own_thread_hashes_as_in_line() {
    let n = TRAILING_HASH_MIN; // 4 MiB of f32
    let data = TensorData::new((0..n).map(|i| i as f32).collect::<Vec<_>>(), [n]);
    let (meta, payload) = into_parts(data.clone()).unwrap();
    let mut asm =
        TensorAssembler::new(meta.clone(), u64::MAX, BufferFrom::Fresh, HashUse::Check).unwrap();
    assert!(matches!(asm.hash, RunningHash::TrailingSoon(_)));
    for (offset, piece) in chunks(&payload, 300_001) {
        asm.accept(offset, piece).unwrap();
        assert!(matches!(asm.hash, RunningHash::Trailing(_)));
    }
    let back = asm.finish().unwrap();
    assert_eq!(back.hash, Some(content_hash(&meta, data.as_bytes())));
    assert_eq!(back.data.as_bytes(), data.as_bytes());
}

/// A chunk asked for piece by piece hands each piece to the trailing hash as the next is asked
/// for; a chunk begun again at its start (a resumed transfer writes it anew) restarts the hash
/// from the committed bytes, on a thread again, so what was hashed of the abandoned pieces is
/// not in it; pieces that skip a place, or a commit past what was given out, are refused.
#[test]
fn pieces_of_a_chunk_hash_as_they_come_and_a_chunk_begun_again_is_hashed_anew() {
    let n = TRAILING_HASH_MIN; // 4 MiB of f32
    let data = TensorData::new((0..n).map(|i| i as f32).collect::<Vec<_>>(), [n]);
    let (meta, payload) = into_parts(data.clone()).unwrap();
    for use_ in [HashUse::Record, HashUse::Check] {
        let mut asm =
            TensorAssembler::new(meta.clone(), u64::MAX, BufferFrom::Fresh, use_).unwrap();
        let chunk = 1 << 20;
        // The first chunk, committed whole from three pieces.
        let mut at = 0;
        for len in [100_000, 500_000, chunk - 600_000] {
            asm.slot(at as u64, len)
                .unwrap()
                .copy_from_slice(&payload[at..at + len]);
            at += len;
        }
        assert!(matches!(
            asm.commit(0, chunk + 1),
            Err(StreamError::Incomplete { .. })
        ));
        asm.commit(0, chunk).unwrap();
        // The second, begun with wrong bytes in two pieces (the first handed to the hash), then
        // begun again at its start, as a resumed transfer does.
        asm.slot(chunk as u64, 4096).unwrap().fill(0xAB);
        asm.slot(chunk as u64 + 4096, 4096).unwrap().fill(0xCD);
        assert!(matches!(
            asm.slot(chunk as u64 + 16_384, 4096),
            Err(StreamError::OutOfOrder { .. })
        ));
        for (offset, piece) in chunks(&payload[chunk..], 777_777) {
            let offset = offset + chunk as u64;
            asm.slot(offset, piece.len())
                .unwrap()
                .copy_from_slice(piece);
            // Begun again, the hash is still on a thread of its own.
            assert!(matches!(asm.hash, RunningHash::Trailing(_)), "{use_:?}");
            asm.commit(offset, piece.len()).unwrap();
        }
        let back = asm.finish().unwrap();
        assert_eq!(
            back.hash,
            Some(content_hash(&meta, data.as_bytes())),
            "{use_:?}"
        );
        assert_eq!(back.data.as_bytes(), data.as_bytes());
    }
}

#[test]
fn a_payload_that_comes_whole_starts_no_hashing_thread() {
    let n = TRAILING_HASH_MIN;
    let data = TensorData::new((0..n).map(|i| (i % 253) as u8).collect::<Vec<_>>(), [n]);
    let (meta, payload) = into_parts(data.clone()).unwrap();
    let mut asm =
        TensorAssembler::new(meta.clone(), u64::MAX, BufferFrom::Fresh, HashUse::Check).unwrap();
    assert!(matches!(asm.hash, RunningHash::TrailingSoon(_)));
    asm.adopt(payload).unwrap();
    assert!(
        matches!(asm.hash, RunningHash::None),
        "not hashed at its handoff"
    );
    // Settled from the bytes by whoever needs it.
    assert_eq!(
        asm.settle_hash().unwrap(),
        content_hash(&meta, data.as_bytes())
    );
    let back = asm.finish().unwrap();
    assert_eq!(back.hash, Some(content_hash(&meta, data.as_bytes())));
    assert_eq!(back.data.as_bytes(), data.as_bytes());
}

/// A receiver that hashes does so for chunks as they arrive (in line and on a trailing thread),
/// and not for a payload that comes whole, whose handoff stays O(1): its registration (a put) or
/// its device (a pull) hashes it later.
#[test]
fn a_hash_comes_with_chunks_but_not_with_a_payload_that_came_whole() {
    for n in [3000, 2 * TRAILING_HASH_MIN] {
        let data = TensorData::new((0..n).map(|i| (i % 241) as u8).collect::<Vec<_>>(), [n]);
        let (meta, payload) = into_parts(data.clone()).unwrap();
        let truth = content_hash(&meta, data.as_bytes());
        let recording = || {
            TensorAssembler::new(meta.clone(), u64::MAX, BufferFrom::Fresh, HashUse::Record)
                .unwrap()
        };
        let mut asm = recording();
        for (offset, piece) in chunks(&payload, 200_003) {
            asm.accept(offset, piece).unwrap();
        }
        let back = asm.finish().unwrap();
        assert_eq!(back.hash, Some(truth), "{n}");
        assert_eq!(back.data.as_bytes(), data.as_bytes());

        let mut whole = recording();
        whole.adopt(payload.clone()).unwrap();
        let back = whole.finish().unwrap();
        assert_eq!(back.hash, None, "{n}: not hashed at its handoff");
        assert_eq!(back.data.as_bytes(), data.as_bytes());

        // Nor by a receiver that hashes to check it: it settles the hash when it needs it.
        let mut checked =
            TensorAssembler::new(meta.clone(), u64::MAX, BufferFrom::Fresh, HashUse::Check)
                .unwrap();
        checked.adopt(payload).unwrap();
        assert_eq!(checked.settle_hash().unwrap(), truth, "{n}");
    }
}

#[test]
fn a_receive_dropped_half_way_stops_its_hashing_thread() {
    let n = TRAILING_HASH_MIN;
    let data = TensorData::new(vec![7u8; n], [n]);
    let (meta, payload) = into_parts(data).unwrap();
    let mut asm = TensorAssembler::new(meta, u64::MAX, BufferFrom::Fresh, HashUse::Check).unwrap();
    asm.accept(0, &payload[..n / 2]).unwrap();
    // Out of order is still refused through the hashing thread's view of the buffer.
    assert!(asm.accept(0, &payload[..8]).is_err());
    drop(asm); // joins the thread; a hang here fails the test by timing out
}

#[test]
fn a_hasher_taken_mid_way_carries_the_committed_bytes() {
    let n = 2 * TRAILING_HASH_MIN;
    let data = TensorData::new((0..n).map(|i| (i % 251) as u8).collect::<Vec<_>>(), [n]);
    let (meta, payload) = into_parts(data.clone()).unwrap();
    let mut asm =
        TensorAssembler::new(meta.clone(), u64::MAX, BufferFrom::Fresh, HashUse::Check).unwrap();
    asm.accept(0, &payload[..n / 3]).unwrap();
    let mut hasher = asm.take_hasher().unwrap();
    hasher.update(&payload[n / 3..]);
    assert_eq!(
        ContentHash::from(hasher.finalize()),
        content_hash(&meta, data.as_bytes())
    );
}

#[test]
fn an_early_end_is_an_error() {
    let data = TensorData::new(vec![1u8, 2, 3], [3]);
    let (meta, payload) = into_parts(data).unwrap();
    let mut asm = TensorAssembler::new(meta, 100, BufferFrom::Fresh, HashUse::Skip).unwrap();
    asm.accept(0, &payload[..2]).unwrap();
    assert!(asm.finish().is_err());
}

#[test]
fn too_large_is_refused_before_allocating() {
    let meta = TensorMeta::new(vec![1 << 40], DType::F32).unwrap();
    assert!(matches!(
        TensorAssembler::new(meta, 1 << 30, BufferFrom::Fresh, HashUse::Skip),
        Err(MetaError::TooLarge { .. })
    ));
}

#[test]
fn a_provided_buffer_of_another_length_is_refused() {
    let data = TensorData::new(vec![1u8, 2, 3], [3]);
    let (meta, payload) = into_parts(data).unwrap();
    let short = burn_std::Bytes::from_bytes_vec(vec![0u8; 2]);
    assert!(matches!(
        TensorAssembler::new(
            meta.clone(),
            100,
            BufferFrom::Provided(short),
            HashUse::Skip
        ),
        Err(MetaError::BufferLength {
            len: 2,
            expected: 3
        })
    ));
    let exact = burn_std::Bytes::from_bytes_vec(vec![0u8; 3]);
    let mut asm =
        TensorAssembler::new(meta, 100, BufferFrom::Provided(exact), HashUse::Skip).unwrap();
    asm.accept(0, &payload).unwrap();
    let back = asm.finish().unwrap();
    assert_eq!(back.data.as_bytes(), &payload[..]);
    assert_eq!(back.hash, None);
}

/// Only a small plain tensor's receiver, hashed in line or not at all, finishes without a
/// hand-off: not a large one (hashed on its own thread or not, settled or not), nor a quantized
/// one (its scales are checked as it is handed out).
#[test]
fn only_a_small_plain_receiver_finishes_at_once() {
    let small = TensorData::new((0..64).map(|i| i as f32).collect::<Vec<_>>(), [64]);
    let just_under = TRAILING_HASH_MIN / 4 - 1;
    let under = TensorData::new(vec![1.0f32; just_under], [just_under]);
    let n = TRAILING_HASH_MIN / 4;
    let large = TensorData::new((0..n).map(|i| i as f32).collect::<Vec<_>>(), [n]);
    let scheme = burn_std::QuantScheme::default()
        .with_value(burn_std::QuantValue::Q8S)
        .with_store(burn_std::QuantStore::Native);
    let quantized = TensorData::quantized(vec![1i8, -2, 3, -4], vec![4], scheme, &[0.5], None);
    let table = [
        (&small, HashUse::Skip, true),
        (&small, HashUse::Record, true),
        (&small, HashUse::Check, true),
        (&under, HashUse::Record, true),
        (&large, HashUse::Skip, false),
        (&large, HashUse::Record, false),
        (&large, HashUse::Check, false),
        (&quantized, HashUse::Skip, false),
        (&quantized, HashUse::Record, false),
    ];
    for (data, use_, at_once) in table {
        let (meta, payload) = into_parts(data.clone()).unwrap();
        let mut asm =
            TensorAssembler::new(meta.clone(), u64::MAX, BufferFrom::Fresh, use_).unwrap();
        for (offset, piece) in chunks(&payload, 1 << 20) {
            asm.accept(offset, piece).unwrap();
        }
        let len = payload.len();
        assert_eq!(asm.finishes_at_once(), at_once, "{len} bytes, {use_:?}");
        if use_ != HashUse::Skip {
            asm.settle_hash().unwrap();
            assert_eq!(asm.finishes_at_once(), at_once, "{len} bytes, settled");
        }
        let back = asm.finish().unwrap();
        assert_eq!(back.data.as_bytes(), data.as_bytes());
        let expected = (use_ != HashUse::Skip).then(|| content_hash(&meta, data.as_bytes()));
        assert_eq!(back.hash, expected, "{len} bytes, {use_:?}");
    }
}
