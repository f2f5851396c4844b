//! The raw layer: libfabric's exported functions found with dlopen at first use, and the C shim
//! (csrc/shim.c) that reaches the rest of libfabric through the headers' inline functions.
//!
//! Why a C shim rather than hand-written `#[repr(C)]` structs: most of libfabric's API
//! (fi_domain, fi_endpoint, fi_mr_reg, fi_read, fi_write, fi_cq_read, fi_close, ...) is static
//! inline code in the headers calling through ops tables, so Rust would need exact copies of
//! `fi_info`, its six attribute structs and every ops table, kept in step with the headers by
//! hand. Compiled against the real (vendored, BSD-licensed) headers, the shim gets every layout
//! from the compiler and stays a few dozen one-line functions.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use crate::tuning::{self, Tuning};

/// Opaque libfabric objects; only pointers to them cross the boundary.
#[repr(C)]
pub struct FiInfo {
    _p: [u8; 0],
}
pub type Fid = *mut c_void;

/// The exported libfabric functions the shim needs (field order matches `struct mk_api`).
#[repr(C)]
pub struct Api {
    pub getinfo: unsafe extern "C" fn(
        u32,
        *const c_char,
        *const c_char,
        u64,
        *const FiInfo,
        *mut *mut FiInfo,
    ) -> c_int,
    pub freeinfo: unsafe extern "C" fn(*mut FiInfo),
    pub dupinfo: unsafe extern "C" fn(*const FiInfo) -> *mut FiInfo,
    pub fabric: unsafe extern "C" fn(*mut c_void, *mut Fid, *mut c_void) -> c_int,
}

/// libfabric, loaded: the functions above plus `fi_strerror` for messages.
pub struct Lib {
    pub api: Api,
    strerror: unsafe extern "C" fn(c_int) -> *const c_char,
    pub version: u32,
    /// What memkv set of rxm's sizes before libfabric initialised (`tuning`).
    pub tuning: Tuning,
    /// Keeps the library mapped for as long as the process runs.
    lib: libloading::Library,
}

/// The library file: the ABI-1 soname every distribution ships.
pub const LIBFABRIC: &str = "libfabric.so.1";

/// The variable naming the libfabric to load instead of the dynamic linker's `libfabric.so.1`:
/// AWS EFA hosts carry their own build under /opt/amazon/efa/lib64 beside the distribution's.
pub const LIBFABRIC_VAR: &str = "MEMKV_LIBFABRIC";

/// Which libfabric to load: `MEMKV_LIBFABRIC` when set and not empty (a path, or a name the
/// dynamic linker resolves), else the soname.
fn library_name(var: Option<std::ffi::OsString>) -> std::ffi::OsString {
    var.filter(|v| !v.is_empty())
        .unwrap_or_else(|| LIBFABRIC.into())
}

