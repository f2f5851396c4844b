//! The shared-memory transport, for a server on this host: the protocol runs over the server's
//! unix socket (an abstract name derived from its TCP address, `memkv_proto::shm_socket_name`,
//! or one configured), and values whose buffers lie in registered memfd or /dev/shm regions
//! (`crate::shm_regions`) move by the server's own copies between its memory and those regions:
//! each region's descriptor is passed once per connection (SHM_REGION, SCM_RIGHTS) and a
//! transfer names (region, offset, length) per key. Buffers outside such regions go over the
//! same socket as on TCP. The client never maps the server's memory.
//!
//! A request that ends without its reply cannot take the server's mapping back (unlike an RDMA
//! registration): a server stopped in the middle of a GET's copy and resumed after the
//! client's deadline may finish the one piece (1 MiB) it was copying; it checks its deadline
//! before every piece and after a PUT's copies, which then commits nothing.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice, Read, Write};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::sync::Arc;
use std::time::Instant;

use memkv_proto::{self as proto, Descriptor, Opcode, ShmRegion};

use crate::buf::Buf;
use crate::shm_regions::Regions;
use crate::transport::{
    deadline_passed, timeout_as_deadline, Described, Link, OneSided, Setup, StreamLink, Transport,
};

/// Opens links over servers' unix sockets.
pub struct Shm {
    regions: Arc<Regions>,
    /// The socket to use for every server (`@name` abstract, else a path); None: the name
    /// derived from each server's address.
    socket: Option<String>,
}

impl Shm {
    pub fn new(regions: Arc<Regions>, socket: Option<String>) -> Shm {
        Shm { regions, socket }
    }

    /// Whether a server at `addr` may serve the same-host path: an address of it is on this
    /// host, or the socket is named (`MEMKV_SHM_SOCKET`).
    pub fn serves(&self, addr: &str) -> bool {
        self.candidates(addr).is_ok_and(|c| !c.is_empty())
    }

    /// The unix addresses a server at `addr` may serve its same-host path on: none when no
    /// address of it is on this host.
    fn candidates(&self, addr: &str) -> io::Result<Vec<UnixAddr>> {
        if let Some(s) = &self.socket {
            return Ok(vec![unix_addr(s)?]);
        }
        let mut out = Vec::new();
        for sa in addr.to_socket_addrs()? {
            if !on_this_host(sa.ip()) {
                continue;
            }
            let any: IpAddr = if sa.is_ipv4() {
                [0u8; 4].into()
            } else {
                [0u16; 8].into()
            };
            for listen in [sa, SocketAddr::new(any, sa.port())] {
                out.push(UnixAddr::from_abstract_name(
                    proto::shm_socket_name(listen).as_bytes(),
                )?);
            }
        }
        Ok(out)
    }
}

/// `@name` as an abstract address, anything else as a path.
fn unix_addr(s: &str) -> io::Result<UnixAddr> {
    match s.strip_prefix('@') {
        Some(name) => UnixAddr::from_abstract_name(name.as_bytes()),
        None => UnixAddr::from_pathname(s),
    }
}

/// Loopback, or an address of one of this host's interfaces (binding to it succeeds).
fn on_this_host(ip: IpAddr) -> bool {
    ip.is_loopback() || UdpSocket::bind((ip, 0)).is_ok()
}

