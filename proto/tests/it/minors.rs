//! Peers of two minors: what this build sends a peer of an older minor and reads from one
//! (PROTOCOL.md §4). Error codes the peer lacks go as the closest it knows, messages it lacks
//! are never sent, the handshake reads alike at every minor, and a message's minor matters.

use ferry_proto::control::{
    decode_request_from, decode_response_from, encode_request, encode_request_for, encode_response,
    encode_response_for,
};
use ferry_proto::frame::HEADER_LEN;
use ferry_proto::{
    DeviceStats, ErrorCode, ErrorReply, FEATURES, FrameError, Hello, NodeStats, PROTOCOL_MINOR,
    PROTOCOL_VERSION, Request, Response, TensorKey, Welcome,
};

fn body(frame: &[u8]) -> &[u8] {
    &frame[HEADER_LEN..]
}

fn error(code: ErrorCode) -> Response {
    Response::Error(ErrorReply {
        code,
        message: "why, for a person".to_string(),
    })
}

/// A `Stats` answer with a field of every minor set.
fn stats() -> NodeStats {
    NodeStats {
        agent: "ferry-node".to_string(),
        devices: vec![DeviceStats {
            index: 0,
            backend: "flex".to_string(),
            device: "FlexDevice".to_string(),
            tensors: 1,
            bytes_held: 24,
            memory_limit: Some(1 << 20),
            holds_measured: 250,
            holds_exact: 249,
            largest_tensor: Some(1 << 27),
        }],
        transfers_done: 1,
        unix_socket: Some("unix:/run/ferry.sock".to_string()),
        hashes_pending: 2,
        pool_bytes: 1 << 30,
        uptime_ms: 60_000,
        ..NodeStats::default()
    }
}

#[test]
fn an_error_code_the_peer_lacks_goes_as_the_closest_it_knows() {
    for minor in 0..=PROTOCOL_MINOR {
        for code in ErrorCode::ALL {
            let frame = encode_response_for(&error(code), minor).unwrap();
            let Response::Error(got) = decode_response_from(body(&frame), minor).unwrap() else {
                panic!("not an error");
            };
            assert_eq!(got.code, code.as_of(minor), "{code:?} at minor {minor}");
            assert!(got.code.since_minor() <= minor, "{code:?} at minor {minor}");
            assert_eq!(got.code.is_fatal(), code.is_fatal(), "{code:?}");
            assert_eq!(got.message, "why, for a person");
            if code.since_minor() <= minor {
                assert_eq!(got.code, code);
            }
        }
    }
    for (code, older) in [
        (ErrorCode::Changed, ErrorCode::NotFound),
        (ErrorCode::Integrity, ErrorCode::PeerFailed),
        (ErrorCode::Busy, ErrorCode::LimitExceeded),
    ] {
        assert_eq!(code.since_minor(), 3);
        assert_eq!(code.as_of(2), older);
        assert_eq!(code.as_of(3), code);
    }
}

#[test]
fn a_response_the_peer_lacks_is_never_sent() {
    let page = Response::Page {
        tensors: Vec::new(),
        next: None,
    };
    let holds = Response::Holds {
        device: 0,
        dtypes: Vec::new(),
    };
    for (response, what, since) in [(page, "page", 3), (holds, "holds", 5)] {
        for minor in 0..since {
            assert_eq!(
                encode_response_for(&response, minor),
                Err(FrameError::NewerThanPeer {
                    what,
                    since,
                    peer: minor
                })
            );
        }
        let frame = encode_response_for(&response, since).unwrap();
        assert_eq!(decode_response_from(body(&frame), since).unwrap(), response);
        // Nor read from a peer whose minor lacks it: that peer broke its own minor's rules.
        assert!(matches!(
            decode_response_from(body(&frame), since - 1),
            Err(FrameError::NewerThanPeer { .. })
        ));
    }
    // Nor an error code it lacks, read from it.
    let busy = encode_response(&error(ErrorCode::Busy)).unwrap();
    assert!(matches!(
        decode_response_from(body(&busy), 2),
        Err(FrameError::NewerThanPeer { .. })
    ));
}

#[test]
fn a_request_the_node_lacks_is_never_sent() {
    let requests = [
        (
            Request::ListPage {
                device: None,
                after: None,
                limit: 10,
            },
            3,
        ),
        (
            Request::DeleteIf {
                key: TensorKey::new(0, "a"),
                content_hash: "ab".repeat(32).parse().unwrap(),
            },
            3,
        ),
        (Request::Holds { device: 0 }, 5),
        (Request::Stat, 0),
        (Request::List { device: None }, 0),
    ];
    for (request, since) in requests {
        assert_eq!(request.since_minor(), since, "{request:?}");
        for minor in 0..since {
            assert_eq!(
                encode_request_for(&request, minor),
                Err(FrameError::NewerThanPeer {
                    what: request.name(),
                    since,
                    peer: minor
                })
            );
        }
        let frame = encode_request_for(&request, since).unwrap();
        assert_eq!(decode_request_from(body(&frame), since).unwrap(), request);
        if since > 0 {
            assert!(matches!(
                decode_request_from(body(&frame), since - 1),
                Err(FrameError::NewerThanPeer { .. })
            ));
        }
    }
}

