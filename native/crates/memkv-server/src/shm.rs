//! The same-host data path: a unix socket beside the TCP listener (by default the abstract name
//! `memkv/IP:PORT` of the TCP address, `memkv_proto::shm_socket_name`), over which a client on
//! this host hands the server its memory regions as file descriptors (memfd or /dev/shm
//! files, SHM_REGION) and the server copies values between its own memory and those regions
//! itself (`cmd::shm_put`, `cmd::shm_get`), as the RDMA path does with one-sided operations.
//!
//! The client never maps the server's memory: a client dying or misbehaving mid-copy cannot
//! corrupt a stored value, and a PUT is committed only after the server copied and
//! checksummed it. The handshake, auth, key tables, statuses, leases and byte budget are those
//! of TCP. Regions are bounded per connection (count, size) and over the server (mapped bytes),
//! only tmpfs and hugetlbfs files opened for reading and writing are mapped (no disk or FUSE
//! file can stall a copy), and a region whose file shrinks under the mapping turns into a
//! failed transfer, not a SIGBUS (`fault_guard`).
//!
//! A mapping is shared by every connection that hands the server the same part of the same
//! file (a client's connections all pass its one pool), and the pages its file already holds
//! are faulted in once, in the background (`populate`): the first copy into a fresh mapping
//! otherwise pays a page fault per 4 KiB page, on every connection, under the process's memory
//! map lock, and runs at a fraction of memcpy speed.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, Weak};

use memkv_proto::{Descriptor, ShmRegion};

use crate::conn::ConnCtx;
use crate::limits::ConnLimits;
use crate::shm_copy::Copier;
use crate::unix_transport::UnixTransport;

/// Where the unix socket is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShmSocket {
    /// The abstract name of the TCP listen address (`memkv_proto::shm_socket_name`): what
    /// clients look for, and nothing left behind by a killed server.
    Default,
    /// An abstract name of one's own (without the leading NUL).
    Abstract(String),
    /// A socket file: removed at exit, and a stale one (no server answers) replaced at start.
    Path(PathBuf),
}

/// The same-host data path's settings and bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmConfig {
    pub socket: ShmSocket,
    /// Regions one connection may have mapped at once.
    pub max_regions: usize,
    /// Largest region mapped.
    pub max_region_bytes: u64,
    /// Bytes of client regions mapped at once over all connections (address space only: the
    /// pages are the clients').
    pub max_mapped_bytes: u64,
    /// Threads that copy large requests' values (`crate::shm_copy`); 1: each request's copies
    /// on its connection's thread.
    pub copy_threads: usize,
    /// The value memory is one sealed memfd per lane, which authenticated clients on the
    /// socket may map read-only (SHM_VALUES) and read GET_MAPPED values out of themselves:
    /// every such client can read every value. Off by default; refused with `--tenants`.
    pub share_values: bool,
}

/// The copy pool's default size: one server thread copies 5-6 GB/s, and on the H200 host eight
/// already reached its copy bandwidth from DRAM (about 23 GB/s), so more would only take cores
/// from the engines beside the server.
pub fn default_copy_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8)
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            socket: ShmSocket::Default,
            max_regions: 64,
            max_region_bytes: 1 << 40,
            max_mapped_bytes: 16 << 40,
            copy_threads: default_copy_threads(),
            share_values: false,
        }
    }
}

/// tmpfs (memfd, /dev/shm) and hugetlbfs, from linux/magic.h.
const TMPFS_MAGIC: u64 = 0x0102_1994;
const HUGETLBFS_MAGIC: u64 = 0x9584_58f6;

/// Which part of which file a mapping shows: (device, inode, offset, length).
type MapKey = (u64, u64, u64, u64);

/// What every connection shares: the bounds, the mapped bytes now, and the mappings.
pub struct ShmShared {
    cfg: ShmConfig,
    mapped: Arc<AtomicU64>,
    /// Live mappings by the file part they show, for the next connection that passes it.
    maps: Mutex<HashMap<MapKey, Weak<Mapping>>>,
    /// New mappings for the populate thread (started with the first).
    populate: Mutex<Option<mpsc::Sender<Weak<Mapping>>>>,
    copier: Copier,
}

