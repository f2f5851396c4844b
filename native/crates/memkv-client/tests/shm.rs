//! The client and server over the shared-memory transport, in-process: the server's unix
//! socket, regions passed as memfd descriptors, and the server's copies into and out of them.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use memkv_client::shm_regions::SharedMemory;
use memkv_client::{Buf, Client, ClientConfig, Status, TransportChoice};
use memkv_server::shm::ShmConfig;
use memkv_server::{Server, ServerConfig};

fn server_with(shm: ShmConfig, auth: Option<Vec<u8>>) -> Server {
    Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory: 256 << 20,
        lanes: 2,
        auth_key: auth,
        frame_timeout: Duration::from_secs(5),
        shm: Some(shm),
        ..ServerConfig::default()
    })
    .unwrap()
}

fn server() -> Server {
    server_with(ShmConfig::default(), None)
}

fn client_with(s: &Server, transport: TransportChoice, auth: Option<Vec<u8>>) -> Arc<Client> {
    Client::new(ClientConfig {
        servers: vec![s.addr.to_string()],
        auth_key: auth,
        op_timeout: Duration::from_secs(10),
        transport,
        ..ClientConfig::default()
    })
    .unwrap()
}

fn client(s: &Server) -> Arc<Client> {
    client_with(s, TransportChoice::Shm, None)
}

/// A memfd region of `len` bytes, registered with `c`; unmapped on drop.
struct Region {
    mem: SharedMemory,
    ptr: usize,
    len: usize,
}

impl Region {
    fn new(c: &Client, len: usize) -> Region {
        let mem = SharedMemory::new("memkv-shm-test", len).unwrap();
        let ptr = mem.ptr();
        // SAFETY: the mapping lives until the Region drops, after the client's use of it.
        unsafe { c.register_memory(ptr, len).unwrap() };
        assert!(c.shm_region_covers(ptr, len));
        Region { mem, ptr, len }
    }

    /// Writes `data` at `off` (memory shared with the server, so written through a pointer).
    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: inside the mapping, which lives with this value.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), (self.ptr as *mut u8).add(off), data.len())
        };
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is ours for the Region's life; tests use one view at a time.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    fn buf(&self, off: usize, len: usize) -> Buf {
        Buf {
            ptr: self.ptr + off,
            len,
        }
    }
}

fn value(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 31 + j * 7 + j / 251) as u8).collect()
}

fn put(c: &Client, keys: &[&[u8]], bufs: &[Buf]) -> Vec<Status> {
    let keys: Vec<Vec<u8>> = keys.iter().map(|k| k.to_vec()).collect();
    // SAFETY: the buffers are live mappings of the test's regions.
    unsafe { c.put(&keys, bufs) }
}

fn get(c: &Client, keys: &[&[u8]], bufs: &[Buf]) -> Vec<Status> {
    let keys: Vec<Vec<u8>> = keys.iter().map(|k| k.to_vec()).collect();
    // SAFETY: as for `put`, and nothing else touches them during the call.
    unsafe { c.get(&keys, bufs) }
}

