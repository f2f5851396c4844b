//! A hand-made RDMA client against a live server on loopback (libfabric tcp), for the tests of
//! hostile and broken RDMA requests: each gets a per-key status or an error frame, touches no
//! memory it was not given, and leaves the server serving.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use memkv_fabric::{Endpoint, Fabric, Mr};
use memkv_proto::{self as proto, Descriptor, Header, Opcode, Status, FLAG_RDMA, HEADER_LEN};

use crate::rdma::RdmaConfig;
use crate::{Server, ServerConfig};

pub(super) fn server() -> Server {
    server_with(Duration::from_secs(5))
}

fn server_with(frame_timeout: Duration) -> Server {
    Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory: 32 << 20,
        lanes: 1,
        frame_timeout,
        rdma: Some(RdmaConfig {
            provider: Some("tcp".into()),
            domains: vec!["lo".into()],
            ..RdmaConfig::default()
        }),
        ..ServerConfig::default()
    })
    .unwrap()
}

/// A client endpoint whose memory the server reads and writes, progressed by a thread.
pub(super) struct Peer {
    pub(super) name: Vec<u8>,
    pub(super) provider: String,
    pub(super) mem: Vec<u8>,
    mr: Mr,
    stop: Arc<AtomicBool>,
    t: Option<std::thread::JoinHandle<()>>,
}

impl Peer {
    /// A client endpoint over `len` registered bytes, driven by its own thread. (A client
    /// that stops driving its endpoint is tested from Python with a stopped process: an
    /// endpoint in this process that nobody drives was sometimes served by the provider's
    /// own threads anyway.)
    pub(super) fn new(len: usize) -> Peer {
        let fab = Fabric::open(Some("tcp"), &["lo".to_string()]).unwrap();
        let mut ep = Endpoint::open(&fab).unwrap();
        let name = ep.name().unwrap();
        let mem = vec![0xEEu8; len];
        // SAFETY: `mem` lives in the Peer, which drops the registration first.
        let mr = unsafe { fab.register(mem.as_ptr() as usize, len, true) }.unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let t = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let _ = ep.progress();
                ep.wait(Duration::from_millis(2));
            }
        });
        Peer {
            name,
            provider: fab.hello_name.clone(),
            mem,
            mr,
            stop,
            t: Some(t),
        }
    }

    pub(super) fn desc(&self, off: usize, len: usize) -> Descriptor {
        Descriptor {
            len: len as u64,
            addr: self.mr.remote_addr(self.mem.as_ptr() as usize + off),
            rkey: self.mr.key,
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.t.take().unwrap().join().unwrap();
    }
}

pub(super) fn call(
    s: &mut TcpStream,
    op: Opcode,
    flags: u32,
    body: &[u8],
) -> Option<(Header, Vec<u8>)> {
    let mut h = Header::new(op, 1, body.len(), 0);
    h.flags = flags;
    s.write_all(&h.encode()).ok()?;
    s.write_all(body).ok()?;
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb).ok()?;
    let h = Header::decode(&hb).unwrap();
    let mut b = vec![0u8; h.body_len as usize];
    s.read_exact(&mut b).ok()?;
    Some((h, b))
}

/// A connection that said HELLO and had its RDMA_HELLO (with `addr`) answered.
pub(super) fn connect(srv: &Server, provider: &str, addr: &[u8]) -> (TcpStream, bool, String) {
    let mut s = TcpStream::connect(srv.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    call(&mut s, Opcode::Hello, 0, &[]).unwrap();
    let (h, b) = call(
        &mut s,
        Opcode::RdmaHello,
        0,
        &proto::encode_rdma_hello(provider, addr),
    )
    .unwrap();
    assert_eq!(h.opcode, Opcode::RdmaHelloReply);
    let (ok, why) = proto::decode_rdma_hello_reply(&b).unwrap();
    (s, ok, why)
}

pub(super) fn put(s: &mut TcpStream, key: &[u8], d: Descriptor) -> Option<Status> {
    let body = proto::encode_descriptors(&[key], &[d]);
    let (_, b) = call(s, Opcode::Put, FLAG_RDMA, &body)?;
    Some(proto::decode_statuses(&b, 1).unwrap()[0])
}

pub(super) fn get(s: &mut TcpStream, key: &[u8], d: Descriptor) -> Option<Status> {
    let body = proto::encode_descriptors(&[key], &[d]);
    let (_, b) = call(s, Opcode::Get, FLAG_RDMA, &body)?;
    Some(proto::decode_status_lens(&b, 1).unwrap()[0].0)
}

/// The server closed the connection (after its last reply).
pub(super) fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}
