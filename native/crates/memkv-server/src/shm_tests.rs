//! Hostile and broken same-host requests against a live server, from a hand-made client over
//! the unix socket: each gets a per-key status, a refusal or an error frame, touches no memory
//! it was not given, and leaves the server serving.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::time::Duration;

use memkv_proto::{
    self as proto, Descriptor, Header, Opcode, ShmRegion, Status, FLAG_SHM, HEADER_LEN,
};

use crate::{Server, ServerConfig};

fn server() -> Server {
    Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory: 32 << 20,
        lanes: 1,
        frame_timeout: Duration::from_secs(5),
        ..ServerConfig::default()
    })
    .unwrap()
}

fn connect(srv: &Server) -> UnixStream {
    let name = srv.shm_socket.as_ref().unwrap().strip_prefix('@').unwrap();
    let s = UnixStream::connect_addr(&UnixAddr::from_abstract_name(name).unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut s = s;
    call(&mut s, Opcode::Hello, 0, &[], None).unwrap();
    s
}

/// One request (with `fd` passed along), and its reply.
fn call(
    s: &mut UnixStream,
    op: Opcode,
    flags: u32,
    body: &[u8],
    fd: Option<i32>,
) -> Option<(Header, Vec<u8>)> {
    let mut h = Header::new(op, 1, body.len(), 0);
    h.flags = flags;
    let mut frame = h.encode().to_vec();
    frame.extend_from_slice(body);
    match fd {
        None => s.write_all(&frame).ok()?,
        Some(fd) => send_with_fd(s, &frame, fd),
    }
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb).ok()?;
    let h = Header::decode(&hb).unwrap();
    let mut b = vec![0u8; h.body_len as usize];
    s.read_exact(&mut b).ok()?;
    Some((h, b))
}

fn send_with_fd(s: &UnixStream, bytes: &[u8], fd: i32) {
    let mut cmsg = [0u64; 4];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: a one-descriptor SCM_RIGHTS message over buffers live for the call.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(4) as usize;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(4) as usize;
        libc::CMSG_DATA(c).cast::<i32>().write_unaligned(fd);
        assert_eq!(libc::sendmsg(s.as_raw_fd(), &msg, 0), bytes.len() as isize);
    }
}

/// A memfd of `len` bytes mapped here too.
struct Mem {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
}

impl Mem {
    fn new(len: usize) -> Mem {
        // SAFETY: a fresh memfd, sized and mapped shared; owned by the Mem.
        unsafe {
            let fd = libc::memfd_create(c"memkv-test".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, len as i64), 0);
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            Mem {
                fd: OwnedFd::from_raw_fd(fd),
                ptr: p.cast(),
                len,
            }
        }
    }

    /// Writes `data` at `off` (memory shared with the server, so written through a pointer).
    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: inside the mapping, which lives with this value.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping lives with the Mem; one view at a time in these tests.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn region(s: &mut UnixStream, id: u32, len: u64, fd: Option<i32>) -> (bool, String) {
    let body = proto::encode_shm_region(&ShmRegion {
        id,
        len,
        file_offset: 0,
    });
    let (h, b) = call(s, Opcode::ShmRegion, 0, &body, fd).unwrap();
    assert_eq!(h.opcode, Opcode::ShmRegionReply);
    proto::decode_shm_region_reply(&b).unwrap()
}

fn desc(id: u32, off: u64, len: u64) -> Descriptor {
    Descriptor {
        len,
        addr: off,
        rkey: id.into(),
    }
}

fn put(s: &mut UnixStream, key: &[u8], d: Descriptor) -> Option<Status> {
    let body = proto::encode_descriptors(&[key], &[d]);
    let (_, b) = call(s, Opcode::Put, FLAG_SHM, &body, None)?;
    Some(proto::decode_statuses(&b, 1).unwrap()[0])
}

fn get(s: &mut UnixStream, key: &[u8], d: Descriptor) -> Option<Status> {
    let body = proto::encode_descriptors(&[key], &[d]);
    let (_, b) = call(s, Opcode::Get, FLAG_SHM, &body, None)?;
    Some(proto::decode_status_lens(&b, 1).unwrap()[0].0)
}

