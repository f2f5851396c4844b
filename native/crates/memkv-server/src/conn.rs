//! One client connection: framing over a blocking socket, the auth handshake, and the commands.
//!
//! Each connection has its own thread; values are read straight into the store's memory and
//! written straight from it, so the only copies are the kernel's. A protocol violation gets an
//! error frame and the connection closes; the rest of the server is unaffected.

use std::hash::Hasher;
use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memkv_proto::{
    self as proto, ErrorCode, Header, HelloReply, Opcode, ProtoError, Status, CHECKSUM_CHUNK,
    HEADER_LEN,
};

use crate::lane::Value;
use crate::store::Store;
use crate::verify::Verifier;

/// GET replies are written in batches of verified chunks of about this size.
const SEND_BATCH: usize = 1 << 20;

/// How often a blocked read wakes up to look at the shutdown flag.
const POLL: Duration = Duration::from_millis(200);

pub struct ConnCtx {
    pub store: Arc<Store>,
    pub auth_key: Option<Vec<u8>>,
    pub shutdown: Arc<AtomicBool>,
    /// Longest a frame may take to arrive once it started, and a reply to be taken by the peer.
    pub frame_timeout: Duration,
    pub verifier: Verifier,
}

/// Why a connection ends early; `Proto` and `Refused` are answered with an error frame first.
enum End {
    Closed,
    Io(io::Error),
    Proto(ProtoError),
    Refused(ErrorCode, String),
}

impl From<io::Error> for End {
    fn from(e: io::Error) -> End {
        End::Io(e)
    }
}

impl From<ProtoError> for End {
    fn from(e: ProtoError) -> End {
        End::Proto(e)
    }
}

struct Conn<'a> {
    stream: TcpStream,
    ctx: &'a ConnCtx,
    nonce: Option<[u8; proto::NONCE_LEN]>,
    greeted: bool,
    authed: bool,
    scratch: Vec<u8>,
}

pub fn serve(stream: TcpStream, ctx: &ConnCtx) {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(POLL));
    let _ = stream.set_write_timeout(Some(ctx.frame_timeout));
    let mut c = Conn {
        stream,
        ctx,
        nonce: None,
        greeted: false,
        authed: ctx.auth_key.is_none(),
        scratch: Vec::new(),
    };
    let m = &ctx.store.metrics;
    match c.run() {
        End::Closed => {}
        End::Io(e) => {
            tracing::debug!(%peer, error = %e, "connection dropped");
            m.error("io");
        }
        End::Proto(e) => {
            tracing::warn!(%peer, error = %e, "protocol error; closing connection");
            m.error(match e.code() {
                ErrorCode::BadMagic => "bad_magic",
                ErrorCode::BadVersion => "bad_version",
                ErrorCode::TooLarge => "too_large",
                _ => "malformed",
            });
            let _ = c.send(
                Opcode::Error,
                0,
                &proto::encode_error(e.code(), &e.to_string()),
                &[],
            );
        }
        End::Refused(code, msg) => {
            tracing::warn!(%peer, %msg, "request refused; closing connection");
            m.error(if code == ErrorCode::AuthFailed {
                "auth_failed"
            } else {
                "unauthenticated"
            });
            let _ = c.send(Opcode::Error, 0, &proto::encode_error(code, &msg), &[]);
        }
    }
}