/// The handshake is read before either side knows the other's minor: `Hello` and `Welcome` are
/// the same bytes at every minor.
#[test]
fn hello_and_welcome_read_alike_at_every_minor() {
    let hello = Request::Hello(Hello {
        major: PROTOCOL_VERSION,
        minor: 3,
        features: FEATURES.iter().map(|f| f.to_string()).collect(),
        token: Some("s3cret".into()),
        agent: "an older client".to_string(),
    });
    let welcome = Response::Welcome(Welcome {
        major: PROTOCOL_VERSION,
        minor: 9,
        features: Vec::new(),
        agent: "a newer node".to_string(),
        max_body: 1 << 24,
        chunk_size: 1 << 22,
    });
    let hello_frame = encode_request(&hello).unwrap();
    let welcome_frame = encode_response(&welcome).unwrap();
    for minor in 0..=PROTOCOL_MINOR + 2 {
        assert_eq!(encode_request_for(&hello, minor).unwrap(), hello_frame);
        assert_eq!(encode_response_for(&welcome, minor).unwrap(), welcome_frame);
        assert_eq!(
            decode_request_from(body(&hello_frame), minor).unwrap(),
            hello
        );
        assert_eq!(
            decode_response_from(body(&welcome_frame), minor).unwrap(),
            welcome
        );
    }
}

/// The minor a message is read as matters: a `Stats` answer of minor 5 reads as of minor 5 (the
/// fields of minors 6 and 7 at their defaults) and is refused as of minor 7.
#[test]
fn a_stats_answer_reads_only_as_of_its_own_minor() {
    let frame = encode_response_for(&Response::Stats(stats()), 5).unwrap();
    let mut want = stats();
    want.devices[0].largest_tensor = None;
    want.uptime_ms = 0;
    assert_eq!(
        decode_response_from(body(&frame), 5).unwrap(),
        Response::Stats(want)
    );
    // Too short as of a later minor, bytes left over as of an earlier one.
    for minor in [4, 6, 7] {
        let read = decode_response_from(body(&frame), minor);
        assert!(
            matches!(read, Err(FrameError::Malformed(_))),
            "{minor}: {read:?}"
        );
    }
}

/// A peer of a newer minor than this build's is talked to as of this build's: it adapts.
#[test]
fn a_newer_peer_is_talked_to_as_of_this_minor() {
    let response = Response::Stats(stats());
    let ours = encode_response_for(&response, PROTOCOL_MINOR).unwrap();
    for newer in [PROTOCOL_MINOR + 1, u16::MAX] {
        assert_eq!(encode_response_for(&response, newer).unwrap(), ours);
        assert_eq!(decode_response_from(body(&ours), newer).unwrap(), response);
    }
}

/// Outside a control message the statistics are plain serde, by field name: the CLI's JSON
/// output has every field, and a record without the later ones reads them as their defaults.
#[test]
fn statistics_outside_the_wire_have_every_field_by_name() {
    let json = serde_json::to_value(stats()).unwrap();
    assert_eq!(json["uptime_ms"], 60_000);
    assert_eq!(json["devices"][0]["largest_tensor"], 1 << 27);
    assert_eq!(serde_json::from_value::<NodeStats>(json).unwrap(), stats());
    let old: NodeStats =
        serde_json::from_str(r#"{"agent": "old", "devices": [{"index": 2}]}"#).unwrap();
    assert_eq!(old.agent, "old");
    assert_eq!(old.devices[0].index, 2);
    assert_eq!(old.uptime_ms, 0);
    assert!(serde_json::from_str::<NodeStats>(r#"{"agent": "a", "agent": "b"}"#).is_err());
}

/// `ErrorCode::ALL` is every code, in wire order: each encodes as its index, and the index past
/// the last decodes as no code at all.
#[test]
fn error_code_all_is_every_code_in_wire_order() {
    for (index, code) in ErrorCode::ALL.into_iter().enumerate() {
        let frame = encode_response(&error(code)).unwrap();
        // `Error` is variant 6 of `Response`, then the reply's code.
        assert_eq!(
            body(&frame)[..8],
            [6, 0, 0, 0, index as u8, 0, 0, 0],
            "{code:?}"
        );
    }
    let past = ErrorCode::ALL.len() as u8;
    let mut forged = vec![6, 0, 0, 0, past, 0, 0, 0];
    forged.extend_from_slice(&0u64.to_le_bytes());
    let read = decode_response_from(&forged, PROTOCOL_MINOR);
    assert!(matches!(read, Err(FrameError::Malformed(_))), "{read:?}");
}
