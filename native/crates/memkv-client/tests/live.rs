//! Client and server together, in-process on loopback: round trips, auth, failures, and a fuzz
//! campaign of arbitrary byte streams against a live server (bounded by PROPTEST_CASES).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memkv_client::{Buf, Client, ClientConfig, Status};
use memkv_proto::{encode_key_lens, Header, HelloReply, Opcode, HEADER_LEN};
use memkv_server::{Server, ServerConfig};
use proptest::prelude::*;

mod common;
use common::{get, put};

fn server(memory: u64, auth: Option<Vec<u8>>) -> Server {
    Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory,
        lanes: 2,
        auth_key: auth,
        frame_timeout: Duration::from_secs(2),
        ..ServerConfig::default()
    })
    .unwrap()
}

fn client(servers: &[&Server], auth: Option<Vec<u8>>) -> Arc<Client> {
    Client::new(ClientConfig {
        servers: servers.iter().map(|s| s.addr.to_string()).collect(),
        auth_key: auth,
        op_timeout: Duration::from_secs(3),
        ..ClientConfig::default()
    })
    .unwrap()
}

#[test]
fn round_trip_over_two_servers() {
    let (a, b) = (server(64 << 20, None), server(64 << 20, None));
    let c = client(&[&a, &b], None);
    for i in 0..100u32 {
        let val: Vec<u8> = (0..(1000 + i)).map(|j| (i ^ j) as u8).collect();
        assert_eq!(put(&c, &i.to_le_bytes(), &val), Status::Ok);
    }
    for i in 0..100u32 {
        let (s, v) = get(&c, &i.to_le_bytes(), 1000 + i as usize);
        assert_eq!(s, Status::Ok);
        assert!(v
            .iter()
            .enumerate()
            .all(|(j, &x)| x == (i ^ j as u32) as u8));
    }
    let items: Vec<u64> = [&a, &b]
        .iter()
        .map(|s| s.store.lane_stats().items)
        .collect();
    assert!(items.iter().all(|&n| n > 20), "{items:?}");
}

#[test]
fn many_concurrent_multi_chunk_gets_are_byte_exact() {
    // More concurrent replies than verifier threads, values spanning several verifier windows and
    // ending mid-chunk, batches mixing sizes: every byte must come back as stored.
    let a = server(512 << 20, None);
    let c = Client::new(ClientConfig {
        servers: vec![a.addr.to_string()],
        connections_per_server: 8,
        op_timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    })
    .unwrap();
    let chunk = memkv_proto::CHECKSUM_CHUNK;
    let sizes = [1, chunk - 1, chunk + 1, 3 * chunk, 40 * chunk + 12_345];
    let val = |t: usize, k: usize| -> Vec<u8> {
        (0..sizes[k]).map(|j| (j * 7 + t * 13 + k) as u8).collect()
    };
    std::thread::scope(|sc| {
        for t in 0..8 {
            let c = &c;
            sc.spawn(move || {
                let keys: Vec<Vec<u8>> = (0..sizes.len())
                    .map(|k| format!("mc/{t}/{k}").into_bytes())
                    .collect();
                let vals: Vec<Vec<u8>> = (0..sizes.len()).map(|k| val(t, k)).collect();
                let bufs: Vec<Buf> = vals.iter().map(|v| Buf::of(v)).collect();
                // SAFETY: `vals` outlives the blocking call.
                let st = unsafe { c.put(&keys, &bufs) };
                assert!(st.iter().all(|s| *s == Status::Ok), "{st:?}");
                for _ in 0..3 {
                    let mut out: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
                    let dst: Vec<Buf> = out.iter_mut().map(|v| Buf::of_mut(v)).collect();
                    // SAFETY: `out` outlives the call; its buffers are distinct and untouched.
                    let st = unsafe { c.get(&keys, &dst) };
                    assert!(st.iter().all(|s| *s == Status::Ok), "{st:?}");
                    assert!(out == vals, "thread {t}: bytes differ");
                }
            });
        }
    });
}

