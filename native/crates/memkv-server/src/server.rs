//! The accept loop, connection slots, the metrics endpoint and graceful shutdown.

use std::io;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use memkv_proto::{self as proto, ErrorCode, Opcode};
use memkv_tls::{ServerTls, ServerTlsFiles};

use crate::conn::{self, ConnCtx};
use crate::disk::{DiskConfig, DiskTier};
use crate::frame::Timing;
use crate::limits::{self, ByteBudget, ConnLimits, WarnLimiter};
use crate::metrics_http;
use crate::rdma::{RdmaConfig, ServerFabric};
use crate::shm::{ShmConfig, ShmListener, ShmShared};
use crate::store::Store;
use crate::tenants::Tenants;
use crate::tls::TlsTransport;
use crate::transport::{TcpTransport, Transport};
use crate::verify::Verifier;

/// Stack of a connection thread: the deepest path (a GET reply) needs a few KiB; the default
/// 2 MiB per thread would only inflate the address space at a thousand connections.
const CONN_STACK: usize = 256 << 10;

/// Pending connections the kernel queues before `accept`.
const ACCEPT_BACKLOG: i32 = 4096;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: String,
    pub memory: u64,
    pub lanes: usize,
    /// The one key every client shares (the implicit tenant); None with `tenants` or without
    /// auth.
    pub auth_key: Option<Vec<u8>>,
    /// The tenants of `--tenants FILE` (each with its own credential, prefix and quota).
    pub tenants: Option<Tenants>,
    pub metrics_listen: Option<String>,
    pub max_connections: usize,
    /// Share of each lane's memory that may be pinned: leased, or being sent or received.
    pub max_leased_fraction: f64,
    /// Allowance of any frame on top of its bytes at `min_rate`.
    pub frame_timeout: Duration,
    /// Slowest transfer accepted (bytes per second) for a request or reply.
    pub min_rate: u64,
    /// Longest a new connection may take to finish its handshake.
    pub handshake_timeout: Duration,
    /// Bytes of request bodies and reply tables held at once over all connections; None:
    /// `default_buffer_budget(memory)`.
    pub buffer_budget: Option<u64>,
    /// How long shutdown waits for open connections to finish their requests.
    pub drain_timeout: Duration,
    /// Serve the RDMA data path too (libfabric, loaded now); None: TCP only.
    pub rdma: Option<RdmaConfig>,
    /// Serve the same-host data path on a unix socket (`crate::shm`); None: off.
    pub shm: Option<ShmConfig>,
    /// The disk tier behind DRAM (`crate::disk`); None: DRAM only. Its spill queue's staging
    /// memory is taken out of `memory`.
    pub disk: Option<DiskConfig>,
    /// TLS 1.3 on the TCP listener (`crate::tls`); None: plaintext.
    pub tls: Option<ServerTlsFiles>,
    /// Serve RDMA beside TLS: its one-sided transfers move values outside TLS, in clear.
    pub tls_allow_rdma: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:7390".into(),
            memory: 1 << 30,
            lanes: 4,
            auth_key: None,
            tenants: None,
            metrics_listen: None,
            max_connections: 1024,
            max_leased_fraction: 0.5,
            frame_timeout: Duration::from_secs(30),
            min_rate: 1 << 20,
            handshake_timeout: Duration::from_secs(10),
            buffer_budget: None,
            drain_timeout: Duration::from_secs(10),
            rdma: None,
            shm: Some(ShmConfig::default()),
            disk: None,
            tls: None,
            tls_allow_rdma: false,
        }
    }
}

/// The buffer budget when none is given: a quarter of the value memory, at least 64 MiB (four
/// largest control bodies) and at most 1 GiB.
pub fn default_buffer_budget(memory: u64) -> u64 {
    (memory / 4).clamp(64 << 20, 1 << 30)
}

/// A running server. Dropping it does not stop it; call `shutdown` then `wait`.
pub struct Server {
    pub addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    /// Where the same-host data path listens (`@name` for an abstract socket), when it is on.
    pub shm_socket: Option<String>,
    shm: Option<Arc<ShmShared>>,
    pub store: Arc<Store>,
    shutdown: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    limits: Arc<ConnLimits>,
    drain_timeout: Duration,
    tls: Option<Arc<ServerTls>>,
}

/// `addr` as one or more socket addresses, or an error that says what is expected.
fn resolve(flag: &str, addr: &str) -> io::Result<Vec<SocketAddr>> {
    let bad = |why: String| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{flag} {addr:?}: expected HOST:PORT (e.g. 127.0.0.1:7390): {why}"),
        )
    };
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| bad(e.to_string()))?
        .collect();
    if addrs.is_empty() {
        return Err(bad("no address".into()));
    }
    Ok(addrs)
}

