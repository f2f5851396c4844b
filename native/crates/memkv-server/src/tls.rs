//! The byte stream of a TCP connection under TLS 1.3 (`--tls-cert`): rustls over the blocking
//! socket of `TcpTransport`, with the same waits. The handshake runs inside the first reads, on
//! the connection's own thread, so it is bounded like any handshake frame: by the handshake
//! timeout, and by the connection slots that give way to new connections before authentication
//! (`limits::ConnLimits`).
//!
//! A peer whose first byte is not a TLS record is a plaintext memkv client: it gets a memkv
//! error frame saying the server wants TLS (which it can read, unlike an alert), and the
//! connection closes.

use std::io::{self, IoSlice, Read, Write};
use std::time::{Duration, Instant};

use memkv_proto::{self as proto, ErrorCode, Opcode, HEADER_LEN};
use memkv_tls::rustls::ServerConnection;
use memkv_tls::{PeerIdentity, ReadAhead, TlsError};

use crate::limits::Closer;
use crate::transport::{TcpTransport, Transport};

/// What a plaintext client is told.
pub const PLAINTEXT_REFUSED: &str = "this server requires TLS: configure the client's tls \
     section (MEMKV_TLS_CA, the CA that signed the server's certificate)";

/// A connection ended by TLS itself (a failed handshake, a bad record, a plaintext peer): the
/// connection counts it as a `tls` error.
fn failure(msg: String) -> io::Error {
    TlsError::io(msg)
}

pub struct TlsTransport {
    tcp: TcpTransport,
    tls: ServerConnection,
    /// Used from the end of the handshake on (a peer that never finishes it costs no buffer).
    ahead: ReadAhead,
    /// The first byte was seen to open a TLS record.
    checked: bool,
    identity: Option<PeerIdentity>,
    /// The client offered `memkv_tls::ALPN_HELLO_TENANT` (known from the end of the handshake).
    reads_hello_tenant: bool,
}

/// The socket as `Write` for rustls, each call waiting at most `wait`.
struct Timed<'a> {
    tcp: &'a mut TcpTransport,
    wait: Duration,
}

impl Write for Timed<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tcp.write_vectored(&[IoSlice::new(buf)], self.wait)
    }

    fn write_vectored(&mut self, parts: &[IoSlice<'_>]) -> io::Result<usize> {
        self.tcp.write_vectored(parts, self.wait)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The socket as `Read` for rustls's records, through the read-ahead buffer once the handshake
/// is done.
struct Records<'a> {
    tcp: &'a mut TcpTransport,
    ahead: &'a mut ReadAhead,
    wait: Duration,
    handshaking: bool,
}

impl Read for Records<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.handshaking && !self.ahead.pending() {
            return self.tcp.read(buf, self.wait);
        }
        let (tcp, wait) = (&mut *self.tcp, self.wait);
        self.ahead.read(buf, |b| tcp.read(b, wait))
    }
}

