//! memkv client core: places keys on servers (rendezvous hashing), fans batches out per server
//! in parallel over pooled connections, and moves values between caller memory and sockets.
//!
//! Failure policy: nothing here panics on server input or runs past the operation's deadline
//! (`op_timeout`, one deadline for the whole call however the servers trickle their bytes). A key
//! whose server failed gets a `Status` saying how: `Timeout`, `Refused`, `AuthFailed`,
//! `ProtocolError`, or `Unavailable` (marked down after an earlier failure, or the connection
//! broke). Only such transport failures mark a server down; per-key statuses and a frame the
//! server refuses as too large do not.
//!
//! PUT outcomes: `Ok` means stored. `Timeout`, `Unavailable` and `ProtocolError` mean unknown:
//! the request may have reached the server before the failure, so the value may be stored (a
//! later GET returns exactly these bytes or a miss, never other bytes). Every other status means
//! not stored.

pub mod buf;
pub mod conn;
pub mod exec;
pub mod mapped;
pub mod placement;
pub mod pool;
pub mod rdma;
pub mod shm;
pub mod shm_regions;
pub mod status;
pub mod tls;
pub mod transport;

use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

pub use memkv_fabric::{memory, Memory};

pub use buf::Buf;
use conn::{Conn, ConnError};
pub use exec::{CompletionQueue, Executor, Lane, Op, OpResult};
pub use pool::{Failure, Health};
use pool::{Pool, PoolConfig};
pub use status::Status;
use transport::{Tcp, Transport};

/// Which transport to move bytes over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    #[default]
    Tcp,
    /// RDMA only: client creation fails when libfabric or its provider cannot be opened, and
    /// a connection fails when its server refuses RDMA.
    Rdma,
    /// A server on this host whose same-host socket answers gets the shared-memory transport
    /// (not when GPU memory is asked for: it moves host memory only). Otherwise RDMA when
    /// libfabric and a provider open (else TCP, with one log line saying why); a server that
    /// refuses RDMA gets that connection's values over TCP. Without a named provider only RDMA
    /// hardware ones are tried (`AUTO_PROVIDERS`).
    Auto,
    /// The shared-memory transport only (`crate::shm`): a connection fails when its server is
    /// not on this host or its same-host socket does not answer.
    Shm,
}

/// Providers `auto` tries when none is named: those that drive RDMA hardware. libfabric lists
/// its software providers (`tcp`, `sockets`) on every host, and they are slower than plain TCP,
/// so they are used only when named (`MEMKV_RDMA_PROVIDER`, `rdma_provider`).
pub const AUTO_PROVIDERS: [&str; 2] = ["verbs", "efa"];

/// Why the TCP transport moves no GPU memory.
const TCP_HOST_ONLY: &str = "the TCP transport moves host memory only (GPU memory needs \
     transport 'rdma' on a provider that registers it, FI_HMEM)";

/// The startup log's words on GPU memory.
fn gpu_memory_line(r: &rdma::Rdma) -> String {
    match r.gpu_memory() {
        Ok(how) => format!("yes: {how}"),
        Err(why) => format!("no: {why}"),
    }
}

/// `auto`'s RDMA transport: the named provider, else the first of `AUTO_PROVIDERS` that opens.
fn open_auto(
    provider: Option<&str>,
    devices: &[String],
    gpu_memory: bool,
) -> Result<rdma::Rdma, String> {
    if provider.is_some() {
        return rdma::Rdma::open(provider, devices, false, gpu_memory);
    }
    let mut why = Vec::new();
    for p in AUTO_PROVIDERS {
        match rdma::Rdma::open(Some(p), devices, false, gpu_memory) {
            Ok(r) => return Ok(r),
            Err(e) => why.push(format!("{p}: {e}")),
        }
    }
    Err(format!(
        "no RDMA hardware provider opened ({}); software providers are used only when \
         MEMKV_RDMA_PROVIDER names one",
        why.join("; ")
    ))
}

/// Why RDMA is not used under TLS (`auto` then uses TCP), or the error refusing transport
/// `rdma`; None when TLS is off or `tls_allow_rdma` accepts values outside it.
fn tls_refuses_rdma(cfg: &ClientConfig) -> Result<Option<&'static str>, String> {
    const WHY: &str = "RDMA's one-sided transfers move values outside TLS, in clear on the \
         fabric; set tls.allow_rdma (MEMKV_TLS_ALLOW_RDMA=1) to accept that";
    if cfg.tls.is_none() || cfg.tls_allow_rdma {
        return Ok(None);
    }
    if cfg.transport == TransportChoice::Rdma {
        return Err(format!(
            "transport 'rdma' with tls: {WHY}, or use transport tcp"
        ));
    }
    Ok(Some(WHY))
}

