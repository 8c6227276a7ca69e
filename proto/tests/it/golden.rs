//! Golden byte vectors of ferry's wire format, checked in under `proto/tests/golden/`, one
//! directory per protocol minor kept.
//!
//! `minor6/` holds every vector as a peer of minor 6 sends it; each later `minorN/` holds only
//! the vectors whose bytes changed in minor N (the others read as in the directory before). For
//! every minor kept, every vector is encoded from the values below for a peer of that minor and
//! compared byte for byte with its file, and the file is decoded as from a peer of that minor
//! and compared with the values: this build talks to each minor kept exactly as a peer of it
//! does, both ways. A change of any frame header field, dtype code, message layout or chunk
//! layout fails here. The files of older minors are frozen (peers of them are running); the
//! current minor's are regenerated, once `PROTOCOL.md` says what changed, with
//!
//! ```text
//! FERRY_BLESS=1 cargo test -p ferry-proto --test it golden::
//! ```
//!
//! which writes the current minor's directory from the values here instead of comparing (a file
//! only where the bytes differ from the older minors'; the test still decodes what it wrote).
//! The file format: `#` starts a comment, every other non-blank character is a hex digit, and
//! whitespace is ignored.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use burn_backend::ops::QTensorOps;
use burn_backend::read_sync;
use burn_flex::{Flex, FlexDevice};
use burn_std::quantization::{QuantMode, QuantScheme, QuantStore, QuantValue, ScaleDtype};
use burn_std::{BoolStore, DType, TensorData};
use bytes::BytesMut;
use ferry_io::{BufferFrom, HashUse, TensorAssembler};
use ferry_proto::control::{
    decode_request_from, decode_response_from, encode_request_for, encode_response_for,
};
use ferry_proto::frame::{self, DEFAULT_CHUNK_SIZE, DEFAULT_MAX_BODY, FrameKind, HEADER_LEN};
use ferry_proto::message::{
    EAGER_PUT_MINOR, FETCH_RANGE_MINOR, ManifestEntry, ModelManifest, ModelSummary, PathsDigest,
    WAIT_MINOR, WaitFor,
};
use ferry_proto::tensor::into_parts;
use ferry_proto::{
    ContentHash, DeviceStats, ErrorCode, ErrorReply, FEATURES, HeldDtype, Hello, NodeStats,
    PROTOCOL_MINOR, PROTOCOL_VERSION, RegionDescriptor, Request, Response, TensorInfo, TensorKey,
    TensorMeta, TransferPath, Welcome, WireMeta, dtype_name,
};

/// The minors whose frames are kept, oldest first, the current one last: minor 6 holds every
/// vector, each later one what it changed. A peer of each may still be running while a cluster
/// is upgraded one node at a time.
const GOLDEN_MINORS: [u16; 6] = [6, 7, 8, 9, 10, 11];

/// One frame of a vector.
enum Item {
    Request(Request),
    Response(Response),
    Chunk { offset: u64, data: Vec<u8> },
    Region(RegionDescriptor),
}

impl Item {
    /// The frame as this build sends it to a peer of minor `minor`.
    fn encode(&self, minor: u16) -> Vec<u8> {
        match self {
            Item::Request(r) => encode_request_for(r, minor).unwrap(),
            Item::Response(r) => encode_response_for(r, minor).unwrap(),
            Item::Chunk { offset, data } => frame::encode_chunk(*offset, data),
            Item::Region(region) => region.frame(),
        }
    }

    fn label(&self) -> String {
        let variant = |debug: String| {
            debug
                .split([' ', '(', '{'])
                .next()
                .unwrap_or("")
                .to_string()
        };
        match self {
            Item::Request(r) => format!("control, Request::{}", variant(format!("{r:?}"))),
            Item::Response(r) => format!("control, Response::{}", variant(format!("{r:?}"))),
            Item::Chunk { offset, data } => {
                format!(
                    "chunk, payload offset {offset}, {} payload bytes",
                    data.len()
                )
            }
            Item::Region(region) => format!(
                "region, {} payload bytes, payload crc32c {:#010x} (its memfd travels with it)",
                region.len, region.crc32c
            ),
        }
    }
}

struct Vector {
    name: &'static str,
    about: &'static str,
    items: Vec<Item>,
}

// ---------------------------------------------------------------------------------------------
// The values
// ---------------------------------------------------------------------------------------------

fn q8s() -> QuantScheme {
    QuantScheme::default()
        .with_value(QuantValue::Q8S)
        .with_store(QuantStore::Native)
}

