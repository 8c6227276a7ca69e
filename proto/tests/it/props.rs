//! Property tests of the wire: messages round-trip, and no input from a peer makes a decoder panic.
//!
//! (a) metas built from valid `TensorMeta`s and every `Request`/`Response` variant with random
//! contents survive encode -> `frame::parse` -> decode; (b) the frame parser, fed arbitrary bytes,
//! truncated frames, lying length fields and flipped bits, answers `Ok(None)` or `Err` and refuses
//! an oversized body from its 16 header bytes alone; (c) `TensorMeta::try_from` on arbitrary wire
//! metas and (d) the control decoders on arbitrary bytes never panic, at any minor; (e) node and
//! device statistics travel between peers of any two minors as of the lower one.

use burn_std::DType;
use burn_std::quantization::{QuantMode, QuantScheme, QuantStore, QuantValue, ScaleDtype};
use bytes::BytesMut;
use ferry_proto::control::{
    decode_request, decode_request_from, decode_response, decode_response_from, encode_request,
    encode_request_for, encode_response, encode_response_for,
};
use ferry_proto::dtype::{PLAIN_DTYPES as PLAIN, QUANT_VALUES as VALUES, SCALE_DTYPES as SCALES};
use ferry_proto::frame::PROTOCOL_MINOR;
use ferry_proto::frame::{self, DEFAULT_MAX_BODY, FrameKind, HEADER_LEN, MAGIC};
use ferry_proto::meta::{MAX_RANK, expected_byte_len};
use ferry_proto::{
    ContentHash, DeviceStats, ErrorCode, ErrorReply, FrameError, HeldDtype, Hello, NodeStats,
    Request, Response, TensorInfo, TensorKey, TensorMeta, TransferPath, Welcome, WireDType,
    WireMeta, WireQuantScheme,
};
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::sample::select;

// ---------------------------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------------------------

/// Any scheme Burn's builders make: every field random, block extents 1..=8 over 1..=5 dims
/// (leading 1s included: Burn drops them), packing dims past the rank included.
fn arb_scheme() -> BoxedStrategy<QuantScheme> {
    (
        select(&VALUES[..]),
        0..3u8,
        0usize..4,
        prop::bool::ANY,
        option::of(select(&SCALES[..])),
        option::of((vec(1u8..=8, 1..=5), select(&SCALES[..]))),
    )
        .prop_map(|(value, store, dim, lookup, tensor, block)| {
            let store = match store {
                0 => QuantStore::Native,
                1 => QuantStore::PackedNative(dim),
                _ => QuantStore::PackedU32(dim),
            };
            let mode = if lookup {
                QuantMode::Lookup
            } else {
                QuantMode::Symmetric
            };
            let mut scheme = QuantScheme::default()
                .with_value(value)
                .with_store(store)
                .with_mode(mode);
            if let Some(dtype) = tensor {
                scheme = scheme.per_tensor(dtype);
            }
            if let Some((extents, dtype)) = block {
                scheme = scheme.per_block(extents, dtype);
            }
            scheme
        })
        .boxed()
}

fn arb_dtype() -> BoxedStrategy<DType> {
    prop_oneof![select(&PLAIN[..]), arb_scheme().prop_map(DType::QFloat),].boxed()
}

/// A valid meta: rank 0..=6 with small dims, any dtype, the byte length by the rule. Burn-side
/// combinations the rule refuses (a block of higher rank than the shape, an ambiguous packed
/// layout) are filtered out.
fn arb_meta() -> BoxedStrategy<TensorMeta> {
    (vec(0usize..6, 0..=6), arb_dtype())
        .prop_filter_map("not a valid meta", |(shape, dtype)| {
            TensorMeta::new(shape, dtype).ok()
        })
        .boxed()
}

fn arb_text() -> impl Strategy<Value = String> {
    prop_oneof!["[a-z0-9._/-]{0,24}", ".{0,12}"]
}

fn arb_hash() -> impl Strategy<Value = ContentHash> {
    any::<[u8; 32]>().prop_map(ContentHash::from_digest)
}

