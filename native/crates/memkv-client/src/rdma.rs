//! The RDMA transport: the TCP link stays the control path (handshake, key tables, statuses)
//! and the server moves the values itself with one-sided reads (PUT) and writes (GET) of the
//! caller's memory, registered here once per buffer (`MrCache`) and named in the request by
//! descriptors (address, length, key).
//!
//! Why a late remote write into memory the caller reused is impossible: the server replies to
//! a GET only after its writes completed in our memory (delivery-complete) and never touches
//! that memory for the request afterwards; and when a request ends without its reply (deadline,
//! broken link), `RdmaSide::revoke` closes the registrations of every buffer of the request and
//! the link's endpoint is closed before the call returns, so no operation still in flight can
//! reach the memory under those keys. The same holds for a PUT's late reads, which could
//! otherwise store bytes the caller changed after the call returned.

use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use memkv_fabric::{Endpoint, Fabric, Mr, MrCache};
use memkv_proto::{self as proto, Descriptor, Opcode};

use crate::buf::Buf;
use crate::transport::{
    deadline_passed, Described, Link, OneSided, Setup, Tcp, TcpLink, Transport,
};

/// Registrations the client keeps at most (least recently used dropped first).
const MR_CACHE_ENTRIES: usize = 4096;

/// Longest the client waits on its sockets between two progress calls of its endpoint.
const PROGRESS_EVERY: Duration = Duration::from_millis(20);

/// Opens TCP control links, each with an RDMA endpoint beside it.
pub struct Rdma {
    /// Opens the control links (under TLS when the client has TLS settings).
    control: Tcp,
    fab: Arc<Fabric>,
    cache: Arc<MrCache>,
    /// True for `rdma` (a server that refuses RDMA fails the connection), false for `auto`
    /// (such a connection carries values over TCP).
    strict: bool,
}

impl Rdma {
    /// Loads libfabric and opens `provider`'s domain (the first in `devices` when not empty);
    /// with `gpu_memory`, one that also registers GPU memory where the provider has one.
    pub fn open(
        provider: Option<&str>,
        devices: &[String],
        strict: bool,
        gpu_memory: bool,
    ) -> Result<Rdma, String> {
        let fab = Fabric::open_for(provider, devices, gpu_memory).map_err(|e| e.to_string())?;
        Ok(Rdma {
            control: Tcp::plain(),
            cache: Arc::new(MrCache::new(fab.clone(), MR_CACHE_ENTRIES)),
            fab,
            strict,
        })
    }

    /// Opens the control links with `control` (TLS, when the client has it).
    pub fn control_over(mut self, control: Tcp) -> Rdma {
        self.control = control;
        self
    }

    pub fn provider(&self) -> &str {
        &self.fab.provider
    }

    pub fn domain(&self) -> &str {
        &self.fab.domain_name
    }

    pub fn cache(&self) -> &Arc<MrCache> {
        &self.cache
    }

    /// Ok (how) when transfers may use GPU memory, else why not.
    pub fn gpu_memory(&self) -> Result<&str, &str> {
        self.fab.device_memory()
    }
}

impl Transport for Rdma {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn connect(&self, addr: &str, deadline: Instant) -> io::Result<Box<dyn Link>> {
        let tcp = self.control.connect_tcp(addr, deadline)?;
        let ep = Endpoint::open(&self.fab).map_err(io::Error::other)?;
        Ok(Box::new(RdmaLink {
            tcp,
            side: Some(RdmaSide {
                ep,
                cache: self.cache.clone(),
                strict: self.strict,
            }),
        }))
    }
}

/// The RDMA half of a link.
pub struct RdmaSide {
    ep: Endpoint,
    cache: Arc<MrCache>,
    strict: bool,
}