fn meta(shape: &[usize], dtype: DType) -> WireMeta {
    TensorMeta::new(shape.to_vec(), dtype).unwrap().to_wire()
}

/// Covers every code: all 17 dtype tags, all 9 values, all 3 stores, both modes, all 5 scale
/// dtypes and the absent level, a bare scheme, a two-level scheme, a 2-D block.
fn every_dtype() -> Vec<DType> {
    let mut all = ferry_proto::dtype::PLAIN_DTYPES.to_vec();
    let base = |v| QuantScheme::default().with_value(v);
    for scheme in [
        base(QuantValue::Q8F).with_store(QuantStore::Native),
        q8s().per_tensor(ScaleDtype::F32),
        base(QuantValue::Q4F)
            .with_store(QuantStore::PackedU32(0))
            .per_block([32], ScaleDtype::F16),
        base(QuantValue::Q4S)
            .with_store(QuantStore::PackedNative(0))
            .per_tensor(ScaleDtype::BF16),
        base(QuantValue::Q2F)
            .with_store(QuantStore::PackedU32(0))
            .per_block([4, 4], ScaleDtype::UE8M0),
        base(QuantValue::Q2S)
            .with_store(QuantStore::Native)
            .with_mode(QuantMode::Lookup)
            .per_block([16], ScaleDtype::UE4M3)
            .per_tensor(ScaleDtype::F32),
        base(QuantValue::E4M3)
            .with_store(QuantStore::Native)
            .per_tensor(ScaleDtype::UE4M3),
        base(QuantValue::E5M2)
            .with_store(QuantStore::Native)
            .per_block([2, 16], ScaleDtype::F32),
        q8s()
            .with_store(QuantStore::PackedNative(1))
            .per_tensor(ScaleDtype::F16),
        base(QuantValue::E2M1)
            .with_store(QuantStore::PackedNative(0))
            .per_block([32], ScaleDtype::UE8M0),
    ] {
        all.push(DType::QFloat(scheme));
    }
    all
}

fn key(device: u32, name: &str) -> TensorKey {
    TensorKey::new(device, name)
}

fn info(key: TensorKey, shape: &[usize], dtype: DType, path: TransferPath) -> TensorInfo {
    let wire = meta(shape, dtype);
    TensorInfo {
        key,
        dtype: wire.dtype,
        shape: wire.shape,
        bytes: wire.byte_len,
        path,
    }
}

/// The content hash the vectors carry: 64 hex digits, `abab...`.
fn hash_ab() -> ContentHash {
    "ab".repeat(32).parse().unwrap()
}

/// The `Stats` answer of the vectors, as a peer of minor `minor` has it: the fields of later
/// minors at their defaults, which is also what this build reads from a peer of that minor.
fn stats(minor: u16) -> NodeStats {
    NodeStats {
        agent: "ferry-node 0.1.0".to_string(),
        devices: vec![
            DeviceStats {
                index: 0,
                backend: "flex".to_string(),
                device: "FlexDevice".to_string(),
                tensors: 3,
                bytes_held: 4096,
                memory_limit: Some(1 << 30),
                holds_measured: 250,
                holds_exact: 250,
                largest_tensor: None,
            },
            DeviceStats {
                index: 1,
                backend: "wgpu".to_string(),
                device: "vulkan:cpu on llvmpipe".to_string(),
                tensors: 0,
                bytes_held: 0,
                memory_limit: None,
                holds_measured: 1000,
                holds_exact: 118,
                largest_tensor: Some(1 << 27),
            },
        ],
        transfers_done: 7,
        transfers_failed: 1,
        native_transfers: 2,
        round_trip_transfers: 3,
        connections: 1,
        transfer_policy: "auto".to_string(),
        node_id: "node-a".to_string(),
        pulls: 4,
        pull_retries: 5,
        dedup_hits: 6,
        fetches_served: 8,
        unix_socket: Some("unix:/run/ferry/node-a.sock".to_string()),
        shared_memory: true,
        shm_payloads_sent: 9,
        shm_payloads_received: 10,
        shm_bytes: 1 << 33,
        regions_in_flight: 1,
        resident_bytes: 3 << 30,
        peak_resident_bytes: 5 << 30,
        hashes_pending: 2,
        hash_mismatches: 0,
        recycled_bytes: 256 << 20,
        regions_kept: 3,
        pool_bytes: 1 << 30,
        pool_free_bytes: 768 << 20,
        pool_misses: 1,
        // Added in minor 7: an hour and a half.
        uptime_ms: if minor >= 7 { 5_400_000 } else { 0 },
        // Added in minor 10: two fetches, 3 GiB between them.
        fetches_in_flight: if minor >= 10 { 2 } else { 0 },
        fetch_bytes_in_flight: if minor >= 10 { 3 << 30 } else { 0 },
    }
}

