//! libfabric for memkv's one-sided data path, loaded with dlopen at first use and never linked,
//! so a process that never asks for RDMA (and a host without libfabric) is unaffected.
//!
//! `Fabric` is one provider's fabric and domain; `Mr` a memory registration (of host memory, or
//! of GPU memory where the domain reaches it: `memory::locate` says which a buffer is);
//! `MrCache` the client's bounded cache of them; `Endpoint` a reliable-datagram endpoint with its completion
//! queue and address vector, which runs batches of RDMA reads and writes (`Endpoint::run`) and
//! drives the provider's progress for a passive side (`Endpoint::progress`).
//!
//! Which provider: `verbs` (InfiniBand/RoCE) and `efa` where the hardware is, `tcp` (and
//! `sockets`) anywhere, which is how the tests run the real path over loopback.

pub mod memory;
mod mr;
mod sys;

use std::ffi::{c_int, c_void, CString};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use memory::Memory;
pub use mr::{Mr, MrCache};
use sys::{FiInfo, Fid, Lib};

/// A libfabric call that failed: which call, libfabric's error code (positive) and its text.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{op}: {msg} ({code})")]
pub struct FabricError {
    pub op: &'static str,
    pub code: i32,
    pub msg: String,
}

impl FabricError {
    fn new(op: &'static str, code: i32) -> FabricError {
        let msg = Lib::get().map_or_else(|e| e, |l| l.strerror(code));
        FabricError {
            op,
            code: code.abs(),
            msg,
        }
    }

    fn other(op: &'static str, msg: impl Into<String>) -> FabricError {
        FabricError {
            op,
            code: 0,
            msg: msg.into(),
        }
    }

    /// True when the operation's deadline passed (the endpoint was closed to stop it).
    pub fn timed_out(&self) -> bool {
        self.code == libc::ETIMEDOUT
    }
}

type Result<T> = std::result::Result<T, FabricError>;

/// Whether libfabric can be loaded here, and its version ("1.17") or why not.
pub fn probe() -> std::result::Result<String, String> {
    let l = Lib::get()?;
    Ok(format!("{}.{}", l.version >> 16, l.version & 0xffff))
}

/// One provider's fabric and domain, shared by its endpoints and registrations (which keep it
/// open). Thread-safe: the domain is opened with FI_THREAD_SAFE.
pub struct Fabric {
    lib: &'static Lib,
    /// The list fi_getinfo returned (freed on drop) and the entry in use.
    infos: *mut FiInfo,
    info: *mut FiInfo,
    fabric: Fid,
    domain: Fid,
    pub provider: String,
    /// The provider's domain: the NIC (`mlx5_0`, `rdmap0s6`) or, for tcp, the interface (`lo`).
    pub domain_name: String,
    /// Remote addresses are virtual addresses (else offsets into the registration).
    virt_addr: bool,
    /// The provider picks registration keys (else we do, unique per domain).
    prov_key: bool,
    /// Operations one endpoint may have in flight.
    pub depth: usize,
    /// Largest single read or write.
    pub max_msg: usize,
    /// Ok: the domain registers CUDA device memory (how, for logs); Err: why it does not.
    device_memory: std::result::Result<String, String>,
    /// Endpoint addresses are NUL-terminated strings (shm), not structures of one size.
    addr_str: bool,
    next_key: AtomicU64,
}

// SAFETY: the domain is FI_THREAD_SAFE and the info list is only read after `open`.
unsafe impl Send for Fabric {}
unsafe impl Sync for Fabric {}

/// Longest endpoint address `Endpoint::name` reads (and a string address may be).
const MAX_NAME: usize = 256;
/// Most operations an endpoint keeps in flight, whatever the provider allows.
const MAX_DEPTH: usize = 256;
/// Largest piece one read or write moves: bigger values are split, so one value does not hold
/// the endpoint for its whole transfer and every provider's message limit is met.
const MAX_PIECE: usize = 4 << 20;

impl Fabric {
    /// Opens the first fabric of `provider` (any when None) whose domain is in `domains` (any
    /// when empty) that offers RDMA reads and writes on reliable-datagram endpoints, for host
    /// memory.
    pub fn open(provider: Option<&str>, domains: &[String]) -> Result<Arc<Fabric>> {
        Fabric::open_for(provider, domains, false)
    }

