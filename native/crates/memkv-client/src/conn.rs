//! One connection to a server: handshake, and one batched request at a time, every step bounded
//! by the operation's deadline.
//!
//! Values go from caller memory to the link with vectored writes and from the link straight into
//! caller memory, so the client copies nothing itself. After any error the connection is in an
//! unknown state (part of a frame may be unread) and must be dropped, never reused.

use std::io;
use std::time::Instant;

use memkv_proto::{self as proto, ErrorCode, Header, HelloReply, Opcode, TenantInfo, HEADER_LEN};

use crate::buf::Buf;
use crate::transport::{Described, Link, Setup, Transport};
use crate::Status;

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
    #[error("transport '{transport}': the server refused {medium}: {why}")]
    OneSidedRefused {
        transport: &'static str,
        medium: &'static str,
        why: String,
    },
}

impl ConnError {
    /// The per-key outcome this failure gives the keys it hit.
    pub fn status(&self) -> Status {
        match self {
            ConnError::Io(e) if memkv_tls::TlsError::is(e) => Status::AuthFailed,
            ConnError::Io(e) => match e.kind() {
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Status::Timeout,
                io::ErrorKind::ConnectionRefused => Status::Refused,
                _ => Status::Unavailable,
            },
            ConnError::Proto(_) => Status::ProtocolError,
            ConnError::AuthRequired => Status::AuthFailed,
            ConnError::OneSidedRefused { .. } => Status::Unavailable,
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
    /// The tenant our credential named, from a server with tenants: its AUTH reply, or its
    /// HELLO reply when our client certificate named it (mutual TLS, no AUTH).
    pub tenant: Option<TenantInfo>,
    /// The server closes the connection after a reply with a REMOTE_ACCESS status (its path
    /// to our endpoint may be gone), so such a connection is not reused.
    spent: bool,
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
            tenant: None,
            spent: false,
        };
        c.link.set_deadline(deadline);
        let (_, body) = c.call(Opcode::Hello, &[], &[])?;
        let hello = HelloReply::decode(&body)?;
        c.max_value_len = hello.max_value_len;
        c.tenant = hello.tenant;
        if hello.auth_required {
            let key = auth_key.ok_or(ConnError::AuthRequired)?;
            let (_, body) = c.call(Opcode::Auth, &proto::auth_mac(key, &hello.nonce), &[])?;
            c.tenant = TenantInfo::decode(&body)?;
        }
        let hello = match c.link.one_sided() {
            Some(side) => side.hello()?,
            None => None,
        };
        if let Some(setup) = hello {
            let (accepted, why) = c.setup(setup)?;
            let side = c.link.one_sided().expect("it sent the hello");
            if !accepted {
                let (transport, medium) = (side.transport(), side.medium());
                if side.strict() {
                    return Err(ConnError::OneSidedRefused {
                        transport,
                        medium,
                        why,
                    });
                }
                tracing::info!(server = %addr, reason = %why,
                    "memkv transport 'auto': the server refused {medium}; values go over the stream");
                c.link.drop_one_sided();
            }
        }
        Ok(c)
    }

    /// False once the server has closed this connection after a reply (see `spent`).
    pub fn reusable(&self) -> bool {
        !self.spent
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
        self.call_flagged(op, 0, body, payload)
    }

    fn call_flagged(
        &mut self,
        op: Opcode,
        flags: u32,
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
        let plen: u64 = values.iter().map(|v| v.len() as u64).sum();
        let mut hdr = Header::new(op, id, body.len(), plen);
        hdr.flags = flags;
        let hdr = hdr.encode();
        let mut parts: Vec<&[u8]> = Vec::with_capacity(2 + values.len());
        parts.push(&hdr);
        parts.push(body);
        parts.extend_from_slice(&values);
        proto::io::write_all_vectored(&mut self.link, &parts)?;
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
        if let Some(d) = self.one_sided(bufs)? {
            return self.one_sided_call(Opcode::Put, keys, bufs, d);
        }
        let lens: Vec<u64> = bufs.iter().map(|b| b.len as u64).collect();
        let (_, body) = self.call(Opcode::Put, &proto::encode_key_lens(keys, &lens), bufs)?;
        Ok(statuses(proto::decode_statuses(&body, keys.len())?))
    }