/// The one tensor vector: a Q8S tensor of shape [2, 4] with one f32 scale per block of 4.
fn q8s_block4() -> TensorData {
    let values: Vec<i8> = vec![1, -2, 3, -4, 127, -127, 0, 64];
    let scheme = q8s().per_block([4], ScaleDtype::F32);
    let data = TensorData::quantized(values, vec![2, 4], scheme, &[0.5, 0.25], None);
    // By hand: the values as bytes, then each block's scale as a little-endian f32.
    let mut by_hand = vec![0x01, 0xfe, 0x03, 0xfc, 0x7f, 0x81, 0x00, 0x40];
    by_hand.extend_from_slice(&0.5f32.to_le_bytes());
    by_hand.extend_from_slice(&0.25f32.to_le_bytes());
    assert_eq!(
        data.as_bytes(),
        by_hand,
        "Burn lays quantized bytes out as PROTOCOL.md says"
    );
    data
}

/// Chunk size of the tensor vector: small, so the payload takes several chunks.
const TENSOR_CHUNK: usize = 7;

/// Every vector, as a peer of minor `minor` sends it.
fn vectors(minor: u16) -> Vec<Vector> {
    let tensor = q8s_block4();
    let (tensor_meta, payload) = into_parts(tensor).unwrap();
    let mut tensor_items = vec![Item::Request(Request::Put {
        device: 0,
        name: Some("q".to_string()),
        meta: tensor_meta.to_wire(),
        overwrite: false,
    })];
    tensor_items.extend(
        frame::chunks(&payload, TENSOR_CHUNK).map(|(offset, data)| Item::Chunk {
            offset,
            data: data.to_vec(),
        }),
    );

    let two_level = QuantScheme::default()
        .with_value(QuantValue::Q4S)
        .with_store(QuantStore::Native)
        .per_block([16], ScaleDtype::UE4M3)
        .per_tensor(ScaleDtype::F32);

    let mut vectors = vec![
        Vector {
            name: "hello",
            about: "Request::Hello opening a connection, with a token.",
            items: vec![Item::Request(Request::Hello(Hello {
                major: PROTOCOL_VERSION,
                minor,
                features: FEATURES.iter().map(|f| f.to_string()).collect(),
                token: Some("s3cret".into()),
                agent: "ferry-golden".to_string(),
            }))],
        },
        Vector {
            name: "welcome",
            about: "Response::Welcome answering a Hello, with the default limits.",
            items: vec![Item::Response(Response::Welcome(Welcome {
                major: PROTOCOL_VERSION,
                minor,
                features: FEATURES.iter().map(|f| f.to_string()).collect(),
                agent: "ferry-node".to_string(),
                max_body: DEFAULT_MAX_BODY as u64,
                chunk_size: DEFAULT_CHUNK_SIZE as u64,
            }))],
        },
        Vector {
            name: "put_f32_meta",
            about: "Request::Put of a [2, 3] f32 tensor named \"w\" on device 0 (24 payload \
                    bytes would follow as chunks).",
            items: vec![Item::Request(Request::Put {
                device: 0,
                name: Some("w".to_string()),
                meta: meta(&[2, 3], DType::F32),
                overwrite: false,
            })],
        },
        Vector {
            name: "put_two_level_meta",
            about: "Request::Put, node-chosen name, overwrite, of a [2, 32] Q4S tensor \
                    (native store) with a UE4M3 scale per block of 16 and an f32 per-tensor \
                    scale: 64 value bytes + 4 block scales + 4 = 72 payload bytes.",
            items: vec![Item::Request(Request::Put {
                device: 1,
                name: None,
                meta: meta(&[2, 32], DType::QFloat(two_level)),
                overwrite: true,
            })],
        },
        Vector {
            name: "get",
            about: "Request::Get of device 2's \"encoder.layer1.weight\".",
            items: vec![Item::Request(Request::Get {
                key: key(2, "encoder.layer1.weight"),
            })],
        },
        Vector {
            name: "other_requests",
            about: "Request::Copy, Delete, List (one device and all), Stat, Identify, Grant, \
                    Pull, Fetch, Release, ListPage (first and next page), DeleteIf and Holds, \
                    one frame each.",
            items: vec![
                Item::Request(Request::Copy {
                    src: key(0, "a"),
                    dst_device: 1,
                    dst_name: Some("b".to_string()),
                    remove_source: true,
                    overwrite: false,
                }),
                Item::Request(Request::Delete { key: key(1, "b") }),
                Item::Request(Request::List { device: Some(1) }),
                Item::Request(Request::List { device: None }),
                Item::Request(Request::Stat),
                Item::Request(Request::Identify),
                Item::Request(Request::Grant {
                    key: key(0, "a"),
                    audience: "node-b".into(),
                }),
                Item::Request(Request::Pull {
                    source: "10.0.0.1:7070".to_string(),
                    capability: "cap".into(),
                    src: key(0, "a"),
                    dst_device: 1,
                    dst_name: None,
                    overwrite: true,
                    content_hash: Some(hash_ab()),
                }),
                Item::Request(Request::Fetch {
                    capability: "cap".into(),
                    node_id: "node-b".into(),
                    offset: 4096,
                }),
                Item::Request(Request::Release {
                    capability: "cap".into(),
                    node_id: "node-b".into(),
                }),
                Item::Request(Request::ListPage {
                    device: None,
                    after: None,
                    limit: 1000,
                }),
                Item::Request(Request::ListPage {
                    device: Some(1),
                    after: Some(key(1, "b")),
                    limit: 2,
                }),
                Item::Request(Request::DeleteIf {
                    key: key(0, "a"),
                    content_hash: hash_ab(),
                }),
                Item::Request(Request::Holds { device: 1 }),
            ],
        },
        Vector {
            name: "error_response",
            about: "Response::Error with code NotFound.",
            items: vec![Item::Response(Response::Error(ErrorReply {
                code: ErrorCode::NotFound,
                message: "no tensor 2/encoder.layer1.weight".to_string(),
            }))],
        },
        Vector {
            name: "error_codes",
            about: "Response::Error once with every ErrorCode, in code order, empty messages.",
            items: ErrorCode::ALL
                .into_iter()
                .map(|code| {
                    Item::Response(Response::Error(ErrorReply {
                        code,
                        message: String::new(),
                    }))
                })
                .collect(),
        },
        Vector {
            name: "stats_response",
            about: "Response::Stats for a node with two devices, one with a memory limit, each \
                    with its holds counts, the second a GPU with its largest tensor; from minor \
                    7 on, the node's uptime (an hour and a half); from minor 10 on, the fetches \
                    it serves (two, 3 GiB).",
            items: vec![Item::Response(Response::Stats(stats(minor)))],
        },
        Vector {
            name: "other_responses",
            about: "Response::Stored, Tensor (its chunks would follow), Deleted, Ready (a Put \
                    admitted: its chunks may follow), Identity, Capability, Released, Page \
                    (one that continues, one that ends) and Holds (one probe held, one refused).",
            items: vec![
                Item::Response(Response::Stored(info(
                    key(0, "w"),
                    &[2, 3],
                    DType::F32,
                    TransferPath::Put,
                ))),
                Item::Response(Response::Tensor {
                    info: info(key(0, "w"), &[2, 3], DType::F32, TransferPath::Put),
                    meta: meta(&[2, 3], DType::F32),
                }),
                Item::Response(Response::Deleted(info(
                    key(1, "b"),
                    &[],
                    DType::Bool(BoolStore::Native),
                    TransferPath::RoundTrip,
                ))),
                Item::Response(Response::Ready),
                Item::Response(Response::Identity {
                    node_id: "node-a".into(),
                }),
                Item::Response(Response::Capability {
                    token: "cap".into(),
                    expires_in_ms: 60_000,
                    info: info(key(0, "a"), &[4], DType::U8, TransferPath::Put),
                    content_hash: hash_ab(),
                }),
                Item::Response(Response::Released),
                Item::Response(Response::Page {
                    tensors: vec![info(key(0, "a"), &[4], DType::U8, TransferPath::Put)],
                    next: Some(key(0, "a")),
                }),
                Item::Response(Response::Page {
                    tensors: Vec::new(),
                    next: None,
                }),
                Item::Response(Response::Holds {
                    device: 1,
                    dtypes: vec![
                        HeldDtype {
                            dtype: DType::F32.into(),
                            shape: vec![3, 5],
                            refused: None,
                        },
                        HeldDtype {
                            dtype: DType::F16.into(),
                            shape: Vec::new(),
                            refused: Some("the backend fails on it".to_string()),
                        },
                    ],
                }),
            ],
        },
        Vector {
            name: "listing_all_dtypes",
            about: "Response::Listing with one [2, 32] tensor of every dtype code: the 16 \
                    plain tags, then quantized schemes covering every value, store, mode and \
                    scale code.",
            items: vec![Item::Response(Response::Listing(
                every_dtype()
                    .into_iter()
                    .enumerate()
                    .map(|(i, dtype)| {
                        info(key(0, &format!("t{i}")), &[2, 32], dtype, TransferPath::Put)
                    })
                    .collect(),
            ))],
        },
        Vector {
            name: "q8s_block4_tensor",
            about: "The client's side of an upload: Request::Put of a [2, 4] Q8S tensor \
                    (native store, one f32 scale per block of 4; values 1 -2 3 -4 127 -127 0 64, \
                    scales 0.5 0.25), then, once the node has answered Ready, its 16 payload \
                    bytes as chunk frames of at most 7 bytes.",
            items: tensor_items,
        },
        Vector {
            name: "region_frame",
            about: "A payload as a shared-memory region (feature shm-memfd, Unix sockets only): \
                    a 256 MiB payload whose crc32c is 0x12345678; the region's file descriptor \
                    is sent with these bytes as SCM_RIGHTS ancillary data.",
            items: vec![Item::Region(RegionDescriptor {
                len: 256 << 20,
                crc32c: 0x1234_5678,
            })],
        },
    ];
    if minor >= FETCH_RANGE_MINOR {
        vectors.push(Vector {
            name: "fetch_range",
            about: "Request::FetchRange of the first 16 MiB stripe of a hash input, and the \
                    Response::TensorPart answering it for a [2, 3] f32 tensor (its chunks would \
                    follow): payload bytes 0..24, the whole payload, which the stripe holds.",
            items: vec![
                Item::Request(Request::FetchRange {
                    capability: "cap".into(),
                    node_id: "node-b".into(),
                    from: 0,
                    to: 16 << 20,
                }),
                Item::Response(Response::TensorPart {
                    info: info(key(0, "w"), &[2, 3], DType::F32, TransferPath::Put),
                    meta: meta(&[2, 3], DType::F32),
                    start: 0,
                    end: 24,
                }),
            ],
        });
    }
    if minor >= EAGER_PUT_MINOR {
        let (meta, payload) = into_parts(TensorData::new(vec![1.5f32, -2.0, 0.25], [3])).unwrap();
        let mut items = vec![Item::Request(Request::PutEager {
            device: 1,
            name: Some("bias".to_string()),
            meta: meta.to_wire(),
            overwrite: true,
        })];
        items.extend(
            frame::chunks(&payload, 8).map(|(offset, data)| Item::Chunk {
                offset,
                data: data.to_vec(),
            }),
        );
        vectors.push(Vector {
            name: "put_eager",
            about: "The client's side of an eager upload: Request::PutEager of a [3] f32 tensor \
                    (1.5, -2, 0.25) named \"bias\" on device 1, replacing, followed at once, \
                    without waiting for Ready, by its 12 payload bytes as chunk frames of at \
                    most 8 bytes.",
            items,
        });
    }
    if minor >= WAIT_MINOR {
        vectors.push(Vector {
            name: "wait",
            about: "Request::Wait for 0/w for up to a minute, answered Response::Arrived with \
                    the [2, 3] f32 tensor that arrived, then a second wait answered with \
                    nothing at its timeout.",
            items: vec![
                Item::Request(Request::Wait {
                    target: WaitFor::Tensor(key(0, "w")),
                    timeout_ms: 60_000,
                }),
                Item::Response(Response::Arrived(Some(info(
                    key(0, "w"),
                    &[2, 3],
                    DType::F32,
                    TransferPath::Put,
                )))),
                Item::Response(Response::Arrived(None)),
            ],
        });
        let manifest = ModelManifest {
            device: 0,
            prefix: "net".into(),
            version: 4,
            tensors: vec![ManifestEntry {
                path: "fc.weight".into(),
                meta: meta(&[2, 3], DType::F32),
                content_hash: ContentHash::from_digest([0xab; 32]),
            }],
            metadata: vec![("format".into(), "pt".into())],
        };
        vectors.push(Vector {
            name: "model",
            about: "A model's life: version 4 of net on device 0 begun (replacing), committed \
                    with the digest of its one path and a metadata pair, answered by its \
                    manifest; aborted; opened, closed; listed; waited for (newer than 3); \
                    deleted.",
            items: vec![
                Item::Request(Request::ModelBegin {
                    device: 0,
                    prefix: "net".into(),
                    replace: true,
                }),
                Item::Response(Response::ModelBegun { version: 4 }),
                Item::Request(Request::ModelCommit {
                    device: 0,
                    prefix: "net".into(),
                    version: 4,
                    sent: PathsDigest::of(["fc.weight"]),
                    metadata: vec![("format".into(), "pt".into())],
                }),
                Item::Response(Response::Model(manifest.clone())),
                Item::Request(Request::ModelAbort {
                    device: 0,
                    prefix: "net".into(),
                    version: 5,
                }),
                Item::Response(Response::Released),
                Item::Request(Request::ModelOpen {
                    device: 0,
                    prefix: "net".into(),
                }),
                Item::Request(Request::ModelClose {
                    device: 0,
                    prefix: "net".into(),
                    version: 4,
                }),
                Item::Request(Request::ModelList { device: Some(0) }),
                Item::Response(Response::Models(vec![ModelSummary {
                    device: 0,
                    prefix: "net".into(),
                    version: 4,
                    tensors: 1,
                    bytes: 24,
                    applies: 2,
                }])),
                Item::Request(Request::Wait {
                    target: WaitFor::Model {
                        device: 0,
                        prefix: "net".into(),
                        newer_than: Some(3),
                    },
                    timeout_ms: 1000,
                }),
                Item::Request(Request::ModelDelete {
                    device: 0,
                    prefix: "net".into(),
                    version: Some(4),
                }),
                Item::Response(Response::Model(manifest)),
            ],
        });
    }
    vectors
}

