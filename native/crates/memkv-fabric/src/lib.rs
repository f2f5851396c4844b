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
//! `sockets`) anywhere, which is how the tests run the real path over loopback. Over the rxm
//! layer (`verbs;ofi_rxm`, `tcp;ofi_rxm`) the endpoints get small message buffers, which they do
//! not use (`tuning`).

pub mod memory;
mod mr;
mod sys;
mod tuning;

use std::ffi::{c_int, c_void, CString};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use memory::Memory;
pub use mr::{Mr, MrCache};
use sys::{FiInfo, Fid, Lib};
pub use tuning::Tuning;

/// A libfabric call that failed: which call, libfabric's error code (positive; 0 for a failure
/// of memkv's own, such as a library that cannot be loaded) and its text.
#[derive(Debug, Clone)]
pub struct FabricError {
    pub op: &'static str,
    pub code: i32,
    pub msg: String,
}

impl std::fmt::Display for FabricError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.op, self.msg)?;
        if self.code != 0 {
            write!(f, " ({})", self.code)?;
        }
        Ok(())
    }
}

impl std::error::Error for FabricError {}

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

/// What memkv set of libfabric's rxm sizes in this process (docs/rdma.md, "Memory per
/// connection"), or why libfabric cannot be loaded.
pub fn tuning() -> std::result::Result<Tuning, String> {
    Lib::get().map(|l| l.tuning.clone())
}

/// How the server knows a GET's bytes are in the client's memory before it replies (on the TCP
/// connection, which may overtake the fabric): docs/rdma.md, "Completion semantics".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteCompletion {
    /// The provider completes a write only once its bytes are in the target's memory
    /// (`FI_DELIVERY_COMPLETE`, asked for and honoured).
    Delivery,
    /// A completed write was acknowledged by the target's NIC, which does not prove its bytes
    /// reached memory; a read of the written memory, ordered after the write
    /// (`FI_ORDER_RAW`) and issued once it completed, is answered only from memory that holds
    /// them. `Endpoint::run` ends every written group with such a one-byte read.
    ReadFence,
}

impl WriteCompletion {
    /// How `memkv net selftest` and the logs say it.
    pub fn describe(self) -> &'static str {
        match self {
            WriteCompletion::Delivery => "delivery-complete writes",
            WriteCompletion::ReadFence => "writes fenced by a read",
        }
    }
}

/// Core providers that accept `FI_DELIVERY_COMPLETE` without honouring it for RDMA writes:
/// `ofi_rxm` advertises it and passes it down to verbs, whose write still completes on the
/// responder's acknowledgement (libfabric 1.17 to 2.x).
const DELIVERY_NOT_HONOURED: [&str; 1] = ["verbs"];

/// The write completion a provider (`tcp;ofi_rxm`, `verbs;ofi_rxm`, `efa`) gives, from what
/// fi_getinfo accepted for it: delivery-complete writes (`delivery`) and read-after-write
/// ordering (`read_after_write`). None: neither guarantee, so the provider cannot serve GETs.
pub fn write_completion(
    provider: &str,
    delivery: bool,
    read_after_write: bool,
) -> Option<WriteCompletion> {
    let core = provider.split(';').next().unwrap_or(provider);
    if delivery && !DELIVERY_NOT_HONOURED.contains(&core) {
        Some(WriteCompletion::Delivery)
    } else if read_after_write {
        Some(WriteCompletion::ReadFence)
    } else {
        None
    }
}

