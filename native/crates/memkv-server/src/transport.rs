//! The byte stream a connection runs over. The framing, the commands and the store see only this
//! trait, so another transport (RDMA, with a control stream beside it) plugs in without touching
//! them. TCP is the first implementation; `crate::tls` runs TLS over it.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::OwnedFd;
use std::time::Duration;

use crate::limits::Closer;

pub trait Transport: Send {
    /// Reads what has arrived into `buf`, waiting at most `wait` for the first byte: Ok(0) at
    /// end of stream, an error of kind WouldBlock or TimedOut when nothing came in time.
    fn read(&mut self, buf: &mut [u8], wait: Duration) -> io::Result<usize>;
    /// Writes a prefix of `parts`, waiting at most `wait` for room; returns the bytes taken
    /// (errors as for `read`).
    fn write_vectored(&mut self, parts: &[IoSlice<'_>], wait: Duration) -> io::Result<usize>;
    /// The peer, for logs.
    fn peer(&self) -> String;
    /// Something that ends this connection from another thread: its reads and writes fail or
    /// see end of stream soon after.
    fn closer(&self) -> io::Result<Closer>;
    /// Who the peer's verified client certificate says it is (mutual TLS, `crate::tls`); None
    /// on other transports and before the TLS handshake is done.
    fn peer_identity(&self) -> Option<&memkv_tls::PeerIdentity> {
        None
    }
    /// Whether the peer said, in its TLS handshake (`memkv_tls::ALPN_HELLO_TENANT`), that it
    /// reads the tenant a HELLO reply may carry; false on other transports.
    fn reads_hello_tenant(&self) -> bool {
        false
    }
    /// The oldest file descriptor the peer passed with its bytes and nobody took yet; only a
    /// unix socket carries them (`crate::unix_transport`).
    fn take_fd(&mut self) -> Option<OwnedFd> {
        None
    }
    /// Sends `fd` to the peer with the next bytes written; only a unix socket can.
    fn attach_fd(&mut self, _fd: OwnedFd) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "only the same-host socket passes file descriptors",
        ))
    }
}

/// A blocking TCP socket; timeouts are socket options, set only when they change.
pub struct TcpTransport {
    stream: TcpStream,
    read_wait: Option<Duration>,
    write_wait: Option<Duration>,
}

impl TcpTransport {
    pub fn new(stream: TcpStream) -> io::Result<TcpTransport> {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        Ok(TcpTransport {
            stream,
            read_wait: None,
            write_wait: None,
        })
    }
}

impl TcpTransport {
    /// Copies what has arrived into `buf` without taking it off the stream, waiting at most
    /// `wait` for the first byte (errors as for `Transport::read`).
    pub(crate) fn peek(&mut self, buf: &mut [u8], wait: Duration) -> io::Result<usize> {
        self.arm_read(wait)?;
        self.stream.peek(buf)
    }

    fn arm_read(&mut self, wait: Duration) -> io::Result<()> {
        let wait = nonzero(wait);
        if self.read_wait != Some(wait) {
            self.stream.set_read_timeout(Some(wait))?;
            self.read_wait = Some(wait);
        }
        Ok(())
    }
}

/// A zero timeout means "block forever" to the socket API; the smallest real one stands in.
fn nonzero(d: Duration) -> Duration {
    d.max(Duration::from_millis(1))
}

impl Transport for TcpTransport {
    fn read(&mut self, buf: &mut [u8], wait: Duration) -> io::Result<usize> {
        self.arm_read(wait)?;
        self.stream.read(buf)
    }

    fn write_vectored(&mut self, parts: &[IoSlice<'_>], wait: Duration) -> io::Result<usize> {
        let wait = nonzero(wait);
        if self.write_wait != Some(wait) {
            self.stream.set_write_timeout(Some(wait))?;
            self.write_wait = Some(wait);
        }
        self.stream.write_vectored(parts)
    }

    fn peer(&self) -> String {
        self.stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_default()
    }

    fn closer(&self) -> io::Result<Closer> {
        let s = self.stream.try_clone()?;
        Ok(Box::new(move || {
            let _ = s.shutdown(Shutdown::Both);
        }))
    }
}