impl Conn<'_> {
    fn run(&mut self) -> End {
        loop {
            if self.ctx.shutdown.load(Ordering::Relaxed) {
                return End::Closed;
            }
            let mut hb = [0u8; HEADER_LEN];
            match self.read_full(&mut hb, true) {
                Ok(true) => {}
                Ok(false) => return End::Closed,
                Err(e) => return e.into(),
            }
            let h = match Header::decode(&hb) {
                Ok(h) => h,
                Err(e) => return e.into(),
            };
            let mut body = vec![0u8; h.body_len as usize];
            if let Err(e) = self.read_full(&mut body, false) {
                return e.into();
            }
            self.ctx
                .store
                .metrics
                .requests
                .fetch_add(1, Ordering::Relaxed);
            if let Err(end) = self.handle(&h, &body) {
                return end;
            }
        }
    }

    fn handle(&mut self, h: &Header, body: &[u8]) -> Result<(), End> {
        let store = &*self.ctx.store;
        let m = &store.metrics;
        match h.opcode {
            Opcode::Hello => {
                let mut nonce = [0u8; proto::NONCE_LEN];
                getrandom::fill(&mut nonce)
                    .map_err(|e| End::Io(io::Error::other(e.to_string())))?;
                self.nonce = Some(nonce);
                self.greeted = true;
                let reply = HelloReply {
                    auth_required: self.ctx.auth_key.is_some(),
                    nonce,
                    max_value_len: store.max_value_len,
                };
                return self.reply(h, &reply.encode(), &[]);
            }
            Opcode::Auth => {
                let (Some(key), Some(nonce)) = (&self.ctx.auth_key, self.nonce) else {
                    return Err(End::Refused(
                        ErrorCode::Malformed,
                        "AUTH without a challenge".into(),
                    ));
                };
                if !proto::auth_verify(key, &nonce, body) {
                    return Err(End::Refused(ErrorCode::AuthFailed, "wrong auth key".into()));
                }
                self.authed = true;
                return self.reply(h, &[], &[]);
            }
            _ if !self.greeted || !self.authed => {
                let why = if self.greeted {
                    "authenticate first"
                } else {
                    "send HELLO first"
                };
                return Err(End::Refused(ErrorCode::Unauthenticated, why.into()));
            }
            _ => {}
        }
        match h.opcode {
            Opcode::Ping => self.reply(h, &[], &[]),
            Opcode::Stats => self.reply(h, store.stats_json().as_bytes(), &[]),
            Opcode::Exists => {
                let (lease_ms, keys) = proto::decode_exists(body)?;
                let lease = Duration::from_millis(lease_ms as u64);
                let st: Vec<(Status, u64)> = keys.iter().map(|k| store.exists(k, lease)).collect();
                for (s, _) in &st {
                    let (hit, lease_ctr) = match s {
                        Status::Ok => (&m.exists_hits, Some(&m.leases_granted)),
                        Status::OkNoLease => (&m.exists_hits, Some(&m.leases_denied)),
                        _ => (&m.exists_misses, None),
                    };
                    hit.fetch_add(1, Ordering::Relaxed);
                    if let (Some(c), true) = (lease_ctr, lease_ms > 0) {
                        c.fetch_add(1, Ordering::Relaxed);
                    }
                }
                self.reply(h, &proto::encode_status_lens(&st), &[])
            }
            Opcode::Delete => {
                let keys = proto::decode_keys(body)?;
                let st: Vec<Status> = keys.iter().map(|k| store.delete(k)).collect();
                m.deletes.fetch_add(
                    st.iter().filter(|s| s.is_ok()).count() as u64,
                    Ordering::Relaxed,
                );
                self.reply(h, &proto::encode_statuses(&st), &[])
            }
            Opcode::Put => self.put(h, body),
            Opcode::Get => self.get(h, body),
            _ => Err(ProtoError::Malformed("a reply opcode sent as a request").into()),
        }
    }

    /// PUT: each value is read into a fresh reservation and becomes visible only once all of its
    /// bytes arrived and were checksummed. A value the store refuses is read and discarded so the
    /// stream stays in sync; a connection lost mid-value drops the reservation, leaving nothing.
    fn put(&mut self, h: &Header, body: &[u8]) -> Result<(), End> {
        let items = proto::decode_key_lens(body)?;
        let total = items.iter().try_fold(0u64, |a, (_, n)| a.checked_add(*n));
        if total != Some(h.payload_len) {
            return Err(
                ProtoError::Malformed("PUT payload length differs from its key table").into(),
            );
        }
        let store = &*self.ctx.store;
        let mut st = Vec::with_capacity(items.len());
        for (key, len) in items {
            match store.reserve(key, len) {
                Ok(mut res) => {
                    // Each chunk is hashed piece by piece as its bytes land (still in cache), so
                    // the reply waits only for the hash of the last piece, not of a whole chunk.
                    let mut sums = Vec::with_capacity(1 + len as usize / CHECKSUM_CHUNK);
                    for chunk in res.span.as_mut_slice().chunks_mut(CHECKSUM_CHUNK) {
                        let mut h = proto::checksum_hasher();
                        self.read_full_with(chunk, false, |piece| h.write(piece))?;
                        sums.push(h.finish());
                    }
                    if sums.is_empty() {
                        sums.push(proto::checksum(&[]));
                    }
                    store.commit(key, res, sums);
                    store.metrics.puts.fetch_add(1, Ordering::Relaxed);
                    store.metrics.bytes_in.fetch_add(len, Ordering::Relaxed);
                    st.push(Status::Ok);
                }
                Err(s) => {
                    store.metrics.error(if s == Status::TooLarge {
                        "too_large"
                    } else {
                        "no_space"
                    });
                    self.discard(len)?;
                    st.push(s);
                }
            }
        }
        self.reply(h, &proto::encode_statuses(&st), &[])
    }

    /// GET: no chunk of a value is sent before it matched its checksum, so no byte other than
    /// those stored ever leaves. The first chunk (all of a value up to 256 KiB) is checked before
    /// the reply starts and a mismatch there answers `Corrupt`; later chunks are checked by the
    /// verifier pool ahead of the send (or here, when the pool has not started one yet), and a
    /// mismatch drops the value and aborts the connection, which the client sees as a miss.
    /// Values stay referenced (not freed by eviction) until sent.
    fn get(&mut self, h: &Header, body: &[u8]) -> Result<(), End> {
        let items = proto::decode_key_lens(body)?;
        let store = &*self.ctx.store;
        let m = &store.metrics;
        let mut st = Vec::with_capacity(items.len());
        let mut vals: Vec<(&[u8], Arc<Value>)> = Vec::with_capacity(items.len());
        for (key, want) in items {
            let s = match store.fetch_verified(key) {
                Ok(v) if v.span.len() == want => {
                    vals.push((key, v));
                    Status::Ok
                }
                Ok(v) => {
                    st.push((Status::LengthMismatch, v.span.len()));
                    m.misses.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Err(s) => s,
            };
            let len = if s == Status::Ok { want } else { 0 };
            (if s == Status::Ok { &m.hits } else { &m.misses }).fetch_add(1, Ordering::Relaxed);
            st.push((s, len));
        }
        let total: u64 = vals.iter().map(|(_, v)| v.span.len()).sum();
        let table = proto::encode_status_lens(&st);
        let hdr = Header::new(h.opcode.reply(), h.request_id, table.len(), total).encode();
        // Send order: every chunk of every value. Chunk 0 of each was verified above; the later
        // ones are checked by the verifier pool, ahead of the send.
        let order: Vec<(usize, usize)> = vals
            .iter()
            .enumerate()
            .flat_map(|(k, (_, v))| (0..v.chunks()).map(move |i| (k, i)))
            .collect();
        let later: Vec<(Arc<Value>, usize)> = order
            .iter()
            .filter(|(_, i)| *i > 0)
            .map(|&(k, i)| (vals[k].1.clone(), i))
            .collect();
        let mut checks = self.ctx.verifier.check(later);
        // The header and table go out with the first chunk, which was verified before the reply
        // started: the client starts receiving while the pool checks the next chunks, instead of
        // the pipe idling for a whole batch's checks (and the pool threads' wake-up).
        let mut batch: Vec<&[u8]> = vec![&hdr, &table];
        let mut batched = 0;
        for (n, &(k, i)) in order.iter().enumerate() {
            let (key, v) = &vals[k];
            if i > 0 && !checks.next_ok() {
                store.drop_corrupt(key, v);
                return Err(End::Io(io::Error::other(
                    "checksum mismatch mid-value; reply aborted",
                )));
            }
            let c = v.chunk(i);
            batch.push(c);
            batched += c.len();
            if batched >= SEND_BATCH || n == 0 {
                proto::io::write_all_vectored(&mut self.stream, &batch)?;
                batch.clear();
                batched = 0;
            }
        }
        proto::io::write_all_vectored(&mut self.stream, &batch)?;
        m.bytes_out.fetch_add(total, Ordering::Relaxed);
        Ok(())
    }

    fn reply(&mut self, h: &Header, body: &[u8], payload: &[&[u8]]) -> Result<(), End> {
        self.send(h.opcode.reply(), h.request_id, body, payload)
            .map_err(End::Io)
    }

    fn send(&mut self, op: Opcode, id: u64, body: &[u8], payload: &[&[u8]]) -> io::Result<()> {
        let plen: u64 = payload.iter().map(|p| p.len() as u64).sum();
        let hdr = Header::new(op, id, body.len(), plen).encode();
        let mut parts: Vec<&[u8]> = Vec::with_capacity(2 + payload.len());
        parts.push(&hdr);
        parts.push(body);
        parts.extend_from_slice(payload);
        proto::io::write_all_vectored(&mut self.stream, &parts)
    }

    /// Fills `buf`. Waiting for the first byte of a frame (`at_frame_start`) may last forever
    /// unless the server shuts down (then Ok(false)); once a frame started it must arrive within
    /// the frame timeout. A clean EOF between frames is Ok(false).
    fn read_full(&mut self, buf: &mut [u8], at_frame_start: bool) -> io::Result<bool> {
        self.read_full_with(buf, at_frame_start, |_| {})
    }

    /// `read_full`, handing each piece to `seen` as it arrives.
    fn read_full_with(
        &mut self,
        buf: &mut [u8],
        at_frame_start: bool,
        mut seen: impl FnMut(&[u8]),
    ) -> io::Result<bool> {
        let mut done = 0;
        let mut deadline = (!at_frame_start).then(|| Instant::now() + self.ctx.frame_timeout);
        while done < buf.len() {
            let end = buf.len().min(done + proto::io::READ_PIECE);
            match self.stream.read(&mut buf[done..end]) {
                Ok(0) if done == 0 && at_frame_start => return Ok(false),
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    seen(&buf[done..done + n]);
                    done += n;
                    deadline.get_or_insert_with(|| Instant::now() + self.ctx.frame_timeout);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    match deadline {
                        None if self.ctx.shutdown.load(Ordering::Relaxed) => return Ok(false),
                        Some(d) if Instant::now() > d => {
                            return Err(io::Error::new(io::ErrorKind::TimedOut, "frame stalled"))
                        }
                        _ => {}
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    fn discard(&mut self, mut n: u64) -> io::Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.resize(1 << 20, 0);
        while n > 0 {
            let k = n.min(scratch.len() as u64) as usize;
            self.read_full(&mut scratch[..k], false)?;
            n -= k as u64;
        }
        self.scratch = scratch;
        Ok(())
    }
}
