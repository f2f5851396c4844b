//! Finding a provider's fi_getinfo entry on a wanted domain, what that domain reaches (host or
//! GPU memory), and opening it as a `Fabric`.

use std::ffi::{c_int, CString};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::completion::WriteCompletion;
use crate::error::{FabricError, Result};
use crate::fabric::{Fabric, MAX_DEPTH, MAX_PIECE};
use crate::sys::{self, FiInfo, Lib};
use crate::tuning;

/// Whether the provider's domain `dom` is among `wanted` (all when empty): by its own name, or by
/// its device's (`rdmap0s31` for efa's `rdmap0s31-rdm`), as sysfs and `memkv net topo` name NICs.
fn domain_wanted(wanted: &[String], dom: &str) -> bool {
    let dev = memkv_topo::device_of_domain(dom);
    wanted.is_empty() || wanted.iter().any(|w| w == dom || w == dev)
}

/// An fi_getinfo answer (freed on drop unless a `Fabric` takes it) and its entry on a wanted
/// domain.
pub(crate) struct Found {
    lib: &'static Lib,
    infos: *mut FiInfo,
    info: *mut FiInfo,
    /// Asked for with FI_HMEM (device memory).
    hmem: bool,
}

impl Found {
    /// Asks for RDM endpoints with RDMA reads and writes from `provider` with the transmit
    /// `op_flags` and `msg_order` given, and picks the first entry on one of `domains`.
    pub(crate) fn get(
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

    pub(crate) fn provider(&self) -> String {
        // SAFETY: `info` is a valid entry while `self` lives.
        unsafe { sys::cstr(sys::mk_info_prov(self.info)) }
    }

    /// Opens the fabric and domain of the entry found; the `Fabric` takes the list.
    pub(crate) fn open(mut self, write_completion: WriteCompletion) -> Result<Arc<Fabric>> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