impl ShmShared {
    pub fn new(cfg: ShmConfig) -> ShmShared {
        crate::fault_guard::install();
        ShmShared {
            copier: Copier::new(cfg.copy_threads),
            cfg,
            mapped: Arc::new(AtomicU64::new(0)),
            maps: Mutex::new(HashMap::new()),
            populate: Mutex::new(None),
        }
    }

    /// The live mapping of `key`, or a new one made by `make` (and handed to the populate
    /// thread when `populate`: tmpfs files, in base pages). A dead mapping (its file shrank under a copy) is never handed out again.
    fn mapping(
        &self,
        key: MapKey,
        populate: bool,
        make: impl FnOnce() -> Result<Mapping, String>,
    ) -> Result<Arc<Mapping>, String> {
        let mut maps = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = maps.get(&key).and_then(Weak::upgrade) {
            if !m.dead.load(Ordering::Acquire) {
                return Ok(m);
            }
        }
        maps.retain(|_, w| w.strong_count() > 0);
        let m = Arc::new(make()?);
        maps.insert(key, Arc::downgrade(&m));
        drop(maps);
        if populate {
            self.populate_later(Arc::downgrade(&m));
        }
        Ok(m)
    }

    /// Whether the value memory is shared with clients (`ShmConfig::share_values`).
    pub fn shares_values(&self) -> bool {
        self.cfg.share_values
    }

    /// The copy pool every connection's transfers share.
    pub(crate) fn copier(&self) -> &Copier {
        &self.copier
    }

    fn populate_later(&self, m: Weak<Mapping>) {
        let mut tx = self.populate.lock().unwrap_or_else(|e| e.into_inner());
        if tx.is_none() {
            let (send, recv) = mpsc::channel();
            let spawned = std::thread::Builder::new()
                .name("memkv-shm-populate".into())
                .spawn(move || recv.iter().for_each(|m| populate(&m)));
            if spawned.is_err() {
                return; // copies fault the pages in themselves
            }
            *tx = Some(send);
        }
        if let Some(tx) = tx.as_ref() {
            let _ = tx.send(m);
        }
    }

    /// Bytes of client regions mapped now.
    pub fn mapped_bytes(&self) -> u64 {
        self.mapped.load(Ordering::Relaxed)
    }
}