impl Lib {
    /// libfabric, loaded once per process at the first call; the error (library missing, or
    /// without a function we need) is returned to every caller.
    pub fn get() -> Result<&'static Lib, String> {
        static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
        LIB.get_or_init(|| Lib::load(&library_name(std::env::var_os(LIBFABRIC_VAR))))
            .as_ref()
            .map_err(Clone::clone)
    }

    fn load(name: &std::ffi::OsStr) -> Result<Lib, String> {
        let shown = name.to_string_lossy();
        // A libfabric some other part of this process loaded first may be initialised with
        // its settings already, or be about to be: memkv's sizes are not its to change.
        // SAFETY: RTLD_NOLOAD only looks for a library already loaded; nothing is run.
        let loaded_before = unsafe {
            libloading::os::unix::Library::open(Some(name), libc::RTLD_NOW | libc::RTLD_NOLOAD)
        }
        .is_ok();
        // SAFETY: loading libfabric runs its constructors, which only initialise the library.
        let lib = unsafe { libloading::Library::new(name) }.map_err(|e| {
            if shown == LIBFABRIC {
                format!(
                    "cannot load {LIBFABRIC} (install libfabric1, or set {LIBFABRIC_VAR} to \
                     the library's path): {e}"
                )
            } else {
                format!("cannot load libfabric from {LIBFABRIC_VAR}={shown}: {e}")
            }
        })?;
        // SAFETY: each symbol is looked up with the C signature the libfabric 1.x ABI gives it.
        unsafe {
            let sym = |sym: &str| format!("{shown} is not libfabric 1.x: it has no {sym}");
            let version: libloading::Symbol<'_, unsafe extern "C" fn() -> u32> =
                lib.get(b"fi_version\0").map_err(|_| sym("fi_version"))?;
            let api = Api {
                getinfo: *lib.get(b"fi_getinfo\0").map_err(|_| sym("fi_getinfo"))?,
                freeinfo: *lib.get(b"fi_freeinfo\0").map_err(|_| sym("fi_freeinfo"))?,
                dupinfo: *lib.get(b"fi_dupinfo\0").map_err(|_| sym("fi_dupinfo"))?,
                fabric: *lib.get(b"fi_fabric\0").map_err(|_| sym("fi_fabric"))?,
            };
            let strerror = *lib.get(b"fi_strerror\0").map_err(|_| sym("fi_strerror"))?;
            let version = version();
            let tuning = if loaded_before {
                Tuning::Skipped(format!(
                    "{shown} was loaded in this process before memkv used it"
                ))
            } else {
                // fi_getparams initialises libfabric (fi_ini), where rxm reads its sizes.
                tuning::apply(|| param_names(&lib).is_some())
                    .unwrap_or_else(|| Tuning::Skipped(format!("{shown} has no fi_getparams")))
            };
            tracing::debug!(library = %shown, rxm = %tuning, "libfabric loaded");
            Ok(Lib {
                api,
                strerror,
                version,
                tuning,
                lib,
            })
        }
    }

    /// The names of the parameters (environment variables) libfabric and its providers define;
    /// None when it has no `fi_getparams`. The first call initialises libfabric.
    pub fn param_names(&self) -> Option<Vec<String>> {
        param_names(&self.lib)
    }

    /// libfabric's text for an error code (positive or negative).
    pub fn strerror(&self, code: i32) -> String {
        // SAFETY: fi_strerror returns a static NUL-terminated string for any code.
        unsafe { CStr::from_ptr((self.strerror)(code.abs())) }
            .to_string_lossy()
            .into_owned()
    }
}

/// `Lib::param_names` of the library `lib`.
fn param_names(lib: &libloading::Library) -> Option<Vec<String>> {
    #[repr(C)]
    struct FiParam {
        name: *const c_char,
        kind: c_int,
        help: *const c_char,
        value: *const c_char,
    }
    type GetParams = unsafe extern "C" fn(*mut *mut FiParam, *mut c_int) -> c_int;
    type FreeParams = unsafe extern "C" fn(*mut FiParam);
    // SAFETY: both functions have the C signatures of fabric.h's fi_getparams and
    // fi_freeparams, and `struct fi_param` is four pointer-sized fields.
    unsafe {
        let get = lib.get::<GetParams>(b"fi_getparams\0").ok()?;
        let free = lib.get::<FreeParams>(b"fi_freeparams\0").ok()?;
        let (mut params, mut count) = (std::ptr::null_mut(), 0);
        if get(&mut params, &mut count) != 0 || params.is_null() {
            return Some(Vec::new());
        }
        let names = std::slice::from_raw_parts(params, count.max(0) as usize)
            .iter()
            .map(|p| cstr(p.name))
            .collect();
        free(params);
        Some(names)
    }
}

/// The C string at `p`, or "" for NULL.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for the call.
pub unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