#[test]
fn auth_is_enforced() {
    let key = vec![9u8; 32];
    let s = server(16 << 20, Some(key.clone()));
    assert_eq!(
        put(&client(&[&s], Some(key.clone())), b"k", b"v"),
        Status::Ok
    );
    let wrong = client(&[&s], Some(vec![1u8; 32]));
    assert_eq!(put(&wrong, b"k", b"x"), Status::AuthFailed);
    let h = &wrong.health()[0];
    assert!(!h.up);
    let f = h.last_failure.as_ref().unwrap();
    assert_eq!(f.status, Status::AuthFailed);
    assert!(f.reason.contains("AuthFailed"), "{}", f.reason);
    assert_eq!(put(&client(&[&s], None), b"k", b"x"), Status::AuthFailed);
    assert_eq!(
        get(&client(&[&s], Some(key)), b"k", 1),
        (Status::Ok, b"v".to_vec())
    );
    assert_eq!(s.store.metrics.errors("auth_failed"), 1);
}

#[test]
fn down_server_gives_fast_misses() {
    let s = server(16 << 20, None);
    let addr = s.addr.to_string();
    s.shutdown();
    s.wait();
    let c = Client::new(ClientConfig {
        servers: vec![addr],
        connect_timeout: Duration::from_millis(500),
        op_timeout: Duration::from_secs(2),
        ..ClientConfig::default()
    })
    .unwrap();
    let t = Instant::now();
    for _ in 0..50 {
        // Refused when tried, Unavailable while marked down in between.
        let st = c.exists(&[b"k".to_vec()], 0)[0].0;
        assert!(matches!(st, Status::Refused | Status::Unavailable), "{st}");
    }
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

#[test]
fn stalled_frame_is_dropped_after_the_frame_timeout() {
    let s = server(16 << 20, None);
    let mut raw = TcpStream::connect(s.addr).unwrap();
    raw.write_all(&Header::new(Opcode::Hello, 1, 0, 0).encode())
        .unwrap();
    let mut buf = [0u8; 73];
    raw.read_exact(&mut buf).unwrap();
    let body = encode_key_lens(&[b"slow".as_slice()], &[100]);
    raw.write_all(&Header::new(Opcode::Put, 2, body.len(), 100).encode())
        .unwrap();
    raw.write_all(&body).unwrap();
    raw.write_all(&[1u8; 10]).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let t = Instant::now();
    // The server answers the stalled request with an ERROR frame (code Stalled), then closes.
    let mut hb = [0u8; memkv_proto::HEADER_LEN];
    raw.read_exact(&mut hb).unwrap();
    let h = Header::decode(&hb).unwrap();
    assert_eq!(h.opcode, Opcode::Error);
    let mut err = vec![0u8; h.body_len as usize];
    raw.read_exact(&mut err).unwrap();
    let (code, _) = memkv_proto::decode_error(&err).unwrap();
    assert_eq!(code, Some(memkv_proto::ErrorCode::Stalled));
    assert_eq!(
        raw.read(&mut buf).unwrap_or(0),
        0,
        "server must close a stalled frame"
    );
    assert!(t.elapsed() < Duration::from_secs(6));
    assert_eq!(get(&client(&[&s], None), b"slow", 100).0, Status::NotFound);
}

/// A fake server on loopback: answers HELLO (no auth, 1 MiB values), then hands the connection
/// and the first request's header to `script`.
fn fake_server(
    script: impl FnOnce(TcpStream, Header) + Send + 'static,
) -> (String, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut hb = [0u8; HEADER_LEN];
        s.read_exact(&mut hb).unwrap();
        let hello = HelloReply {
            auth_required: false,
            nonce: [0; 32],
            max_value_len: 1 << 20,
            tenant: None,
        }
        .encode();
        s.write_all(&Header::new(Opcode::HelloReply, 1, hello.len(), 0).encode())
            .unwrap();
        s.write_all(&hello).unwrap();
        s.read_exact(&mut hb).unwrap();
        let h = Header::decode(&hb).unwrap();
        let mut body = vec![0u8; h.body_len as usize];
        s.read_exact(&mut body).unwrap();
        script(s, h)
    });
    (addr, t)
}

fn client_at(addr: &str, op_timeout: Duration) -> Arc<Client> {
    Client::new(ClientConfig {
        servers: vec![addr.to_string()],
        op_timeout,
        ..ClientConfig::default()
    })
    .unwrap()
}