// ---------------------------------------------------------------------------------------------
// The files
// ---------------------------------------------------------------------------------------------

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// The directory of the frames of minor `minor`.
fn minor_dir(minor: u16) -> PathBuf {
    golden_dir().join(format!("minor{minor}"))
}

/// The file that holds vector `name` as of minor `minor`: in the newest directory kept, up to
/// that minor, that has it (a later minor keeps only the vectors it changed).
fn golden_file(name: &str, minor: u16) -> Option<PathBuf> {
    GOLDEN_MINORS
        .iter()
        .rev()
        .filter(|&&kept| kept <= minor)
        .map(|&kept| minor_dir(kept).join(format!("{name}.hex")))
        .find(|path| path.exists())
}

/// The bytes of a golden file.
fn read_golden(path: &Path) -> Vec<u8> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e} (bless with FERRY_BLESS=1)", path.display()));
    parse_hex(&text)
}

fn blessing() -> bool {
    std::env::var("FERRY_BLESS").is_ok_and(|v| v == "1")
}

/// Writes `vector`'s file in the current minor's directory where its bytes differ from the
/// minors before, and removes it where they do not.
fn bless(vector: &Vector, encoded: &[u8]) {
    let dir = minor_dir(PROTOCOL_MINOR);
    let path = dir.join(format!("{}.hex", vector.name));
    let before = GOLDEN_MINORS
        .iter()
        .rev()
        .find(|&&kept| kept < PROTOCOL_MINOR)
        .and_then(|&kept| golden_file(vector.name, kept));
    if before.is_some_and(|older| read_golden(&older) == encoded) {
        if path.exists() {
            std::fs::remove_file(&path).unwrap();
        }
    } else {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&path, render(vector, PROTOCOL_MINOR)).unwrap();
    }
}

