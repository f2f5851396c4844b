//! TLS 1.3 over a TCP link (the client's `tls` settings): rustls's stream over the deadline-bound
//! socket of `StreamLink`, so the operation's deadline bounds the handshake and every record as
//! it bounds plain reads and writes.
//!
//! Failures say which setting to change: a certificate the CA did not sign, one that does not
//! name the server, one that expired, a server asking for a client certificate, and a server
//! that speaks plaintext memkv (it answers the ClientHello with its own error frame, which the
//! handshake looks for before rustls would call it a corrupt record).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use memkv_tls::rustls::{self, AlertDescription, CertificateError, ClientConnection, StreamOwned};
use memkv_tls::{ClientTls, ReadAhead, TlsError};

use crate::transport::{Link, StreamLink};

/// A link that failed for a reason of TLS itself: its keys get `Status::AuthFailed` (the server
/// is fine, the settings do not fit it).
fn tls_error(msg: String) -> io::Error {
    TlsError::io(msg)
}

/// rustls's error `e` on the link to `addr`, told as the setting that fixes it; other I/O errors
/// (deadlines, a broken connection) pass unchanged.
fn explain(e: io::Error, addr: &str) -> io::Error {
    let Some(r) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) else {
        return e;
    };
    let why = match r {
        rustls::Error::InvalidCertificate(c) => match c {
            CertificateError::UnknownIssuer | CertificateError::BadSignature => format!(
                "the certificate of server {addr} is not signed by the CA in tls.ca \
                 (MEMKV_TLS_CA): {r}"
            ),
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                format!(
                    "the certificate of server {addr} does not carry the name verified: set \
                     tls.server_name (MEMKV_TLS_SERVER_NAME) to one it carries: {r}"
                )
            }
            CertificateError::Expired
            | CertificateError::ExpiredContext { .. }
            | CertificateError::NotValidYet
            | CertificateError::NotValidYetContext { .. } => format!(
                "the certificate of server {addr} is outside its validity period (renew it \
                 on the server, then SIGHUP reloads it): {r}"
            ),
            _ => format!("the certificate of server {addr} was refused: {r}"),
        },
        rustls::Error::AlertReceived(AlertDescription::CertificateRequired) => format!(
            "server {addr} requires a client certificate: set tls.cert and tls.key \
             (MEMKV_TLS_CERT, MEMKV_TLS_KEY)"
        ),
        rustls::Error::AlertReceived(
            AlertDescription::BadCertificate
            | AlertDescription::UnknownCA
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown
            | AlertDescription::DecryptError,
        ) => format!(
            "server {addr} refused the client certificate in tls.cert (MEMKV_TLS_CERT): {r}"
        ),
        _ => format!("TLS with server {addr} failed: {r}"),
    };
    tls_error(why)
}

fn plaintext_server(addr: &str) -> io::Error {
    tls_error(format!(
        "server {addr} speaks plaintext memkv, not TLS: remove the client's tls settings \
         (MEMKV_TLS_CA, yaml tls:), or start the server with --tls-cert and --tls-key"
    ))
}

/// The socket beneath rustls: reads through a read-ahead buffer (rustls asks for 4 KiB a call).
pub(crate) struct Socket {
    link: StreamLink<TcpStream>,
    ahead: ReadAhead,
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let link = &mut self.link;
        self.ahead.read(buf, |b| link.read(b))
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.link.write(buf)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.link.write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A TCP link under TLS.
pub(crate) struct TlsLink {
    s: StreamOwned<ClientConnection, Socket>,
    addr: String,
}

impl TlsLink {
    /// Runs the handshake with the server at `addr` (`host:port`) over `tcp`, by its deadline.
    pub(crate) fn handshake(
        tls: &ClientTls,
        addr: &str,
        tcp: StreamLink<TcpStream>,
    ) -> io::Result<TlsLink> {
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
        let conn = tls
            .connection(host)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("tls: {e}")))?;
        let mut s = StreamOwned::new(
            conn,
            Socket {
                link: tcp,
                ahead: ReadAhead::default(),
            },
        );
        while s.conn.wants_write() {
            s.conn.write_tls(&mut s.sock)?;
        }
        let mut first = [0u8; 1];
        match s.sock.link.peek(&mut first) {
            Ok(1) if first[0] == memkv_proto::MAGIC[0] => return Err(plaintext_server(addr)),
            Ok(_) => {}
            // A plaintext server that closed on our ClientHello before we looked.
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                return Err(plaintext_server(addr))
            }
            Err(e) => return Err(e),
        }
        while s.conn.is_handshaking() {
            s.conn
                .complete_io(&mut s.sock)
                .map_err(|e| explain(e, addr))?;
        }
        Ok(TlsLink {
            s,
            addr: addr.to_string(),
        })
    }

    pub(crate) fn stream(&self) -> &TcpStream {
        self.s.sock.link.stream()
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.s.sock.link.deadline()
    }

    /// Whether a read would find bytes without waiting on the socket (decrypted, or a whole
    /// record rustls holds).
    pub(crate) fn buffered(&mut self) -> bool {
        if self.s.sock.ahead.pending() {
            return true;
        }
        // process_new_packets only decrypts what read_tls already took in; on an error the
        // read goes ahead and returns it.
        self.s
            .conn
            .process_new_packets()
            .map_or(true, |st| st.plaintext_bytes_to_read() > 0)
    }
}

impl Read for TlsLink {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.s.read(buf).map_err(|e| explain(e, &self.addr))
    }
}

impl Write for TlsLink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.s.write(buf).map_err(|e| explain(e, &self.addr))
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.s
            .write_vectored(bufs)
            .map_err(|e| explain(e, &self.addr))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.s.flush().map_err(|e| explain(e, &self.addr))
    }
}

impl Link for TlsLink {
    fn set_deadline(&mut self, deadline: Instant) {
        self.s.sock.link.set_deadline(deadline);
    }
}
