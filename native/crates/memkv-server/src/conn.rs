//! One client connection: the session (handshake, then requests in order) over a `Transport`.
//! The commands themselves are in `cmd`.
//!
//! Before the handshake is done a connection costs at most its header and a 32-byte AUTH body:
//! any other frame is refused unread, and a connection that does not finish the handshake within
//! the handshake timeout is closed (it can also be closed earlier to admit a new connection; see
//! `limits::ConnLimits`). After it, every frame has a deadline in each direction (`frame::Timing`)
//! and every buffer comes out of the server-wide byte budget. A protocol violation or a stalled
//! request gets an error frame and the connection closes; the rest of the server is unaffected.
//!
//! The credential a connection proves names its tenant (`crate::tenants`); every command then
//! answers FORBIDDEN for a key outside the tenant's prefix (and for a write by a read-only
//! tenant) without looking the key up (`Conn::may_name`, `Conn::may_write`).

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memkv_proto::{self as proto, ErrorCode, Header, HelloReply, Opcode, ProtoError, NONCE_LEN};

use crate::frame::{FrameIo, ReadEnd, Timing};
use crate::limits::{BudgetShare, ByteBudget, Permit, WarnLimiter};
use crate::mapped::MappedPins;
use crate::rdma::{RdmaPeer, ServerFabric};
use crate::shm::{ShmPeer, ShmShared};
use crate::store::Store;
use crate::tenants::{Tenant, TenantId};
use crate::transport::Transport;
use crate::verify::Verifier;

/// What a TLS client on a plaintext listener is told (its own side names the setting too).
const TLS_REFUSED: &str = "a TLS ClientHello to a plaintext server: start the server with \
     --tls-cert and --tls-key, or remove the client's tls settings";

/// What every connection shares.
pub struct ConnCtx {
    /// The values, and the tenants whose credentials the handshake checks.
    pub store: Arc<Store>,
    pub shutdown: Arc<AtomicBool>,
    pub timing: Timing,
    /// Longest a new connection may take to finish HELLO (and AUTH when a key is set).
    pub handshake_timeout: Duration,
    pub budget: ByteBudget,
    pub verifier: Verifier,
    /// Warnings a peer can cause (bad frames, refusals) go through this.
    pub warn: WarnLimiter,
    /// The RDMA data path, when the server runs with it (`--rdma`).
    pub rdma: Option<Arc<ServerFabric>>,
    /// The same-host data path's bounds, when it is on (`--shm-socket`).
    pub shm: Option<Arc<ShmShared>>,
}

/// Why a connection ends early; all but `Closed` and `Io` are answered with an error frame
/// first when the stream is between frames.
pub(crate) enum End {
    Closed,
    Io(io::Error),
    Proto(ProtoError),
    Refused(ErrorCode, String),
    /// A request (`reply_started` false) or reply that missed its deadline.
    Stalled {
        reply_started: bool,
    },
}

impl From<ProtoError> for End {
    fn from(e: ProtoError) -> End {
        End::Proto(e)
    }
}

impl From<ReadEnd> for End {
    fn from(e: ReadEnd) -> End {
        match e {
            ReadEnd::Closed => End::Closed,
            ReadEnd::Idle => End::Refused(ErrorCode::Stalled, "handshake not done in time".into()),
            ReadEnd::Stalled => End::Stalled {
                reply_started: false,
            },
            ReadEnd::Io(e) => End::Io(e),
        }
    }
}

/// A reply write that failed: a deadline miss is a stall, anything else the transport's error.
pub(crate) fn write_end(e: io::Error) -> End {
    if e.kind() == io::ErrorKind::TimedOut {
        End::Stalled {
            reply_started: true,
        }
    } else {
        End::Io(e)
    }
}