impl Server {
    /// Reserves memory, binds the listeners and starts serving in background threads.
    pub fn start(mut cfg: ServerConfig) -> io::Result<Server> {
        let listen = resolve("--listen", &cfg.listen)?;
        let tenants = match (&cfg.tenants, &cfg.auth_key) {
            (Some(_), Some(_)) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "--tenants and --auth-key: give one (each tenant has its own auth_key)",
                ))
            }
            (Some(t), None) => t.clone(),
            (None, key) => Tenants::implicit(key.clone()),
        };
        let auth = tenants.auth_required();
        let tls = start_tls(&mut cfg)?;
        let staging = cfg.disk.as_ref().map_or(0, |d| d.queue_bytes);
        let lane_memory = cfg.memory.checked_sub(staging).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "--disk-queue must be smaller than --memory",
            )
        })?;
        let share_values = cfg.shm.as_ref().is_some_and(|c| c.share_values);
        if share_values && tenants.len() > 1 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "--shm-share-values and --tenants: a client that maps the shared value memory \
                 reads every value in it, whatever its tenant's prefix; give one",
            ));
        }
        let mut store = Store::with_tenants(
            lane_memory,
            cfg.lanes,
            cfg.max_leased_fraction,
            tenants,
            share_values,
        )
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("--memory: cannot reserve {} bytes: {e}", cfg.memory),
            )
        })?;
        if let Some(d) = &cfg.disk {
            store.attach_disk(DiskTier::open(d)?);
        }
        let store = Arc::new(store);
        let rdma = cfg
            .rdma
            .as_ref()
            .map(|c| ServerFabric::open(c, &store))
            .transpose()?
            .map(Arc::new);
        let listener = TcpListener::bind(&listen[..])?;
        // A deeper accept queue than std's 128 (the kernel caps it at somaxconn): a burst of
        // connections from an attacker must not make a client's SYN wait for a retransmit.
        // SAFETY: listen(2) on the socket we own; on Linux it updates the backlog in place.
        unsafe { libc::listen(listener.as_raw_fd(), ACCEPT_BACKLOG) };
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shm_listener = cfg
            .shm
            .as_ref()
            .map(|c| ShmListener::bind(c, addr))
            .transpose()?;
        let shm = cfg.shm.clone().map(|c| Arc::new(ShmShared::new(c)));
        let shutdown = Arc::new(AtomicBool::new(false));
        let budget = cfg
            .buffer_budget
            .unwrap_or_else(|| default_buffer_budget(cfg.memory));
        let ctx = Arc::new(ConnCtx {
            store: store.clone(),
            shutdown: shutdown.clone(),
            timing: Timing {
                frame_timeout: cfg.frame_timeout,
                min_rate: cfg.min_rate,
            },
            handshake_timeout: cfg.handshake_timeout,
            budget: ByteBudget::new(budget),
            verifier: Verifier::new(std::thread::available_parallelism().map_or(1, |n| n.get()))?,
            warn: WarnLimiter::new(10, Duration::from_secs(10)),
            rdma,
            shm: shm.clone(),
        });
        let rdma_endpoints = cfg.rdma.as_ref().map_or(0, |r| r.max_endpoints as u64);
        let max_connections = limits::fit_fd_limit(cfg.max_connections, rdma_endpoints);
        let limits = ConnLimits::new(max_connections, store.metrics.clone());
        let mut threads = Vec::new();
        let shm_socket = shm_listener.as_ref().map(|l| l.name.clone());
        if let Some(l) = shm_listener {
            let (ctx, lim) = (ctx.clone(), limits.clone());
            threads.push(
                std::thread::Builder::new()
                    .name("memkv-accept-shm".into())
                    .spawn(move || l.serve(ctx, lim))?,
            );
        }
        let lim = limits.clone();
        threads.push(
            std::thread::Builder::new()
                .name("memkv-accept".into())
                .spawn({
                    let tls = tls.clone();
                    move || accept_loop(listener, ctx, lim, tls)
                })?,
        );
        let mut metrics_addr = None;
        if let Some(m) = &cfg.metrics_listen {
            let at = resolve("--metrics", m)?;
            let http = TcpListener::bind(&at[..])
                .map_err(|e| io::Error::new(e.kind(), format!("metrics listener {m}: {e}")))?;
            http.set_nonblocking(true)?;
            let bound = http.local_addr()?;
            metrics_addr = Some(bound);
            if auth && !bound.ip().is_loopback() {
                tracing::warn!(
                    metrics = %m,
                    "--metrics serves counters without credentials to anyone who can reach it"
                );
            }
            let (store, stop) = (store.clone(), shutdown.clone());
            threads.push(
                std::thread::Builder::new()
                    .name("memkv-metrics".into())
                    .spawn(move || metrics_http::serve(http, &store, &stop))?,
            );
        }
        tracing::info!(
            listen = %addr,
            memory_bytes = store.lane_stats().capacity_bytes,
            lanes = store.lane_count(),
            max_value_bytes = store.max_value_len,
            auth,
            tenants = if store.tenants.is_named() {
                store.tenants.len()
            } else {
                0
            },
            tls = match &tls {
                Some(t) if t.mutual() => "mutual",
                Some(_) => "on",
                None => "off",
            },
            buffer_budget_bytes = budget,
            metrics = %metrics_addr.map_or("off".to_string(), |a| a.to_string()),
            shm_socket = shm_socket.as_deref().unwrap_or("off"),
            shm_share_values = share_values,
            "memkv serving"
        );
        Ok(Server {
            addr,
            metrics_addr,
            shm_socket,
            shm,
            store,
            shutdown,
            threads,
            limits,
            drain_timeout: cfg.drain_timeout,
            tls,
        })
    }

    /// Reads the TLS certificate and key files again (on SIGHUP): later handshakes present
    /// them, open connections go on with the keys they agreed. On an error the old certificate
    /// stays in use. Err when TLS is off.
    pub fn reload_tls(&self) -> Result<(), String> {
        let tls = self.tls.as_ref().ok_or("TLS is off (no --tls-cert)")?;
        tls.reload()
    }

    /// Bytes of client regions the same-host path has mapped now (0 when it is off).
    pub fn shm_mapped_bytes(&self) -> u64 {
        self.shm.as_ref().map_or(0, |s| s.mapped_bytes())
    }

    /// The flag that stops the server (set it from a signal handler).
    pub fn shutdown_flag(&self) -> Arc<AtomicBool> {
        self.shutdown.clone()
    }

    pub fn shutdown(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
    }

    /// Blocks until shutdown is requested, then drains: stops accepting, lets requests in flight
    /// finish (up to the drain timeout) and returns.
    pub fn wait(self) {
        for t in self.threads {
            let _ = t.join();
        }
        let open = self.limits.wait_all_closed(self.drain_timeout);
        // After the drain, so that the values of the last PUTs are written too.
        self.store.flush_to_disk();
        tracing::info!(open_connections = open, "memkv stopped");
    }
}