#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// `host:port` of every server; put in canonical form (`placement::canonical_server`).
    pub servers: Vec<String>,
    pub auth_key: Option<Vec<u8>>,
    pub connections_per_server: usize,
    pub connect_timeout: Duration,
    /// Deadline of one whole operation (all its servers, frames and bytes).
    pub op_timeout: Duration,
    /// Threads running submitted (asynchronous) operations.
    pub io_threads: usize,
    pub transport: TransportChoice,
    /// RDMA devices to use (empty = all); only meaningful with an RDMA transport. For
    /// libfabric these are domain names (`mlx5_0`; for the tcp provider, interfaces: `lo`).
    pub rdma_devices: Vec<String>,
    /// libfabric provider (`verbs`, `efa`, `tcp`); None: `MEMKV_RDMA_PROVIDER`, else the first
    /// provider libfabric offers.
    pub rdma_provider: Option<String>,
    /// Ask the RDMA provider for a domain that also registers GPU memory (FI_HMEM), so that
    /// transfers may name CUDA device buffers (`Client::gpu_memory` says whether it has one).
    /// Asked only when wanted: a provider without it still serves host memory.
    pub gpu_memory: bool,
    /// TLS 1.3 on every TCP link (data, and RDMA's control path); None: plaintext.
    pub tls: Option<memkv_tls::ClientTlsFiles>,
    /// With `tls`, still move values by RDMA (outside TLS, in clear on the fabric): without it
    /// transport `rdma` is refused and `auto` does not try RDMA.
    pub tls_allow_rdma: bool,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            servers: vec!["127.0.0.1:7390".into()],
            auth_key: None,
            connections_per_server: 8,
            connect_timeout: Duration::from_secs(1),
            op_timeout: Duration::from_secs(10),
            io_threads: 8,
            transport: TransportChoice::Tcp,
            rdma_devices: Vec::new(),
            rdma_provider: None,
            gpu_memory: false,
            tls: None,
            tls_allow_rdma: false,
        }
    }
}

/// Per-server answer of `ping` / `stats`.
pub type PerServer<T> = Vec<(String, Result<T, String>)>;

/// Request body bytes per frame besides the keys (count, and EXISTS' lease field).
const FRAME_FIXED: usize = 8;

/// The kind of batch frame, for the body bytes each key adds to it.
#[derive(Clone, Copy)]
enum Frame {
    /// EXISTS, DELETE: key length and key.
    Keys,
    /// PUT, GET: key length, key and value length.
    KeyLens,
}

impl Frame {
    fn key_bytes(self, key: &[u8]) -> usize {
        2 + key.len()
            + match self {
                Frame::Keys => 0,
                Frame::KeyLens => 8,
            }
    }

    /// Keys per part when a server's share of a batch is split over its connections (one part
    /// per this many keys, rounded up, one connection each): each further part costs a thread
    /// hand-off, tens of microseconds. A value moves its bytes, so a few keys already pay for a
    /// part of their own (`values_per_part` makes it fewer for large values); a key-only lookup
    /// costs the server well under a microsecond, so a batch of up to 2,048 keys is answered
    /// sooner on one connection (a 1,000-key EXISTS took 75 us on one against 104 us split over
    /// two, see docs/benchmarks.md).
    fn keys_per_part(self) -> usize {
        match self {
            Frame::Keys => 2048,
            Frame::KeyLens => 4,
        }
    }
}

/// How `Client::fan_out` cuts a batch: its frames' kind, and one part (a connection of its own)
/// per `keys_per_part` keys, up to the server's connection count.
#[derive(Clone, Copy)]
struct Cut {
    frame: Frame,
    keys_per_part: usize,
}

impl From<Frame> for Cut {
    fn from(frame: Frame) -> Cut {
        Cut {
            frame,
            keys_per_part: frame.keys_per_part(),
        }
    }
}

/// The bytes that pay for a part of their own when a PUT or GET is split over connections.
const PART_BYTES: usize = 1 << 20;