    /// `open`; with `device_memory`, asks first for a domain that also registers GPU memory
    /// (FI_HMEM) and, where the provider (or this libfabric build) has none, opens the host-only
    /// one: `device_memory()` then says why GPU memory is out of reach.
    pub fn open_for(
        provider: Option<&str>,
        domains: &[String],
        device_memory: bool,
    ) -> Result<Arc<Fabric>> {
        let lib = Lib::get().map_err(|e| FabricError::other("dlopen", e))?;
        let prov = provider
            .map(CString::new)
            .transpose()
            .map_err(|_| FabricError::other("fi_getinfo", "provider name contains NUL"))?;
        let not_asked = "GPU memory was not asked for (FI_HMEM)".to_string();
        if device_memory {
            match Fabric::open_with(lib, prov.as_deref(), domains, true) {
                Ok(f) => return Ok(f),
                Err(e) => {
                    let why = format!(
                        "provider {} offers no domain that registers GPU memory (FI_HMEM): {e}",
                        provider.unwrap_or("(any)")
                    );
                    return Fabric::open_with(lib, prov.as_deref(), domains, false).map(|mut f| {
                        Arc::get_mut(&mut f).expect("not shared yet").device_memory = Err(why);
                        f
                    });
                }
            }
        }
        Fabric::open_with(lib, prov.as_deref(), domains, false).map(|mut f| {
            Arc::get_mut(&mut f).expect("not shared yet").device_memory = Err(not_asked);
            f
        })
    }

    fn open_with(
        lib: &'static Lib,
        prov: Option<&std::ffi::CStr>,
        domains: &[String],
        hmem: bool,
    ) -> Result<Arc<Fabric>> {
        let mut infos: *mut FiInfo = std::ptr::null_mut();
        // SAFETY: `lib.api` holds libfabric's functions; the hints are built inside the shim.
        let r = unsafe {
            sys::mk_getinfo(
                &lib.api,
                prov.map_or(std::ptr::null(), |p| p.as_ptr()),
                c_int::from(hmem),
                &mut infos,
            )
        };
        if r != 0 {
            return Err(FabricError::new("fi_getinfo", r));
        }
        let mut seen = Vec::new();
        let mut info = infos;
        while !info.is_null() {
            // SAFETY: `info` is an entry of the list fi_getinfo returned.
            let dom = unsafe { sys::cstr(sys::mk_info_domain(info)) };
            if domains.is_empty() || domains.contains(&dom) {
                break;
            }
            seen.push(dom);
            // SAFETY: as above.
            info = unsafe { sys::mk_info_next(info) };
        }
        if info.is_null() {
            // SAFETY: the list came from fi_getinfo and nothing refers to it any more.
            unsafe { (lib.api.freeinfo)(infos) };
            return Err(FabricError::other(
                "fi_getinfo",
                format!("no domain among {domains:?}; the provider offers {seen:?}"),
            ));
        }
        let (mut fabric, mut domain) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: `info` is a valid entry; the out pointers are ours.
        let r = unsafe { sys::mk_open_domain(&lib.api, info, &mut fabric, &mut domain) };
        if r != 0 {
            // SAFETY: as above.
            unsafe { (lib.api.freeinfo)(infos) };
            return Err(FabricError::new("fi_domain", r));
        }
        // SAFETY: `info` stays valid until drop; the accessors only read it.
        let f = unsafe {
            let mr_mode = sys::mk_info_mr_mode(info);
            Fabric {
                lib,
                infos,
                info,
                fabric,
                domain,
                provider: sys::cstr(sys::mk_info_prov(info)),
                domain_name: sys::cstr(sys::mk_info_domain(info)),
                virt_addr: mr_mode & sys::mk_mr_virt_addr() != 0,
                prov_key: mr_mode & sys::mk_mr_prov_key() != 0,
                depth: sys::mk_info_tx_size(info).clamp(1, MAX_DEPTH),
                max_msg: sys::mk_info_max_msg(info).clamp(1, MAX_PIECE),
                device_memory: cuda_reach(
                    &format!(
                        "provider {} on {}",
                        sys::cstr(sys::mk_info_prov(info)),
                        sys::cstr(sys::mk_info_domain(info))
                    ),
                    sys::mk_info_caps(info) & sys::mk_cap_hmem() != 0,
                ),
                addr_str: sys::mk_info_addr_str(info) != 0,
                next_key: AtomicU64::new(1),
            }
        };
        // SAFETY: as above.
        let key_size = unsafe { sys::mk_info_key_size(info) };
        if key_size > 8 {
            return Err(FabricError::other(
                "fi_getinfo",
                format!("provider keys are {key_size} bytes; memkv carries 8"),
            ));
        }
        tracing::debug!(provider = %f.provider, domain = %f.domain_name,
            fabric = %unsafe { sys::cstr(sys::mk_info_fabric(info)) },
            virt_addr = f.virt_addr, prov_key = f.prov_key, depth = f.depth,
            device_memory = ?f.device_memory, "libfabric domain open");
        Ok(Arc::new(f))
    }

