//! One connection to a server: handshake, and one batched request at a time, every step bounded
//! by the operation's deadline.
//!
//! Values go from caller memory to the link with vectored writes and from the link straight into
//! caller memory, so the client copies nothing itself. After any error the connection is in an
//! unknown state (part of a frame may be unread) and must be dropped, never reused.

use std::io;
use std::time::Instant;

use memkv_proto::{self as proto, ErrorCode, Header, HelloReply, Opcode, HEADER_LEN};

use crate::transport::{Link, Transport};
use crate::Status;

/// A caller buffer: raw address and length. Callers guarantee it stays valid (and, for GET,
/// unaliased) until the operation using it returns.
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
    #[error("protocol error: {0}")]
    Proto(#[from] proto::ProtoError),
    #[error("server error {code:?}: {msg}")]
    Server {
        code: Option<ErrorCode>,
        msg: String,
    },
    #[error("server requires an auth key and none is configured (set MEMKV_AUTH_KEY)")]
    AuthRequired,
}

impl ConnError {
    /// The per-key outcome this failure gives the keys it hit.
    pub fn status(&self) -> Status {
        match self {
            ConnError::Io(e) => match e.kind() {
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Status::Timeout,
                io::ErrorKind::ConnectionRefused => Status::Refused,
                _ => Status::Unavailable,
            },
            ConnError::Proto(_) => Status::ProtocolError,
            ConnError::AuthRequired => Status::AuthFailed,
            ConnError::Server { code, .. } => match code {
                Some(ErrorCode::Unauthenticated | ErrorCode::AuthFailed) => Status::AuthFailed,
                Some(ErrorCode::TooLarge) => Status::TooLarge,
                Some(
                    ErrorCode::BadMagic
                    | ErrorCode::BadVersion
                    | ErrorCode::BadOpcode
                    | ErrorCode::Malformed,
                ) => Status::ProtocolError,
                // Stalled: the server cut this connection off because the request arrived too
                // slowly (the path is the problem, as with a client-side timeout).
                Some(ErrorCode::Stalled) => Status::Timeout,
                Some(ErrorCode::ShuttingDown | ErrorCode::Internal | ErrorCode::Busy) | None => {
                    Status::Unavailable
                }
            },
        }
    }

    /// Whether the server should be skipped for a while: true for failures of the server or of
    /// the path to it, false for a request the server refused as too large (the server is fine;
    /// only that request was wrong) or refused for want of request-buffer memory at this moment
    /// (`Busy`: the next request may well pass; skipping the server would turn its keys into
    /// misses for everyone).
    pub fn marks_down(&self) -> bool {
        !matches!(
            self,
            ConnError::Server {
                code: Some(ErrorCode::TooLarge | ErrorCode::Busy),
                ..
            }
        )
    }
}

pub struct Conn {
    link: Box<dyn Link>,
    next_id: u64,
    pub max_value_len: u64,
}

impl Conn {
    /// Connects and authenticates, all before `deadline`.
    pub fn connect(
        transport: &dyn Transport,
        addr: &str,
        auth_key: Option<&[u8]>,
        deadline: Instant,
    ) -> Result<Conn, ConnError> {
        let link = transport.connect(addr, deadline)?;
        let mut c = Conn {
            link,
            next_id: 1,
            max_value_len: 0,
        };
        c.link.set_deadline(deadline);
        let (_, body) = c.call(Opcode::Hello, &[], &[])?;
        let hello = HelloReply::decode(&body)?;
        c.max_value_len = hello.max_value_len;
        if hello.auth_required {
            let key = auth_key.ok_or(ConnError::AuthRequired)?;
            c.call(Opcode::Auth, &proto::auth_mac(key, &hello.nonce), &[])?;
        }
        Ok(c)
    }

    /// Bounds every following request on this connection by `deadline`.
    pub fn set_deadline(&mut self, deadline: Instant) {
        self.link.set_deadline(deadline);
    }

    /// Sends one request and reads the reply header and body. The reply payload, if any, is
    /// left on the link for the caller to read.
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
        proto::io::write_frame(&mut self.link, op, id, body, &values)?;
        let mut hb = [0u8; HEADER_LEN];
        self.link.read_exact(&mut hb)?;
        let h = Header::decode(&hb)?;
        let mut rbody = vec![0u8; h.body_len as usize];
        self.link.read_exact(&mut rbody)?;
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
        Ok(proto::decode_status_lens(&body, keys.len())?
            .into_iter()
            .map(|(s, n)| (s.into(), n))
            .collect())
    }

    pub fn delete(&mut self, keys: &[&[u8]]) -> Result<Vec<Status>, ConnError> {
        let (_, body) = self.call(Opcode::Delete, &proto::encode_keys(keys), &[])?;
        Ok(statuses(proto::decode_statuses(&body, keys.len())?))
    }

    pub fn put(&mut self, keys: &[&[u8]], bufs: &[Buf]) -> Result<Vec<Status>, ConnError> {
        let lens: Vec<u64> = bufs.iter().map(|b| b.len as u64).collect();
        let (_, body) = self.call(Opcode::Put, &proto::encode_key_lens(keys, &lens), bufs)?;
        Ok(statuses(proto::decode_statuses(&body, keys.len())?))
    }

    /// GET into caller buffers. Nothing is written into a buffer before the reply's status table
    /// said Ok for its key with exactly its length, so buffers of every other key keep their
    /// bytes. An error while an Ok value is arriving (deadline, broken link) leaves that one
    /// buffer partly written; it is never written after this returns.
    pub fn get(&mut self, keys: &[&[u8]], bufs: &[Buf]) -> Result<Vec<Status>, ConnError> {
        let lens: Vec<u64> = bufs.iter().map(|b| b.len as u64).collect();
        let (h, body) = self.call(Opcode::Get, &proto::encode_key_lens(keys, &lens), &[])?;
        let st = proto::decode_status_lens(&body, keys.len())?;
        let mut expected = 0u64;
        for ((s, n), b) in st.iter().zip(bufs) {
            if *s == proto::Status::Ok {
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
            if *s == proto::Status::Ok {
                // SAFETY: the caller guarantees the buffer is valid and exclusively ours until the
                // operation returns; this read ends (at the latest at the deadline) before that.
                let dst = unsafe { std::slice::from_raw_parts_mut(b.ptr as *mut u8, b.len) };
                proto::io::read_exact_in_pieces(&mut self.link, dst)?;
            }
        }
        Ok(st.into_iter().map(|(s, _)| s.into()).collect())
    }
}

fn statuses(st: Vec<proto::Status>) -> Vec<Status> {
    st.into_iter().map(Status::from).collect()
}