pub(crate) struct Conn<'a, T: Transport> {
    pub io: FrameIo<T>,
    pub ctx: &'a ConnCtx,
    permit: Permit,
    nonce: Option<[u8; NONCE_LEN]>,
    greeted: bool,
    authed: bool,
    /// Whose connection it is: the implicit tenant until a credential names another.
    tenant: TenantId,
    handshake_until: Instant,
    /// This connection's RDMA endpoint, once the client's RDMA_HELLO was accepted.
    pub(crate) rdma: Option<RdmaPeer>,
    /// The client regions this connection mapped (SHM_REGION).
    pub(crate) shm: ShmPeer,
    /// Values this connection's client reads out of the server's memory (GET_MAPPED).
    pub(crate) pins: MappedPins<'a>,
}

/// Serves one connection until it closes; `permit` is its slot, freed when this returns.
pub fn serve<T: Transport>(t: T, ctx: &ConnCtx, permit: Permit) {
    let peer = t.peer();
    let mut c = Conn {
        io: FrameIo::new(t, ctx.shutdown.clone(), ctx.timing),
        ctx,
        permit,
        nonce: None,
        greeted: false,
        authed: !ctx.store.tenants.auth_required(),
        tenant: 0,
        handshake_until: Instant::now() + ctx.handshake_timeout,
        rdma: None,
        shm: ShmPeer::default(),
        pins: MappedPins::default(),
    };
    let m = &ctx.store.metrics;
    let (code, msg, kind) = match c.run() {
        End::Closed => return,
        End::Io(e) if memkv_tls::TlsError::is(&e) => {
            m.error("tls");
            if let Some(dropped) = ctx.warn.allow() {
                tracing::warn!(%peer, error = %e, dropped_warnings = dropped, "TLS refused");
            }
            return;
        }
        End::Io(e) => {
            tracing::debug!(%peer, error = %e, "connection dropped");
            m.error("io");
            return;
        }
        End::Proto(e) => {
            let kind = match e.code() {
                ErrorCode::BadMagic => "bad_magic",
                ErrorCode::BadVersion => "bad_version",
                ErrorCode::TooLarge => "too_large",
                _ => "malformed",
            };
            (e.code(), e.to_string(), kind)
        }
        End::Refused(code, msg) => {
            let kind = match code {
                ErrorCode::AuthFailed => "auth_failed",
                ErrorCode::Stalled => "handshake_timeout",
                ErrorCode::Busy => "busy",
                ErrorCode::Malformed => "malformed",
                ErrorCode::BadMagic => "tls",
                _ => "unauthenticated",
            };
            (code, msg, kind)
        }
        End::Stalled { reply_started } => {
            m.error("stalled");
            let msg = format!(
                "{} slower than {} bytes/s after {:?}; connection closed",
                if reply_started {
                    "reply taken"
                } else {
                    "request sent"
                },
                ctx.timing.min_rate,
                ctx.timing.frame_timeout,
            );
            if let Some(dropped) = ctx.warn.allow() {
                tracing::warn!(%peer, dropped_warnings = dropped, "{msg}");
            }
            // Mid-reply the peer is inside a payload: an error frame there would be read as
            // value bytes, so the connection just closes.
            if !reply_started {
                c.send_error(ErrorCode::Stalled, &msg);
            }
            return;
        }
    };
    m.error(kind);
    if let Some(dropped) = ctx.warn.allow() {
        tracing::warn!(%peer, error = %msg, dropped_warnings = dropped, "closing connection");
    }
    c.send_error(code, &msg);
}