fn arb_path() -> impl Strategy<Value = TransferPath> {
    select(
        &[
            TransferPath::Put,
            TransferPath::Native,
            TransferPath::RoundTrip,
            TransferPath::Pull,
            TransferPath::Dedup,
        ][..],
    )
}

fn arb_key() -> impl Strategy<Value = TensorKey> {
    (any::<u32>(), arb_text()).prop_map(|(device, name)| TensorKey { device, name })
}

/// Any wire dtype: arbitrary codes, not necessarily valid (bincode carries them regardless).
fn arb_wire_dtype() -> BoxedStrategy<WireDType> {
    let scheme = (
        any::<u8>(),
        any::<u8>(),
        any::<u8>(),
        any::<u8>(),
        any::<u8>(),
        any::<u8>(),
        vec(any::<u8>(), 0..8),
    )
        .prop_map(
            |(value, store, packing_dim, mode, tensor_scale, block_scale, block_size)| {
                WireQuantScheme {
                    value,
                    store,
                    packing_dim,
                    mode,
                    tensor_scale,
                    block_scale,
                    block_size,
                }
            },
        );
    prop_oneof![
        arb_dtype().prop_map(WireDType::from),
        (any::<u8>(), option::of(scheme)).prop_map(|(tag, quant)| WireDType { tag, quant }),
    ]
    .boxed()
}

fn arb_wire_meta() -> BoxedStrategy<WireMeta> {
    prop_oneof![
        arb_meta().prop_map(|m| m.to_wire()),
        (vec(any::<u64>(), 0..20), arb_wire_dtype(), any::<u64>()).prop_map(
            |(shape, dtype, byte_len)| WireMeta {
                shape,
                dtype,
                byte_len
            }
        ),
    ]
    .boxed()
}

fn arb_info() -> BoxedStrategy<TensorInfo> {
    (
        arb_key(),
        arb_wire_dtype(),
        vec(any::<u64>(), 0..6),
        any::<u64>(),
        arb_path(),
    )
        .prop_map(|(key, dtype, shape, bytes, path)| TensorInfo {
            key,
            dtype,
            shape,
            bytes,
            path,
        })
        .boxed()
}

fn arb_request() -> BoxedStrategy<Request> {
    let hello = (
        any::<u8>(),
        any::<u16>(),
        vec(arb_text(), 0..4),
        option::of(arb_text()),
        arb_text(),
    )
        .prop_map(|(major, minor, features, token, agent)| {
            Request::Hello(Hello {
                major,
                minor,
                features,
                token: token.map(Into::into),
                agent,
            })
        });
    let put = (
        any::<u32>(),
        option::of(arb_text()),
        arb_wire_meta(),
        any::<bool>(),
    )
        .prop_map(|(device, name, meta, overwrite)| Request::Put {
            device,
            name,
            meta,
            overwrite,
        });
    let put_eager = (
        any::<u32>(),
        option::of(arb_text()),
        arb_wire_meta(),
        any::<bool>(),
    )
        .prop_map(|(device, name, meta, overwrite)| Request::PutEager {
            device,
            name,
            meta,
            overwrite,
        });
    let copy = (
        arb_key(),
        any::<u32>(),
        option::of(arb_text()),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(src, dst_device, dst_name, remove_source, overwrite)| Request::Copy {
                src,
                dst_device,
                dst_name,
                remove_source,
                overwrite,
            },
        );
    let pull = (
        (arb_text(), arb_text(), arb_key()),
        (
            any::<u32>(),
            option::of(arb_text()),
            any::<bool>(),
            option::of(arb_hash()),
        ),
    )
        .prop_map(
            |((source, capability, src), (dst_device, dst_name, overwrite, content_hash))| {
                Request::Pull {
                    source,
                    capability: capability.into(),
                    src,
                    dst_device,
                    dst_name,
                    overwrite,
                    content_hash,
                }
            },
        );
    prop_oneof![
        hello,
        put,
        put_eager,
        arb_key().prop_map(|key| Request::Get { key }),
        copy,
        arb_key().prop_map(|key| Request::Delete { key }),
        option::of(any::<u32>()).prop_map(|device| Request::List { device }),
        Just(Request::Stat),
        Just(Request::Identify),
        (arb_key(), arb_text()).prop_map(|(key, audience)| Request::Grant {
            key,
            audience: audience.into()
        }),
        pull,
        (arb_text(), arb_text(), any::<u64>()).prop_map(|(capability, node_id, offset)| {
            Request::Fetch {
                capability: capability.into(),
                node_id: node_id.into(),
                offset,
            }
        }),
        (
            option::of(any::<u32>()),
            option::of(arb_key()),
            any::<u32>()
        )
            .prop_map(|(device, after, limit)| Request::ListPage {
                device,
                after,
                limit
            }),
        (arb_key(), arb_hash())
            .prop_map(|(key, content_hash)| Request::DeleteIf { key, content_hash }),
        any::<u32>().prop_map(|device| Request::Holds { device }),
        (arb_text(), arb_text(), any::<u64>(), any::<u64>()).prop_map(
            |(capability, node_id, from, to)| Request::FetchRange {
                capability: capability.into(),
                node_id: node_id.into(),
                from,
                to,
            }
        ),
    ]
    .boxed()
}