impl Transport for Shm {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn connect(&self, addr: &str, deadline: Instant) -> io::Result<Box<dyn Link>> {
        let mut last = io::Error::new(
            io::ErrorKind::NotFound,
            format!("{addr}: not on this host, so no same-host socket"),
        );
        for ua in self.candidates(addr)? {
            if Instant::now() >= deadline {
                return Err(deadline_passed());
            }
            match UnixStream::connect_addr(&ua) {
                Ok(stream) => {
                    return Ok(Box::new(ShmLink {
                        stream: StreamLink::new(stream, deadline),
                        side: Some(ShmSide {
                            regions: self.regions.clone(),
                            mapped: HashMap::new(),
                        }),
                        fds: Vec::new(),
                        received: VecDeque::new(),
                    }))
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

/// A server's answer to one of our regions, on one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mapped {
    Yes,
    /// Refused (a bound, a file it does not map): transfers naming it go over the stream.
    Refused,
}

/// Tags of setups that forget a region (the id is in the low bits).
const FORGET: u64 = 1 << 32;

/// The one-sided half of a shared-memory link: which regions this connection's server has.
pub struct ShmSide {
    regions: Arc<Regions>,
    mapped: HashMap<u32, Mapped>,
}

impl OneSided for ShmSide {
    fn transport(&self) -> &'static str {
        "shm"
    }

    fn medium(&self) -> &'static str {
        "shared memory"
    }

    fn strict(&self) -> bool {
        true
    }

    fn flag(&self) -> u32 {
        proto::FLAG_SHM
    }

    /// None: reaching the server's unix socket is the handshake.
    fn hello(&mut self) -> io::Result<Option<Setup>> {
        Ok(None)
    }

    /// SHM_REGION for every region of `bufs` this server has not answered for yet, and a
    /// forget for every region it maps that is no longer registered.
    fn setups(&mut self, bufs: &[Buf]) -> Vec<Setup> {
        let mut out: Vec<Setup> = self
            .mapped
            .iter()
            .filter(|(id, m)| **m == Mapped::Yes && !self.regions.holds(**id))
            .map(|(id, _)| Setup {
                op: Opcode::ShmRegion,
                body: proto::encode_shm_region(&ShmRegion {
                    id: *id,
                    len: 0,
                    file_offset: 0,
                }),
                fd: None,
                tag: FORGET | u64::from(*id),
            })
            .collect();
        for b in bufs.iter().filter(|b| b.len > 0) {
            let Some(r) = self.regions.find(b.ptr, b.len) else {
                continue;
            };
            if self.mapped.contains_key(&r.id) || out.iter().any(|s| s.tag == u64::from(r.id)) {
                continue;
            }
            out.push(Setup {
                op: Opcode::ShmRegion,
                body: proto::encode_shm_region(&ShmRegion {
                    id: r.id,
                    len: r.len as u64,
                    file_offset: r.file_offset,
                }),
                fd: Some(r.fd.clone()),
                tag: u64::from(r.id),
            });
        }
        out
    }

    fn answered(&mut self, tag: u64, accepted: bool, why: &str) {
        let id = tag as u32;
        if tag & FORGET != 0 {
            self.mapped.remove(&id);
        } else if accepted {
            self.mapped.insert(id, Mapped::Yes);
        } else {
            tracing::info!(region = id, reason = %why,
                "memkv transport 'shm': the server refused a region; its values go over the socket");
            self.mapped.insert(id, Mapped::Refused);
        }
    }

    fn describe(&mut self, bufs: &[Buf]) -> io::Result<Option<Described>> {
        let mut descs = Vec::with_capacity(bufs.len());
        let mut held = Vec::with_capacity(bufs.len());
        for b in bufs {
            if b.len == 0 {
                descs.push(Descriptor {
                    len: 0,
                    addr: 0,
                    rkey: 0,
                });
                continue;
            }
            let Some(r) = self
                .regions
                .find(b.ptr, b.len)
                .filter(|r| self.mapped.get(&r.id) == Some(&Mapped::Yes))
            else {
                return Ok(None);
            };
            descs.push(Descriptor {
                len: b.len as u64,
                addr: (b.ptr - r.ptr) as u64,
                rkey: u64::from(r.id),
            });
            held.push(r);
        }
        // Only empty values: nothing to copy, and a connection that never needed a region has
        // told the server of none (it refuses a shared-memory transfer before SHM_REGION).
        if held.is_empty() {
            return Ok(None);
        }
        Ok(Some(Described {
            descs,
            held: Box::new(held),
        }))
    }

    /// Nothing to take back: the server's copies of a request end with it (see the module
    /// documentation), and the connection is dropped after a request without its reply.
    fn revoke(&mut self, _bufs: &[Buf]) {}
}

/// A link over a server's unix socket.
pub struct ShmLink {
    stream: StreamLink<UnixStream>,
    side: Option<ShmSide>,
    /// Descriptors to send with the next bytes written.
    fds: Vec<Arc<OwnedFd>>,
    /// Descriptors the server passed (SHM_VALUES replies), at most `MAX_RECEIVED_FDS`.
    received: VecDeque<OwnedFd>,
}

/// Received descriptors held untaken at most (one SHM_VALUES reply carries one); more are
/// closed, so a misbehaving server cannot make the client hold descriptors.
const MAX_RECEIVED_FDS: usize = 2;

impl ShmLink {
    /// sendmsg of `bufs` with the pending descriptors (SCM_RIGHTS).
    fn send_with_fds(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let fds: Vec<libc::c_int> = self.fds.iter().map(|f| f.as_raw_fd()).collect();
        let sock = self.stream.stream().as_raw_fd();
        let n = proto::fd_passing::send_with_fds(sock, bufs, &fds)?;
        // Sent with the first byte; the descriptors are the server's now.
        self.fds.clear();
        Ok(n)
    }

    /// recvmsg into `buf`, keeping the descriptors that came with the bytes.
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let sock = self.stream.stream().as_raw_fd();
        proto::fd_passing::recv_with_fds(sock, buf, MAX_RECEIVED_FDS, &mut self.received)
    }
}

impl Read for ShmLink {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.arm(true)?;
        timeout_as_deadline(self.recv(buf))
    }
}

impl Write for ShmLink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        if self.fds.is_empty() {
            return self.stream.write_vectored(bufs);
        }
        self.stream.arm(false)?;
        timeout_as_deadline(self.send_with_fds(bufs))
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Link for ShmLink {
    fn set_deadline(&mut self, deadline: Instant) {
        self.stream.set_deadline(deadline);
    }

    fn one_sided(&mut self) -> Option<&mut dyn OneSided> {
        match &mut self.side {
            Some(s) => Some(s),
            None => None,
        }
    }

    fn drop_one_sided(&mut self) {
        self.side = None;
    }

    fn pass_fd(&mut self, fd: Arc<OwnedFd>) -> io::Result<()> {
        self.fds.push(fd);
        Ok(())
    }

    fn take_fd(&mut self) -> Option<OwnedFd> {
        self.received.pop_front()
    }
}

/// `auto` for servers on this host: their same-host socket when one answers, else `other`.
pub struct SameHostFirst {
    pub shm: Arc<Shm>,
    pub other: Arc<dyn Transport>,
}

impl Transport for SameHostFirst {
    fn name(&self) -> &'static str {
        "auto"
    }

    fn connect(&self, addr: &str, deadline: Instant) -> io::Result<Box<dyn Link>> {
        match self.shm.connect(addr, deadline) {
            Ok(l) => Ok(l),
            Err(e) => {
                tracing::debug!(server = %addr, reason = %e,
                    "memkv transport 'auto': no same-host socket; using {}", self.other.name());
                self.other.connect(addr, deadline)
            }
        }
    }
}