fn hex_line(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The file text for a vector at `minor`: comments saying what it is, then each frame's header
/// and body.
fn render(vector: &Vector, minor: u16) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# ferry golden vector: {}, minor {minor}", vector.name);
    let mut line = String::from("#");
    for word in vector.about.split_whitespace() {
        if line.len() + word.len() + 1 > 96 {
            let _ = writeln!(out, "{line}");
            line = String::from("#");
        }
        line.push(' ');
        line.push_str(word);
    }
    let _ = writeln!(out, "{line}");
    let _ = writeln!(
        out,
        "#\n# These bytes are ferry's wire format, protocol version {PROTOCOL_VERSION}, minor \
         {minor}: what a peer of that minor\n# sends and reads. Once the minor is released they \
         never change; see proto/tests/golden/README.md.\n# Format: '#' starts a comment; \
         everything else is hex, whitespace ignored."
    );
    for (i, item) in vector.items.iter().enumerate() {
        let bytes = item.encode(minor);
        let (header, body) = bytes.split_at(HEADER_LEN);
        let _ = writeln!(
            out,
            "\n# frame {}: {}, body {} bytes",
            i + 1,
            item.label(),
            body.len()
        );
        let _ = writeln!(out, "# magic=FRRY version kind flags body_len crc32c(body)");
        let _ = writeln!(
            out,
            "{}  {}  {}  {}  {}  {}",
            hex_line(&header[0..4]),
            hex_line(&header[4..5]),
            hex_line(&header[5..6]),
            hex_line(&header[6..8]),
            hex_line(&header[8..12]),
            hex_line(&header[12..16]),
        );
        for (row, piece) in body.chunks(16).enumerate() {
            let _ = writeln!(out, "{:<47}  # body +{}", hex_line(piece), row * 16);
        }
    }
    out
}