/// Whether the provider's domain `dom` is among `wanted` (all when empty): by its own name, or by
/// its device's (`rdmap0s31` for efa's `rdmap0s31-rdm`), as sysfs and `memkv net topo` name NICs.
fn domain_wanted(wanted: &[String], dom: &str) -> bool {
    let dev = memkv_topo::device_of_domain(dom);
    wanted.is_empty() || wanted.iter().any(|w| w == dom || w == dev)
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
    /// How endpoints of this domain name their provider to a peer (RDMA_HELLO): `provider`, and
    /// for rxm its buffer size (`tuning::hello_name`).
    pub hello_name: String,
    /// The provider's domain: the NIC (`mlx5_0`, `rdmap0s6-rdm`) or, for tcp, the interface
    /// (`lo`).
    pub domain_name: String,
    /// How a completed write proves its bytes are in the target's memory.
    pub write_completion: WriteCompletion,
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
    /// memory, with the best write completion it gives (`write_completion`): delivery-complete
    /// writes where the provider honours them, else writes fenced by a read.
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
        if !device_memory {
            return Fabric::open_with(lib, provider, domains, false);
        }
        Fabric::open_with(lib, provider, domains, true).or_else(|e| {
            let why = format!(
                "provider {} offers no domain that registers GPU memory (FI_HMEM): {e}",
                provider.unwrap_or("(any)")
            );
            Fabric::open_with(lib, provider, domains, false).map(|mut f| {
                Arc::get_mut(&mut f).expect("not shared yet").device_memory = Err(why);
                f
            })
        })
    }

    /// The domain `open_for` opens, with (`hmem`) or without device memory.
    fn open_with(
        lib: &'static Lib,
        provider: Option<&str>,
        domains: &[String],
        hmem: bool,
    ) -> Result<Arc<Fabric>> {
        // SAFETY: constants.
        let (dc, raw) = unsafe { (sys::mk_op_delivery_complete(), sys::mk_order_raw()) };
        let delivery = Found::get(lib, provider, hmem, dc, 0, domains);
        // The fallback stays on the provider found first (which may have been "any").
        let named = delivery.as_ref().ok().map(Found::provider);
        let ordered = Found::get(lib, named.as_deref().or(provider), hmem, 0, raw, domains);
        let name = named
            .or_else(|| ordered.as_ref().ok().map(Found::provider))
            .unwrap_or_default();
        match (
            write_completion(&name, delivery.is_ok(), ordered.is_ok()),
            delivery,
            ordered,
        ) {
            (Some(WriteCompletion::Delivery), Ok(f), _) => f.open(WriteCompletion::Delivery),
            (Some(WriteCompletion::ReadFence), _, Ok(f)) => f.open(WriteCompletion::ReadFence),
            (_, Ok(_), _) => Err(FabricError::other(
                "fi_getinfo",
                format!(
                    "{name} accepts FI_DELIVERY_COMPLETE without honouring it for RDMA writes \
                     and offers no read-after-write ordering to fence them"
                ),
            )),
            // Neither way found a domain: the first answer says why (no such provider, ...).
            (_, Err(e), _) => Err(e),
        }
    }

    /// `open` with writes fenced by a read (`WriteCompletion::ReadFence`) whatever else the
    /// provider offers: how the tests run the fallback over a provider that also honours
    /// delivery completion.
    pub fn open_with_read_fence(provider: Option<&str>, domains: &[String]) -> Result<Arc<Fabric>> {
        let lib = Lib::get().map_err(|e| FabricError::other("dlopen", e))?;
        // SAFETY: a constant.
        let raw = unsafe { sys::mk_order_raw() };
        Found::get(lib, provider, false, 0, raw, domains)?.open(WriteCompletion::ReadFence)
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

/// An fi_getinfo answer (freed on drop unless a `Fabric` takes it) and its entry on a wanted
/// domain.
struct Found {
    lib: &'static Lib,
    infos: *mut FiInfo,
    info: *mut FiInfo,
    /// Asked for with FI_HMEM (device memory).
    hmem: bool,
}

impl Found {
    /// Asks for RDM endpoints with RDMA reads and writes from `provider` with the transmit
    /// `op_flags` and `msg_order` given, and picks the first entry on one of `domains`.
    fn get(
        lib: &'static Lib,
        provider: Option<&str>,
        hmem: bool,
        op_flags: u64,
        msg_order: u64,
        domains: &[String],
    ) -> Result<Found> {
        let prov = provider
            .map(CString::new)
            .transpose()
            .map_err(|_| FabricError::other("fi_getinfo", "provider name contains NUL"))?;
        let mut infos: *mut FiInfo = std::ptr::null_mut();
        // SAFETY: `lib.api` holds libfabric's functions; the hints are built inside the shim.
        let r = unsafe {
            sys::mk_getinfo(
                &lib.api,
                prov.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
                c_int::from(hmem),
                op_flags,
                msg_order,
                &mut infos,
            )
        };
        if r != 0 {
            return Err(FabricError::new("fi_getinfo", r));
        }
        let mut found = Found {
            lib,
            infos,
            info: infos,
            hmem,
        };
        let mut seen = Vec::new();
        while !found.info.is_null() {
            // SAFETY: `info` is an entry of the list fi_getinfo returned.
            let dom = unsafe { sys::cstr(sys::mk_info_domain(found.info)) };
            if domain_wanted(domains, &dom) {
                return Ok(found);
            }
            seen.push(dom);
            // SAFETY: as above.
            found.info = unsafe { sys::mk_info_next(found.info) };
        }
        Err(FabricError::other(
            "fi_getinfo",
            format!("no domain among {domains:?}; the provider offers {seen:?}"),
        ))
    }

    fn provider(&self) -> String {
        // SAFETY: `info` is a valid entry while `self` lives.
        unsafe { sys::cstr(sys::mk_info_prov(self.info)) }
    }

    /// Opens the fabric and domain of the entry found; the `Fabric` takes the list.
    fn open(mut self, write_completion: WriteCompletion) -> Result<Arc<Fabric>> {
        let (lib, info) = (self.lib, self.info);
        // SAFETY: `info` is a valid entry of the list this Found owns.
        let (prov, domain_name) = unsafe {
            (
                sys::cstr(sys::mk_info_prov(info)),
                sys::cstr(sys::mk_info_domain(info)),
            )
        };
        if tuning::shrinks_rx(&prov, std::env::var_os(tuning::RX_SIZE_VAR).is_some()) {
            // The endpoints are opened with this entry, so their receive queues take its size.
            // SAFETY: as above; nothing has been opened with the entry yet.
            unsafe { sys::mk_info_shrink_rx(info, tuning::RX_SIZE) };
        }
        let (mut fabric, mut domain) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: `info` is a valid entry; the out pointers are ours.
        let r = unsafe { sys::mk_open_domain(&lib.api, info, &mut fabric, &mut domain) };
        if r != 0 {
            return Err(FabricError::new("fi_domain", r));
        }
        let infos = std::mem::replace(&mut self.infos, std::ptr::null_mut());
        // SAFETY: `info` stays valid until the Fabric drops the list; the accessors only read.
        let f = unsafe {
            let mr_mode = sys::mk_info_mr_mode(info);
            Fabric {
                lib,
                infos,
                info,
                fabric,
                domain,
                provider: prov.clone(),
                hello_name: tuning::hello_name(&prov, &lib.tuning.rxm_buffer_size()),
                write_completion,
                virt_addr: mr_mode & sys::mk_mr_virt_addr() != 0,
                prov_key: mr_mode & sys::mk_mr_prov_key() != 0,
                depth: sys::mk_info_tx_size(info).clamp(1, MAX_DEPTH),
                max_msg: sys::mk_info_max_msg(info).clamp(1, MAX_PIECE),
                device_memory: if self.hmem {
                    cuda_reach(
                        lib,
                        &format!("provider {prov} on {domain_name}"),
                        sys::mk_info_caps(info) & sys::mk_cap_hmem() != 0,
                    )
                } else {
                    Err("GPU memory was not asked for (FI_HMEM)".to_string())
                },
                addr_str: sys::mk_info_addr_str(info) != 0,
                // After `device_memory`, whose text names it.
                domain_name,
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
            write_completion = ?f.write_completion, virt_addr = f.virt_addr,
            prov_key = f.prov_key, depth = f.depth, device_memory = ?f.device_memory,
            "libfabric domain open");
        Ok(Arc::new(f))
    }
}

impl Drop for Found {
    fn drop(&mut self) {
        if !self.infos.is_null() {
            // SAFETY: the list came from fi_getinfo and nothing refers to it any more.
            unsafe { (self.lib.api.freeinfo)(self.infos) };
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
fn cuda_reach(lib: &Lib, what: &str, hmem: bool) -> std::result::Result<String, String> {
    if !hmem {
        return Err(format!("{what} registers host memory only (no FI_HMEM)"));
    }
    if !libfabric_has_param(lib, "FI_HMEM_CUDA_ENABLE_XFER") {
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
fn libfabric_has_param(lib: &Lib, name: &str) -> bool {
    lib.param_names()
        .is_some_and(|names| names.iter().any(|n| n == name))
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
    /// Where the fencing reads land, under `WriteCompletion::ReadFence`.
    fence: Option<FenceTarget>,
}

/// Bytes the fencing reads of `WriteCompletion::ReadFence` land in and nobody reads, registered
/// once per endpoint (the registration drops before the memory).
struct FenceTarget {
    mr: Mr,
    _mem: Box<[u8]>,
}

/// Bytes of a `FenceTarget`: concurrent fencing reads mostly land in different bytes, though
/// nothing depends on it.
const FENCE_BYTES: usize = 64;

/// The reads that prove a batch's writes are in the target's memory (`ReadFence`): per group
/// with writes and no error, one byte read back from the end of its last write, landing in
/// `[base, base + FENCE_BYTES)` (registered, `desc`).
fn fence_reads(ops: &[Rma], errors: &[Option<FabricError>], base: usize, desc: usize) -> Vec<Rma> {
    let mut last: Vec<Option<&Rma>> = vec![None; errors.len()];
    for op in ops.iter().filter(|op| op.write && op.len > 0) {
        last[op.group] = Some(op);
    }
    last.iter()
        .zip(errors)
        .filter_map(|(op, e)| if e.is_none() { *op } else { None })
        .enumerate()
        .map(|(i, op)| Rma {
            write: false,
            local: base + i % FENCE_BYTES,
            desc,
            len: 1,
            remote_addr: op.remote_addr.wrapping_add(op.len as u64 - 1),
            rkey: op.rkey,
            group: op.group,
        })
        .collect()
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
        let mut e = Endpoint {
            fab: fab.clone(),
            ep,
            cq,
            av,
            wait_fd: fd,
            contexts: vec![0u64; ctx_words * fab.depth].into_boxed_slice(),
            ctx_words,
            closed: false,
            fence: None,
        };
        if fab.write_completion == WriteCompletion::ReadFence {
            let mem = vec![0u8; FENCE_BYTES].into_boxed_slice();
            // SAFETY: the memory lives in the FenceTarget, which drops the registration first.
            let mr = unsafe { fab.register(mem.as_ptr() as usize, mem.len(), false) }?;
            e.fence = Some(FenceTarget { mr, _mem: mem });
        }
        Ok(e)
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
    /// an operation of a failed group that is not yet posted is skipped. A group's writes have
    /// their bytes in the peer's memory when it reports no error (`WriteCompletion`). A deadline
    /// miss or a broken completion queue closes the endpoint first (no operation of it can
    /// touch memory afterwards), so the caller may then release the memory the operations named.
    pub fn run(
        &mut self,
        peer: u64,
        ops: &[Rma],
        groups: usize,
        deadline: Instant,
    ) -> Result<Vec<Option<FabricError>>> {
        let mut errors: Vec<Option<FabricError>> = vec![None; groups];
        self.run_batch(peer, ops, &mut errors, deadline)?;
        // Posted only now that the writes completed, so each read follows its group's writes.
        let fences = self
            .fence
            .as_ref()
            .map(|f| fence_reads(ops, &errors, f.mr.base, f.mr.desc()))
            .unwrap_or_default();
        if !fences.is_empty() {
            self.run_batch(peer, &fences, &mut errors, deadline)?;
        }
        Ok(errors)
    }

    /// `run`'s loop: posts `ops`, records each group's first error in `errors`.
    fn run_batch(
        &mut self,
        peer: u64,
        ops: &[Rma],
        errors: &mut [Option<FabricError>],
        deadline: Instant,
    ) -> Result<()> {
        if self.closed {
            return Err(FabricError::other("fi_read/fi_write", "endpoint closed"));
        }
        let depth = self.fab.depth;
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
                return Ok(());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_are_fenced_where_delivery_completion_is_missing_or_hollow() {
        use WriteCompletion::{Delivery, ReadFence};
        // Providers other than verbs are taken at their word (tcp and efa, read in their
        // sources, deliver before they complete).
        for p in ["tcp;ofi_rxm", "sockets", "shm", "efa"] {
            assert_eq!(write_completion(p, true, true), Some(Delivery), "{p}");
            assert_eq!(write_completion(p, true, false), Some(Delivery), "{p}");
        }
        // rxm accepts it over verbs, whose writes still complete on the acknowledgement.
        assert_eq!(
            write_completion("verbs;ofi_rxm", true, true),
            Some(ReadFence)
        );
        assert_eq!(
            write_completion("verbs;ofi_rxd", true, true),
            Some(ReadFence)
        );
        assert_eq!(write_completion("verbs;ofi_rxm", true, false), None);
        // A provider without it: the fence where reads are ordered after writes, else nothing.
        assert_eq!(write_completion("efa", false, true), Some(ReadFence));
        assert_eq!(write_completion("efa", false, false), None);
    }

    #[test]
    fn a_fence_reads_the_last_byte_of_each_written_groups_last_write() {
        let op = |write, group, remote_addr, len| Rma {
            write,
            local: 0,
            desc: 0,
            len,
            remote_addr,
            rkey: 10 + group as u64,
            group,
        };
        // Group 0: two pieces; group 1: failed; group 2: a read (a PUT's); group 3: one write.
        let ops = [
            op(true, 0, 1000, 4),
            op(true, 0, 1004, 6),
            op(true, 1, 5000, 8),
            op(false, 2, 7000, 8),
            op(true, 3, 9000, 1),
        ];
        let errors = [None, Some(FabricError::other("x", "failed")), None, None];
        let f = fence_reads(&ops, &errors, 0x100, 77);
        let got: Vec<_> = f
            .iter()
            .map(|r| {
                (
                    r.write,
                    r.group,
                    r.remote_addr,
                    r.rkey,
                    r.len,
                    r.local,
                    r.desc,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (false, 0, 1009, 10, 1, 0x100, 77),
                (false, 3, 9000, 13, 1, 0x101, 77)
            ]
        );
        assert!(fence_reads(&ops[3..4], &[None, None, None], 0, 0).is_empty());
    }

    #[test]
    fn devices_are_named_as_sysfs_or_as_the_provider_names_their_domain() {
        let want = |w: &[&str], dom: &str| {
            domain_wanted(&w.iter().map(|s| s.to_string()).collect::<Vec<_>>(), dom)
        };
        assert!(want(&[], "anything"));
        assert!(want(&["rdmap0s31"], "rdmap0s31-rdm"));
        assert!(want(&["rdmap0s31-rdm"], "rdmap0s31-rdm"));
        assert!(want(&["efa_0"], "efa_0-rdm"));
        assert!(want(&["mlx5_1", "mlx5_0"], "mlx5_0"));
        assert!(!want(&["rdmap0s31"], "rdmap0s32-rdm"));
        assert!(!want(&["mlx5_0"], "mlx5_01"));
        assert!(!want(&["lo"], "eth0"));
    }
}
