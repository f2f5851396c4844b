//! The byte streams the client speaks its protocol over, and the seam for one-sided transfers.
//! `Conn` frames requests on any `Link`; a transport only opens links. TCP is one, plain or under
//! TLS (`crate::tls`): every TCP link, RDMA's control link included, is a `TcpLink` opened by
//! `Tcp`, so TLS covers them all in one place. A link may
//! also have a `OneSided` side, through which the server itself reads (PUT) and writes (GET) the
//! caller's memory, named by descriptors in the request, instead of the values travelling over
//! the stream: RDMA (`crate::rdma`) is one.

use std::any::Any;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use memkv_proto::{Descriptor, Opcode};
use memkv_tls::ClientTls;

use crate::buf::Buf;
use crate::tls::TlsLink;

/// A connected, ordered byte stream to one server whose reads and writes all fail with
/// `ErrorKind::TimedOut` once the deadline set by `set_deadline` has passed, however the peer
/// trickles its bytes: the deadline bounds the whole operation, not each system call.
pub trait Link: Read + Write + Send {
    fn set_deadline(&mut self, deadline: Instant);
    /// The one-sided half of the link, when it has one.
    fn one_sided(&mut self) -> Option<&mut dyn OneSided> {
        None
    }
    /// Gives the one-sided half up: values go over the stream (a server that refused it).
    fn drop_one_sided(&mut self) {}
    /// Sends `fd` with the next bytes written (SCM_RIGHTS); only links over a unix socket can.
    fn pass_fd(&mut self, _fd: Arc<OwnedFd>) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this link cannot pass file descriptors",
        ))
    }
    /// The oldest descriptor the server passed with its bytes and nobody took yet; only a
    /// unix socket carries them.
    fn take_fd(&mut self) -> Option<OwnedFd> {
        None
    }
}

/// A request a one-sided side needs answered before it can go on: its hello when the
/// connection opens, or, before a transfer, an announcement of memory the server is to reach.
/// Every such reply is `accepted u8, reason` (the RDMA_HELLO reply's form).
pub struct Setup {
    pub op: Opcode,
    pub body: Vec<u8>,
    /// Sent with the request (`Link::pass_fd`).
    pub fd: Option<Arc<OwnedFd>>,
    /// Handed back to `OneSided::answered` with the server's answer.
    pub tag: u64,
}

/// The descriptors of a transfer's buffers, and what must be held until the request ended
/// (registrations, mappings).
pub struct Described {
    pub descs: Vec<Descriptor>,
    pub held: Box<dyn Any + Send>,
}

/// Server-driven transfers of caller memory. The server moves every value before it replies;
/// after the reply it never touches the memory for that request.
pub trait OneSided: Send {
    /// The transport's name in messages ("rdma").
    fn transport(&self) -> &'static str;
    /// What the server moves values by, in messages ("RDMA").
    fn medium(&self) -> &'static str;
    /// True when a server refusing the hello fails the connection; false when values then go
    /// over the stream.
    fn strict(&self) -> bool;
    /// The header flag of a PUT or GET whose body carries this side's descriptors.
    fn flag(&self) -> u32;
    /// The request that sets this side up on a new connection, if it needs one.
    fn hello(&mut self) -> io::Result<Option<Setup>>;
    /// Requests to answer before a transfer of `bufs` (none by default).
    fn setups(&mut self, _bufs: &[Buf]) -> Vec<Setup> {
        Vec::new()
    }
    /// The server's answer to the setup tagged `tag` (not the hello's).
    fn answered(&mut self, _tag: u64, _accepted: bool, _why: &str) {}
    /// Describes `bufs` for the server; None when one of them is memory this side cannot name
    /// (that transfer goes over the stream).
    fn describe(&mut self, bufs: &[Buf]) -> io::Result<Option<Described>>;
    /// Called when a request of `bufs` ended without its reply: afterwards no remote operation
    /// of it may touch the buffers.
    fn revoke(&mut self, bufs: &[Buf]);
}

/// Opens links to servers.
pub trait Transport: Send + Sync {
    /// Short name for logs ("tcp").
    fn name(&self) -> &'static str;
    /// Connects to `addr` (a canonical `host:port`), giving up at `deadline`.
    fn connect(&self, addr: &str, deadline: Instant) -> io::Result<Box<dyn Link>>;
}

/// An error meaning "the operation's deadline passed".
pub fn deadline_passed() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "operation deadline passed")
}

/// Time left until `deadline`, or the deadline error when none is.
pub(crate) fn left(deadline: Instant, now: Instant) -> io::Result<Duration> {
    deadline
        .checked_duration_since(now)
        .filter(|d| !d.is_zero())
        .ok_or_else(deadline_passed)
}

/// TCP with `TCP_NODELAY`, under TLS when it has the client's TLS settings.
#[derive(Clone, Default)]
pub struct Tcp {
    tls: Option<Arc<ClientTls>>,
}

impl Transport for Tcp {
    fn name(&self) -> &'static str {
        if self.tls.is_some() {
            "tcp+tls"
        } else {
            "tcp"
        }
    }

    fn connect(&self, addr: &str, deadline: Instant) -> io::Result<Box<dyn Link>> {
        Ok(Box::new(self.connect_tcp(addr, deadline)?))
    }
}

impl Tcp {
    /// Plaintext TCP.
    pub fn plain() -> Tcp {
        Tcp { tls: None }
    }