/// The bytes of a golden file: comments dropped, hex decoded.
fn parse_hex(text: &str) -> Vec<u8> {
    let digits: Vec<u8> = text
        .lines()
        .map(|line| line.split('#').next().unwrap_or(""))
        .flat_map(|line| line.bytes().filter(|b| !b.is_ascii_whitespace()))
        .collect();
    assert!(digits.len().is_multiple_of(2), "odd number of hex digits");
    digits
        .chunks(2)
        .map(|pair| {
            let text = std::str::from_utf8(pair).unwrap();
            u8::from_str_radix(text, 16).unwrap_or_else(|_| panic!("not hex: {text:?}"))
        })
        .collect()
}

/// Decodes the frames in `bytes` as from a peer of minor `minor` and checks they are exactly
/// `items`.
fn decode_and_compare(name: &str, bytes: &[u8], items: &[Item], minor: u16) {
    let mut buf = BytesMut::from(bytes);
    for (i, item) in items.iter().enumerate() {
        let frame = frame::parse(&mut buf, DEFAULT_MAX_BODY)
            .unwrap_or_else(|e| panic!("{name} frame {}: {e}", i + 1))
            .unwrap_or_else(|| panic!("{name} frame {}: missing", i + 1));
        match item {
            Item::Request(want) => {
                assert_eq!(frame.kind, FrameKind::Control);
                let got = decode_request_from(&frame.body, minor).unwrap();
                assert_eq!(&got, want, "{name}");
            }
            Item::Response(want) => {
                assert_eq!(frame.kind, FrameKind::Control);
                let got = decode_response_from(&frame.body, minor).unwrap();
                assert_eq!(&got, want, "{name}");
            }
            Item::Chunk { offset, data } => {
                assert_eq!(frame.kind, FrameKind::Chunk);
                let chunk = frame.into_chunk().unwrap();
                assert_eq!(
                    (chunk.offset, &chunk.data[..]),
                    (*offset, &data[..]),
                    "{name}"
                );
            }
            Item::Region(want) => {
                assert_eq!(frame.kind, FrameKind::Region);
                assert_eq!(
                    &RegionDescriptor::decode(&frame.body).unwrap(),
                    want,
                    "{name}"
                );
            }
        }
    }
    assert!(buf.is_empty(), "{name}: bytes after the last frame");
}