/// Values per part of a PUT or GET: as many as make `PART_BYTES` on average, one at least and
/// `Frame::KeyLens`'s bound at most. A 2 MiB value keeps a loopback connection busy for hundreds
/// of microseconds against the part's tens: such values go one per connection, so that a batch
/// of four uses four connections instead of queueing on one (a direct-mode job of 16 blocks
/// then keeps all eight of a server's connections busy, not four).
fn values_per_part(bufs: &[Buf]) -> usize {
    let total: usize = bufs.iter().map(|b| b.len).sum();
    let mean = (total / bufs.len().max(1)).max(1);
    PART_BYTES
        .div_ceil(mean)
        .clamp(1, Frame::KeyLens.keys_per_part())
}

/// Splits `idx` into runs that each fit one frame: at most `MAX_BATCH` keys and a control body
/// of at most `MAX_BODY_LEN` bytes, so the server never has to refuse a batch as too large.
fn frames<'a, K: AsRef<[u8]>>(idx: &'a [usize], keys: &[K], kind: Frame) -> Vec<&'a [usize]> {
    let max_body = memkv_proto::MAX_BODY_LEN as usize - FRAME_FIXED;
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (n, &i) in idx.iter().enumerate() {
        let b = kind.key_bytes(keys[i].as_ref());
        if n > start && (n - start == memkv_proto::MAX_BATCH || bytes + b > max_body) {
            out.push(&idx[start..n]);
            (start, bytes) = (n, 0);
        }
        bytes += b;
    }
    if start < idx.len() {
        out.push(&idx[start..]);
    }
    out
}

pub struct Client {
    pools: Vec<Pool>,
    placement: placement::Placement,
    cfg: ClientConfig,
    exec: Executor,
    /// The RDMA transport's registrations, when values move by RDMA.
    registrations: Option<Arc<memkv_fabric::MrCache>>,
    /// The libfabric provider values move through; None over TCP.
    rdma_provider: Option<String>,
    /// Registered memory the shared-memory transport can hand servers, when it may be used.
    shm_regions: Option<Arc<shm_regions::Regions>>,
    /// The same-host path, when the transport may take it (`shm`, `auto`).
    same_host: Option<Arc<shm::Shm>>,
    /// Reads out of same-host servers' memory, once enabled (`enable_mapped_reads`).
    mapped: std::sync::OnceLock<mapped::MappedReads>,
}

