//! `Fabric`: one provider's fabric and domain, and the memory registrations made on it.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::completion::{write_completion, WriteCompletion};
use crate::discovery::Found;
use crate::endpoint::MAX_NAME;
use crate::error::{FabricError, Result};
use crate::memory::Memory;
use crate::mr::Mr;
use crate::sys::{self, FiInfo, Fid, Lib};

/// One provider's fabric and domain, shared by its endpoints and registrations (which keep it
/// open). Thread-safe: the domain is opened with FI_THREAD_SAFE.
pub struct Fabric {
    pub(crate) lib: &'static Lib,
    /// The list fi_getinfo returned (freed on drop) and the entry in use.
    pub(crate) infos: *mut FiInfo,
    pub(crate) info: *mut FiInfo,
    pub(crate) fabric: Fid,
    pub(crate) domain: Fid,
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
    pub(crate) virt_addr: bool,
    /// The provider picks registration keys (else we do, unique per domain).
    pub(crate) prov_key: bool,
    /// Operations one endpoint may have in flight.
    pub depth: usize,
    /// Largest single read or write.
    pub max_msg: usize,
    /// Ok: the domain registers CUDA device memory (how, for logs); Err: why it does not.
    pub(crate) device_memory: std::result::Result<String, String>,
    /// Endpoint addresses are NUL-terminated strings (shm), not structures of one size.
    pub(crate) addr_str: bool,
    pub(crate) next_key: AtomicU64,
}

// SAFETY: the domain is FI_THREAD_SAFE and the info list is only read after `open`.
unsafe impl Send for Fabric {}
unsafe impl Sync for Fabric {}

/// Most operations an endpoint keeps in flight, whatever the provider allows.
pub(crate) const MAX_DEPTH: usize = 256;
/// Largest piece one read or write moves: bigger values are split, so one value does not hold
/// the endpoint for its whole transfer and every provider's message limit is met.
pub(crate) const MAX_PIECE: usize = 4 << 20;

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
    pub(crate) fn remote_addr(&self, base: usize, ptr: usize) -> u64 {
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