/// For every minor kept: this build sends each vector to a peer of that minor as exactly the
/// bytes of its file, and reads the file as from such a peer back to the values.
#[test]
fn golden_vectors_match_byte_for_byte() {
    assert_eq!(
        GOLDEN_MINORS.last(),
        Some(&PROTOCOL_MINOR),
        "a new minor gets its own golden directory: add it to GOLDEN_MINORS"
    );
    let mut failures = Vec::new();
    for minor in GOLDEN_MINORS {
        for vector in vectors(minor) {
            let encoded: Vec<u8> = vector.items.iter().flat_map(|i| i.encode(minor)).collect();
            if blessing() && minor == PROTOCOL_MINOR {
                bless(&vector, &encoded);
            }
            let Some(path) = golden_file(vector.name, minor) else {
                failures.push(format!("minor {minor}: no file for {}", vector.name));
                continue;
            };
            let golden = read_golden(&path);
            if golden != encoded {
                let at = golden
                    .iter()
                    .zip(&encoded)
                    .position(|(a, b)| a != b)
                    .unwrap_or(golden.len().min(encoded.len()));
                failures.push(format!(
                    "minor {minor}: {} differs from byte {at} (golden {} bytes, encoded {} bytes)",
                    path.display(),
                    golden.len(),
                    encoded.len()
                ));
                continue;
            }
            let name = format!("{} at minor {minor}", vector.name);
            decode_and_compare(&name, &golden, &vector.items, minor);
        }
    }
    assert!(
        failures.is_empty(),
        "the wire format changed. A released minor's bytes never change (its peers are \
         running); for an addition, bump PROTOCOL_MINOR and update PROTOCOL.md before \
         re-blessing the current minor:\n{}",
        failures.join("\n")
    );
}