    /// Whether `addr`, a peer's endpoint address, is one the provider can read without reading
    /// past it: of the length of this domain's own (`own_len`), or, for string addresses (shm),
    /// NUL-terminated within its bytes and no longer than `own_len` allows a name to be.
    pub fn peer_address_ok(&self, own_len: usize, addr: &[u8]) -> std::result::Result<(), String> {
        if self.addr_str {
            if addr.len() <= MAX_NAME && addr.contains(&0) {
                return Ok(());
            }
            return Err(format!(
                "a {}-byte endpoint address that is no NUL-terminated name of at most {MAX_NAME} \
                 bytes",
                addr.len()
            ));
        }
        if addr.len() != own_len {
            return Err(format!(
                "a {}-byte endpoint address; this provider's are {own_len} bytes",
                addr.len()
            ));
        }
        Ok(())
    }

    /// Ok (how, for a log line) when this domain registers CUDA device memory, else why not.
    pub fn device_memory(&self) -> std::result::Result<&str, &str> {
        match &self.device_memory {
            Ok(how) => Ok(how),
            Err(why) => Err(why),
        }
    }

    /// Registers `len` bytes of host memory at `ptr`: for the server's own memory (`remote`
    /// false: local reads and writes) or for a client's memory the server reads and writes
    /// (`remote` true).
    ///
    /// # Safety
    /// The memory must stay mapped until the returned `Mr` is closed (dropped or revoked).
    pub unsafe fn register(self: &Arc<Self>, ptr: usize, len: usize, remote: bool) -> Result<Mr> {
        self.register_memory(ptr, len, remote, Memory::Host)
    }

    /// `register` for memory that lives where `mem` says. GPU memory on a domain that does not
    /// register it is refused here, before libfabric sees it: a provider handed a device
    /// pointer as host memory would copy from it on the CPU and crash the process.
    ///
    /// # Safety
    /// As `register`; `mem` must say truly where the memory lives (`memory::locate`).
    pub unsafe fn register_memory(
        self: &Arc<Self>,
        ptr: usize,
        len: usize,
        remote: bool,
        mem: Memory,
    ) -> Result<Mr> {
        let (iface, device) = match mem {
            Memory::Host => (sys::mk_hmem_system(), 0),
            Memory::Cuda(d) => {
                if let Err(why) = &self.device_memory {
                    return Err(FabricError::other(
                        "fi_mr_regattr",
                        format!("cannot register {mem} at {ptr:#x}: {why}"),
                    ));
                }
                (sys::mk_hmem_cuda(), d)
            }
        };
        let access = if remote {
            sys::mk_access_remote_read() | sys::mk_access_remote_write()
        } else {
            sys::mk_access_local_read() | sys::mk_access_local_write()
        };
        let requested = if self.prov_key {
            0
        } else {
            self.next_key.fetch_add(1, Ordering::Relaxed)
        };
        let (mut fid, mut desc, mut key) = (std::ptr::null_mut(), std::ptr::null_mut(), 0u64);
        let r = sys::mk_mr_reg(
            self.domain,
            ptr as *mut c_void,
            len,
            access,
            requested,
            iface,
            device,
            &mut fid,
            &mut desc,
            &mut key,
        );
        if r != 0 {
            return Err(FabricError::new("fi_mr_reg", r));
        }
        Ok(Mr::new(self.clone(), fid, desc, key, ptr, len, mem))
    }

    /// The address a peer names `ptr` by in a remote operation on a registration starting at
    /// `base`.
    fn remote_addr(&self, base: usize, ptr: usize) -> u64 {
        if self.virt_addr {
            ptr as u64
        } else {
            (ptr - base) as u64
        }
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        // SAFETY: every endpoint and registration holds an Arc, so none is left; close in
        // reverse order of opening.
        unsafe {
            sys::mk_close(self.domain);
            sys::mk_close(self.fabric);
            (self.lib.api.freeinfo)(self.infos);
        }
    }
}