impl Client {
    pub fn new(mut cfg: ClientConfig) -> Result<Arc<Client>, String> {
        if cfg.servers.is_empty() {
            return Err("no memkv servers configured".into());
        }
        let mut ids: Vec<String> = Vec::with_capacity(cfg.servers.len());
        for s in &cfg.servers {
            let c = placement::canonical_server(s)?;
            if ids.contains(&c) {
                return Err(format!("server '{c}' is listed twice"));
            }
            ids.push(c);
        }
        cfg.servers = ids.clone();
        let provider = cfg.rdma_provider.clone().or_else(|| {
            std::env::var("MEMKV_RDMA_PROVIDER")
                .ok()
                .filter(|p| !p.is_empty())
        });
        let mut registrations = None;
        let mut rdma_provider = None;
        // MEMKV_SHM_SOCKET names the same-host socket (`@name` abstract, else a path) when the
        // server's is not the one derived from its address (`memkv serve --shm-socket` reads
        // the same variable; its `auto` and `off` leave the derived name).
        let shm_socket = std::env::var("MEMKV_SHM_SOCKET")
            .ok()
            .filter(|p| !matches!(p.as_str(), "" | "auto" | "off"));
        let tcp = match &cfg.tls {
            Some(files) => Tcp::tls(Arc::new(
                memkv_tls::ClientTls::new(files).map_err(|e| format!("tls: {e}"))?,
            )),
            None => Tcp::plain(),
        };
        let rdma_refused = tls_refuses_rdma(&cfg)?;
        // `auto` under TLS keeps every link under TLS: no same-host socket (it carries no TLS).
        let shm_regions = matches!(cfg.transport, TransportChoice::Shm)
            || (cfg.transport == TransportChoice::Auto && !cfg.gpu_memory && !tcp.is_tls());
        let shm_regions = shm_regions.then(|| Arc::new(shm_regions::Regions::default()));
        // The same-host path, when the transport may take it: `shm` itself, or tried first by
        // `auto`.
        let same_host = shm_regions
            .as_ref()
            .map(|r| Arc::new(shm::Shm::new(r.clone(), shm_socket.clone())));
        let transport: Arc<dyn Transport> = match cfg.transport {
            TransportChoice::Tcp => Arc::new(tcp),
            TransportChoice::Shm => {
                let shm = same_host.clone().expect("made for shm");
                tracing::info!(
                    socket = shm_socket
                        .as_deref()
                        .unwrap_or("derived from each server's address"),
                    "memkv transport 'shm'"
                );
                if tcp.is_tls() {
                    tracing::info!(
                        "memkv transport 'shm': the same-host socket never leaves this host \
                         and carries no TLS; the tls settings are not used"
                    );
                }
                shm
            }
            TransportChoice::Rdma => {
                let r =
                    rdma::Rdma::open(provider.as_deref(), &cfg.rdma_devices, true, cfg.gpu_memory)
                        .map_err(|e| format!("transport 'rdma': {e}"))?
                        .control_over(tcp);
                tracing::info!(
                    provider = r.provider(),
                    domain = r.domain(),
                    gpu_memory = %gpu_memory_line(&r),
                    "memkv transport 'rdma'"
                );
                registrations = Some(r.cache().clone());
                rdma_provider = Some(r.provider().to_string());
                Arc::new(r)
            }
            TransportChoice::Auto => {
                let rdma = match rdma_refused {
                    Some(why) => Err(why.to_string()),
                    None => open_auto(provider.as_deref(), &cfg.rdma_devices, cfg.gpu_memory),
                };
                match rdma {
                    Ok(r) => {
                        let r = r.control_over(tcp);
                        tracing::info!(
                            provider = r.provider(),
                            domain = r.domain(),
                            gpu_memory = %gpu_memory_line(&r),
                            "memkv transport 'auto': using RDMA"
                        );
                        registrations = Some(r.cache().clone());
                        rdma_provider = Some(r.provider().to_string());
                        Arc::new(r)
                    }
                    Err(e) => {
                        static SAID: Once = Once::new();
                        SAID.call_once(|| {
                            tracing::info!(rdma_devices = ?cfg.rdma_devices, reason = %e,
                                "memkv transport 'auto': no usable RDMA; using TCP");
                        });
                        Arc::new(tcp)
                    }
                }
            }
        };
        let transport: Arc<dyn Transport> = match (&same_host, cfg.transport) {
            (Some(shm), TransportChoice::Auto) => Arc::new(shm::SameHostFirst {
                shm: shm.clone(),
                other: transport,
            }),
            _ => transport,
        };
        let pc = Arc::new(PoolConfig {
            auth_key: cfg.auth_key.clone(),
            max_connections: cfg.connections_per_server.max(1),
            connect_timeout: cfg.connect_timeout,
            transport,
        });
        let pools = ids
            .iter()
            .map(|s| Pool::new(s.clone(), pc.clone()))
            .collect();
        Ok(Arc::new(Client {
            pools,
            placement: placement::Placement::new(&ids),
            exec: Executor::new(cfg.io_threads.max(1)),
            cfg,
            registrations,
            rdma_provider,
            shm_regions,
            same_host,
            mapped: std::sync::OnceLock::new(),
        }))
    }

    /// Registers `[ptr, ptr + len)` with the RDMA transport as one region (e.g. a whole pool of
    /// blocks, so that its blocks share one registration instead of one each); a no-op over TCP.
    /// Host memory or, where `gpu_memory()` is Ok, CUDA device memory (found out here); GPU
    /// memory the transport cannot reach is an error. With the shared-memory transport, memory
    /// that is a shared mapping of a memfd or /dev/shm file becomes a region servers on this
    /// host copy values into and out of; other memory moves over the socket (never an error).
    ///
    /// # Safety
    /// The memory must stay mapped until `unregister_memory(ptr)`.
    pub unsafe fn register_memory(&self, ptr: usize, len: usize) -> Result<(), String> {
        if let Some(r) = &self.shm_regions {
            if let Err(why) = r.register(ptr, len) {
                tracing::info!(ptr = format!("{ptr:#x}"), len, reason = %why,
                    "memkv transport 'shm': not a shared-memory region; its values go over the socket");
            }
        }
        match &self.registrations {
            Some(c) => c.pin(ptr, len).map_err(|e| e.to_string()),
            None => match memkv_fabric::memory::locate(ptr) {
                Memory::Host => Ok(()),
                mem => Err(format!(
                    "cannot register {mem} at {ptr:#x}: {TCP_HOST_ONLY}"
                )),
            },
        }
    }

