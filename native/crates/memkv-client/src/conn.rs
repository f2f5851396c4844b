//! One TCP connection to a server: handshake, and one batched request at a time.
//!
//! Values go from caller memory to the socket with vectored writes and from the socket straight
//! into caller memory, so the client copies nothing itself.

use std::io::{self, Read};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use memkv_proto::{self as proto, Header, HelloReply, Opcode, Status, HEADER_LEN};

/// A caller buffer: raw address and length. Callers guarantee it stays valid (and, for GET,
/// unaliased) until the operation using it completes.
#[derive(Debug, Clone, Copy)]
pub struct Buf {
    pub ptr: usize,
    pub len: usize,
}

impl Buf {
    /// A buffer the client reads from (a PUT's value).
    pub fn of(v: &[u8]) -> Buf {
        Buf {
            ptr: v.as_ptr() as usize,
            len: v.len(),
        }
    }

    /// A buffer the client writes into (a GET's destination).
    pub fn of_mut(v: &mut [u8]) -> Buf {
        Buf {
            ptr: v.as_mut_ptr() as usize,
            len: v.len(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("protocol: {0}")]
    Proto(#[from] proto::ProtoError),
    #[error("server error {code:?}: {msg}")]
    Server {
        code: Option<proto::ErrorCode>,
        msg: String,
    },
    #[error("server requires an auth key (set MEMKV_AUTH_KEY)")]
    AuthRequired,
}

pub struct Conn {
    stream: TcpStream,
    next_id: u64,
    pub max_value_len: u64,
}

impl Conn {
    pub fn connect(
        addr: &str,
        auth_key: Option<&[u8]>,
        connect_timeout: Duration,
        op_timeout: Duration,
    ) -> Result<Conn, ConnError> {
        let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{addr}: no address"));
        let mut stream = None;
        for sa in addr.to_socket_addrs()? {
            match TcpStream::connect_timeout(&sa, connect_timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let stream = stream.ok_or(last)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(op_timeout))?;
        stream.set_write_timeout(Some(op_timeout))?;
        let mut c = Conn {
            stream,
            next_id: 1,
            max_value_len: 0,
        };
        let (_, body) = c.call(Opcode::Hello, &[], &[])?;
        let hello = HelloReply::decode(&body)?;
        c.max_value_len = hello.max_value_len;
        if hello.auth_required {
            let key = auth_key.ok_or(ConnError::AuthRequired)?;
            c.call(Opcode::Auth, &proto::auth_mac(key, &hello.nonce), &[])?;
        }
        Ok(c)
    }

    /// Sends one request and reads the reply header and body. The reply payload, if any, is
    /// left on the socket for the caller to read.
    fn call(
        &mut self,
        op: Opcode,
        body: &[u8],
        payload: &[Buf],
    ) -> Result<(Header, Vec<u8>), ConnError> {
        let id = self.next_id;
        self.next_id += 1;
        // SAFETY: the caller guarantees each Buf is valid for reads until this call returns.
        let values: Vec<&[u8]> = payload
            .iter()
            .map(|b| unsafe { std::slice::from_raw_parts(b.ptr as *const u8, b.len) })
            .collect();
        proto::io::write_frame(&mut self.stream, op, id, body, &values)?;
        let mut hb = [0u8; HEADER_LEN];
        self.stream.read_exact(&mut hb)?;
        let h = Header::decode(&hb)?;
        let mut rbody = vec![0u8; h.body_len as usize];
        self.stream.read_exact(&mut rbody)?;
        if h.opcode == Opcode::Error {
            let (code, msg) = proto::decode_error(&rbody)?;
            return Err(ConnError::Server { code, msg });
        }
        if h.opcode != op.reply() || h.request_id != id {
            return Err(proto::ProtoError::Malformed("reply does not match request").into());
        }
        Ok((h, rbody))
    }

    pub fn ping(&mut self) -> Result<(), ConnError> {
        self.call(Opcode::Ping, &[], &[]).map(|_| ())
    }

    pub fn stats(&mut self) -> Result<String, ConnError> {
        let (_, body) = self.call(Opcode::Stats, &[], &[])?;
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    pub fn exists(
        &mut self,
        keys: &[&[u8]],
        lease_ms: u32,
    ) -> Result<Vec<(Status, u64)>, ConnError> {
        let (_, body) = self.call(Opcode::Exists, &proto::encode_exists(lease_ms, keys), &[])?;
        Ok(proto::decode_status_lens(&body, keys.len())?)
    }

    pub fn delete(&mut self, keys: &[&[u8]]) -> Result<Vec<Status>, ConnError> {
        let (_, body) = self.call(Opcode::Delete, &proto::encode_keys(keys), &[])?;
        Ok(proto::decode_statuses(&body, keys.len())?)
    }

    pub fn put(&mut self, keys: &[&[u8]], bufs: &[Buf]) -> Result<Vec<Status>, ConnError> {
        let lens: Vec<u64> = bufs.iter().map(|b| b.len as u64).collect();
        let (_, body) = self.call(Opcode::Put, &proto::encode_key_lens(keys, &lens), bufs)?;
        Ok(proto::decode_statuses(&body, keys.len())?)
    }

    /// GET into caller buffers. The server sends bytes only for keys whose stored length equals
    /// the buffer's, so a buffer is written only when its key's status is Ok.
    pub fn get(&mut self, keys: &[&[u8]], bufs: &[Buf]) -> Result<Vec<Status>, ConnError> {
        let lens: Vec<u64> = bufs.iter().map(|b| b.len as u64).collect();
        let (h, body) = self.call(Opcode::Get, &proto::encode_key_lens(keys, &lens), &[])?;
        let st = proto::decode_status_lens(&body, keys.len())?;
        let mut expected = 0u64;
        for ((s, n), b) in st.iter().zip(bufs) {
            if *s == Status::Ok {
                if *n != b.len as u64 {
                    return Err(proto::ProtoError::Malformed(
                        "GET reply length differs from request",
                    )
                    .into());
                }
                expected += *n;
            }
        }
        if expected != h.payload_len {
            return Err(
                proto::ProtoError::Malformed("GET payload length differs from its table").into(),
            );
        }
        for ((s, _), b) in st.iter().zip(bufs) {
            if *s == Status::Ok {
                // SAFETY: the caller guarantees the buffer is valid and exclusively ours until the
                // operation completes.
                let dst = unsafe { std::slice::from_raw_parts_mut(b.ptr as *mut u8, b.len) };
                proto::io::read_exact_in_pieces(&mut self.stream, dst)?;
            }
        }
        Ok(st.into_iter().map(|(s, _)| s).collect())
    }
}
