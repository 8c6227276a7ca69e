//! Wire throughput: 256 MiB f32 and Q8S tensors through ferry's chunked framing, against memcpy.
//!
//! Measured in the same run, on the same bytes:
//! - `memcpy`: the tensor's payload copied into a preallocated, already-touched buffer, the copy
//!   any receiver makes at least once;
//! - `encode prefix`: per 4 MiB chunk, [`frame::chunk_prefix`] (the 24-byte header + offset,
//!   which means a crc32c over the chunk). This is all the framing a zero-copy writer adds: it
//!   writes the prefix and then the payload slice itself;
//! - `encode copy`: the same, then header and payload copied into a reused socket-sized buffer
//!   (a writer that frames into its own buffer);
//! - `decode`: the whole frame stream in a `BytesMut` (as read from a socket): [`frame::parse`]
//!   (header checks + crc32c), `into_chunk`, [`TensorAssembler::accept`] into the buffer
//!   preallocated from the meta (touched beforehand, like memcpy's), then `finish()`;
//! - `decode incl. alloc`: the same with the assembler created inside the timing, so the first
//!   touch of its fresh pages is paid as a receiver pays it;
//! - `decode in place`: what `ferry_client::Connection::read_payload` does instead of `parse`:
//!   the header decoded from its 16 bytes, the chunk's payload copied straight into
//!   [`TensorAssembler::slot`] (standing in for the socket read into it), the crc32c computed
//!   over the slot, then `commit`: one copy and one checksum pass per byte;
//! - `decode fused`: the same, but the checksum is computed over each 256 KiB piece right after
//!   it is copied into the slot (as a receiver would after each socket read), while the piece is
//!   still in cache.
//!
//! Besides criterion's report, the run prints one line per measurement with GB/s and the ratio of
//! its time to memcpy's (the goal: framing + checksum at most 1.5x a memcpy).
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use burn_std::quantization::{QuantScheme, QuantStore, QuantValue, ScaleDtype};
use burn_std::{Bytes, TensorData};
use bytes::BytesMut;
use criterion::{BatchSize, Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use ferry_io::{BufferFrom, HashUse, TensorAssembler};
use ferry_proto::TensorMeta;
use ferry_proto::frame::{
    self, CHUNK_PREFIX_LEN, DEFAULT_CHUNK_SIZE, DEFAULT_MAX_BODY, FrameHeader, HEADER_LEN,
};
use ferry_proto::tensor::into_parts;

const MIB: usize = 1 << 20;

/// A tensor ready to send: its meta, its payload, and its whole chunk frame stream.
struct Subject {
    name: &'static str,
    meta: TensorMeta,
    payload: Bytes,
    stream: Vec<u8>,
}

fn subject(name: &'static str, data: TensorData) -> Subject {
    let (meta, payload) = into_parts(data).expect("a valid tensor");
    let mut stream =
        Vec::with_capacity(payload.len() + payload.len() / DEFAULT_CHUNK_SIZE * 24 + 24);
    for (offset, piece) in frame::chunks(&payload, DEFAULT_CHUNK_SIZE) {
        stream.extend_from_slice(&frame::chunk_prefix(offset, piece));
        stream.extend_from_slice(piece);
    }
    Subject {
        name,
        meta,
        payload,
        stream,
    }
}

/// 256 MiB of f32: shape [16384, 4096].
fn f32_tensor() -> TensorData {
    let numel = 256 * MIB / 4;
    let values: Vec<f32> = (0..numel)
        .map(|i| (i % 65_521) as f32 * 0.25 - 1e4)
        .collect();
    TensorData::new(values, [16_384, 4096])
}

/// Q8S with one f32 scale per block of 32, shape [58254, 4096]: 238,608,384 value bytes plus
/// 29,826,048 scale bytes, 256 MiB less 1 KiB. Built from i8 values and scales directly, not by
/// quantizing through a backend.
fn q8s_tensor() -> TensorData {
    let shape = [58_254, 4096];
    let numel = shape[0] * shape[1];
    let values: Vec<i8> = (0..numel).map(|i| (i % 255) as i8).collect();
    let scales: Vec<f32> = (0..numel / 32).map(|i| 1.0 / (1 + i % 97) as f32).collect();
    let scheme = QuantScheme::default()
        .with_value(QuantValue::Q8S)
        .with_store(QuantStore::Native)
        .per_block([32], ScaleDtype::F32);
    TensorData::quantized(values, shape, scheme, &scales, None)
}

fn memcpy(src: &[u8], dst: &mut [u8]) {
    dst.copy_from_slice(black_box(src));
    black_box(dst);
}

fn encode_prefix(payload: &[u8]) -> u32 {
    let mut acc = 0u32;
    for (offset, piece) in frame::chunks(payload, DEFAULT_CHUNK_SIZE) {
        let prefix = frame::chunk_prefix(offset, black_box(piece));
        acc ^= u32::from_le_bytes([prefix[12], prefix[13], prefix[14], prefix[15]]);
    }
    black_box(acc)
}

fn encode_copy(payload: &[u8], socket: &mut [u8]) {
    for (offset, piece) in frame::chunks(payload, DEFAULT_CHUNK_SIZE) {
        let prefix = frame::chunk_prefix(offset, black_box(piece));
        socket[..HEADER_LEN + CHUNK_PREFIX_LEN].copy_from_slice(&prefix);
        socket[HEADER_LEN + CHUNK_PREFIX_LEN..][..piece.len()].copy_from_slice(piece);
        black_box(&mut *socket);
    }
}

/// An assembler for `meta` with every page of its buffer already touched.
fn touched_assembler(meta: &TensorMeta) -> TensorAssembler {
    let mut assembler =
        TensorAssembler::new(meta.clone(), u64::MAX, BufferFrom::Fresh, HashUse::Skip)
            .expect("no limit");
    if meta.byte_len() > 0 {
        // Written through the slot, never committed: the stream still starts at offset 0.
        assembler.slot(0, meta.byte_len()).expect("slot").fill(1);
    }
    assembler
}

fn decode(mut stream: BytesMut, mut assembler: TensorAssembler) -> TensorData {
    while let Some(frame) = frame::parse(&mut stream, DEFAULT_MAX_BODY).expect("valid frame") {
        let chunk = frame.into_chunk().expect("a chunk");
        assembler
            .accept(chunk.offset, &chunk.data)
            .expect("in order");
    }
    assembler.finish().expect("complete").data
}

/// The receive path of `Connection::read_payload`, reading from `stream` instead of a socket.
fn decode_in_place(stream: &[u8], mut assembler: TensorAssembler) -> TensorData {
    let mut at = 0;
    while at < stream.len() {
        let head = stream[at..].first_chunk::<HEADER_LEN>().expect("a header");
        let header = FrameHeader::decode(head, DEFAULT_MAX_BODY).expect("valid header");
        let body = &stream[at + HEADER_LEN..][..header.body_len as usize];
        let (offset_bytes, data) = body.split_at(CHUNK_PREFIX_LEN);
        let offset = u64::from_le_bytes(offset_bytes.try_into().expect("8 bytes"));
        let slot = assembler.slot(offset, data.len()).expect("in order");
        slot.copy_from_slice(data);
        let crc = crc32c::crc32c_append(crc32c::crc32c(offset_bytes), slot);
        header.verify_crc(crc).expect("checksum");
        assembler.commit(offset, data.len()).expect("in order");
        at += HEADER_LEN + header.body_len as usize;
    }
    assembler.finish().expect("complete").data
}

/// Bytes copied (one simulated socket read) before they are checksummed, in `decode_fused`.
const FUSE: usize = 256 << 10;

/// `decode_in_place`, checksumming each [`FUSE`]-sized piece right after copying it in.
fn decode_fused(stream: &[u8], mut assembler: TensorAssembler) -> TensorData {
    let mut at = 0;
    while at < stream.len() {
        let head = stream[at..].first_chunk::<HEADER_LEN>().expect("a header");
        let header = FrameHeader::decode(head, DEFAULT_MAX_BODY).expect("valid header");
        let body = &stream[at + HEADER_LEN..][..header.body_len as usize];
        let (offset_bytes, data) = body.split_at(CHUNK_PREFIX_LEN);
        let offset = u64::from_le_bytes(offset_bytes.try_into().expect("8 bytes"));
        let slot = assembler.slot(offset, data.len()).expect("in order");
        let mut crc = crc32c::crc32c(offset_bytes);
        for (to, from) in slot.chunks_mut(FUSE).zip(data.chunks(FUSE)) {
            to.copy_from_slice(from);
            crc = crc32c::crc32c_append(crc, to);
        }
        header.verify_crc(crc).expect("checksum");
        assembler.commit(offset, data.len()).expect("in order");
        at += HEADER_LEN + header.body_len as usize;
    }
    assembler.finish().expect("complete").data
}

/// Median wall time of `runs` runs of `f` (after one warm-up), `setup` untimed before each and
/// the output dropped after the clock stops (freeing 256 MiB is not part of decoding it).
fn median<I, O>(runs: usize, mut setup: impl FnMut() -> I, mut f: impl FnMut(I) -> O) -> Duration {
    drop(f(setup()));
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let input = setup();
            let start = Instant::now();
            let output = black_box(f(input));
            let time = start.elapsed();
            drop(output);
            time
        })
        .collect();
    times.sort();
    times[runs / 2]
}