    /// Ok (how) when transfers may name GPU memory: the transport is RDMA and its domain
    /// registers CUDA device memory. Else why not.
    pub fn gpu_memory(&self) -> Result<String, String> {
        match &self.registrations {
            Some(c) => c
                .fabric()
                .device_memory()
                .map(String::from)
                .map_err(String::from),
            None => Err(TCP_HOST_ONLY.into()),
        }
    }

    /// Checks that every buffer is memory this client's transport can move: host memory, or GPU
    /// memory where `gpu_memory()` is Ok. A transfer must not be given any other: TCP would
    /// hand a device pointer to the kernel's socket calls, a provider without FI_HMEM to its
    /// CPU copies. Costless in a process without the CUDA driver; else one driver query per
    /// buffer not inside a registered region.
    pub fn check_buffers(&self, bufs: &[Buf]) -> Result<(), String> {
        if !memkv_fabric::memory::cuda_loaded() {
            return Ok(());
        }
        let Err(why) = self.gpu_memory() else {
            return Ok(()); // every kind of memory moves
        };
        for (i, b) in bufs.iter().enumerate().filter(|(_, b)| b.len > 0) {
            let mem = match &self.registrations {
                Some(c) => c.memory_of(b.ptr, b.len),
                None => memkv_fabric::memory::locate(b.ptr),
            };
            if let Memory::Cuda(_) = mem {
                return Err(format!(
                    "buffer {i} at {:#x} is {mem}, which this client cannot move: {why}",
                    b.ptr
                ));
            }
        }
        Ok(())
    }

    /// Undoes `register_memory(ptr, ..)`; no transfer touching the region may be running.
    pub fn unregister_memory(&self, ptr: usize) {
        if let Some(r) = &self.shm_regions {
            r.unregister(ptr);
        }
        if let Some(c) = &self.registrations {
            c.unpin(ptr);
        }
    }

    pub fn config(&self) -> &ClientConfig {
        &self.cfg
    }

    /// The libfabric provider values move through (`verbs`, `tcp`, ...); None over TCP.
    pub fn rdma_provider(&self) -> Option<&str> {
        self.rdma_provider.as_deref()
    }

    /// Whether `[ptr, ptr + len)` lies in a region the shared-memory transport hands servers on
    /// this host (its transfers to them move by the server's copies, not over a socket).
    pub fn shm_region_covers(&self, ptr: usize, len: usize) -> bool {
        self.shm_regions
            .as_ref()
            .is_some_and(|r| r.find(ptr, len).is_some())
    }

    /// Index of the server that owns `key`.
    pub fn server_of(&self, key: &[u8]) -> usize {
        self.placement.owner(key)
    }

    /// The deadline of an operation starting now (`op_timeout` from now); submitted operations
    /// take theirs when they are submitted (`*_by`), so waiting for an I/O thread counts too.
    pub fn deadline(&self) -> Instant {
        Instant::now() + self.cfg.op_timeout
    }

    pub fn exists<K: AsRef<[u8]> + Sync>(&self, keys: &[K], lease_ms: u32) -> Vec<(Status, u64)> {
        self.exists_by(keys, lease_ms, self.deadline())
    }

    /// `exists` with a deadline of the caller's.
    pub fn exists_by<K: AsRef<[u8]> + Sync>(
        &self,
        keys: &[K],
        lease_ms: u32,
        deadline: Instant,
    ) -> Vec<(Status, u64)> {
        let mut out = vec![(Status::InvalidKey, 0); keys.len()];
        self.fan_out(
            deadline,
            keys,
            Frame::Keys.into(),
            &mut out,
            |s| (s, 0),
            |c, idx| {
                let ks: Vec<&[u8]> = idx.iter().map(|&i| keys[i].as_ref()).collect();
                c.exists(&ks, lease_ms)
            },
        );
        out
    }

    pub fn delete<K: AsRef<[u8]> + Sync>(&self, keys: &[K]) -> Vec<Status> {
        self.delete_by(keys, self.deadline())
    }

    /// `delete` with a deadline of the caller's.
    pub fn delete_by<K: AsRef<[u8]> + Sync>(&self, keys: &[K], deadline: Instant) -> Vec<Status> {
        let mut out = vec![Status::InvalidKey; keys.len()];
        self.fan_out(
            deadline,
            keys,
            Frame::Keys.into(),
            &mut out,
            |s| s,
            |c, idx| {
                let ks: Vec<&[u8]> = idx.iter().map(|&i| keys[i].as_ref()).collect();
                c.delete(&ks)
            },
        );
        out
    }