    /// GET into caller buffers. Nothing is written into a buffer before the reply's status table
    /// said Ok for its key with exactly its length, so buffers of every other key keep their
    /// bytes. An error while an Ok value is arriving (deadline, broken link) leaves that one
    /// buffer partly written; it is never written after this returns.
    pub fn get(&mut self, keys: &[&[u8]], bufs: &[Buf]) -> Result<Vec<Status>, ConnError> {
        if let Some(d) = self.one_sided(bufs)? {
            return self.one_sided_call(Opcode::Get, keys, bufs, d);
        }
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

impl Conn {
    /// SHM_VALUES: lane `lane`'s length and a read-only descriptor of its memory, from a server
    /// sharing its value memory; `Ok(Err(why))` when it does not.
    pub fn shm_values(
        &mut self,
        lane: u32,
    ) -> Result<Result<(proto::ShmValuesReply, std::os::fd::OwnedFd), String>, ConnError> {
        let (_, rb) = self.call(Opcode::ShmValues, &proto::encode_shm_values(lane), &[])?;
        let rep = proto::decode_shm_values_reply(&rb)?;
        // A descriptor came with the reply's bytes exactly when it was accepted.
        let fd = self.link.take_fd();
        Ok(match (rep.refused.clone(), fd) {
            (Some(why), _) => Err(why),
            (None, None) => Err("the server's reply carried no descriptor".into()),
            (None, Some(fd)) => Ok((rep, fd)),
        })
    }

    /// GET_MAPPED: the pin and, per key, where its value lies in the server's lanes.
    pub fn get_mapped(
        &mut self,
        keys: &[&[u8]],
        lens: &[u64],
    ) -> Result<(u64, Vec<proto::MappedValue>), ConnError> {
        let (_, rb) = self.call(Opcode::GetMapped, &proto::encode_key_lens(keys, lens), &[])?;
        let (pin, vals) = proto::decode_get_mapped_reply(&rb, keys.len())?;
        if vals
            .iter()
            .zip(lens)
            .any(|(v, n)| v.status == proto::Status::Ok && v.len != *n)
        {
            return Err(
                proto::ProtoError::Malformed("GET_MAPPED length differs from request").into(),
            );
        }
        Ok((pin, vals))
    }

    /// SHM_RELEASE: whether the server still held the pin set.
    pub fn shm_release(&mut self, pin: u64) -> Result<bool, ConnError> {
        let (_, rb) = self.call(Opcode::ShmRelease, &proto::encode_shm_release(pin), &[])?;
        match rb[..] {
            [held] => Ok(held == 1),
            _ => Err(proto::ProtoError::Malformed("SHM_RELEASE reply").into()),
        }
    }

    /// Sends a one-sided side's setup request (with its descriptor, if any) and returns the
    /// server's answer: accepted, and why not.
    fn setup(&mut self, s: Setup) -> Result<(bool, String), ConnError> {
        if let Some(fd) = s.fd {
            self.link.pass_fd(fd)?;
        }
        let (_, rb) = self.call(s.op, &s.body, &[])?;
        Ok(proto::decode_rdma_hello_reply(&rb)?)
    }

    /// The flag and descriptors of a one-sided transfer of `bufs`, after the setups it needs;
    /// None when the link has no one-sided side or it cannot name every buffer (the values
    /// then go over the stream).
    fn one_sided(&mut self, bufs: &[Buf]) -> Result<Option<(u32, Described)>, ConnError> {
        let Some(side) = self.link.one_sided() else {
            return Ok(None);
        };
        for s in side.setups(bufs) {
            let tag = s.tag;
            let (accepted, why) = self.setup(s)?;
            if let Some(side) = self.link.one_sided() {
                side.answered(tag, accepted, &why);
            }
        }
        let Some(side) = self.link.one_sided() else {
            return Ok(None);
        };
        Ok(side.describe(bufs)?.map(|d| (side.flag(), d)))
    }

    /// PUT or GET by the server's one-sided transfers: descriptors of the caller's buffers go
    /// in the request and the server moves the bytes before it replies. Any failure without a
    /// reply revokes the server's access to the buffers before returning (`OneSided::revoke`).
    fn one_sided_call(
        &mut self,
        op: Opcode,
        keys: &[&[u8]],
        bufs: &[Buf],
        (flag, described): (u32, Described),
    ) -> Result<Vec<Status>, ConnError> {
        let body = proto::encode_descriptors(keys, &described.descs);
        let r = self.call_flagged(op, flag, &body, &[]).and_then(|(h, rb)| {
            if h.payload_len != 0 {
                return Err(proto::ProtoError::Malformed("payload in a one-sided reply").into());
            }
            let st: Vec<Status> = if op == Opcode::Put {
                statuses(proto::decode_statuses(&rb, keys.len())?)
            } else {
                let sl = proto::decode_status_lens(&rb, keys.len())?;
                if sl
                    .iter()
                    .zip(bufs)
                    .any(|((s, n), b)| *s == proto::Status::Ok && *n != b.len as u64)
                {
                    return Err(proto::ProtoError::Malformed(
                        "GET reply length differs from request",
                    )
                    .into());
                }
                sl.into_iter().map(|(s, _)| s.into()).collect()
            };
            Ok(st)
        });
        match r {
            Ok(st) => {
                self.spent = st.contains(&Status::RemoteAccess);
                drop(described.held);
                Ok(st)
            }
            Err(e) => {
                if let Some(side) = self.link.one_sided() {
                    side.revoke(bufs);
                }
                drop(described.held);
                Err(e)
            }
        }
    }
}

fn statuses(st: Vec<proto::Status>) -> Vec<Status> {
    st.into_iter().map(Status::from).collect()
}