impl<'a, T: Transport> Conn<'a, T> {
    /// The connection's tenant.
    pub(crate) fn tenant(&self) -> &'a Tenant {
        self.ctx.store.tenants.get(self.tenant)
    }

    pub(crate) fn tenant_id(&self) -> TenantId {
        self.tenant
    }

    /// Whether this connection may name `key` (read it, probe it, lease it); a key it may not
    /// is counted as forbidden.
    pub(crate) fn may_name(&self, key: &[u8]) -> bool {
        self.allowed(self.tenant().may_name(key))
    }

    /// Whether this connection may store or delete `key`; counted as `may_name`.
    pub(crate) fn may_write(&self, key: &[u8]) -> bool {
        self.allowed(self.tenant().may_write(key))
    }

    fn allowed(&self, ok: bool) -> bool {
        if !ok {
            let usage = &self.ctx.store.usage;
            usage.add(self.tenant, 1, |s| &s.forbidden);
        }
        ok
    }

    /// Who the peer's verified client certificate says it is: under mutual TLS
    /// (`--tls-client-ca`) from the end of the TLS handshake, so by the time HELLO is handled;
    /// None on plain TCP and the same-host socket.
    pub fn client_identity(&self) -> Option<&memkv_tls::PeerIdentity> {
        self.io.transport().peer_identity()
    }

    /// HELLO done, and AUTH when the server has a key.
    fn ready(&self) -> bool {
        self.greeted && self.authed
    }

    fn run(&mut self) -> End {
        loop {
            let idle_until = (!self.ready()).then_some(self.handshake_until);
            let hb = match self.io.next_header(idle_until) {
                Ok(hb) => hb,
                Err(e) => return e.into(),
            };
            let h = match Header::decode(&hb) {
                Ok(h) => h,
                Err(_) if hb[0] == memkv_tls::HANDSHAKE_RECORD && hb[1] == 3 => {
                    return End::Refused(ErrorCode::BadMagic, TLS_REFUSED.into())
                }
                Err(e) => return e.into(),
            };
            if !self.ready() {
                if let Err(end) = self.check_handshake_frame(&h) {
                    return end;
                }
            }
            // Refused before its body is read: the body has no meaning, so it is a peer error.
            if h.body_len != 0 && matches!(h.opcode, Opcode::Hello | Opcode::Ping | Opcode::Stats) {
                return ProtoError::Malformed("HELLO, PING and STATS carry no body").into();
            }
            let mut deadline =
                (self.io.timing).deadline(u64::from(h.body_len).saturating_add(h.payload_len));
            if !self.ready() {
                deadline = deadline.min(self.handshake_until);
            }
            let Some(_share) = self.take(h.body_len as u64, deadline) else {
                return self.busy();
            };
            let mut body = vec![0u8; h.body_len as usize];
            if let Err(e) = self.io.read_exact(&mut body, deadline, |_| {}) {
                return e.into();
            }
            let m = &self.ctx.store.metrics;
            m.requests.fetch_add(1, Ordering::Relaxed);
            if let Err(end) = self.handle(&h, &body, deadline) {
                return end;
            }
        }
    }

    /// Before the handshake only an empty HELLO and a 32-byte AUTH are read; anything else is
    /// refused before its body is read, so a peer without the key costs no buffer memory.
    fn check_handshake_frame(&self, h: &Header) -> Result<(), End> {
        let want = match h.opcode {
            Opcode::Hello => 0,
            Opcode::Auth if self.greeted && !self.authed => NONCE_LEN as u32,
            _ => {
                let why = if self.greeted {
                    "authenticate first"
                } else {
                    "send HELLO first"
                };
                return Err(End::Refused(ErrorCode::Unauthenticated, why.into()));
            }
        };
        if h.body_len != want {
            return Err(ProtoError::Malformed("handshake frame of the wrong length").into());
        }
        Ok(())
    }

    /// `bytes` of the byte budget, waiting for it until `deadline`, or until the request falls
    /// behind its pace (the wait moves none of its bytes) if that comes first.
    pub(crate) fn take(&self, bytes: u64, deadline: Instant) -> Option<BudgetShare<'a>> {
        self.ctx.budget.take(bytes, self.io.keep_pace(deadline))
    }

    pub(crate) fn busy(&self) -> End {
        End::Refused(
            ErrorCode::Busy,
            "server buffer memory stayed in use until the request's deadline".into(),
        )
    }

    fn handle(&mut self, h: &Header, body: &[u8], deadline: Instant) -> Result<(), End> {
        let store = &*self.ctx.store;
        match h.opcode {
            Opcode::Hello => {
                let mut nonce = [0u8; NONCE_LEN];
                getrandom::fill(&mut nonce)
                    .map_err(|e| End::Io(io::Error::other(e.to_string())))?;
                self.nonce = Some(nonce);
                self.greeted = true;
                let mut named_by_certificate = false;
                if let Some(id) = self.client_identity() {
                    tracing::debug!(peer = %self.io.transport().peer(), subject = %id.subject,
                        "client certificate");
                    // Under mutual TLS a verified certificate whose subject names a tenant is
                    // that tenant's credential: the connection is authenticated, no AUTH.
                    if let Some(t) = store.tenants.by_subject(&id.subject) {
                        self.tenant = t;
                        self.authed = true;
                        named_by_certificate = true;
                    }
                }
                if self.ready() {
                    self.permit.authenticated();
                } else {
                    self.permit.greeted();
                }
                let reply = HelloReply {
                    auth_required: !self.authed,
                    nonce,
                    max_value_len: store.max_value_len,
                    // A certificate named the tenant: no AUTH reply will tell the client, so
                    // this one does, if the client said it reads it (older ones would not).
                    tenant: (named_by_certificate && self.io.transport().reads_hello_tenant())
                        .then(|| store.tenants.get(self.tenant).info()),
                };
                self.reply(h, &reply.encode())
            }
            Opcode::Auth => {
                let tenants = &store.tenants;
                let (true, Some(nonce)) = (tenants.auth_required(), self.nonce) else {
                    return Err(End::Refused(
                        ErrorCode::Malformed,
                        "AUTH without a challenge".into(),
                    ));
                };
                let Some(tenant) = tenants.by_answer(&nonce, body) else {
                    return Err(End::Refused(ErrorCode::AuthFailed, "wrong auth key".into()));
                };
                self.tenant = tenant;
                self.authed = true;
                self.permit.authenticated();
                // Tells a client with tenants its prefix; empty (as before tenants) otherwise.
                let info = if tenants.is_named() {
                    tenants.get(tenant).info().encode()
                } else {
                    Vec::new()
                };
                self.reply(h, &info)
            }
            Opcode::Ping => self.reply(h, &[]),
            Opcode::Stats => self.reply(h, store.stats_json().as_bytes()),
            Opcode::Exists => self.exists(h, body, deadline),
            Opcode::Delete => self.delete(h, body, deadline),
            Opcode::RdmaHello => self.rdma_hello(h, body),
            Opcode::Put | Opcode::Get if h.flags & proto::FLAG_RDMA != 0 => {
                self.rdma_transfer(h, body, deadline)
            }
            Opcode::ShmRegion => self.shm_region(h, body),
            Opcode::ShmValues => self.shm_values(h, body),
            Opcode::GetMapped => self.get_mapped(h, body, deadline),
            Opcode::ShmRelease => self.shm_release(h, body, deadline),
            Opcode::Put if h.flags & proto::FLAG_SHM != 0 => self.shm_put(h, body, deadline),
            Opcode::Get if h.flags & proto::FLAG_SHM != 0 => self.shm_get(h, body, deadline),
            Opcode::Put => self.put(h, body, deadline),
            Opcode::Get => self.get(h, body, deadline),
            _ => Err(ProtoError::Malformed("a reply opcode sent as a request").into()),
        }
    }

    /// A reply without payload, due within the frame deadline for its size.
    pub(crate) fn reply(&mut self, h: &Header, body: &[u8]) -> Result<(), End> {
        let deadline = self.io.timing.deadline(body.len() as u64);
        let mut w = self.io.writer(deadline);
        proto::io::write_frame(&mut w, h.opcode.reply(), h.request_id, body, &[]).map_err(write_end)
    }

    /// The error frame before closing; a peer that does not take it within a second loses it.
    fn send_error(&mut self, code: ErrorCode, msg: &str) {
        let body = proto::encode_error(code, msg);
        let mut w = self.io.writer(Instant::now() + Duration::from_secs(1));
        let _ = proto::io::write_frame(&mut w, Opcode::Error, 0, &body, &[]);
    }
}