/// The bound socket; a socket file is removed when this drops.
pub struct ShmListener {
    listener: UnixListener,
    path: Option<PathBuf>,
    /// How clients reach it, for the startup log.
    pub name: String,
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        if let Some(p) = &self.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl ShmListener {
    /// Binds the socket of a server whose TCP listener is at `tcp`.
    pub fn bind(cfg: &ShmConfig, tcp: SocketAddr) -> io::Result<ShmListener> {
        let fail = |what: &str, e: io::Error| {
            io::Error::new(e.kind(), format!("--shm-socket {what}: {e}"))
        };
        let (listener, path, name) = match &cfg.socket {
            ShmSocket::Default | ShmSocket::Abstract(_) => {
                let name = match &cfg.socket {
                    ShmSocket::Abstract(n) => n.clone(),
                    _ => memkv_proto::shm_socket_name(tcp),
                };
                let addr =
                    UnixAddr::from_abstract_name(name.as_bytes()).map_err(|e| fail(&name, e))?;
                let l = UnixListener::bind_addr(&addr).map_err(|e| fail(&format!("@{name}"), e))?;
                (l, None, format!("@{name}"))
            }
            ShmSocket::Path(p) => {
                let shown = p.display().to_string();
                if p.exists() {
                    if UnixStream::connect(p).is_ok() {
                        return Err(fail(
                            &shown,
                            io::Error::new(
                                io::ErrorKind::AddrInUse,
                                "another server answers on this socket",
                            ),
                        ));
                    }
                    // A killed server's socket: nobody answers on it.
                    std::fs::remove_file(p).map_err(|e| fail(&shown, e))?;
                }
                let l = UnixListener::bind(p).map_err(|e| fail(&shown, e))?;
                (l, Some(p.clone()), shown)
            }
        };
        listener.set_nonblocking(true)?;
        Ok(ShmListener {
            listener,
            path,
            name,
        })
    }

    /// Serves connections until shutdown, like the TCP accept loop.
    pub fn serve(self, ctx: Arc<ConnCtx>, limits: Arc<ConnLimits>) {
        let fd = self.listener.as_raw_fd();
        crate::server::serve_accepted(fd, &ctx, &limits, || {
            let (stream, _) = self.listener.accept()?;
            UnixTransport::new(stream)
        });
    }
}

/// Bytes of `ShmShared::mapped` one region holds, given back on drop.
struct Charge {
    mapped: Arc<AtomicU64>,
    bytes: u64,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.mapped.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// A part of a client's file mapped into the server, shared by the regions that show it.
struct Mapping {
    /// Page-aligned start and length.
    map: (usize, usize),
    /// A copy faulted (the file shrank): the mapping is anonymous memory now.
    dead: AtomicBool,
    _charge: Charge,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping this value made; no region refers to it any more, and the populate
        // thread holds a strong reference while it works on it.
        unsafe { libc::munmap(self.map.0 as *mut libc::c_void, self.map.1) };
    }
}

/// Pages faulted in per step of `populate` (a step holds the mapping alive).
const POPULATE_STEP: usize = 256 << 20;

/// Faults in the pages of `m` that its file already holds (`mincore`), so that copies do not
/// take one fault per page. A hole is left alone: faulting it would allocate the client's file
/// on the server's account. Stops when the mapping is gone or dead; an error (a kernel without
/// MADV_POPULATE_WRITE, a file shrunk meanwhile) leaves the rest to the copies.
fn populate(m: &Weak<Mapping>) {
    let page = 4096usize;
    let mut resident = vec![0u8; POPULATE_STEP / page];
    let mut off = 0usize;
    loop {
        let Some(m) = m.upgrade() else { return };
        let (start, len) = m.map;
        if off >= len || m.dead.load(Ordering::Acquire) {
            return;
        }
        let n = POPULATE_STEP.min(len - off);
        let base = start + off;
        // SAFETY: [base, base + n) lies inside the mapping `m` keeps alive; the vector has a byte
        // per page of it.
        if unsafe { libc::mincore(base as *mut libc::c_void, n, resident.as_mut_ptr()) } != 0 {
            return;
        }
        let pages = n.div_ceil(page);
        let mut p = 0;
        while p < pages {
            if resident[p] & 1 == 0 {
                p += 1;
                continue;
            }
            let run = resident[p..pages]
                .iter()
                .take_while(|r| *r & 1 != 0)
                .count();
            // SAFETY: advice on resident pages of a mapping `m` keeps alive; a page its file
            // lost meanwhile makes the call fail (EFAULT), it raises no SIGBUS.
            let rc = unsafe {
                libc::madvise(
                    (base + p * page) as *mut libc::c_void,
                    (run * page).min(n - p * page),
                    libc::MADV_POPULATE_WRITE,
                )
            };
            if rc != 0 {
                return;
            }
            p += run;
        }
        off += n;
    }
}

/// A client region mapped into the server.
struct Region {
    mapping: Arc<Mapping>,
    /// Where the region's first byte lies in the mapping.
    start: usize,
    len: u64,
}

/// Where a descriptor points: the address in the server and the mapping it lies in.
pub(crate) struct Place {
    pub addr: usize,
    pub mapping: (usize, usize),
    pub region: u32,
}

/// One connection's regions.
#[derive(Default)]
pub(crate) struct ShmPeer {
    regions: HashMap<u32, Region>,
}

impl ShmPeer {
    /// Maps `r` from `fd`, within the bounds of `shared`; Err says why not.
    pub fn map(&mut self, shared: &ShmShared, r: &ShmRegion, fd: OwnedFd) -> Result<(), String> {
        let cfg = &shared.cfg;
        if self.regions.contains_key(&r.id) {
            return Err(format!("region {} is already mapped", r.id));
        }
        if self.regions.len() >= cfg.max_regions {
            return Err(format!(
                "this connection has {} regions mapped, the server's bound \
                 (--max-shm-regions)",
                cfg.max_regions
            ));
        }
        if r.len > cfg.max_region_bytes {
            return Err(format!(
                "a region of {} bytes is larger than the server's bound of {} \
                 (--max-shm-region)",
                r.len, cfg.max_region_bytes
            ));
        }
        let raw = fd.as_raw_fd();
        // SAFETY: fcntl, fstat and fstatfs on a descriptor we own, into local structs.
        let (mode, st, sfs) = unsafe {
            let mode = libc::fcntl(raw, libc::F_GETFL);
            let mut st: libc::stat = std::mem::zeroed();
            let mut sfs: libc::statfs = std::mem::zeroed();
            if mode < 0 || libc::fstat(raw, &mut st) != 0 || libc::fstatfs(raw, &mut sfs) != 0 {
                return Err(format!(
                    "cannot inspect the descriptor: {}",
                    io::Error::last_os_error()
                ));
            }
            (mode, st, sfs)
        };
        if mode & libc::O_ACCMODE != libc::O_RDWR {
            return Err("the descriptor is not open for reading and writing".into());
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG
            || !matches!(sfs.f_type as u64, TMPFS_MAGIC | HUGETLBFS_MAGIC)
        {
            return Err("only memfd, /dev/shm (tmpfs) and hugetlbfs files are mapped".into());
        }
        let end = r
            .file_offset
            .checked_add(r.len)
            .ok_or("region end overflows")?;
        if end > st.st_size as u64 {
            return Err(format!(
                "the region ends at byte {end}, past its file's {} bytes",
                st.st_size
            ));
        }
        // hugetlbfs maps in its huge pages; tmpfs in base pages.
        let align = (sfs.f_bsize as u64).max(4096);
        let map_off = r.file_offset - r.file_offset % align;
        let start = (r.file_offset - map_off) as usize;
        let map_len = (start as u64 + r.len).div_ceil(align) * align;
        let key = (st.st_dev, st.st_ino, map_off, map_len);
        let mapping = shared.mapping(key, sfs.f_type as u64 == TMPFS_MAGIC, || {
            let charged = shared
                .mapped
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |m| {
                    m.checked_add(map_len)
                        .filter(|t| *t <= cfg.max_mapped_bytes)
                });
            if charged.is_err() {
                return Err(format!(
                    "the server has {} bytes of client regions mapped; {map_len} more would \
                     pass its bound of {} (--max-shm-mapped)",
                    shared.mapped_bytes(),
                    cfg.max_mapped_bytes
                ));
            }
            let charge = Charge {
                mapped: shared.mapped.clone(),
                bytes: map_len,
            };
            // SAFETY: a fresh shared mapping of a file we checked; the mapping is ours until the
            // Mapping drops. The descriptor may close after mmap.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    map_len as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    raw,
                    map_off as libc::off_t,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(format!(
                    "cannot map the region: {}",
                    io::Error::last_os_error()
                ));
            }
            Ok(Mapping {
                map: (p as usize, map_len as usize),
                dead: AtomicBool::new(false),
                _charge: charge,
            })
        })?;
        self.regions.insert(
            r.id,
            Region {
                mapping,
                start,
                len: r.len,
            },
        );
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// Forgets region `id` (unmaps it); false when there was none.
    pub fn forget(&mut self, id: u32) -> bool {
        self.regions.remove(&id).is_some()
    }

    /// Where `d` points, when it lies wholly inside a live region of this connection.
    pub fn place(&self, d: &Descriptor) -> Option<Place> {
        let id = u32::try_from(d.rkey).ok()?;
        let r = self.regions.get(&id)?;
        if r.mapping.dead.load(Ordering::Acquire) {
            return None;
        }
        let end = d.addr.checked_add(d.len)?;
        let map = r.mapping.map;
        (end <= r.len).then(|| Place {
            addr: map.0 + r.start + d.addr as usize,
            mapping: map,
            region: id,
        })
    }

    /// Marks the mapping of a region whose copy faulted: none of its transfers is served again,
    /// on any connection that shares it.
    pub fn kill(&mut self, id: u32) {
        if let Some(r) = self.regions.get(&id) {
            r.mapping.dead.store(true, Ordering::Release);
        }
    }
}