/// Whether a domain (`what`: its provider and name) with or without FI_HMEM registers CUDA
/// memory. FI_HMEM alone does not say so: some providers (shm) list it in every build, and
/// the distributions' libfabric is built without CUDA; a provider handed CUDA memory by such a
/// build would call CUDA functions it never loaded. So CUDA must also be compiled in (the build
/// then defines its `FI_HMEM_CUDA_ENABLE_XFER` parameter) and started: libfabric loads the CUDA
/// runtime by the name `libcudart.so` when it initialises, and unloads it when no device
/// answers.
fn cuda_reach(what: &str, hmem: bool) -> std::result::Result<String, String> {
    if !hmem {
        return Err(format!("{what} registers host memory only (no FI_HMEM)"));
    }
    if !libfabric_has_param("FI_HMEM_CUDA_ENABLE_XFER") {
        return Err(format!(
            "{what} offers FI_HMEM but this libfabric is built without CUDA support"
        ));
    }
    // SAFETY: RTLD_NOLOAD only looks for a library already loaded; nothing is run.
    let cudart = unsafe {
        libloading::os::unix::Library::open(
            Some("libcudart.so"),
            libc::RTLD_NOW | libc::RTLD_NOLOAD,
        )
    };
    if cudart.is_err() {
        return Err(format!(
            "{what} offers FI_HMEM but libfabric's CUDA support did not start (it loads \
             libcudart.so, which must be on the library path, and needs a CUDA device)"
        ));
    }
    Ok(format!("{what} registers GPU memory (FI_HMEM, CUDA)"))
}

/// Whether the loaded libfabric defines the parameter `name` (`fi_getparams` lists them by
/// their environment variables' names).
fn libfabric_has_param(name: &str) -> bool {
    #[repr(C)]
    struct FiParam {
        name: *const std::ffi::c_char,
        kind: c_int,
        help: *const std::ffi::c_char,
        value: *const std::ffi::c_char,
    }
    type GetParams = unsafe extern "C" fn(*mut *mut FiParam, *mut c_int) -> c_int;
    type FreeParams = unsafe extern "C" fn(*mut FiParam);
    // SAFETY: the library is the one `Lib` loaded (RTLD_NOLOAD takes a reference by its
    // soname); both functions have the C signatures of fabric.h's fi_getparams and
    // fi_freeparams, and `struct fi_param` is four pointer-sized fields.
    unsafe {
        let Ok(lib) = libloading::os::unix::Library::open(
            Some(sys::LIBFABRIC),
            libc::RTLD_NOW | libc::RTLD_NOLOAD,
        ) else {
            return false;
        };
        let (Ok(get), Ok(free)) = (
            lib.get::<GetParams>(b"fi_getparams\0"),
            lib.get::<FreeParams>(b"fi_freeparams\0"),
        ) else {
            return false;
        };
        let (mut params, mut count) = (std::ptr::null_mut(), 0 as c_int);
        if get(&mut params, &mut count) != 0 || params.is_null() {
            return false;
        }
        let found = std::slice::from_raw_parts(params, count.max(0) as usize)
            .iter()
            .any(|p| sys::cstr(p.name) == name);
        free(params);
        found
    }
}

/// One remote operation of a batch: moves `len` bytes between local memory at `local`
/// (registered, `desc` from its `Mr`) and the peer's memory at `remote_addr` under `rkey`.
/// `group` names the caller's unit (a key): a failure is reported per group.
#[derive(Debug, Clone, Copy)]
pub struct Rma {
    /// true: write local to remote (GET); false: read remote into local (PUT).
    pub write: bool,
    pub local: usize,
    pub desc: usize,
    pub len: usize,
    pub remote_addr: u64,
    pub rkey: u64,
    pub group: usize,
}

/// A reliable-datagram endpoint with its completion queue and address vector.
pub struct Endpoint {
    fab: Arc<Fabric>,
    ep: Fid,
    cq: Fid,
    av: Fid,
    wait_fd: RawFd,
    /// One `fi_context2` per operation in flight: providers may use it until the completion.
    contexts: Box<[u64]>,
    ctx_words: usize,
    closed: bool,
}