/// Any device's statistics, every field random (those of every minor).
pub(crate) fn arb_device_stats() -> BoxedStrategy<DeviceStats> {
    (
        any::<u32>(),
        arb_text(),
        arb_text(),
        any::<u64>(),
        any::<u64>(),
        option::of(any::<u64>()),
        any::<[u32; 2]>(),
        option::of(any::<u64>()),
    )
        .prop_map(
            |(index, backend, device, tensors, bytes_held, memory_limit, holds, largest)| {
                DeviceStats {
                    index,
                    backend,
                    device,
                    tensors,
                    bytes_held,
                    memory_limit,
                    holds_measured: holds[0],
                    holds_exact: holds[1],
                    largest_tensor: largest,
                }
            },
        )
        .boxed()
}

/// Any node's statistics, every field random (those of every minor).
pub(crate) fn arb_node_stats() -> BoxedStrategy<NodeStats> {
    (
        arb_text(),
        vec(arb_device_stats(), 0..3),
        any::<[u64; 25]>(),
        arb_text(),
        arb_text(),
        option::of(arb_text()),
    )
        .prop_map(
            |(agent, devices, n, transfer_policy, node_id, unix_socket)| NodeStats {
                agent,
                devices,
                transfers_done: n[0],
                transfers_failed: n[1],
                native_transfers: n[2],
                round_trip_transfers: n[3],
                connections: n[4],
                transfer_policy,
                node_id,
                pulls: n[5],
                pull_retries: n[6],
                dedup_hits: n[7],
                fetches_served: n[8],
                unix_socket,
                shared_memory: n[9] % 2 == 0,
                shm_payloads_sent: n[10],
                shm_payloads_received: n[11],
                shm_bytes: n[12],
                regions_in_flight: n[9] / 2,
                resident_bytes: n[13],
                peak_resident_bytes: n[14],
                hashes_pending: n[15],
                hash_mismatches: n[16],
                recycled_bytes: n[17],
                regions_kept: n[18],
                pool_bytes: n[19],
                pool_free_bytes: n[20],
                pool_misses: n[21],
                uptime_ms: n[22],
                fetches_in_flight: n[23],
                fetch_bytes_in_flight: n[24],
            },
        )
        .boxed()
}