fn closed(s: &mut UnixStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

#[test]
fn bad_descriptors_fail_their_key_and_touch_nothing_else() {
    let srv = server();
    let mem = Mem::new(1 << 20);
    let val: Vec<u8> = (0..300_000u32).map(|i| (i % 249) as u8).collect();
    mem.write(0, &val);
    let mut s = connect(&srv);
    assert_eq!(
        region(&mut s, 1, 1 << 20, Some(mem.fd.as_raw_fd())),
        (true, String::new())
    );
    assert_eq!(
        put(&mut s, b"good", desc(1, 0, val.len() as u64)),
        Some(Status::Ok)
    );
    // A region nobody announced, and a range past the region's end: REMOTE_ACCESS, nothing
    // stored or written, the connection closed after the reply.
    assert_eq!(
        put(&mut s, b"bad", desc(9, 0, 100)),
        Some(Status::RemoteAccess)
    );
    assert!(closed(&mut s));
    assert!(srv.store.fetch_verified(b"bad").is_err());
    let before = mem.bytes().to_vec();
    let mut s = connect(&srv);
    region(&mut s, 1, 1 << 20, Some(mem.fd.as_raw_fd()));
    let past = desc(1, (1 << 20) - 8, val.len() as u64);
    assert_eq!(get(&mut s, b"good", past), Some(Status::RemoteAccess));
    assert!(closed(&mut s));
    assert_eq!(mem.bytes(), &before[..]);
    // A length that is not the stored one: LENGTH_MISMATCH, nothing written.
    let mut s = connect(&srv);
    region(&mut s, 1, 1 << 20, Some(mem.fd.as_raw_fd()));
    let off = 1 << 19;
    assert_eq!(
        get(&mut s, b"good", desc(1, off, val.len() as u64 - 1)),
        Some(Status::LengthMismatch)
    );
    assert_eq!(mem.bytes(), &before[..]);
    assert_eq!(
        get(&mut s, b"good", desc(1, off, val.len() as u64)),
        Some(Status::Ok)
    );
    assert_eq!(
        &mem.bytes()[off as usize..off as usize + val.len()],
        &val[..]
    );
    assert_eq!(srv.store.metrics.errors("shm_remote"), 2);
    srv.shutdown();
    srv.wait();
}

#[test]
fn regions_that_are_not_shared_memory_are_refused() {
    let srv = server();
    let mut s = connect(&srv);
    // No descriptor with the frame.
    let (ok, why) = region(&mut s, 1, 4096, None);
    assert!(!ok && why.contains("without a file descriptor"), "{why}");
    // A socket, a read-only memfd, a file on a disk, and a region past its file's end.
    let (sock, _other) = UnixStream::pair().unwrap();
    let (ok, why) = region(&mut s, 1, 4096, Some(sock.as_raw_fd()));
    assert!(!ok && why.contains("only memfd"), "{why}");
    let mem = Mem::new(8192);
    let ro = std::fs::File::open(format!("/proc/self/fd/{}", mem.fd.as_raw_fd())).unwrap();
    let (ok, why) = region(&mut s, 1, 4096, Some(ro.as_raw_fd()));
    assert!(!ok && why.contains("reading and writing"), "{why}");
    let disk = std::env::current_exe().unwrap();
    if let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&disk)
    {
        let (ok, _) = region(&mut s, 1, 4096, Some(f.as_raw_fd()));
        assert!(!ok);
    }
    let (ok, why) = region(&mut s, 1, 1 << 20, Some(mem.fd.as_raw_fd()));
    assert!(!ok && why.contains("past its file"), "{why}");
    // A shared-memory transfer before any region: an error frame, then the connection closes.
    let body = proto::encode_descriptors(&[b"k".as_slice()], &[desc(1, 0, 10)]);
    let (h, b) = call(&mut s, Opcode::Put, FLAG_SHM, &body, None).unwrap();
    assert_eq!(h.opcode, Opcode::Error);
    assert!(proto::decode_error(&b)
        .unwrap()
        .1
        .contains("before SHM_REGION"));
    // Still serving; the refusals were counted.
    let mut s = connect(&srv);
    assert!(region(&mut s, 1, 8192, Some(mem.fd.as_raw_fd())).0);
    assert!(srv.store.metrics.errors("shm_refused") >= 4);
    srv.shutdown();
    srv.wait();
}

