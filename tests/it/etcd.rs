//! ferry's etcd client (`ferry-etcd`, over etcd's JSON gateway) against a real etcd: every call
//! the cluster makes, leases that expire and are revoked, a watch that sees each change once and
//! in order, failing over to a later endpoint, and peers that are not etcd.

use std::time::Duration;

use ferry_etcd::{Etcd, EtcdError, Event, EventKind, TxnOp, WatchBatch};
use ferry_testkit::Etcd as TestEtcd;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TIMEOUT: Duration = Duration::from_secs(5);

async fn client(etcd: &TestEtcd) -> Etcd {
    let endpoints = ferry_proto::cluster::endpoints(&etcd.cluster()).unwrap();
    Etcd::connect(&endpoints, TIMEOUT).await.unwrap()
}

fn pairs(range: &ferry_etcd::Range) -> Vec<(&[u8], &[u8])> {
    range
        .kvs
        .iter()
        .map(|kv| (kv.key.as_slice(), kv.value.as_slice()))
        .collect()
}

/// The next batch of events, within a few seconds.
async fn events(watch: &mut ferry_etcd::Watch) -> Vec<Event> {
    match tokio::time::timeout(TIMEOUT, watch.next()).await {
        Ok(Ok(Some(WatchBatch::Events(events)))) => events,
        other => panic!("expected events, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_the_cluster_makes_against_a_real_etcd() {
    let etcd = TestEtcd::start().await;
    let mut c = client(&etcd).await;

    // Puts, a prefix read in key order (binary keys and values intact), a single get, a delete.
    c.put(b"/t/b", b"2", None).await.unwrap();
    c.put(b"/t/a", &[0, 255, 10], None).await.unwrap();
    c.put(b"/u", b"outside", None).await.unwrap();
    let range = c.get_prefix(b"/t/").await.unwrap();
    assert_eq!(
        pairs(&range),
        [(&b"/t/a"[..], &[0u8, 255, 10][..]), (b"/t/b", b"2")]
    );
    assert!(range.revision >= 3);
    assert_eq!(
        pairs(&c.get(b"/t/b").await.unwrap()),
        [(&b"/t/b"[..], &b"2"[..])]
    );
    assert!(c.get(b"/t/").await.unwrap().kvs.is_empty());
    c.delete(b"/t/b").await.unwrap();
    c.delete(b"/t/never").await.unwrap();
    assert_eq!(c.get_prefix(b"/t/").await.unwrap().kvs.len(), 1);

    // A watch from the revision after a read sees every later change once, in order.
    let read = c.get_prefix(b"/t/").await.unwrap();
    let mut watch = c.watch_prefix(b"/t/", read.revision + 1).await.unwrap();
    // A transaction applies all of its operations, under a lease where asked.
    let lease = c.lease_grant(Duration::from_secs(30)).await.unwrap();
    assert_eq!(lease.ttl, Duration::from_secs(30));
    c.txn(&[
        TxnOp::Put {
            key: b"/t/c",
            value: b"3",
            lease: Some(lease.id),
        },
        TxnOp::Delete { key: b"/t/a" },
        TxnOp::Put {
            key: b"/u2",
            value: b"not watched",
            lease: None,
        },
    ])
    .await
    .unwrap();
    let seen = events(&mut watch).await;
    let seen: Vec<(EventKind, &[u8], &[u8])> = seen
        .iter()
        .map(|e| (e.kind, e.kv.key.as_slice(), e.kv.value.as_slice()))
        .collect();
    assert_eq!(
        seen,
        [
            (EventKind::Put, &b"/t/c"[..], &b"3"[..]),
            (EventKind::Delete, b"/t/a", b""),
        ]
    );
    let c_kv = c.get(b"/t/c").await.unwrap();
    assert_eq!(c_kv.kvs[0].lease, lease.id.get());

    // Keep-alive renews; revoking deletes the lease's keys at once (and the watch says so).
    let left = c.lease_keep_alive(lease.id).await.unwrap();
    assert_eq!(left, Some(Duration::from_secs(30)));
    c.lease_revoke(lease.id).await.unwrap();
    assert!(c.get(b"/t/c").await.unwrap().kvs.is_empty());
    let gone = events(&mut watch).await;
    assert_eq!(gone.len(), 1);
    assert_eq!(
        (gone[0].kind, gone[0].kv.key.as_slice()),
        (EventKind::Delete, &b"/t/c"[..])
    );

    // A revoked lease: keep-alive says it expired, a second revoke is etcd's refusal, typed.
    assert_eq!(c.lease_keep_alive(lease.id).await.unwrap(), None);
    match c.lease_revoke(lease.id).await {
        Err(EtcdError::Refused { message, code, .. }) => {
            assert!(message.contains("lease not found"), "{message}");
            assert_eq!(code, 5);
        }
        other => panic!("expected a refusal, got {other:?}"),
    }

    // A lease that is not renewed expires on its own, and takes its keys with it. (A millisecond
    // is asked for: rounded up to a whole second, then raised to etcd's own minimum.)
    let short = c.lease_grant(Duration::from_millis(1)).await.unwrap();
    assert!(short.ttl >= Duration::from_secs(1), "{:?}", short.ttl);
    c.put(b"/t/short", b"x", Some(short.id)).await.unwrap();
    let put = events(&mut watch).await;
    assert_eq!(
        (put[0].kind, put[0].kv.key.as_slice()),
        (EventKind::Put, &b"/t/short"[..])
    );
    // etcd checks for expired leases every half second or so: the delete comes within the TTL
    // plus a few seconds.
    let expired = tokio::time::timeout(short.ttl + TIMEOUT, watch.next())
        .await
        .expect("the lease expired")
        .unwrap();
    match expired {
        Some(WatchBatch::Events(e)) => {
            assert_eq!(
                (e[0].kind, e[0].kv.key.as_slice()),
                (EventKind::Delete, &b"/t/short"[..])
            )
        }
        other => panic!("expected the expiry's delete, got {other:?}"),
    }
    assert_eq!(c.lease_keep_alive(short.id).await.unwrap(), None);

    // The etcd cluster's own member list names its peer URL.
    let members = c.member_list().await.unwrap();
    assert_eq!(members.len(), 1);
    assert_eq!(members[0].name, "ferry-test");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_etcd_ends_a_watch_and_the_client_connects_again_once_it_is_back() {
    let mut etcd = TestEtcd::start().await;
    let mut c = client(&etcd).await;
    c.put(b"/w/a", b"1", None).await.unwrap();
    let mut watch = c.watch_prefix(b"/w/", 1).await.unwrap();
    assert_eq!(events(&mut watch).await.len(), 1);
    // etcd going away ends the stream, with an error or its end, never a hang.
    etcd.stop();
    let ended = tokio::time::timeout(TIMEOUT, watch.next()).await.unwrap();
    assert!(!matches!(ended, Ok(Some(_))), "{ended:?}");
    // The client's next call says who did not answer.
    match c.get(b"/w/a").await {
        Err(EtcdError::Unreachable { tried, .. }) => assert!(tried.contains("127.0.0.1")),
        Err(EtcdError::Http { .. }) => {}
        other => panic!("expected etcd unreachable, got {other:?}"),
    }
    // Back again: the same client connects anew on its next call.
    etcd.resume().await;
    assert_eq!(
        pairs(&c.get(b"/w/a").await.unwrap()),
        [(&b"/w/a"[..], &b"1"[..])]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_first_endpoint_fails_over_and_none_answering_names_them_all() {
    let etcd = TestEtcd::start().await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let mut endpoints = vec![format!("http://{dead}")];
    endpoints.extend(ferry_proto::cluster::endpoints(&etcd.cluster()).unwrap());
    let mut c = Etcd::connect(&endpoints, TIMEOUT).await.unwrap();
    assert_eq!(c.endpoint(), endpoints[1]);
    c.put(b"k", b"v", None).await.unwrap();

    match Etcd::connect(&endpoints[..1], TIMEOUT).await {
        Err(e @ EtcdError::Unreachable { .. }) => {
            assert!(e.to_string().contains(&dead.to_string()), "{e}")
        }
        other => panic!("expected unreachable, got {:?}", other.err()),
    }
    for bad in ["127.0.0.1:2379", "http://h:1/path", "https://h:1/path"] {
        assert!(matches!(
            Etcd::connect(&[bad.to_string()], TIMEOUT).await,
            Err(EtcdError::Endpoint(_))
        ));
    }
    // etcd over TLS, and nothing to reach it with: said before connecting.
    assert!(matches!(
        Etcd::connect(&["https://127.0.0.1:2379".to_string()], TIMEOUT).await,
        Err(EtcdError::NeedsTls(_))
    ));
}

fn answer_200(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A peer that answers every request on a connection with `answer`, for tests of what the
/// client makes of a server that is not etcd.
/// Each connection stays open `hold` after the answer.
async fn fake_etcd(answer: Vec<u8>, hold: Duration) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                let mut request = vec![0u8; 64 * 1024];
                let _ = stream.read(&mut request).await;
                let _ = stream.write_all(&answer).await;
                tokio::time::sleep(hold).await;
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_is_not_etcd_gets_a_typed_error_never_a_panic_or_a_hang() {
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "not json",
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello".to_vec(),
        ),
        ("bad base64", answer_200(r#"{"kvs":[{"key":"***"}]}"#)),
        ("a number for a key", answer_200(r#"{"kvs":[{"key":1}]}"#)),
        (
            "a revision that is no integer",
            answer_200(r#"{"header":{"revision":"x"}}"#),
        ),
        (
            "too large",
            format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
                ferry_etcd::MAX_ANSWER + 1
            )
            .into_bytes(),
        ),
        (
            "a status with no etcd error",
            b"HTTP/1.1 500 Oops\r\nContent-Length: 2\r\n\r\nno".to_vec(),
        ),
        ("silence", Vec::new()),
    ];
    for (what, answer) in cases {
        // The silent peer keeps its connection open: only the client's timeout ends the wait.
        let endpoint = fake_etcd(answer, Duration::from_secs(30)).await;
        let mut c = Etcd::connect(&[endpoint], Duration::from_millis(500))
            .await
            .unwrap();
        let got = c.get_prefix(b"/ferry/").await;
        match (what, &got) {
            ("too large", Err(EtcdError::TooLarge { .. }))
            | ("silence", Err(EtcdError::Timeout { .. })) => {}
            ("too large" | "silence", _) => panic!("{what}: {got:?}"),
            (_, Err(EtcdError::Malformed { .. })) => {}
            _ => panic!("{what}: {got:?}"),
        }
    }
}

/// A peer that streams `chunks` (HTTP/1.1 chunked) as the answer to a watch, then ends it.
async fn fake_watch(chunks: Vec<&'static str>) -> Etcd {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let chunks = chunks.clone();
            tokio::spawn(async move {
                let mut request = vec![0u8; 64 * 1024];
                let _ = stream.read(&mut request).await;
                let head = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
                stream.write_all(head.as_bytes()).await.unwrap();
                for chunk in chunks {
                    let framed = format!("{:x}\r\n{chunk}\r\n", chunk.len());
                    stream.write_all(framed.as_bytes()).await.unwrap();
                    stream.flush().await.unwrap();
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let _ = stream.write_all(b"0\r\n\r\n").await;
            });
        }
    });
    Etcd::connect(&[format!("http://{addr}")], TIMEOUT)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_messages_are_read_whole_however_the_stream_cuts_them() {
    let created = "{\"result\":{\"created\":true}}\n";
    // Two messages in one chunk, then one cut in three, then etcd's end of the stream.
    let c = fake_watch(vec![
        created,
        "{\"result\":{\"events\":[{\"kv\":{\"key\":\"YQ==\",\"value\":\"MQ==\"}}]}}\n{\"result\":{\"events\":[{\"type\":\"DELETE\",\"kv\":{\"key\":\"YQ==\"}}]}}\n",
        "{\"result\":{\"eve",
        "nts\":[{\"kv\":{\"key\":\"Yg==\",\"val",
        "ue\":\"Mg==\"}}]}}\n",
        "{\"result\":{\"canceled\":true,\"cancel_reason\":\"compacted\",\"compact_revision\":\"9\"}}\n",
    ])
    .await;
    let mut watch = c.watch_prefix(b"", 1).await.unwrap();
    let keys = |b: Option<WatchBatch>| match b {
        Some(WatchBatch::Events(e)) => e
            .into_iter()
            .map(|e| (e.kind, e.kv.key, e.kv.value))
            .collect::<Vec<_>>(),
        other => panic!("expected events, got {other:?}"),
    };
    assert_eq!(
        keys(watch.next().await.unwrap()),
        [(EventKind::Put, b"a".to_vec(), b"1".to_vec())]
    );
    assert_eq!(
        keys(watch.next().await.unwrap()),
        [(EventKind::Delete, b"a".to_vec(), Vec::new())]
    );
    assert_eq!(
        keys(watch.next().await.unwrap()),
        [(EventKind::Put, b"b".to_vec(), b"2".to_vec())]
    );
    assert_eq!(
        watch.next().await.unwrap(),
        Some(WatchBatch::Canceled {
            reason: "compacted".into(),
            compact_revision: 9
        })
    );
    assert_eq!(watch.next().await.unwrap(), None);

    // A watch etcd does not confirm, and a message that is not etcd's JSON, are errors.
    let c = fake_watch(vec!["{\"result\":{\"canceled\":true}}\n"]).await;
    assert!(matches!(
        c.watch_prefix(b"", 1).await,
        Err(EtcdError::Refused { .. })
    ));
    assert!(matches!(
        first_after_created(vec!["{\"result\":[1,2]}\n"]).await,
        Err(EtcdError::Malformed { .. })
    ));
    assert!(matches!(
        first_after_created(vec![
            "{\"error\":{\"grpc_code\":14,\"message\":\"gone\"}}\n"
        ])
        .await,
        Err(EtcdError::Refused { code: 14, .. })
    ));
    // A stream that ends within a message: an error, not a quiet end.
    assert!(matches!(
        first_after_created(vec!["{\"result\":{\"events\":["]).await,
        Err(EtcdError::Malformed { .. })
    ));
    // Blank lines between messages are nothing; a byte at a time is as good as whole.
    assert_eq!(
        first_after_created(vec!["\n", " \n", "{", "\"result\"", ":{}", "}", "\n"])
            .await
            .unwrap(),
        Some(WatchBatch::Events(Vec::new()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dropped_halfway_leaves_a_client_that_still_works() {
    let etcd = TestEtcd::start().await;
    let mut c = client(&etcd).await;
    c.put(b"k", b"v", None).await.unwrap();
    // Calls cancelled at every stage (before sending, waiting for the answer, reading it): the
    // next call on the same client connects again where it must, and answers right.
    for micros in [0u64, 1, 10, 50, 100, 200, 500, 1000, 2000, 5000] {
        let _ = tokio::time::timeout(Duration::from_micros(micros), c.get(b"k")).await;
        assert_eq!(pairs(&c.get(b"k").await.unwrap()), [(&b"k"[..], &b"v"[..])]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_accepts_but_never_answers_is_left_for_the_next() {
    let etcd = TestEtcd::start().await;
    // The first endpoint takes connections and reads requests, and never answers.
    let mute = fake_etcd(Vec::new(), Duration::from_secs(30)).await;
    let mut endpoints = vec![mute.clone()];
    endpoints.extend(ferry_proto::cluster::endpoints(&etcd.cluster()).unwrap());
    let mut c = Etcd::connect(&endpoints, Duration::from_millis(500))
        .await
        .unwrap();
    assert_eq!(c.endpoint(), mute);
    assert!(matches!(c.get(b"k").await, Err(EtcdError::Timeout { .. })));
    // The next call starts from the endpoint after the one that failed.
    c.put(b"k", b"v", None).await.unwrap();
    assert_eq!(c.endpoint(), endpoints[1]);
}

/// What a watch gives first when the peer confirms it and then streams `chunks`.
async fn first_after_created(chunks: Vec<&'static str>) -> Result<Option<WatchBatch>, EtcdError> {
    let mut all = vec!["{\"result\":{\"created\":true}}\n"];
    all.extend(chunks);
    let c = fake_watch(all).await;
    let mut watch = c.watch_prefix(b"", 1).await.unwrap();
    watch.next().await
}