fn arb_response() -> BoxedStrategy<Response> {
    let welcome = (
        any::<u8>(),
        any::<u16>(),
        vec(arb_text(), 0..4),
        arb_text(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(|(major, minor, features, agent, max_body, chunk_size)| {
            Response::Welcome(Welcome {
                major,
                minor,
                features,
                agent,
                max_body,
                chunk_size,
            })
        });
    prop_oneof![
        welcome,
        arb_info().prop_map(Response::Stored),
        (arb_info(), arb_wire_meta()).prop_map(|(info, meta)| Response::Tensor { info, meta }),
        arb_info().prop_map(Response::Deleted),
        vec(arb_info(), 0..4).prop_map(Response::Listing),
        arb_node_stats().prop_map(Response::Stats),
        (select(&ErrorCode::ALL[..]), arb_text())
            .prop_map(|(code, message)| Response::Error(ErrorReply { code, message })),
        Just(Response::Ready),
        arb_text().prop_map(|node_id| Response::Identity {
            node_id: node_id.into()
        }),
        (arb_text(), any::<u64>(), arb_info(), arb_hash()).prop_map(
            |(token, expires_in_ms, info, content_hash)| Response::Capability {
                token: token.into(),
                expires_in_ms,
                info,
                content_hash,
            }
        ),
        (vec(arb_info(), 0..4), option::of(arb_key()))
            .prop_map(|(tensors, next)| Response::Page { tensors, next }),
        (
            any::<u32>(),
            vec(
                (
                    arb_wire_dtype(),
                    vec(any::<u64>(), 0..4),
                    option::of(arb_text())
                ),
                0..4
            )
        )
            .prop_map(|(device, dtypes)| Response::Holds {
                device,
                dtypes: dtypes
                    .into_iter()
                    .map(|(dtype, shape, refused)| HeldDtype {
                        dtype,
                        shape,
                        refused,
                    })
                    .collect(),
            }),
        (arb_info(), arb_wire_meta(), any::<u64>(), any::<u64>()).prop_map(
            |(info, meta, start, end)| Response::TensorPart {
                info,
                meta,
                start,
                end,
            }
        ),
    ]
    .boxed()
}

/// A valid frame of either kind.
fn arb_frame() -> BoxedStrategy<Vec<u8>> {
    prop_oneof![
        arb_request().prop_map(|r| encode_request(&r).unwrap()),
        arb_response().prop_map(|r| encode_response(&r).unwrap()),
        (any::<u64>(), vec(any::<u8>(), 0..64)).prop_map(|(o, p)| frame::encode_chunk(o, &p)),
        vec(any::<u8>(), 0..64).prop_map(|b| frame::encode(FrameKind::Control, &b)),
    ]
    .boxed()
}

/// The one control frame in `bytes`, its body.
fn only_control_body(bytes: &[u8]) -> bytes::Bytes {
    let mut buf = BytesMut::from(bytes);
    let frame = frame::parse(&mut buf, DEFAULT_MAX_BODY)
        .expect("valid")
        .expect("whole");
    assert_eq!(frame.kind, FrameKind::Control);
    assert!(buf.is_empty(), "one frame, nothing after it");
    frame.body
}

/// Parses `bytes` with `max_body`, checking what holds whatever the bytes: `Ok(None)` consumes
/// nothing, `Ok(Some)` consumes exactly its frame, and nothing panics.
fn parse_checked(bytes: &[u8], max_body: usize) -> Result<Option<frame::Frame>, FrameError> {
    let mut buf = BytesMut::from(bytes);
    let result = frame::parse(&mut buf, max_body);
    match &result {
        Ok(None) => assert_eq!(&buf[..], bytes, "nothing consumed"),
        Ok(Some(frame)) => {
            assert_eq!(bytes[..4], MAGIC);
            assert!(frame.body.len() <= max_body);
            assert_eq!(buf.len(), bytes.len() - HEADER_LEN - frame.body.len());
        }
        Err(_) => {}
    }
    result
}

// ---------------------------------------------------------------------------------------------
// (a) round trips
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig { max_global_rejects: 100_000, ..ProptestConfig::default() })]

    #[test]
    fn a_valid_meta_round_trips_through_a_put(
        meta in arb_meta(),
        device in any::<u32>(),
        name in option::of(arb_text()),
        overwrite in any::<bool>(),
    ) {
        let put = Request::Put { device, name, meta: meta.to_wire(), overwrite };
        let decoded = decode_request(&only_control_body(&encode_request(&put).unwrap())).unwrap();
        prop_assert_eq!(&decoded, &put);
        let Request::Put { meta: wire, .. } = decoded else { unreachable!() };
        prop_assert_eq!(wire.byte_len, meta.byte_len() as u64);
        // The receiver accepts what a valid sender sends, and sees the same meta.
        prop_assert_eq!(TensorMeta::try_from(&wire), Ok(meta));
    }

    #[test]
    fn every_request_round_trips(request in arb_request()) {
        let body = only_control_body(&encode_request(&request).unwrap());
        prop_assert_eq!(decode_request(&body), Ok(request));
    }

    #[test]
    fn every_response_round_trips(response in arb_response()) {
        let body = only_control_body(&encode_response(&response).unwrap());
        prop_assert_eq!(decode_response(&body), Ok(response));
    }
}