/// Every file is a vector this test knows (no stale ones left behind), and a later minor holds
/// only the vectors whose bytes it changed.
#[test]
fn the_golden_directories_hold_only_what_each_minor_changed() {
    let known: Vec<String> = vectors(PROTOCOL_MINOR)
        .iter()
        .map(|v| format!("{}.hex", v.name))
        .collect();
    for entry in std::fs::read_dir(golden_dir()).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let dirs: Vec<String> = GOLDEN_MINORS.iter().map(|m| format!("minor{m}")).collect();
        assert!(
            name == "README.md" || dirs.contains(&name),
            "unknown file {name} in {}",
            golden_dir().display()
        );
    }
    for (i, &minor) in GOLDEN_MINORS.iter().enumerate() {
        for entry in std::fs::read_dir(minor_dir(minor)).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap().to_string();
            assert!(known.contains(&name), "unknown file {}", path.display());
            let Some(&before) = i.checked_sub(1).and_then(|j| GOLDEN_MINORS.get(j)) else {
                continue;
            };
            let stem = name.trim_end_matches(".hex");
            // A vector of a message added in this minor has no file before it.
            let Some(older) = golden_file(stem, before) else {
                let added_now = !vectors(before).iter().any(|v| v.name == stem);
                assert!(added_now, "{stem} has no file before minor {minor}");
                continue;
            };
            assert_ne!(
                read_golden(&older),
                read_golden(&path),
                "{} repeats the bytes of {}: a minor keeps only what it changed",
                path.display(),
                older.display()
            );
        }
    }
}

/// What the minor-7 field changes: a node of minor 7 sends its `Stats` answer to a peer of minor
/// 6 as exactly that minor's golden frame (its uptime left out), and each minor's frame reads only
/// as of its own minor.
#[test]
fn a_stats_answer_travels_as_of_the_lower_minor() {
    let current = Response::Stats(stats(PROTOCOL_MINOR));
    let file = |minor| read_golden(&golden_file("stats_response", minor).unwrap());
    let (old, new) = (file(6), file(PROTOCOL_MINOR));
    assert_ne!(old, new);
    assert_eq!(encode_response_for(&current, 6).unwrap(), old);
    assert_eq!(encode_response_for(&current, PROTOCOL_MINOR).unwrap(), new);
    let body = |bytes: &[u8]| bytes[HEADER_LEN..].to_vec();
    assert_eq!(
        decode_response_from(&body(&old), 6).unwrap(),
        Response::Stats(stats(6))
    );
    assert_eq!(
        decode_response_from(&body(&new), PROTOCOL_MINOR).unwrap(),
        current
    );
    // The minor matters: read as of another minor, the same bytes are refused.
    for read in [
        decode_response_from(&body(&old), PROTOCOL_MINOR),
        decode_response_from(&body(&new), 6),
    ] {
        assert!(
            matches!(read, Err(ferry_proto::FrameError::Malformed(_))),
            "{read:?}"
        );
    }
}

#[test]
fn the_golden_tensor_arrives_exactly() {
    let path = golden_file("q8s_block4_tensor", PROTOCOL_MINOR).unwrap();
    let mut buf = BytesMut::from(&read_golden(&path)[..]);
    let put = frame::parse(&mut buf, DEFAULT_MAX_BODY).unwrap().unwrap();
    let Request::Put { meta: wire, .. } = decode_request_from(&put.body, PROTOCOL_MINOR).unwrap()
    else {
        panic!("not a put")
    };
    let meta = TensorMeta::try_from(&wire).unwrap();
    let mut assembler =
        TensorAssembler::new(meta, 1 << 20, BufferFrom::Fresh, HashUse::Skip).unwrap();
    let mut chunks = 0;
    while let Some(frame) = frame::parse(&mut buf, DEFAULT_MAX_BODY).unwrap() {
        let chunk = frame.into_chunk().unwrap();
        assembler.accept(chunk.offset, &chunk.data).unwrap();
        chunks += 1;
    }
    assert_eq!(chunks, 3);
    let arrived = assembler.finish().unwrap().data;
    let want = q8s_block4();
    assert_eq!(arrived.as_bytes(), want.as_bytes());
    assert_eq!(arrived.dtype(), want.dtype());
    assert_eq!(arrived.shape(), want.shape());
    assert_eq!(
        dtype_name(&arrived.dtype()),
        "qfloat(Q8S, block [4] F32)",
        "the scheme is exactly the one built"
    );
    // And Flex holds it exactly.
    let device = FlexDevice;
    let back = read_sync(Flex::q_into_data(Flex::q_from_data(arrived, &device))).unwrap();
    assert_eq!(back.as_bytes(), want.as_bytes());
    assert_eq!(back.dtype(), want.dtype());
}