fn gbps(bytes: usize, time: Duration) -> f64 {
    bytes as f64 / time.as_secs_f64() / 1e9
}

/// Our own measurement, printed as plain lines so the ratios are easy to find.
fn report(s: &Subject) {
    const RUNS: usize = 7;
    let len = s.payload.len();
    let mut dst = vec![1u8; len];
    let mut socket = vec![1u8; DEFAULT_CHUNK_SIZE + HEADER_LEN + CHUNK_PREFIX_LEN];
    let copy = median(RUNS, || (), |()| memcpy(&s.payload, &mut dst));
    drop(dst);
    let prefix = median(
        RUNS,
        || (),
        |()| {
            encode_prefix(&s.payload);
        },
    );
    let framed = median(RUNS, || (), |()| encode_copy(&s.payload, &mut socket));
    let decoded = median(
        RUNS,
        || (BytesMut::from(&s.stream[..]), touched_assembler(&s.meta)),
        |(stream, assembler)| decode(stream, assembler),
    );
    let decoded_alloc = median(
        RUNS,
        || BytesMut::from(&s.stream[..]),
        |stream| {
            let assembler =
                TensorAssembler::new(s.meta.clone(), u64::MAX, BufferFrom::Fresh, HashUse::Skip)
                    .expect("no limit");
            decode(stream, assembler)
        },
    );
    let in_place = median(
        RUNS,
        || touched_assembler(&s.meta),
        |assembler| decode_in_place(&s.stream, assembler),
    );
    let fused = median(
        RUNS,
        || touched_assembler(&s.meta),
        |assembler| decode_fused(&s.stream, assembler),
    );
    let mib = len as f64 / MIB as f64;
    println!(
        "wire/memcpy {} {mib:.0}MiB ({len} bytes): {:.2} GB/s",
        s.name,
        gbps(len, copy)
    );
    for (what, time) in [
        ("encode prefix", prefix),
        ("encode copy", framed),
        ("decode", decoded),
        ("decode incl. alloc", decoded_alloc),
        ("decode in place", in_place),
        ("decode fused", fused),
    ] {
        println!(
            "wire/{what} {} {mib:.0}MiB: {:.2} GB/s, memcpy {:.2} GB/s, ratio {:.2}",
            s.name,
            gbps(len, time),
            gbps(len, copy),
            time.as_secs_f64() / copy.as_secs_f64()
        );
    }
}