// ---------------------------------------------------------------------------------------------
// (b) the frame parser
// ---------------------------------------------------------------------------------------------

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic_the_parser(
        bytes in vec(any::<u8>(), 0..256),
        max_body in 0usize..512,
    ) {
        let _ = parse_checked(&bytes, max_body);
    }

    #[test]
    fn arbitrary_bodies_behind_a_plausible_header_never_panic_the_parser(
        kind in 0u8..4,
        flags in prop_oneof![Just(0u16), any::<u16>()],
        len in prop_oneof![0u32..300, any::<u32>()],
        crc in any::<u32>(),
        body in vec(any::<u8>(), 0..300),
        max_body in prop_oneof![0usize..512, Just(DEFAULT_MAX_BODY)],
    ) {
        let mut bytes = MAGIC.to_vec();
        bytes.push(frame::PROTOCOL_VERSION);
        bytes.push(kind);
        bytes.extend_from_slice(&flags.to_le_bytes());
        bytes.extend_from_slice(&len.to_le_bytes());
        bytes.extend_from_slice(&crc.to_le_bytes());
        bytes.extend_from_slice(&body);
        let _ = parse_checked(&bytes, max_body);
    }

    #[test]
    fn a_truncated_frame_is_not_yet_a_frame(
        frame in arb_frame(),
        cut in any::<prop::sample::Index>(),
    ) {
        let cut = cut.index(frame.len());
        prop_assert_eq!(parse_checked(&frame[..cut], DEFAULT_MAX_BODY), Ok(None));
        // The whole frame, followed by a truncated one, yields the first and waits for the rest.
        let mut buf = BytesMut::from(&frame[..]);
        buf.extend_from_slice(&frame[..cut]);
        prop_assert!(frame::parse(&mut buf, DEFAULT_MAX_BODY).unwrap().is_some());
        prop_assert_eq!(frame::parse(&mut buf, DEFAULT_MAX_BODY), Ok(None));
        prop_assert_eq!(&buf[..], &frame[..cut]);
    }

    #[test]
    fn a_lying_length_never_yields_a_frame(
        frame in arb_frame(),
        lie in prop_oneof![0u32..200, any::<u32>()],
        headroom in prop_oneof![Just(None), (0usize..200).prop_map(Some)],
    ) {
        let real = (frame.len() - HEADER_LEN) as u32;
        prop_assume!(lie != real);
        let max_body = headroom.map_or(DEFAULT_MAX_BODY, |extra| real as usize + extra);
        let mut bytes = frame.clone();
        bytes[8..12].copy_from_slice(&lie.to_le_bytes());
        let result = parse_checked(&bytes, max_body);
        if lie as usize > max_body {
            let max = max_body as u64;
            prop_assert_eq!(result, Err(FrameError::TooLarge { len: lie.into(), max }));
        } else if lie > real {
            prop_assert_eq!(result, Ok(None));
        } else {
            // The body is cut short: its checksum no longer matches.
            let mismatch = matches!(result, Err(FrameError::ChecksumMismatch { .. }));
            prop_assert!(mismatch, "{:?}", result);
        }
    }

    #[test]
    fn a_flipped_bit_never_yields_a_frame(
        frame in arb_frame(),
        bit in any::<prop::sample::Index>(),
    ) {
        let bit = bit.index(frame.len() * 8);
        let mut bytes = frame.clone();
        bytes[bit / 8] ^= 1 << (bit % 8);
        let result = parse_checked(&bytes, DEFAULT_MAX_BODY);
        // Magic, version, kind and flags are checked by value, the body and checksum by crc32c
        // (which catches every single-bit error), and a changed length either waits for bytes
        // that never come or cuts the body short of its checksum.
        prop_assert!(!matches!(result, Ok(Some(_))), "bit {} gave {:?}", bit, result);
        if bit / 8 >= 8 && bit / 8 < 12 && result == Ok(None) {
            let declared = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
            prop_assert!(bytes.len() < HEADER_LEN + declared);
        }
    }

    #[test]
    fn corrupted_bytes_never_panic_the_parser(
        frame in arb_frame(),
        edits in vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let mut bytes = frame.clone();
        for (at, byte) in edits {
            let at = at.index(bytes.len());
            bytes[at] = byte;
        }
        let _ = parse_checked(&bytes, DEFAULT_MAX_BODY);
    }

    #[test]
    fn an_oversized_body_is_refused_from_the_header_alone(
        kind in 1u8..=2,
        max_body in prop_oneof![0usize..1024, Just(DEFAULT_MAX_BODY)],
        excess in 1u64..=u32::MAX as u64,
        crc in any::<u32>(),
    ) {
        let len = max_body as u64 + excess;
        prop_assume!(len <= u32::MAX as u64);
        let mut header = MAGIC.to_vec();
        header.push(frame::PROTOCOL_VERSION);
        header.push(kind);
        header.extend_from_slice(&0u16.to_le_bytes());
        header.extend_from_slice(&(len as u32).to_le_bytes());
        header.extend_from_slice(&crc.to_le_bytes());
        let refused = FrameError::TooLarge { len, max: max_body as u64 };
        // Only the 16 header bytes are there: nothing has been (or needs to be) allocated.
        prop_assert_eq!(frame::check(&header, max_body), Err(refused.clone()));
        prop_assert_eq!(parse_checked(&header, max_body), Err(refused));
        // Fewer than 16 bytes: not yet decidable, so not an error.
        prop_assert_eq!(frame::check(&header[..HEADER_LEN - 1], max_body), Ok(None));
    }
}