/// Time left until `until`, at least a millisecond (one more look at the socket).
fn left(until: Instant) -> Duration {
    until
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

impl TlsTransport {
    pub fn new(tcp: TcpTransport, tls: ServerConnection) -> TlsTransport {
        TlsTransport {
            tcp,
            tls,
            ahead: ReadAhead::default(),
            checked: false,
            identity: None,
            reads_hello_tenant: false,
        }
    }

    /// Sends the TLS records rustls has queued, until `until`; an error of kind WouldBlock or
    /// TimedOut when they did not all go out by then.
    fn flush_until(&mut self, until: Instant) -> io::Result<()> {
        while self.tls.wants_write() {
            let wait = left(until);
            self.tls.write_tls(&mut Timed {
                tcp: &mut self.tcp,
                wait,
            })?;
        }
        Ok(())
    }

    /// Looks at the first byte; a plaintext peer is answered with a memkv error frame.
    fn check_first_byte(&mut self, wait: Duration) -> io::Result<()> {
        let mut first = [0u8; 1];
        if self.tcp.peek(&mut first, wait)? == 0 {
            return Ok(()); // end of stream: the read after this sees it
        }
        if first[0] == memkv_tls::HANDSHAKE_RECORD {
            self.checked = true;
            return Ok(());
        }
        // Take the frame header the client sent, so that closing with unread bytes does not
        // reset the connection before the client read our answer.
        let _ = self
            .tcp
            .read(&mut [0u8; HEADER_LEN], Duration::from_millis(10));
        let body = proto::encode_error(ErrorCode::Unauthenticated, PLAINTEXT_REFUSED);
        let hdr = proto::Header::new(Opcode::Error, 0, body.len(), 0).encode();
        let parts = [IoSlice::new(&hdr), IoSlice::new(&body)];
        let _ = self.tcp.write_vectored(&parts, Duration::from_millis(100));
        Err(failure("a plaintext client on the TLS listener".into()))
    }
}

impl Transport for TlsTransport {
    fn read(&mut self, buf: &mut [u8], wait: Duration) -> io::Result<usize> {
        let until = Instant::now() + wait;
        loop {
            match self.tls.reader().read(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return r,
            }
            // Handshake messages, and a reply's last records a write could not send in time.
            self.flush_until(until)?;
            if !self.checked {
                self.check_first_byte(left(until))?;
            }
            let handshaking = self.tls.is_handshaking();
            let n = self.tls.read_tls(&mut Records {
                tcp: &mut self.tcp,
                ahead: &mut self.ahead,
                wait: left(until),
                handshaking,
            })?;
            if n == 0 {
                return Ok(0);
            }
            if let Err(e) = self.tls.process_new_packets() {
                // rustls queued an alert telling the peer why; it gets a moment to go out.
                let _ = self.flush_until(Instant::now() + Duration::from_millis(100));
                return Err(failure(format!("TLS: {e}")));
            }
            // What the handshake settled, read once as it ends (the client's Finished comes in
            // here), not again with every record after it.
            if handshaking && !self.tls.is_handshaking() {
                self.reads_hello_tenant =
                    self.tls.alpn_protocol() == Some(memkv_tls::ALPN_HELLO_TENANT);
                self.identity = self
                    .tls
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .and_then(|c| PeerIdentity::from_der(c));
            }
            if Instant::now() >= until {
                // Records arrived but none completed plaintext: nothing came in time.
                return Err(io::ErrorKind::WouldBlock.into());
            }
        }
    }

    /// Takes what rustls accepts of `parts` (up to its buffer limit) once the records of earlier
    /// writes went out, then sends as much as `wait` allows; what is left goes out with the next
    /// write or read.
    fn write_vectored(&mut self, parts: &[IoSlice<'_>], wait: Duration) -> io::Result<usize> {
        let until = Instant::now() + wait;
        self.flush_until(until)?;
        let n = self.tls.writer().write_vectored(parts)?;
        match self.flush_until(until) {
            Err(e)
                if !matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(e)
            }
            _ => Ok(n),
        }
    }

    fn peer(&self) -> String {
        self.tcp.peer()
    }

    fn closer(&self) -> io::Result<Closer> {
        self.tcp.closer()
    }

    fn peer_identity(&self) -> Option<&PeerIdentity> {
        self.identity.as_ref()
    }

    fn reads_hello_tenant(&self) -> bool {
        self.reads_hello_tenant
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memkv_tls::ephemeral::Pki;
    use memkv_tls::{ClientTls, ClientTlsFiles, ServerTls, ServerTlsFiles};
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn the_verified_client_certificate_names_the_peer_after_the_handshake() {
        let pki = Pki::new();
        let (server_cert, client_cert) = (pki.server("s"), pki.issue("c", "engine-a", &[], false));
        let tls = ServerTls::new(&ServerTlsFiles {
            cert: server_cert.cert,
            key: server_cert.key,
            client_ca: Some(pki.ca()),
        })
        .unwrap();
        let client = ClientTls::new(&ClientTlsFiles {
            ca: pki.ca(),
            server_name: None,
            cert: Some(client_cert.cert),
            key: Some(client_cert.key),
        })
        .unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let peer = std::thread::spawn(move || {
            let conn = client.connection("127.0.0.1").unwrap();
            let mut s =
                memkv_tls::rustls::StreamOwned::new(conn, TcpStream::connect(addr).unwrap());
            s.write_all(b"hello").unwrap();
            s.flush().unwrap();
            let mut end = [0u8; 1];
            let _ = s.read(&mut end); // until the server closes
        });
        let (stream, _) = l.accept().unwrap();
        let mut t = TlsTransport::new(
            TcpTransport::new(stream).unwrap(),
            tls.connection().unwrap(),
        );
        assert!(
            t.peer_identity().is_none(),
            "nothing is known before the handshake"
        );
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while got.len() < 5 && Instant::now() < deadline {
            let mut buf = [0u8; 16];
            match t.read(&mut buf, Duration::from_millis(200)) {
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(got, b"hello");
        let id = t.peer_identity().expect("the handshake is done");
        assert_eq!(id.subject, "CN=engine-a, O=memkv tests");
        drop(t);
        peer.join().unwrap();
    }
}
