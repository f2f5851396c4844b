//! Where a buffer lives: host memory, or the memory of a CUDA device.
//!
//! Asked of the CUDA driver (`cuPointerGetAttribute`), looked up in a `libcuda.so.1` the process
//! has ALREADY loaded (dlopen with RTLD_NOLOAD): a process that never loaded the driver cannot
//! hold device memory, so it gets "host" for every buffer without the driver being loaded into
//! it (an engine on the CPU, `memkv serve`, a host without NVIDIA's driver). Nothing links the
//! driver. Memory the driver calls device memory includes managed memory (the classification
//! libfabric itself uses for `FI_HMEM_CUDA`).

use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;

/// Where the bytes of a buffer live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    Host,
    /// Memory of the CUDA device with this ordinal (as the driver numbers them).
    Cuda(i32),
}

impl std::fmt::Display for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Memory::Host => f.write_str("host memory"),
            Memory::Cuda(d) => write!(f, "GPU memory (CUDA device {d})"),
        }
    }
}

type PointerGetAttribute = unsafe extern "C" fn(*mut c_void, c_int, u64) -> c_int;

/// `CUpointer_attribute` and `CUmemorytype` values of cuda.h (stable since CUDA 9.2).
const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
const CU_MEMORYTYPE_DEVICE: c_uint = 2;

struct Driver {
    get_attribute: PointerGetAttribute,
    /// Keeps our reference to the driver (it is never unloaded while we may call it).
    _lib: libloading::os::unix::Library,
}

/// The driver, once the process has loaded it; None before that (and on hosts without it).
fn driver() -> Option<&'static Driver> {
    static DRIVER: OnceLock<Driver> = OnceLock::new();
    if let Some(d) = DRIVER.get() {
        return Some(d);
    }
    // SAFETY: RTLD_NOLOAD only takes a reference to a library already loaded (its constructors
    // ran); the symbol has the C signature of cuda.h's cuPointerGetAttribute.
    let d = unsafe {
        let lib = libloading::os::unix::Library::open(
            Some("libcuda.so.1"),
            libc::RTLD_NOW | libc::RTLD_NOLOAD,
        )
        .ok()?;
        let get_attribute: PointerGetAttribute = *lib.get(b"cuPointerGetAttribute\0").ok()?;
        Driver {
            get_attribute,
            _lib: lib,
        }
    };
    Some(DRIVER.get_or_init(|| d))
}

/// Where the byte at `ptr` lives. Any answer but "device memory" from the driver (host memory,
/// an address it does not know, a driver not initialised) is host memory.
pub fn locate(ptr: usize) -> Memory {
    let Some(d) = driver() else {
        return Memory::Host;
    };
    let mut kind: c_uint = 0;
    // SAFETY: the driver writes one CUmemorytype (an unsigned int) for this attribute; it
    // never dereferences `ptr`.
    let r = unsafe {
        (d.get_attribute)(
            (&raw mut kind).cast(),
            CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr as u64,
        )
    };
    if r != 0 || kind != CU_MEMORYTYPE_DEVICE {
        return Memory::Host;
    }
    let mut ordinal: c_int = -1;
    // SAFETY: the driver writes one int for this attribute.
    let r = unsafe {
        (d.get_attribute)(
            (&raw mut ordinal).cast(),
            CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr as u64,
        )
    };
    // Device memory of an unknown device is still device memory: never treat it as host.
    Memory::Cuda(if r == 0 { ordinal } else { -1 })
}

/// Whether this process has loaded the CUDA driver (only then can a buffer be device memory).
pub fn cuda_loaded() -> bool {
    driver().is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffers_are_host_memory() {
        let v = vec![7u8; 4096];
        let b = Box::new(0u64);
        assert_eq!(locate(v.as_ptr() as usize), Memory::Host);
        assert_eq!(locate(std::ptr::from_ref(&*b) as usize), Memory::Host);
        assert_eq!(locate(0), Memory::Host);
    }

    #[test]
    fn describes_itself() {
        assert_eq!(Memory::Host.to_string(), "host memory");
        assert_eq!(Memory::Cuda(3).to_string(), "GPU memory (CUDA device 3)");
    }
}