/// Loads the TLS files and settles what TLS rules out: RDMA without `tls_allow_rdma`, and the
/// same-host socket under mutual TLS without an auth key (nothing would check who connects).
fn start_tls(cfg: &mut ServerConfig) -> io::Result<Option<Arc<ServerTls>>> {
    let Some(files) = &cfg.tls else {
        return Ok(None);
    };
    let tls = ServerTls::new(files).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("--tls-cert/--tls-key: {e}"),
        )
    })?;
    if cfg.rdma.is_some() && !cfg.tls_allow_rdma {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "--rdma with --tls-cert: RDMA's one-sided transfers move values outside TLS, in \
             clear on the fabric; add --tls-allow-rdma to accept that (docs/tls.md)",
        ));
    }
    if tls.mutual() && cfg.auth_key.is_none() && cfg.shm.take().is_some() {
        tracing::info!(
            "same-host socket off: under --tls-client-ca without --auth-key nothing would \
             check who connects to it (docs/tls.md)"
        );
    }
    Ok(Some(Arc::new(tls)))
}

fn accept_loop(
    listener: TcpListener,
    ctx: Arc<ConnCtx>,
    limits: Arc<ConnLimits>,
    tls: Option<Arc<ServerTls>>,
) {
    let fd = listener.as_raw_fd();
    match tls {
        None => serve_accepted(fd, &ctx, &limits, || {
            let (stream, _) = listener.accept()?;
            TcpTransport::new(stream)
        }),
        Some(tls) => serve_accepted(fd, &ctx, &limits, || {
            let (stream, _) = listener.accept()?;
            let session = tls.connection().map_err(io::Error::other)?;
            Ok(TlsTransport::new(TcpTransport::new(stream)?, session))
        }),
    }
}