    /// TCP under TLS with `tls`.
    pub fn tls(tls: Arc<ClientTls>) -> Tcp {
        Tcp { tls: Some(tls) }
    }

    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    pub(crate) fn connect_tcp(&self, addr: &str, deadline: Instant) -> io::Result<TcpLink> {
        let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{addr}: no address"));
        for sa in addr.to_socket_addrs()? {
            match TcpStream::connect_timeout(&sa, left(deadline, Instant::now())?) {
                Ok(stream) => {
                    stream.set_nodelay(true)?;
                    let link = StreamLink::new(stream, deadline);
                    return Ok(match &self.tls {
                        None => TcpLink::Plain(link),
                        Some(tls) => TcpLink::Tls(Box::new(TlsLink::handshake(tls, addr, link)?)),
                    });
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

/// A TCP link, plain or under TLS.
pub(crate) enum TcpLink {
    Plain(StreamLink<TcpStream>),
    Tls(Box<TlsLink>),
}

impl TcpLink {
    pub(crate) fn stream(&self) -> &TcpStream {
        match self {
            TcpLink::Plain(l) => l.stream(),
            TcpLink::Tls(l) => l.stream(),
        }
    }

    pub(crate) fn deadline(&self) -> Instant {
        match self {
            TcpLink::Plain(l) => l.deadline(),
            TcpLink::Tls(l) => l.deadline(),
        }
    }

    /// Whether a read would find bytes that are no longer in the socket (TLS holds them).
    pub(crate) fn buffered(&mut self) -> bool {
        match self {
            TcpLink::Plain(_) => false,
            TcpLink::Tls(l) => l.buffered(),
        }
    }

    fn inner(&mut self) -> &mut dyn Link {
        match self {
            TcpLink::Plain(l) => l,
            TcpLink::Tls(l) => &mut **l,
        }
    }
}

impl Read for TcpLink {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner().read(buf)
    }
}

impl Write for TcpLink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner().write(buf)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.inner().write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner().flush()
    }
}

impl Link for TcpLink {
    fn set_deadline(&mut self, deadline: Instant) {
        self.inner().set_deadline(deadline);
    }
}

/// A socket timeout set this long ago or less is reused for the next call: the deadline then
/// overshoots by at most this much, and a bulk transfer makes no extra system call per read.
const REARM_AFTER: Duration = Duration::from_millis(5);

/// A socket whose timeouts bound each blocking call: TCP, or a unix socket (`crate::shm`).
pub(crate) trait TimedStream: Read + Write + Send + std::os::fd::AsRawFd {
    fn set_timeouts(&self, read: bool, t: Duration) -> io::Result<()>;
}

impl TimedStream for TcpStream {
    fn set_timeouts(&self, read: bool, t: Duration) -> io::Result<()> {
        if read {
            self.set_read_timeout(Some(t))
        } else {
            self.set_write_timeout(Some(t))
        }
    }
}

impl TimedStream for std::os::unix::net::UnixStream {
    fn set_timeouts(&self, read: bool, t: Duration) -> io::Result<()> {
        if read {
            self.set_read_timeout(Some(t))
        } else {
            self.set_write_timeout(Some(t))
        }
    }
}

/// A stream link: the socket and the deadline its calls are bounded by.
pub(crate) struct StreamLink<S: TimedStream> {
    stream: S,
    deadline: Instant,
    /// When the read / write socket timeout was last set to the time left.
    read_armed: Option<Instant>,
    write_armed: Option<Instant>,
}

impl StreamLink<TcpStream> {
    /// Copies what has arrived into `buf` without taking it, waiting until the deadline.
    pub(crate) fn peek(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm(true)?;
        timeout_as_deadline(self.stream.peek(buf))
    }
}

impl<S: TimedStream> StreamLink<S> {
    pub(crate) fn new(stream: S, deadline: Instant) -> StreamLink<S> {
        StreamLink {
            stream,
            deadline,
            read_armed: None,
            write_armed: None,
        }
    }

    pub(crate) fn stream(&self) -> &S {
        &self.stream
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Makes the next blocking call on the socket return by the deadline (plus `REARM_AFTER`).
    pub(crate) fn arm(&mut self, read: bool) -> io::Result<()> {
        let now = Instant::now();
        let rest = left(self.deadline, now)?;
        let armed = if read {
            &mut self.read_armed
        } else {
            &mut self.write_armed
        };
        if armed.is_none_or(|t| now.duration_since(t) > REARM_AFTER) {
            self.stream.set_timeouts(read, rest)?;
            *armed = Some(now);
        }
        Ok(())
    }
}

/// A socket timeout surfaces as WouldBlock (Linux) or TimedOut; both mean the deadline passed.
pub(crate) fn timeout_as_deadline<T>(r: io::Result<T>) -> io::Result<T> {
    r.map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => deadline_passed(),
        _ => e,
    })
}

impl<S: TimedStream> Read for StreamLink<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm(true)?;
        timeout_as_deadline(self.stream.read(buf))
    }
}

impl<S: TimedStream> Write for StreamLink<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm(false)?;
        timeout_as_deadline(self.stream.write(buf))
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.arm(false)?;
        timeout_as_deadline(self.stream.write_vectored(bufs))
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<S: TimedStream> Link for StreamLink<S> {
    fn set_deadline(&mut self, deadline: Instant) {
        self.deadline = deadline;
        self.read_armed = None;
        self.write_armed = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A peer that sends one byte every 50 ms: a read of 1 KiB must give up at the deadline, not
    /// after 1,024 x 50 ms.
    #[test]
    fn a_trickling_peer_cannot_stretch_the_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let peer = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            for _ in 0..40 {
                if s.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let t = Instant::now();
        let mut link = Tcp::plain()
            .connect(&addr, t + Duration::from_millis(400))
            .unwrap();
        let mut buf = [0u8; 1024];
        let err = link.read_exact(&mut buf).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(400) && took < Duration::from_millis(700),
            "{took:?}"
        );
        drop(link);
        peer.join().unwrap();
    }
}