    /// Stores each key's bytes from caller memory. Values become visible atomically per key.
    /// See the crate documentation for what a failed PUT's status says about the value.
    ///
    /// # Safety
    /// Every `Buf` must stay valid for reads until this returns.
    pub unsafe fn put(&self, keys: &[Vec<u8>], bufs: &[Buf]) -> Vec<Status> {
        self.transfer(keys, bufs, true, self.deadline())
    }

    /// `put` with a deadline of the caller's.
    ///
    /// # Safety
    /// As for `put`.
    pub unsafe fn put_by(&self, keys: &[Vec<u8>], bufs: &[Buf], deadline: Instant) -> Vec<Status> {
        self.transfer(keys, bufs, true, deadline)
    }

    /// Reads each key's value into caller memory. A buffer is written only after the server
    /// answered Ok for its key with exactly its length; if the transfer then fails part-way
    /// (`Timeout`, `Unavailable`, `ProtocolError`), that key's buffer may hold part of the value.
    /// Buffers of keys with any other status keep their bytes, and no buffer is written after
    /// this returns.
    ///
    /// # Safety
    /// Every `Buf` must stay valid for writes, and not be accessed by anyone else, until this
    /// returns. Buffers must not overlap.
    pub unsafe fn get(&self, keys: &[Vec<u8>], bufs: &[Buf]) -> Vec<Status> {
        self.transfer(keys, bufs, false, self.deadline())
    }

    /// `get` with a deadline of the caller's.
    ///
    /// # Safety
    /// As for `get`.
    pub unsafe fn get_by(&self, keys: &[Vec<u8>], bufs: &[Buf], deadline: Instant) -> Vec<Status> {
        self.transfer(keys, bufs, false, deadline)
    }

    fn transfer(
        &self,
        keys: &[Vec<u8>],
        bufs: &[Buf],
        put: bool,
        deadline: Instant,
    ) -> Vec<Status> {
        assert_eq!(keys.len(), bufs.len(), "one buffer per key");
        let mut out = vec![Status::InvalidKey; keys.len()];
        self.fan_out(
            deadline,
            keys,
            Cut {
                frame: Frame::KeyLens,
                keys_per_part: values_per_part(bufs),
            },
            &mut out,
            |s| s,
            |c, idx| {
                // Values bigger than a server accepts are refused here rather than sent and discarded.
                let max = c.max_value_len as usize;
                let (ok, too_big): (Vec<usize>, Vec<usize>) =
                    idx.iter().partition(|&&i| !put || bufs[i].len <= max);
                let ks: Vec<&[u8]> = ok.iter().map(|&i| keys[i].as_slice()).collect();
                let bs: Vec<Buf> = ok.iter().map(|&i| bufs[i]).collect();
                let st = if ks.is_empty() {
                    vec![]
                } else if put {
                    c.put(&ks, &bs)?
                } else {
                    c.get(&ks, &bs)?
                };
                let mut res: Vec<(usize, Status)> = ok.into_iter().zip(st).collect();
                res.extend(too_big.into_iter().map(|i| (i, Status::TooLarge)));
                res.sort_unstable_by_key(|(i, _)| *i);
                Ok(res.into_iter().map(|(_, s)| s).collect())
            },
        );
        out
    }

    pub fn ping(&self) -> PerServer<Duration> {
        let deadline = self.deadline();
        self.pools
            .iter()
            .map(|p| {
                let t = Instant::now();
                let r = p
                    .with_conn(deadline, |c| c.ping())
                    .map(|_| t.elapsed())
                    .map_err(|e| e.to_string());
                (p.addr.clone(), r)
            })
            .collect()
    }

    pub fn stats(&self) -> PerServer<String> {
        let deadline = self.deadline();
        self.pools
            .iter()
            .map(|p| {
                (
                    p.addr.clone(),
                    p.with_conn(deadline, |c| c.stats())
                        .map_err(|e| e.to_string()),
                )
            })
            .collect()
    }

    /// The tenant our credential names on each server (None from a server without tenants),
    /// from a connection's handshake (made now if none is open).
    pub fn tenants(&self) -> PerServer<Option<memkv_proto::TenantInfo>> {
        let deadline = self.deadline();
        self.pools
            .iter()
            .map(|p| {
                let r = p.with_conn(deadline, |c| Ok(c.tenant.clone()));
                (p.addr.clone(), r.map_err(|e| e.to_string()))
            })
            .collect()
    }