#[test]
fn round_trips_of_every_size_through_the_servers_copies() {
    let s = server();
    let c = client(&s);
    let sizes = [
        0,
        1,
        1000,
        256 << 10,
        (256 << 10) + 1,
        3 << 20,
        (5 << 20) + 13,
        // Past the copy pool's threshold on its own: its pieces are copied by several threads.
        (9 << 20) + 7,
    ];
    let total: usize = sizes.iter().sum();
    let src = Region::new(&c, total);
    let dst = Region::new(&c, total);
    let mut off = 0;
    let mut bufs = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        src.write(off, &value(i, n));
        bufs.push((off, n));
        off += n;
    }
    let keys: Vec<Vec<u8>> = (0..sizes.len())
        .map(|i| format!("k{i}").into_bytes())
        .collect();
    let krefs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let pb: Vec<Buf> = bufs.iter().map(|&(o, n)| src.buf(o, n)).collect();
    let st = put(&c, &krefs, &pb);
    assert!(st.iter().all(|s| *s == Status::Ok), "{st:?}");
    // Each connection the batch went over mapped the source region (in whole pages).
    let after_put = s.shm_mapped_bytes() as usize;
    assert!(
        after_put >= total,
        "the source region is mapped: {after_put}"
    );
    let gb: Vec<Buf> = bufs.iter().map(|&(o, n)| dst.buf(o, n)).collect();
    assert!(get(&c, &krefs, &gb).iter().all(|s| *s == Status::Ok));
    assert_eq!(src.bytes(), dst.bytes(), "byte-exact");
    assert!(
        s.shm_mapped_bytes() as usize >= after_put + total,
        "both regions are mapped"
    );
    // Nothing went over the socket's payload: the bytes are counted once each way.
    assert_eq!(s.store.metrics.errors("shm_remote"), 0);
    s.shutdown();
    s.wait();
}

#[test]
fn empty_values_alone_go_over_the_socket_of_a_connection_without_regions() {
    // A batch of empty values only needs no region: on a connection that has mapped none, it
    // goes over the socket (a shared-memory transfer before any region is refused there).
    let s = server();
    let c = client(&s);
    let r = Region::new(&c, 4096);
    assert_eq!(
        put(&c, &[b"e0", b"e1"], &[r.buf(0, 0), r.buf(0, 0)]),
        [Status::Ok; 2]
    );
    assert_eq!(get(&c, &[b"e0"], &[r.buf(0, 0)]), [Status::Ok]);
    assert_eq!(s.store.metrics.errors("malformed"), 0);
    s.shutdown();
    s.wait();
}

#[test]
fn per_key_statuses_are_those_of_tcp() {
    let s = server();
    let c = client(&s);
    let r = Region::new(&c, 4 << 20);
    r.write(0, &value(1, 1000));
    assert_eq!(put(&c, &[b"a"], &[r.buf(0, 1000)]), [Status::Ok]);
    r.write(1 << 20, &[0xEE; 1000]);
    let st = get(
        &c,
        &[b"a", b"missing", b"a"],
        &[
            r.buf(1 << 20, 999),
            r.buf(2 << 20, 10),
            r.buf(3 << 20, 1000),
        ],
    );
    assert_eq!(
        st,
        [Status::LengthMismatch, Status::NotFound, Status::NotFound]
    );
    assert!(
        r.bytes()[1 << 20..(1 << 20) + 1000]
            .iter()
            .all(|&b| b == 0xEE),
        "nothing written"
    );
    // Too large for the server: refused before sending, as over TCP.
    let big = Region::new(&c, (s.store.max_value_len + 1) as usize);
    assert_eq!(
        put(&c, &[b"big"], &[big.buf(0, big.len)]),
        [Status::TooLarge]
    );
    // A lease taken by EXISTS holds across a GET over shared memory.
    assert_eq!(c.exists(&[b"a".to_vec()], 5_000), [(Status::Ok, 1000)]);
    assert_eq!(get(&c, &[b"a"], &[r.buf(3 << 20, 1000)]), [Status::Ok]);
    assert_eq!(&r.bytes()[3 << 20..(3 << 20) + 1000], &value(1, 1000)[..]);
    s.shutdown();
    s.wait();
}

#[test]
fn buffers_outside_regions_go_over_the_socket() {
    let s = server();
    let c = client(&s);
    let val = value(3, 300_000);
    assert_eq!(put(&c, &[b"heap"], &[Buf::of(&val)]), [Status::Ok]);
    let mut back = vec![0u8; val.len()];
    assert_eq!(get(&c, &[b"heap"], &[Buf::of_mut(&mut back)]), [Status::Ok]);
    assert_eq!(back, val);
    assert_eq!(s.shm_mapped_bytes(), 0, "no region was handed over");
    s.shutdown();
    s.wait();
}