// SAFETY: an endpoint is used by one thread at a time (`&mut self`); the domain is thread-safe.
unsafe impl Send for Endpoint {}

impl Endpoint {
    pub fn open(fab: &Arc<Fabric>) -> Result<Endpoint> {
        let (mut ep, mut cq, mut av, mut fd) = (
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            -1 as c_int,
        );
        // SAFETY: the domain and info are open for as long as `fab` lives.
        let r =
            unsafe { sys::mk_open_ep(fab.domain, fab.info, &mut ep, &mut cq, &mut av, &mut fd) };
        if r != 0 {
            return Err(FabricError::new("fi_endpoint", r));
        }
        // SAFETY: a constant.
        let ctx_words = unsafe { sys::mk_context_size() }.div_ceil(8);
        Ok(Endpoint {
            fab: fab.clone(),
            ep,
            cq,
            av,
            wait_fd: fd,
            contexts: vec![0u64; ctx_words * fab.depth].into_boxed_slice(),
            ctx_words,
            closed: false,
        })
    }

    pub fn fabric(&self) -> &Arc<Fabric> {
        &self.fab
    }

    /// This endpoint's address, for a peer's address vector.
    pub fn name(&self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; MAX_NAME];
        let mut len = buf.len();
        // SAFETY: `buf` holds `len` bytes.
        let r = unsafe { sys::mk_getname(self.ep, buf.as_mut_ptr().cast(), &mut len) };
        if r != 0 {
            return Err(FabricError::new("fi_getname", r));
        }
        buf.truncate(len);
        Ok(buf)
    }

    /// Adds a peer's address; the result names it in `run`.
    pub fn insert_peer(&mut self, addr: &[u8]) -> Result<u64> {
        let mut a = 0u64;
        // SAFETY: the provider reads one address of its own format from `addr`; a short or
        // malformed one is the provider's to refuse. Our caller bounds its length.
        let r = unsafe { sys::mk_av_insert(self.av, addr.as_ptr().cast(), &mut a) };
        if r != 0 {
            return Err(FabricError::new("fi_av_insert", r));
        }
        Ok(a)
    }

    /// The fd that becomes readable when the provider has work (None: poll `progress`).
    pub fn wait_fd(&self) -> Option<RawFd> {
        (self.wait_fd >= 0).then_some(self.wait_fd)
    }

    /// Whether blocking on `wait_fd` now cannot miss work (else call `progress` first).
    pub fn may_block(&self) -> bool {
        // SAFETY: fabric and CQ are open.
        self.wait_fd >= 0 && unsafe { sys::mk_trywait(self.fab.fabric, self.cq) } == 0
    }

    /// Drives the provider's progress: a passive side (whose memory a peer reads or writes)
    /// must call this while it waits, since software providers move the bytes in these calls.
    pub fn progress(&mut self) -> Result<()> {
        let mut ctx = [std::ptr::null_mut(); 16];
        loop {
            let (mut ectx, mut err, mut perr) = (std::ptr::null_mut(), 0, 0);
            // SAFETY: `ctx` holds 16 entries.
            let n = unsafe {
                sys::mk_cq_read(
                    self.cq,
                    ctx.as_mut_ptr(),
                    16,
                    &mut ectx,
                    &mut err,
                    &mut perr,
                )
            };
            // A passive endpoint posts nothing, so any completion is not ours to act on.
            match n {
                0 => return Ok(()),
                n if n > 0 => continue,
                n if n == -(unsafe { sys::mk_eavail() } as isize) => continue,
                n => return Err(FabricError::new("fi_cq_read", n as i32)),
            }
        }
    }

    /// Runs `ops` against `peer`, at most `depth` in flight, until all completed or `deadline`.
    /// Returns, per group (index = `group`, `groups` entries), None or the group's first error;
    /// an operation of a failed group that is not yet posted is skipped. A deadline miss or a
    /// broken completion queue closes the endpoint first (no operation of it can touch memory
    /// afterwards), so the caller may then release the memory the operations named.
    pub fn run(
        &mut self,
        peer: u64,
        ops: &[Rma],
        groups: usize,
        deadline: Instant,
    ) -> Result<Vec<Option<FabricError>>> {
        if self.closed {
            return Err(FabricError::other("fi_read/fi_write", "endpoint closed"));
        }
        let depth = self.fab.depth;
        let mut errors: Vec<Option<FabricError>> = vec![None; groups];
        let mut slot_group = vec![usize::MAX; depth];
        let mut free: Vec<usize> = (0..depth).rev().collect();
        let (mut next, mut inflight) = (0, 0usize);
        // SAFETY: constants.
        let (eagain, eavail) = unsafe { (sys::mk_eagain() as isize, sys::mk_eavail() as isize) };
        let base = self.contexts.as_ptr() as usize;
        let ctx_bytes = self.ctx_words * 8;
        loop {
            while next < ops.len() && !free.is_empty() {
                let op = ops[next];
                if errors[op.group].is_some() {
                    next += 1;
                    continue;
                }
                let s = free.pop().expect("checked");
                let ctx = (base + s * ctx_bytes) as *mut c_void;
                // SAFETY: the local memory is registered (`desc`) and stays valid until this
                // returns (the caller's contract, and on early return the endpoint is closed
                // first); `ctx` is a slot of `contexts`, unused until its completion.
                let r = unsafe {
                    sys::mk_rma(
                        self.ep,
                        c_int::from(op.write),
                        op.local as *mut c_void,
                        op.len,
                        op.desc as *mut c_void,
                        peer,
                        op.remote_addr,
                        op.rkey,
                        ctx,
                    )
                };
                if r == -eagain {
                    free.push(s);
                    break;
                }
                if r < 0 {
                    free.push(s);
                    errors[op.group] = Some(FabricError::new(
                        if op.write { "fi_write" } else { "fi_read" },
                        r as i32,
                    ));
                } else {
                    slot_group[s] = op.group;
                    inflight += 1;
                }
                next += 1;
            }
            if next == ops.len() && inflight == 0 {
                return Ok(errors);
            }
            let mut done = [std::ptr::null_mut(); 16];
            let (mut ectx, mut err, mut perr) = (std::ptr::null_mut(), 0, 0);
            // SAFETY: `done` holds 16 entries.
            let n = unsafe {
                sys::mk_cq_read(
                    self.cq,
                    done.as_mut_ptr(),
                    16,
                    &mut ectx,
                    &mut err,
                    &mut perr,
                )
            };
            let slot_of = |p: *mut c_void| -> Option<usize> {
                let off = (p as usize).checked_sub(base)?;
                (off % ctx_bytes == 0 && off / ctx_bytes < depth).then_some(off / ctx_bytes)
            };
            if n > 0 {
                for &p in &done[..n as usize] {
                    let s = slot_of(p).ok_or_else(|| self.fail("a completion of no operation"))?;
                    free.push(s);
                    inflight -= 1;
                }
            } else if n == -eavail {
                let s = slot_of(ectx).ok_or_else(|| self.fail("an error of no operation"))?;
                free.push(s);
                inflight -= 1;
                let g = slot_group[s];
                let mut e = FabricError::new("remote operation", err);
                if perr != 0 {
                    e.msg = format!("{} (provider error {perr})", e.msg);
                }
                errors[g].get_or_insert(e);
            } else if n < 0 {
                self.close();
                return Err(FabricError::new("fi_cq_read", n as i32));
            } else {
                let now = Instant::now();
                if now >= deadline {
                    self.close();
                    return Err(FabricError::new("fi_read/fi_write", libc::ETIMEDOUT));
                }
                self.wait((deadline - now).min(Duration::from_millis(10)));
            }
        }
    }

    /// Waits up to `max` for the provider to have work, or yields when it offers no fd.
    pub fn wait(&self, max: Duration) {
        if self.may_block() {
            let mut pfd = libc::pollfd {
                fd: self.wait_fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd for the CQ's wait fd, open while `self` lives.
            unsafe { libc::poll(&mut pfd, 1, max.as_millis().max(1) as c_int) };
        } else {
            std::thread::yield_now();
        }
    }

    fn fail(&mut self, what: &str) -> FabricError {
        self.close();
        FabricError::other("fi_cq_read", format!("provider reported {what}"))
    }

    /// Closes the endpoint now: operations in flight are cancelled and none touches memory
    /// after this returns. Later `run` calls fail.
    pub fn close(&mut self) {
        if !self.closed {
            self.closed = true;
            // SAFETY: closing in reverse order of binding; nothing uses them afterwards.
            unsafe {
                sys::mk_close(self.ep);
                sys::mk_close(self.av);
                sys::mk_close(self.cq);
            }
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.close();
    }
}