#[test]
fn a_corrupt_value_answers_corrupt_and_writes_no_byte() {
    // A value checked on the connection's thread, and one whose chunks the copy pool checks.
    for len in [3 * proto::CHECKSUM_CHUNK + 5, (6 << 20) + 5] {
        let srv = server();
        let mem = Mem::new(16 << 20);
        let val: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        mem.write(0, &val);
        let mut s = connect(&srv);
        assert!(region(&mut s, 1, 16 << 20, Some(mem.fd.as_raw_fd())).0);
        assert_eq!(put(&mut s, b"v", desc(1, 0, len as u64)), Some(Status::Ok));
        let v = srv.store.fetch_verified(b"v").ok().unwrap();
        // In the last chunk: every chunk before it checks out.
        v.span.corrupt_for_test(len - 3);
        drop(v);
        let off = 8 << 20;
        mem.write(off, &vec![0xEE; len]);
        assert_eq!(
            get(&mut s, b"v", desc(1, off as u64, len as u64)),
            Some(Status::Corrupt)
        );
        assert!(
            mem.bytes()[off..off + len].iter().all(|&b| b == 0xEE),
            "no byte written ({len} bytes)"
        );
        assert!(srv.store.fetch_verified(b"v").is_err(), "dropped");
        srv.shutdown();
        srv.wait();
    }
}

#[test]
fn descriptors_passed_before_auth_are_not_kept() {
    let srv = Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory: 8 << 20,
        auth_key: Some(vec![1; 32]),
        ..ServerConfig::default()
    })
    .unwrap();
    let mem = Mem::new(4096);
    let name = srv.shm_socket.as_ref().unwrap().strip_prefix('@').unwrap();
    let mut s = UnixStream::connect_addr(&UnixAddr::from_abstract_name(name).unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    call(&mut s, Opcode::Hello, 0, &[], Some(mem.fd.as_raw_fd())).unwrap();
    let body = proto::encode_shm_region(&ShmRegion {
        id: 1,
        len: 4096,
        file_offset: 0,
    });
    let (h, b) = call(
        &mut s,
        Opcode::ShmRegion,
        0,
        &body,
        Some(mem.fd.as_raw_fd()),
    )
    .unwrap();
    assert_eq!(h.opcode, Opcode::Error);
    assert!(proto::decode_error(&b)
        .unwrap()
        .1
        .contains("authenticate first"));
    assert_eq!(srv.shm_mapped_bytes(), 0);
    srv.shutdown();
    srv.wait();
}

fn sharing_server() -> Server {
    Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory: 32 << 20,
        lanes: 1,
        frame_timeout: Duration::from_secs(5),
        shm: Some(crate::shm::ShmConfig {
            share_values: true,
            ..crate::shm::ShmConfig::default()
        }),
        ..ServerConfig::default()
    })
    .unwrap()
}

fn get_mapped(s: &mut UnixStream, key: &[u8], len: u64) -> Option<(u64, proto::MappedValue)> {
    let (h, b) = call(
        s,
        Opcode::GetMapped,
        0,
        &proto::encode_key_lens(&[key], &[len]),
        None,
    )?;
    (h.opcode == Opcode::GetMappedReply).then_some(())?;
    let (pin, v) = proto::decode_get_mapped_reply(&b, 1).unwrap();
    Some((pin, v[0]))
}