/// A client of one connection: which connection a request takes (and so whether it has mapped a
/// region already) is then known.
fn one_connection_client(s: &Server) -> Arc<Client> {
    Client::new(ClientConfig {
        servers: vec![s.addr.to_string()],
        op_timeout: Duration::from_secs(10),
        transport: TransportChoice::Shm,
        connections_per_server: 1,
        ..ClientConfig::default()
    })
    .unwrap()
}

/// Stores `value(seed, len)` under `key` through a region of `region_len` bytes, then shrinks the
/// region's file to nothing under two clients whose one connection each has the region mapped
/// (the server maps the file once for both): a PUT from it through the first and a GET into it
/// through the second must both fail with REMOTE_ACCESS, store nothing and leave the server and
/// `key` intact. A failed key closes its connection, hence a client per failure.
fn shrink_under(s: &Server, key: &[u8], len: usize, region_len: usize) {
    let (ca, cb) = (one_connection_client(s), one_connection_client(s));
    let r = Region::new(&ca, region_len);
    // SAFETY: the mapping outlives both clients' use of it.
    unsafe { cb.register_memory(r.ptr, r.len).unwrap() };
    r.write(0, &value(2, len));
    assert_eq!(put(&ca, &[key], &[r.buf(0, len)]), [Status::Ok]);
    assert_eq!(get(&cb, &[key], &[r.buf(len, len)]), [Status::Ok]);
    // SAFETY: ftruncate of our own memfd; the test touches the mapping no more.
    assert_eq!(unsafe { libc::ftruncate(r.mem.fd().as_raw_fd(), 0) }, 0);
    assert_eq!(put(&ca, &[b"w"], &[r.buf(0, len)]), [Status::RemoteAccess]);
    assert_eq!(get(&cb, &[key], &[r.buf(len, len)]), [Status::RemoteAccess]);
    // The clients share the one mapping of the file: the first fault kills it for both, so the
    // second key may fail without a fault of its own.
    let faults = s.store.metrics.errors("shm_fault");
    assert!((1..=2).contains(&faults), "{faults} faults");
    assert!(s.store.fetch_verified(b"w").is_err(), "nothing stored");
    // The server and the stored value are intact; a fresh region works.
    let c = client(s);
    let fresh = Region::new(&c, len);
    assert_eq!(get(&c, &[key], &[fresh.buf(0, len)]), [Status::Ok]);
    assert_eq!(fresh.bytes(), &value(2, len)[..], "the value is intact");
}

#[test]
fn a_region_shrunk_under_the_server_fails_its_keys_and_the_server_lives() {
    let s = server();
    shrink_under(&s, b"v", 1 << 20, 4 << 20);
    s.shutdown();
    s.wait();
}

#[test]
fn a_region_shrunk_under_pooled_copies_fails_their_keys() {
    // Values big enough for the copy pool, whose pieces several threads copy: whichever thread
    // meets the fault, the key fails.
    let s = server();
    shrink_under(&s, b"big", 8 << 20, 16 << 20);
    s.shutdown();
    s.wait();
}

#[test]
fn the_connections_of_a_client_share_one_mapping_of_its_region() {
    let s = server();
    let c = Client::new(ClientConfig {
        servers: vec![s.addr.to_string()],
        connections_per_server: 4,
        op_timeout: Duration::from_secs(10),
        transport: TransportChoice::Shm,
        ..ClientConfig::default()
    })
    .unwrap();
    let r = Region::new(&c, 4 << 20);
    r.write(0, &value(5, 4 << 20));
    // Sixteen keys spread over the four connections: each hands the server the region.
    let keys: Vec<Vec<u8>> = (0..16).map(|i| vec![b's', i]).collect();
    let krefs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let bufs: Vec<Buf> = (0..16).map(|i| r.buf(i << 18, 1 << 18)).collect();
    assert!(put(&c, &krefs, &bufs).iter().all(|s| *s == Status::Ok));
    assert_eq!(
        s.shm_mapped_bytes(),
        4 << 20,
        "one mapping, not one per connection"
    );
    let back = Region::new(&c, 4 << 20);
    let bufs: Vec<Buf> = (0..16).map(|i| back.buf(i << 18, 1 << 18)).collect();
    assert!(get(&c, &krefs, &bufs).iter().all(|s| *s == Status::Ok));
    assert_eq!(
        back.bytes(),
        r.bytes(),
        "byte-exact through the shared mappings"
    );
    assert_eq!(s.shm_mapped_bytes(), 8 << 20);
    drop(c);
    // The last connection's region gone, the mappings go too.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while s.shm_mapped_bytes() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "mappings outlived their connections"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    s.shutdown();
    s.wait();
}