#[test]
fn a_trickled_get_ends_at_the_op_deadline_and_never_writes_a_buffer_not_answered_ok() {
    // The reply says NotFound for the first key and Ok (100 bytes) for the second, then sends
    // those bytes one per 50 ms: 5 s of trickle against a 1 s deadline.
    let (addr, peer) = fake_server(|mut s, h| {
        let table = memkv_proto::encode_status_lens(&[
            (memkv_proto::Status::NotFound, 0),
            (memkv_proto::Status::Ok, 100),
        ]);
        s.write_all(&Header::new(Opcode::GetReply, h.request_id, table.len(), 100).encode())
            .unwrap();
        s.write_all(&table).unwrap();
        for _ in 0..100 {
            if s.write_all(&[0xAB]).is_err() {
                return; // the client hung up at its deadline
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let c = client_at(&addr, Duration::from_secs(1));
    let mut miss = vec![7u8; 100];
    let mut slow = vec![7u8; 100];
    let bufs = [Buf::of_mut(&mut miss), Buf::of_mut(&mut slow)];
    let t = Instant::now();
    // SAFETY: both vectors outlive the call and are not touched during it.
    let st = unsafe { c.get(&[b"a".to_vec(), b"b".to_vec()], &bufs) };
    let took = t.elapsed();
    assert_eq!(st, [Status::Timeout, Status::Timeout]);
    assert!(
        took < Duration::from_millis(1500),
        "returned after {took:?}"
    );
    assert!(
        miss.iter().all(|&b| b == 7),
        "a buffer not answered Ok was written"
    );
    // Once the call returned nothing writes into caller memory any more: the client closed the
    // connection, so the peer stops at its next write.
    let after = slow.clone();
    peer.join().unwrap();
    assert_eq!(slow, after);
    let h = &c.health()[0];
    assert!(!h.up && h.last_failure.as_ref().unwrap().status == Status::Timeout);
}

#[test]
fn each_failure_has_its_own_outcome() {
    // Nothing listening: Refused.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let c = client_at(&format!("127.0.0.1:{port}"), Duration::from_secs(2));
    assert_eq!(c.exists(&[b"k".to_vec()], 0)[0].0, Status::Refused);
    // A second call inside the backoff does not retry: Unavailable (marked down), same reason.
    assert_eq!(c.exists(&[b"k".to_vec()], 0)[0].0, Status::Unavailable);
    assert_eq!(
        c.health()[0].last_failure.as_ref().unwrap().status,
        Status::Refused
    );

    // A peer that is not a memkv server: ProtocolError.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let peer = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
        let _ = s.read(&mut [0u8; 64]);
    });
    let c = client_at(&addr, Duration::from_secs(2));
    assert_eq!(c.exists(&[b"k".to_vec()], 0)[0].0, Status::ProtocolError);
    peer.join().unwrap();

    // A peer that accepts and never answers: Timeout, at the deadline.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let c = client_at(&addr, Duration::from_millis(500));
    let t = Instant::now();
    assert_eq!(c.exists(&[b"k".to_vec()], 0)[0].0, Status::Timeout);
    assert!(
        t.elapsed() < Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    drop(l);
}

#[test]
fn a_frame_refused_as_too_large_does_not_mark_the_server_down() {
    let (addr, peer) = fake_server(|mut s, h| {
        let body = memkv_proto::encode_error(memkv_proto::ErrorCode::TooLarge, "too many keys");
        s.write_all(&Header::new(Opcode::Error, h.request_id, body.len(), 0).encode())
            .unwrap();
        s.write_all(&body).unwrap();
    });
    let c = client_at(&addr, Duration::from_secs(2));
    assert_eq!(c.exists(&[b"k".to_vec()], 0)[0].0, Status::TooLarge);
    peer.join().unwrap();
    let h = &c.health()[0];
    assert!(h.up && h.last_failure.is_none(), "{h:?}");
}

#[test]
fn one_call_of_large_values_spreads_over_the_connections_byte_exact() {
    // Eight 4 MiB values in one PUT and one GET: each value is a part of its own, so the call
    // runs over several of the server's connections at once (one took them all in turn before),
    // and every byte comes back to its own key.
    let s = server(256 << 20, None);
    let c = Client::new(ClientConfig {
        servers: vec![s.addr.to_string()],
        connections_per_server: 8,
        op_timeout: Duration::from_secs(20),
        ..ClientConfig::default()
    })
    .unwrap();
    let keys: Vec<Vec<u8>> = (0..8u8).map(|i| vec![b'v', i]).collect();
    let vals: Vec<Vec<u8>> = (0..8usize)
        .map(|i| (0..4usize << 20).map(|j| (j * 31 + i * 7) as u8).collect())
        .collect();
    let bufs: Vec<Buf> = vals.iter().map(|v| Buf::of(v)).collect();
    // SAFETY: `vals` outlives the call.
    let st = unsafe { c.put(&keys, &bufs) };
    assert_eq!(st, vec![Status::Ok; 8]);
    let accepted = s
        .store
        .metrics
        .connections_accepted
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(accepted >= 2, "one connection carried all eight values");
    let mut out: Vec<Vec<u8>> = vec![vec![0u8; 4 << 20]; 8];
    let dst: Vec<Buf> = out.iter_mut().map(|v| Buf::of_mut(v)).collect();
    // SAFETY: `out` outlives the call; its buffers are distinct and untouched meanwhile.
    let st = unsafe { c.get(&keys, &dst) };
    assert_eq!(st, vec![Status::Ok; 8]);
    assert!(out == vals, "a value came back with other bytes");
}

#[test]
fn batches_beyond_the_protocol_limits_are_split_not_refused() {
    let s = server(64 << 20, None);
    // One connection, so that the whole batch goes into one connection's frames.
    let c = Client::new(ClientConfig {
        servers: vec![s.addr.to_string()],
        connections_per_server: 1,
        op_timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    })
    .unwrap();
    // More keys than one frame may carry.
    let many: Vec<Vec<u8>> = (0..70_000u32)
        .map(|i| format!("many/{i}").into_bytes())
        .collect();
    let st = c.exists(&many, 0);
    assert!(st.iter().all(|(s, _)| *s == Status::NotFound));
    // Fewer keys, but a key table larger than one frame's body limit (18 MB > 16 MiB).
    let long: Vec<Vec<u8>> = (0..18_000u32)
        .map(|i| format!("{i:01000}").into_bytes())
        .collect();
    let vals: Vec<[u8; 8]> = (0..long.len() as u64).map(|i| i.to_le_bytes()).collect();
    let bufs: Vec<Buf> = vals.iter().map(|v| Buf::of(v)).collect();
    // SAFETY: `vals` outlives the call.
    let st = unsafe { c.put(&long, &bufs) };
    assert!(st.iter().all(|s| *s == Status::Ok));
    let mut out = vec![[0u8; 8]; long.len()];
    let dst: Vec<Buf> = out.iter_mut().map(|v| Buf::of_mut(v)).collect();
    // SAFETY: `out` outlives the call; its buffers are distinct and untouched meanwhile.
    let st = unsafe { c.get(&long, &dst) };
    assert!(st.iter().all(|s| *s == Status::Ok));
    assert_eq!(out, vals);
    assert!(c.health()[0].up);
}

#[test]
fn server_spellings_are_canonicalised_before_placement() {
    let canon = vec![
        "10.0.0.1:7390".to_string(),
        "[::1]:7390".into(),
        "host-a:1".into(),
    ];
    let c = Client::new(ClientConfig {
        servers: vec![
            " 10.0.0.1:7390".into(),
            "[0::0001]:07390".into(),
            "HOST-A.:1".into(),
        ],
        ..ClientConfig::default()
    })
    .unwrap();
    assert_eq!(c.config().servers, canon);
    for i in 0..1000u32 {
        let k = format!("key/{i}");
        assert_eq!(
            c.server_of(k.as_bytes()),
            memkv_client::placement::rendezvous(k.as_bytes(), &canon)
        );
    }
    let dup = Client::new(ClientConfig {
        servers: vec!["a:1".into(), "A:1".into()],
        ..ClientConfig::default()
    });
    assert!(dup.err().unwrap().contains("listed twice"));
}

fn fuzz_server() -> &'static (Server, Arc<Client>) {
    static S: std::sync::OnceLock<(Server, Arc<Client>)> = std::sync::OnceLock::new();
    S.get_or_init(|| {
        let s = server(32 << 20, None);
        // What the fuzz checks is the bytes the server serves after each stream, not how fast:
        // deadlines far above a loaded test machine's stalls (the other tests of this binary run
        // in parallel and pre-fault their servers' memory), still bounding a real hang.
        let c = Client::new(ClientConfig {
            servers: vec![s.addr.to_string()],
            connect_timeout: Duration::from_secs(30),
            op_timeout: Duration::from_secs(30),
            ..ClientConfig::default()
        })
        .unwrap();
        assert_eq!(put(&c, b"canary", b"the stored bytes"), Status::Ok);
        (s, c)
    })
}

/// A valid HELLO, then either noise or a well-formed header with a random opcode and lengths
/// followed by noise.
fn stream() -> impl Strategy<Value = Vec<u8>> {
    let noise = proptest::collection::vec(any::<u8>(), 0..600);
    prop_oneof![
        noise.clone(),
        (1u8..=9, 0u32..700, 0u64..2000, noise.clone()).prop_map(|(op, bl, pl, tail)| {
            let mut h = Header::new(Opcode::Ping, 7, bl as usize, pl)
                .encode()
                .to_vec();
            h[3] = op;
            h.extend(tail);
            h
        }),
        (
            proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..5),
            noise
        )
            .prop_map(|(keys, tail)| {
                let lens: Vec<u64> = keys.iter().map(|k| k.len() as u64).collect();
                let body = encode_key_lens(&keys, &lens);
                let mut h = Header::new(Opcode::Get, 3, body.len(), 0).encode().to_vec();
                h.extend(body);
                h.extend(tail);
                h
            }),
    ]
}

/// Sends one stream on a fresh connection, then checks the server still serves exactly the
/// stored bytes to a well-behaved client.
fn check_stream(greet: bool, bytes: &[u8]) -> Result<(), TestCaseError> {
    let (s, c) = fuzz_server();
    let mut raw = TcpStream::connect(s.addr).unwrap();
    raw.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    if greet {
        raw.write_all(&Header::new(Opcode::Hello, 1, 0, 0).encode())
            .unwrap();
    }
    let _ = raw.write_all(bytes);
    let mut sink = [0u8; 4096];
    let _ = raw.read(&mut sink);
    drop(raw);
    let (st, v) = get(c, b"canary", 16);
    prop_assert_eq!(st, Status::Ok);
    prop_assert_eq!(&v[..], b"the stored bytes");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    /// Whatever arrives, the server stays up and keeps serving exactly the stored bytes.
    #[test]
    fn fuzz_live_server_with_arbitrary_streams(greet in any::<bool>(), bytes in stream()) {
        check_stream(greet, &bytes)?;
    }
}

/// The same property for a fixed time (MEMKV_FUZZ_SECS, default 10 s) with fresh seeds each
/// round: the bounded fuzz campaign CI runs.
#[test]
#[ignore = "time-bounded campaign; run with --include-ignored and MEMKV_FUZZ_SECS"]
fn fuzz_campaign_live_server() {
    use proptest::test_runner::{RngAlgorithm, TestRng, TestRunner};
    let secs: u64 = std::env::var("MEMKV_FUZZ_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let deadline = Instant::now() + Duration::from_secs(secs);
    let (mut rounds, mut streams) = (0u64, 0u64);
    while Instant::now() < deadline {
        let mut seed = [0u8; 32];
        seed[..8].copy_from_slice(&rounds.to_le_bytes());
        seed[8..16].copy_from_slice(&(std::process::id() as u64).to_le_bytes());
        let cfg = ProptestConfig {
            cases: 64,
            failure_persistence: None,
            ..ProptestConfig::default()
        };
        let mut runner =
            TestRunner::new_with_rng(cfg, TestRng::from_seed(RngAlgorithm::ChaCha, &seed));
        runner
            .run(&(any::<bool>(), stream()), |(greet, bytes)| {
                check_stream(greet, &bytes)
            })
            .unwrap();
        rounds += 1;
        streams += 64;
    }
    let (s, _) = fuzz_server();
    eprintln!(
        "fuzz campaign: {streams} streams in {secs} s; server errors counted: malformed {}, bad_magic {}",
        s.store.metrics.errors("malformed"),
        s.store.metrics.errors("bad_magic")
    );
}