/// Until shutdown: waits for `fd` (a listener) to be readable, takes the next connection with
/// `accept` and serves it on a thread of its own under `limits`. Shared by the TCP listener
/// and the same-host unix socket (`crate::shm`).
pub(crate) fn serve_accepted<T: Transport + 'static>(
    fd: std::os::fd::RawFd,
    ctx: &Arc<ConnCtx>,
    limits: &Arc<ConnLimits>,
    mut accept: impl FnMut() -> io::Result<T>,
) {
    while !ctx.shutdown.load(Ordering::Relaxed) {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the listener we own, for the duration of the call.
        let r = unsafe { libc::poll(&mut pfd, 1, 200) };
        if r <= 0 {
            continue;
        }
        let t = match accept() {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                // Out of descriptors or memory: back off instead of spinning on the error.
                if let Some(dropped) = ctx.warn.allow() {
                    tracing::warn!(error = %e, dropped_warnings = dropped, "accept failed");
                }
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let Some(permit) = t.closer().ok().and_then(|c| limits.admit(c)) else {
            ctx.store.metrics.error("connection_limit");
            if let Some(dropped) = ctx.warn.allow() {
                tracing::warn!(
                    dropped_warnings = dropped,
                    "every connection slot is authenticated; refusing a connection"
                );
            }
            refuse(t, "too many connections");
            continue;
        };
        ctx.store
            .metrics
            .connections_accepted
            .fetch_add(1, Ordering::Relaxed);
        let ctx = ctx.clone();
        let spawned = std::thread::Builder::new()
            .name("memkv-conn".into())
            .stack_size(CONN_STACK)
            .spawn(move || conn::serve(t, &ctx, permit));
        if let Err(e) = spawned {
            // The closure (socket and permit) was dropped with the error: slot and socket freed.
            tracing::error!(error = %e, "cannot start a connection thread");
        }
    }
}

fn refuse<T: Transport>(mut t: T, msg: &str) {
    let body = proto::encode_error(ErrorCode::ShuttingDown, msg);
    let hdr = proto::Header::new(Opcode::Error, 0, body.len(), 0).encode();
    let parts = [io::IoSlice::new(&hdr), io::IoSlice::new(&body)];
    // One short write into an empty socket buffer; a peer that cannot take 50 bytes loses them.
    let _ = t.write_vectored(&parts, Duration::from_millis(100));
}

#[cfg(test)]
mod tests {
    use super::*;
    use memkv_proto::Header;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    fn call(s: &mut TcpStream, op: Opcode, body: &[u8], payload: &[u8]) -> (Header, Vec<u8>) {
        let h = Header::new(op, 1, body.len(), payload.len() as u64).encode();
        s.write_all(&h).unwrap();
        s.write_all(body).unwrap();
        s.write_all(payload).unwrap();
        let mut hb = [0u8; proto::HEADER_LEN];
        s.read_exact(&mut hb).unwrap();
        let h = Header::decode(&hb).unwrap();
        let mut b = vec![0u8; h.body_len as usize];
        s.read_exact(&mut b).unwrap();
        (h, b)
    }

    #[test]
    fn corruption_in_a_later_chunk_aborts_the_reply_and_drops_the_value() {
        let srv = Server::start(ServerConfig {
            listen: "127.0.0.1:0".into(),
            memory: 16 << 20,
            lanes: 1,
            ..ServerConfig::default()
        })
        .unwrap();
        let mut s = TcpStream::connect(srv.addr).unwrap();
        call(&mut s, Opcode::Hello, &[], &[]);
        let len = 3 * proto::CHECKSUM_CHUNK + 5;
        let val: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        let body = proto::encode_key_lens(&[b"big".as_slice()], &[len as u64]);
        call(&mut s, Opcode::Put, &body, &val);
        let v = srv.store.fetch_verified(b"big").ok().unwrap();
        v.span.corrupt_for_test(2 * proto::CHECKSUM_CHUNK + 7);
        drop(v);
        let get = Header::new(Opcode::Get, 2, body.len(), 0).encode();
        s.write_all(&get).unwrap();
        s.write_all(&body).unwrap();
        // The connection is aborted before the corrupt chunk: whatever arrived is a strict
        // prefix of the full reply, and no byte of it differs from what was stored.
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        let head = proto::HEADER_LEN + 4 + 9;
        assert!(
            got.len() <= head + 2 * proto::CHECKSUM_CHUNK,
            "no byte of the corrupt chunk may be sent"
        );
        if got.len() > head {
            assert_eq!(&got[head..], &val[..got.len() - head]);
        }
        assert!(
            srv.store.fetch_verified(b"big").is_err(),
            "corrupt value must be dropped"
        );
        assert_eq!(srv.store.metrics.errors("corrupt"), 1);
        srv.shutdown();
        srv.wait();
    }
}