#[test]
fn bounds_refuse_regions_clearly_and_values_still_move() {
    let s = server_with(
        ShmConfig {
            max_regions: 1,
            max_region_bytes: 2 << 20,
            ..ShmConfig::default()
        },
        None,
    );
    let c = client(&s);
    let big = Region::new(&c, 4 << 20);
    big.write(0, &value(4, 1000));
    assert_eq!(put(&c, &[b"x"], &[big.buf(0, 1000)]), [Status::Ok]);
    assert_eq!(s.shm_mapped_bytes(), 0, "the oversize region was refused");
    assert_eq!(s.store.metrics.errors("shm_refused"), 1);
    let (a, b) = (Region::new(&c, 1 << 20), Region::new(&c, 1 << 20));
    assert_eq!(get(&c, &[b"x"], &[a.buf(0, 1000)]), [Status::Ok]);
    assert_eq!(get(&c, &[b"x"], &[b.buf(0, 1000)]), [Status::Ok]);
    assert_eq!(s.shm_mapped_bytes(), 1 << 20, "one region per connection");
    assert_eq!(&b.bytes()[..1000], &value(4, 1000)[..]);
    assert_eq!(s.store.metrics.errors("shm_refused"), 2);
    s.shutdown();
    s.wait();
}

#[test]
fn auth_is_that_of_tcp() {
    let key = vec![7u8; 32];
    let s = server_with(ShmConfig::default(), Some(key.clone()));
    let r = {
        let c = client_with(&s, TransportChoice::Shm, None);
        let r = Region::new(&c, 1 << 20);
        assert_eq!(put(&c, &[b"k"], &[r.buf(0, 10)]), [Status::AuthFailed]);
        let wrong = client_with(&s, TransportChoice::Shm, Some(vec![8u8; 32]));
        assert_eq!(
            put(&wrong, &[b"k"], &[Buf::of(b"0123456789")]),
            [Status::AuthFailed]
        );
        r
    };
    drop(r);
    let c = client_with(&s, TransportChoice::Shm, Some(key));
    let r = Region::new(&c, 1 << 20);
    assert_eq!(put(&c, &[b"k"], &[r.buf(0, 10)]), [Status::Ok]);
    s.shutdown();
    s.wait();
}

#[test]
fn auto_takes_the_same_host_path_and_shm_needs_a_socket() {
    let s = server();
    let c = client_with(&s, TransportChoice::Auto, None);
    let r = Region::new(&c, 1 << 20);
    assert_eq!(put(&c, &[b"a"], &[r.buf(0, 100)]), [Status::Ok]);
    assert_eq!(s.shm_mapped_bytes(), 1 << 20, "auto used shared memory");
    let tcp_only = Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory: 8 << 20,
        shm: None,
        ..ServerConfig::default()
    })
    .unwrap();
    let auto = client_with(&tcp_only, TransportChoice::Auto, None);
    assert_eq!(
        put(&auto, &[b"t"], &[Buf::of(b"tcp")]),
        [Status::Ok],
        "auto falls back to TCP"
    );
    let strict = client_with(&tcp_only, TransportChoice::Shm, None);
    assert_eq!(put(&strict, &[b"t"], &[Buf::of(b"tcp")]), [Status::Refused]);
    for srv in [s, tcp_only] {
        srv.shutdown();
        srv.wait();
    }
}