    /// Each server's state as this client sees it: up or down, and the last failure's reason.
    pub fn health(&self) -> Vec<Health> {
        self.pools.iter().map(Pool::health).collect()
    }

    /// Runs `f` for each (server, key indices) group in parallel, splitting a server's group over
    /// its connections when it has several (`cut`'s keys per connection, at least) and
    /// each connection's share into frames that fit the protocol's limits, all under `deadline`. Writes each key's result into `out`; keys of a
    /// failed server or connection get `fail(status of the failure)`. Invalid keys never reach a
    /// server (they keep what `out` held).
    fn fan_out<K: AsRef<[u8]> + Sync, T: Copy + Send>(
        &self,
        deadline: Instant,
        keys: &[K],
        cut: Cut,
        out: &mut [T],
        fail: impl Fn(Status) -> T + Sync,
        f: impl Fn(&mut Conn, &[usize]) -> Result<Vec<T>, ConnError> + Sync,
    ) {
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); self.pools.len()];
        for (i, k) in keys.iter().enumerate() {
            let k = k.as_ref();
            if memkv_proto::key_ok(k) {
                groups[self.server_of(k)].push(i);
            }
        }
        let per = self.cfg.connections_per_server.max(1);
        let mut tasks: Vec<(usize, Vec<usize>)> = Vec::new();
        for (s, g) in groups
            .into_iter()
            .enumerate()
            .filter(|(_, g)| !g.is_empty())
        {
            let parts = per.min(g.len().div_ceil(cut.keys_per_part.max(1))).max(1);
            let chunk = g.len().div_ceil(parts);
            tasks.extend(g.chunks(chunk).map(|c| (s, c.to_vec())));
        }
        let run = |(s, idx): (usize, Vec<usize>)| -> (Vec<usize>, Vec<T>) {
            let pool = &self.pools[s];
            let mut res = Vec::with_capacity(idx.len());
            match pool.acquire(deadline) {
                Err(e) => res.resize(idx.len(), fail(e.status())),
                Ok(mut conn) => {
                    let mut broken: Option<Status> = None;
                    for fr in frames(&idx, keys, cut.frame) {
                        if let Some(st) = broken {
                            res.resize(res.len() + fr.len(), fail(st));
                            continue;
                        }
                        let r = f(&mut conn, fr).and_then(|v| {
                            if v.len() == fr.len() {
                                Ok(v)
                            } else {
                                Err(memkv_proto::ProtoError::Malformed("reply count").into())
                            }
                        });
                        match r {
                            Ok(v) => res.extend(v),
                            Err(e) => {
                                let st = e.status();
                                pool.fail(e);
                                broken = Some(st);
                                res.resize(res.len() + fr.len(), fail(st));
                            }
                        }
                    }
                    if broken.is_none() {
                        if conn.reusable() {
                            pool.release(conn);
                        } else {
                            pool.discard(conn);
                        }
                    }
                }
            }
            (idx, res)
        };
        let results: Vec<(Vec<usize>, Vec<T>)> = if tasks.len() <= 1 {
            tasks.into_iter().map(run).collect()
        } else {
            std::thread::scope(|sc| {
                let mut it = tasks.into_iter();
                let first = it.next().expect("two or more tasks");
                let handles: Vec<_> = it.map(|t| sc.spawn(|| run(t))).collect();
                let mut res = vec![run(first)];
                res.extend(
                    handles
                        .into_iter()
                        .map(|h| h.join().expect("fan-out task panicked")),
                );
                res
            })
        };
        for (idx, r) in results {
            idx.iter().zip(r).for_each(|(&i, s)| out[i] = s);
        }
    }

    /// Turns mapped reads on (`crate::mapped`): every server's lanes are mapped now and handed
    /// to `hook`. One result per server; a server that does not share its memory (or is not on
    /// this host, or is down) says why, and its keys' mapped reads answer UNAVAILABLE. Only the
    /// first call's hook counts.
    pub fn enable_mapped_reads(&self, hook: Arc<dyn mapped::MapHook>) -> Vec<Result<(), String>> {
        let Some(same_host) = &self.same_host else {
            let why = "mapped reads need the same-host path (transport shm or auto)";
            return vec![Err(why.to_string()); self.pools.len()];
        };
        // Only servers with an address of this host can share their memory: the others are
        // not asked (under `auto` that would cost a TCP connection each at start-up).
        let local = self
            .pools
            .iter()
            .map(|p| same_host.serves(&p.addr))
            .collect();
        let m = self
            .mapped
            .get_or_init(|| mapped::MappedReads::new(local, hook));
        m.open_all(&self.pools, self.deadline())
    }

    /// Where each key's value lies in this process's mappings of its server's memory (Ok and
    /// the address, else the status and 0), pinned there until `release_mapped` of the
    /// returned ticket (0: nothing pinned). `lens` are the expected lengths, as for GET. Keys
    /// answer UNAVAILABLE before `enable_mapped_reads`.
    pub fn get_mapped_by(
        &self,
        keys: &[Vec<u8>],
        lens: &[u64],
        deadline: Instant,
    ) -> (Vec<(Status, usize)>, u64) {
        assert_eq!(keys.len(), lens.len(), "one length per key");
        let Some(m) = self.mapped.get() else {
            return (vec![(Status::Unavailable, 0); keys.len()], 0);
        };
        let mut by_server: Vec<Vec<usize>> = vec![Vec::new(); self.pools.len()];
        for (i, k) in keys.iter().enumerate() {
            if memkv_proto::key_ok(k) {
                by_server[self.server_of(k)].push(i);
            }
        }
        let groups = by_server
            .into_iter()
            .enumerate()
            .filter(|(_, g)| !g.is_empty())
            .flat_map(|(s, g)| {
                frames(&g, keys, Frame::KeyLens)
                    .into_iter()
                    .map(move |f| (s, f.to_vec()))
                    .collect::<Vec<_>>()
            })
            .collect();
        m.get(&self.pools, keys, lens, groups, deadline)
    }

    /// Ends a `get_mapped_by`'s pins: true when the servers held every value until now, so
    /// what was read out of them is what was stored; false (read them as failed) otherwise.
    pub fn release_mapped(&self, ticket: u64) -> bool {
        self.mapped
            .get()
            .is_some_and(|m| m.release(&self.pools, ticket, self.deadline()))
    }

    /// Runs `job` on the I/O threads; the returned Op completes with its result.
    pub fn submit(self: &Arc<Self>, job: impl FnOnce(&Client) -> OpResult + Send + 'static) -> Op {
        self.submit_to(job, Lane::Urgent, None)
    }

    /// As `submit`, in `lane`; once the Op is complete its tag is pushed onto the queue
    /// (`exec`).
    pub fn submit_to(
        self: &Arc<Self>,
        job: impl FnOnce(&Client) -> OpResult + Send + 'static,
        lane: Lane,
        notify: Option<(CompletionQueue, u64)>,
    ) -> Op {
        let me = self.clone();
        self.exec.submit_to(move || job(&me), lane, notify)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_respect_key_count_and_body_limits() {
        let small: Vec<Vec<u8>> = (0..150_000u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let idx: Vec<usize> = (0..small.len()).collect();
        let f = frames(&idx, &small, Frame::Keys);
        assert_eq!(
            f.iter().map(|f| f.len()).collect::<Vec<_>>(),
            [65_536, 65_536, 18_928]
        );
        let big: Vec<Vec<u8>> = (0..40_000u32).map(|_| vec![7u8; 1000]).collect();
        let idx: Vec<usize> = (0..big.len()).collect();
        let f = frames(&idx, &big, Frame::KeyLens);
        assert!(f.len() == 3 && f.concat() == idx);
        for fr in f {
            let body: usize = FRAME_FIXED + fr.iter().map(|&i| 2 + big[i].len() + 8).sum::<usize>();
            assert!(body <= memkv_proto::MAX_BODY_LEN as usize, "{body}");
        }
        assert!(frames(&[], &big, Frame::Keys).is_empty());
    }

    #[test]
    fn large_values_get_a_part_each_small_ones_share_one() {
        let of = |lens: &[usize]| -> usize {
            let bufs: Vec<Buf> = lens.iter().map(|&len| Buf { ptr: 0, len }).collect();
            values_per_part(&bufs)
        };
        assert_eq!(of(&[2 << 20; 4]), 1); // direct mode's 2 MiB blocks
        assert_eq!(of(&[1 << 20; 16]), 1);
        assert_eq!(of(&[512 << 10; 4]), 2);
        assert_eq!(of(&[4096; 64]), Frame::KeyLens.keys_per_part());
        assert_eq!(of(&[0, 0]), Frame::KeyLens.keys_per_part()); // empty values: no bytes to spread
        assert_eq!(of(&[]), Frame::KeyLens.keys_per_part());
    }
}