// ---------------------------------------------------------------------------------------------
// (c) metas from outside
// ---------------------------------------------------------------------------------------------

proptest! {
    #[test]
    fn any_wire_meta_is_judged_without_panicking(
        mut wire in arb_wire_meta(),
        use_the_rule in any::<bool>(),
    ) {
        // Half the time give the length the rule implies, so the success path is reached too.
        if let (true, Ok(dtype)) = (use_the_rule, DType::try_from(&wire.dtype)) {
            let shape: Option<Vec<usize>> =
                wire.shape.iter().map(|&d| usize::try_from(d).ok()).collect();
            if let Some(Ok(len)) = shape.map(|s| expected_byte_len(&s, &dtype)) {
                wire.byte_len = len as u64;
            }
        }
        if let Ok(meta) = TensorMeta::try_from(&wire) {
            // Accepted metas are canonical: they encode back to exactly what arrived.
            prop_assert_eq!(meta.to_wire(), wire.clone());
            prop_assert!(meta.shape().len() <= MAX_RANK);
            prop_assert_eq!(expected_byte_len(meta.shape(), &meta.dtype()), Ok(meta.byte_len()));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// (d) control bodies from outside
// ---------------------------------------------------------------------------------------------

/// Body bytes that start like a message (a variant index, then fields) more often than chance.
fn arb_body() -> BoxedStrategy<Vec<u8>> {
    prop_oneof![
        vec(any::<u8>(), 0..128),
        (0u32..13, vec(any::<u8>(), 0..128)).prop_map(|(variant, tail)| {
            let mut body = variant.to_le_bytes().to_vec();
            body.extend_from_slice(&tail);
            body
        }),
        // A length prefix claiming far more than there is.
        (0u32..11, any::<u32>(), 0u8..2, any::<u64>()).prop_map(|(variant, device, tag, len)| {
            let mut body = variant.to_le_bytes().to_vec();
            body.extend_from_slice(&device.to_le_bytes());
            body.push(tag);
            body.extend_from_slice(&len.to_le_bytes());
            body
        }),
    ]
    .boxed()
}

/// A valid request or response body with a few bytes replaced, cut or appended.
fn arb_mangled_body() -> BoxedStrategy<Vec<u8>> {
    let body = prop_oneof![
        arb_request().prop_map(|r| only_control_body(&encode_request(&r).unwrap()).to_vec()),
        arb_response().prop_map(|r| only_control_body(&encode_response(&r).unwrap()).to_vec()),
    ];
    (
        body,
        vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        any::<prop::sample::Index>(),
        vec(any::<u8>(), 0..3),
    )
        .prop_map(|(mut body, edits, cut, tail)| {
            if !body.is_empty() {
                for (at, byte) in edits {
                    let at = at.index(body.len());
                    body[at] = byte;
                }
            }
            let keep = cut.index(body.len() + 1);
            body.truncate(keep.max(body.len().saturating_sub(8)));
            body.extend_from_slice(&tail);
            body
        })
        .boxed()
}

proptest! {
    #[test]
    fn arbitrary_bodies_never_panic_the_decoders(
        body in prop_oneof![arb_body(), arb_mangled_body()],
        minor in 0..=PROTOCOL_MINOR + 1,
    ) {
        // What decodes is canonical: encoding it again for the same minor gives the very same
        // bytes.
        if let Ok(request) = decode_request_from(&body, minor) {
            let again = encode_request_for(&request, minor).unwrap();
            prop_assert_eq!(&only_control_body(&again)[..], &body[..]);
        }
        if let Ok(response) = decode_response_from(&body, minor) {
            let again = encode_response_for(&response, minor).unwrap();
            prop_assert_eq!(&only_control_body(&again)[..], &body[..]);
        }
    }
}

/// The cases property (a) found: Burn's builders make schemes the wire decoder refuses, so
/// `TensorMeta::new` refuses them too rather than build a meta no receiver accepts.
#[test]
fn a_sender_cannot_build_a_meta_the_receiver_refuses() {
    use ferry_proto::{DTypeError, MetaError};
    let q8s = QuantScheme::default()
        .with_value(QuantValue::Q8S)
        .with_store(QuantStore::Native);
    // `per_block([1])` canonicalises to a block of no extents.
    let empty = DType::QFloat(q8s.per_block([1], ScaleDtype::F32));
    assert_eq!(
        TensorMeta::new(vec![4], empty),
        Err(MetaError::DType(DTypeError::EmptyBlockSize))
    );
    let zero = DType::QFloat(q8s.per_block([4, 0], ScaleDtype::F32));
    assert_eq!(
        TensorMeta::new(vec![4, 4], zero),
        Err(MetaError::DType(DTypeError::ZeroBlockExtent {
            extents: vec![4, 0]
        }))
    );
    // A leading 1 is dropped by Burn itself, so `[1, 4]` is simply `[4]` and is fine.
    let lead = DType::QFloat(q8s.per_block([1, 4], ScaleDtype::F32));
    let meta = TensorMeta::new(vec![2, 4], lead).unwrap();
    assert_eq!(meta.to_wire().dtype.quant.unwrap().block_size, vec![4]);
}

/// What PROTOCOL.md §4 promises a decoder refuses: a bool or an `Option` tag other than 0 or 1,
/// invalid UTF-8, an unknown variant index, trailing bytes, and a length claiming more than is
/// there (without allocating it).
#[test]
fn non_canonical_bodies_are_refused() {
    let body = |r: &Request| only_control_body(&encode_request(r).unwrap()).to_vec();
    let put = Request::Put {
        device: 0,
        name: Some("w".to_string()),
        meta: TensorMeta::new(vec![2, 3], DType::F32).unwrap().to_wire(),
        overwrite: true,
    };
    let good = body(&put);
    assert_eq!(decode_request(&good), Ok(put));
    let last = good.len() - 1;
    let refused = |bytes: &[u8]| matches!(decode_request(bytes), Err(FrameError::Malformed(_)));
    // bool: the last byte is `overwrite`.
    let mut bad = good.clone();
    bad[last] = 2;
    assert!(refused(&bad));
    // Option tag: byte 8 is `name`'s.
    let mut bad = good.clone();
    bad[8] = 2;
    assert!(refused(&bad));
    // Invalid UTF-8 in the name (its one byte is at 17).
    let mut bad = good.clone();
    bad[17] = 0xff;
    assert!(refused(&bad));
    // Unknown variant index.
    let mut bad = good.clone();
    bad[0] = 200;
    assert!(refused(&bad));
    // Trailing byte; missing byte.
    let mut bad = good.clone();
    bad.push(0);
    assert!(refused(&bad));
    assert!(refused(&good[..last]));
    // A name claiming 2^40 bytes.
    let mut bad = good[..9].to_vec();
    bad.extend_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(refused(&bad));
}

// ---------------------------------------------------------------------------------------------
// (e) statistics across minors
// ---------------------------------------------------------------------------------------------

/// `stats` as a peer of minor `minor` has them: every field added after that minor at its
/// default. Written out from PROTOCOL.md §8's table, apart from the `since` of the message
/// definitions, so that each checks the other.
fn stats_as_of(stats: &NodeStats, minor: u16) -> NodeStats {
    let mut s = stats.clone();
    s.devices = s.devices.iter().map(|d| device_as_of(d, minor)).collect();
    if minor < 1 {
        s.unix_socket = None;
        s.shared_memory = false;
        s.shm_payloads_sent = 0;
        s.shm_payloads_received = 0;
        s.shm_bytes = 0;
        s.regions_in_flight = 0;
        s.resident_bytes = 0;
        s.peak_resident_bytes = 0;
    }
    if minor < 2 {
        s.hashes_pending = 0;
        s.hash_mismatches = 0;
        s.recycled_bytes = 0;
        s.regions_kept = 0;
    }
    if minor < 4 {
        s.pool_bytes = 0;
        s.pool_free_bytes = 0;
        s.pool_misses = 0;
    }
    if minor < 7 {
        s.uptime_ms = 0;
    }
    if minor < 10 {
        s.fetches_in_flight = 0;
        s.fetch_bytes_in_flight = 0;
    }
    s
}

/// `device` as a peer of minor `minor` has it (see [`stats_as_of`]).
fn device_as_of(device: &DeviceStats, minor: u16) -> DeviceStats {
    let mut d = device.clone();
    if minor < 5 {
        d.holds_measured = 0;
        d.holds_exact = 0;
    }
    if minor < 6 {
        d.largest_tensor = None;
    }
    d
}

proptest! {
    /// A peer of minor `a` sends its statistics to a peer of minor `b`: whichever is newer
    /// adapts, so they travel as of the lower minor, and arrive with every field that minor has
    /// and the later ones at their defaults. What the sender knows beyond that never reaches
    /// the wire.
    #[test]
    fn stats_travel_between_any_two_minors(stats in arb_node_stats()) {
        for a in 0..=PROTOCOL_MINOR {
            for b in 0..=PROTOCOL_MINOR {
                let wire = a.min(b);
                let sent = Response::Stats(stats_as_of(&stats, a));
                let frame = encode_response_for(&sent, wire).unwrap();
                let everything = encode_response_for(&Response::Stats(stats.clone()), wire);
                prop_assert_eq!(&frame, &everything.unwrap());
                let got = decode_response_from(&only_control_body(&frame), wire).unwrap();
                prop_assert_eq!(got, Response::Stats(stats_as_of(&stats, wire)), "{} -> {}", a, b);
            }
        }
    }
}