#[test]
fn a_corrupt_value_read_in_place_fails_its_release_and_is_dropped() {
    // Checked on the connection's thread, and by the copy pool while the client copies.
    for len in [3 * proto::CHECKSUM_CHUNK + 5, (6 << 20) + 5] {
        let srv = sharing_server();
        let mem = Mem::new(16 << 20);
        let val: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        mem.write(0, &val);
        let mut s = connect(&srv);
        assert!(region(&mut s, 1, 16 << 20, Some(mem.fd.as_raw_fd())).0);
        let rel = |s: &mut UnixStream, p: u64| {
            call(
                s,
                Opcode::ShmRelease,
                0,
                &proto::encode_shm_release(p),
                None,
            )
            .unwrap()
            .1
        };
        // Intact: released once as held and intact, then unknown.
        assert_eq!(put(&mut s, b"ok", desc(1, 0, len as u64)), Some(Status::Ok));
        let (pin, v) = get_mapped(&mut s, b"ok", len as u64).unwrap();
        assert_eq!((v.status, v.len), (Status::Ok, len as u64));
        assert_ne!(pin, 0);
        assert_eq!(rel(&mut s, pin), [1]);
        assert_eq!(rel(&mut s, pin), [0]);
        // Corrupt in its last chunk (the lookup checks only the first): the read is answered,
        // its release says the copy does not count, and the value is gone.
        assert_eq!(put(&mut s, b"v", desc(1, 0, len as u64)), Some(Status::Ok));
        let v = srv.store.fetch_verified(b"v").ok().unwrap();
        v.span.corrupt_for_test(len - 3);
        drop(v);
        let (pin, v) = get_mapped(&mut s, b"v", len as u64).unwrap();
        assert_eq!(v.status, Status::Ok);
        assert_eq!(rel(&mut s, pin), [2], "{len} bytes");
        assert!(srv.store.fetch_verified(b"v").is_err(), "dropped");
        assert_eq!(
            get_mapped(&mut s, b"v", len as u64).unwrap().1.status,
            Status::NotFound
        );
        // Corrupt in its first chunk: CORRUPT at once, nothing pinned.
        assert_eq!(put(&mut s, b"w", desc(1, 0, len as u64)), Some(Status::Ok));
        let w = srv.store.fetch_verified(b"w").ok().unwrap();
        w.span.corrupt_for_test(1);
        drop(w);
        let (pin, w) = get_mapped(&mut s, b"w", len as u64).unwrap();
        assert_eq!((pin, w.status), (0, Status::Corrupt));
        srv.shutdown();
        srv.wait();
    }
}

#[test]
fn reads_in_place_need_the_option_and_the_unix_socket() {
    let srv = server();
    let mut s = connect(&srv);
    let (h, b) = call(
        &mut s,
        Opcode::ShmValues,
        0,
        &proto::encode_shm_values(0),
        None,
    )
    .unwrap();
    assert_eq!(h.opcode, Opcode::ShmValuesReply);
    let rep = proto::decode_shm_values_reply(&b).unwrap();
    assert!(rep.refused.unwrap().contains("--shm-share-values"));
    // A GET_MAPPED there is a protocol error: the connection closes after an error frame.
    let (h, _) = call(
        &mut s,
        Opcode::GetMapped,
        0,
        &proto::encode_key_lens(&[b"k"], &[1]),
        None,
    )
    .unwrap();
    assert_eq!(h.opcode, Opcode::Error);
    srv.shutdown();
    srv.wait();
    // Over TCP no descriptor can be passed: refused, the connection serves on.
    let srv = sharing_server();
    let mut t = std::net::TcpStream::connect(srv.addr).unwrap();
    t.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut tcp_call = |op: Opcode, body: &[u8]| {
        let mut frame = Header::new(op, 1, body.len(), 0).encode().to_vec();
        frame.extend_from_slice(body);
        t.write_all(&frame).unwrap();
        let mut hb = [0u8; HEADER_LEN];
        t.read_exact(&mut hb).unwrap();
        let h = Header::decode(&hb).unwrap();
        let mut b = vec![0u8; h.body_len as usize];
        t.read_exact(&mut b).unwrap();
        (h, b)
    };
    tcp_call(Opcode::Hello, &[]);
    let (_, b) = tcp_call(Opcode::ShmValues, &proto::encode_shm_values(0));
    let rep = proto::decode_shm_values_reply(&b).unwrap();
    assert!(rep.refused.unwrap().contains("same-host socket"));
    assert_eq!(tcp_call(Opcode::Ping, &[]).0.opcode, Opcode::Pong);
    // A lane that does not exist is refused by name.
    let mut s = connect(&srv);
    let (_, b) = call(
        &mut s,
        Opcode::ShmValues,
        0,
        &proto::encode_shm_values(5),
        None,
    )
    .unwrap();
    assert!(proto::decode_shm_values_reply(&b)
        .unwrap()
        .refused
        .unwrap()
        .contains("no lane 5"));
    srv.shutdown();
    srv.wait();
}