extern "C" {
    pub fn mk_getinfo(
        api: *const Api,
        prov: *const c_char,
        hmem: c_int,
        op_flags: u64,
        msg_order: u64,
        out: *mut *mut FiInfo,
    ) -> c_int;
    pub fn mk_info_next(info: *const FiInfo) -> *mut FiInfo;
    pub fn mk_info_prov(info: *const FiInfo) -> *const c_char;
    pub fn mk_info_domain(info: *const FiInfo) -> *const c_char;
    pub fn mk_info_fabric(info: *const FiInfo) -> *const c_char;
    pub fn mk_info_mr_mode(info: *const FiInfo) -> u64;
    pub fn mk_info_tx_size(info: *const FiInfo) -> usize;
    pub fn mk_info_max_msg(info: *const FiInfo) -> usize;
    pub fn mk_info_key_size(info: *const FiInfo) -> usize;
    pub fn mk_info_caps(info: *const FiInfo) -> u64;
    pub fn mk_info_addr_str(info: *const FiInfo) -> c_int;
    pub fn mk_info_shrink_rx(info: *mut FiInfo, size: usize);
    pub fn mk_open_domain(
        api: *const Api,
        info: *mut FiInfo,
        fabric: *mut Fid,
        domain: *mut Fid,
    ) -> c_int;
    pub fn mk_open_ep(
        domain: Fid,
        info: *mut FiInfo,
        ep: *mut Fid,
        cq: *mut Fid,
        av: *mut Fid,
        wait_fd: *mut c_int,
    ) -> c_int;
    pub fn mk_close(fid: Fid) -> c_int;
    pub fn mk_getname(ep: Fid, addr: *mut c_void, len: *mut usize) -> c_int;
    pub fn mk_av_insert(av: Fid, addr: *const c_void, fi_addr: *mut u64) -> c_int;
    pub fn mk_mr_reg(
        domain: Fid,
        buf: *mut c_void,
        len: usize,
        access: u64,
        requested_key: u64,
        iface: c_int,
        device: c_int,
        mr: *mut Fid,
        desc: *mut *mut c_void,
        key: *mut u64,
    ) -> c_int;
    pub fn mk_access_local_read() -> u64;
    pub fn mk_access_local_write() -> u64;
    pub fn mk_access_remote_read() -> u64;
    pub fn mk_access_remote_write() -> u64;
    pub fn mk_mr_virt_addr() -> u64;
    pub fn mk_mr_prov_key() -> u64;
    pub fn mk_cap_hmem() -> u64;
    pub fn mk_hmem_system() -> c_int;
    pub fn mk_hmem_cuda() -> c_int;
    pub fn mk_op_delivery_complete() -> u64;
    pub fn mk_order_raw() -> u64;
    pub fn mk_context_size() -> usize;
    pub fn mk_rma(
        ep: Fid,
        write: c_int,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        peer: u64,
        addr: u64,
        key: u64,
        ctx: *mut c_void,
    ) -> isize;
    pub fn mk_cq_read(
        cq: Fid,
        contexts: *mut *mut c_void,
        count: usize,
        err_context: *mut *mut c_void,
        err: *mut c_int,
        prov_errno: *mut c_int,
    ) -> isize;
    pub fn mk_trywait(fabric: Fid, cq: Fid) -> c_int;
    pub fn mk_eagain() -> c_int;
    pub fn mk_eavail() -> c_int;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_names_the_library_and_empty_means_the_soname() {
        assert_eq!(library_name(None), LIBFABRIC);
        assert_eq!(library_name(Some("".into())), LIBFABRIC);
        assert_eq!(
            library_name(Some("/opt/amazon/efa/lib64/libfabric.so.1".into())),
            "/opt/amazon/efa/lib64/libfabric.so.1"
        );
    }

    #[test]
    fn a_library_that_is_missing_or_not_libfabric_is_a_clear_error() {
        let e = Lib::load("/nonexistent/libfabric.so.1".as_ref())
            .err()
            .unwrap();
        assert!(
            e.starts_with(
                "cannot load libfabric from MEMKV_LIBFABRIC=/nonexistent/libfabric.so.1: "
            ),
            "{e}"
        );
        // The C library loads but is no libfabric.
        let e = Lib::load("libc.so.6".as_ref()).err().unwrap();
        assert_eq!(e, "libc.so.6 is not libfabric 1.x: it has no fi_version");
    }
}