fn bench(c: &mut Criterion) {
    for s in [subject("f32", f32_tensor()), subject("q8s", q8s_tensor())] {
        // Sanity: the decode path gives back the very bytes.
        let back = decode(BytesMut::from(&s.stream[..]), touched_assembler(&s.meta));
        assert_eq!(back.as_bytes(), &s.payload[..]);
        assert_eq!(back.dtype(), s.meta.dtype());
        drop(back);
        for back in [
            decode_in_place(&s.stream, touched_assembler(&s.meta)),
            decode_fused(&s.stream, touched_assembler(&s.meta)),
        ] {
            assert_eq!(back.as_bytes(), &s.payload[..]);
            assert_eq!(back.dtype(), s.meta.dtype());
        }

        report(&s);

        let len = s.payload.len();
        let mut group = c.benchmark_group(format!("wire/{}", s.name));
        group
            .sample_size(10)
            .sampling_mode(SamplingMode::Flat)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2))
            .throughput(Throughput::Bytes(len as u64));
        let mut dst = vec![1u8; len];
        group.bench_function("memcpy", |b| b.iter(|| memcpy(&s.payload, &mut dst)));
        drop(dst);
        group.bench_function("encode prefix", |b| b.iter(|| encode_prefix(&s.payload)));
        let mut socket = vec![1u8; DEFAULT_CHUNK_SIZE + HEADER_LEN + CHUNK_PREFIX_LEN];
        group.bench_function("encode copy", |b| {
            b.iter(|| encode_copy(&s.payload, &mut socket))
        });
        group.bench_function("decode", |b| {
            b.iter_batched(
                || (BytesMut::from(&s.stream[..]), touched_assembler(&s.meta)),
                |(stream, assembler)| decode(stream, assembler),
                BatchSize::PerIteration,
            )
        });
        group.bench_function("decode in place", |b| {
            b.iter_batched(
                || touched_assembler(&s.meta),
                |assembler| decode_in_place(&s.stream, assembler),
                BatchSize::PerIteration,
            )
        });
        group.bench_function("decode fused", |b| {
            b.iter_batched(
                || touched_assembler(&s.meta),
                |assembler| decode_fused(&s.stream, assembler),
                BatchSize::PerIteration,
            )
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