impl RdmaSide {
    /// Registers (or finds) each buffer and describes it for the server. The returned
    /// registrations must be held until the request ended.
    fn describe_all(&self, bufs: &[Buf]) -> io::Result<(Vec<Descriptor>, Vec<Arc<Mr>>)> {
        let mut descs = Vec::with_capacity(bufs.len());
        let mut held = Vec::with_capacity(bufs.len());
        for b in bufs {
            if b.len == 0 {
                // Nothing to move: no registration (an empty buffer may have no real address).
                descs.push(Descriptor {
                    len: 0,
                    addr: 0,
                    rkey: 0,
                });
                continue;
            }
            // SAFETY: the caller keeps every buffer valid until the operation returns, and a
            // registration outliving it is only a key nobody is sent again; a buffer freed
            // and remapped is the documented caveat of the cache (docs/rdma.md).
            let mr = unsafe { self.cache.get(b.ptr, b.len) }.map_err(io::Error::other)?;
            descs.push(Descriptor {
                len: b.len as u64,
                addr: mr.remote_addr(b.ptr),
                rkey: mr.key,
            });
            held.push(mr);
        }
        Ok((descs, held))
    }
}

impl OneSided for RdmaSide {
    fn transport(&self) -> &'static str {
        "rdma"
    }

    fn medium(&self) -> &'static str {
        "RDMA"
    }

    fn strict(&self) -> bool {
        self.strict
    }

    fn flag(&self) -> u32 {
        proto::FLAG_RDMA
    }

    /// RDMA_HELLO: the provider as the server must match it (`Fabric::hello_name`) and this
    /// link's endpoint address.
    fn hello(&mut self) -> io::Result<Option<Setup>> {
        let name = self.ep.name().map_err(io::Error::other)?;
        Ok(Some(Setup {
            op: Opcode::RdmaHello,
            body: proto::encode_rdma_hello(&self.ep.fabric().hello_name, &name),
            fd: None,
            tag: 0,
        }))
    }

    fn describe(&mut self, bufs: &[Buf]) -> io::Result<Option<Described>> {
        let (descs, held) = self.describe_all(bufs)?;
        Ok(Some(Described {
            descs,
            held: Box::new(held),
        }))
    }

    /// Closes the registrations of `bufs` and this endpoint: after a request ended without its
    /// reply, no remote operation of it can touch the buffers any more.
    fn revoke(&mut self, bufs: &[Buf]) {
        for b in bufs {
            self.cache.invalidate(b.ptr, b.len);
        }
        self.ep.close();
    }
}

/// A TCP control link (plain or TLS) that drives its endpoint's progress while it waits for a reply (software
/// providers move the server's reads and writes of our memory inside those calls).
pub struct RdmaLink {
    tcp: TcpLink,
    side: Option<RdmaSide>,
}

impl RdmaLink {
    /// Waits until the socket has bytes, progressing the endpoint meanwhile.
    fn await_readable(&mut self) -> io::Result<()> {
        let Some(side) = self.side.as_mut() else {
            return Ok(());
        };
        if self.tcp.buffered() {
            return Ok(()); // TLS has the reply's bytes already; the socket may have none left
        }
        let fd = self.tcp.stream().as_raw_fd();
        loop {
            side.ep.progress().map_err(io::Error::other)?;
            let now = Instant::now();
            if now >= self.tcp.deadline() {
                return Err(deadline_passed());
            }
            let mut fds = [
                libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: side.ep.wait_fd().unwrap_or(-1),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // Block only when the provider says no work can be missed; else just look.
            let wait = if side.ep.may_block() {
                (self.tcp.deadline() - now).min(PROGRESS_EVERY)
            } else {
                Duration::ZERO
            };
            // SAFETY: two pollfds (a negative fd is ignored by poll) for the call's duration.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, wait.as_millis() as libc::c_int) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            } else if fds[0].revents != 0 {
                return Ok(());
            } else if wait.is_zero() {
                std::thread::yield_now();
            }
        }
    }
}

impl Read for RdmaLink {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.await_readable()?;
        self.tcp.read(buf)
    }
}

impl Write for RdmaLink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tcp.write(buf)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.tcp.write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Link for RdmaLink {
    fn set_deadline(&mut self, deadline: Instant) {
        self.tcp.set_deadline(deadline);
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
}
