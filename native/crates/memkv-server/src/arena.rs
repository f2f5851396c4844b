//! Value memory: one pre-faulted anonymous mapping per lane and a first-fit span allocator over it.
//!
//! Memory is mapped and faulted in at startup (huge pages where the kernel gives them) so a PUT
//! never pays page faults on the hot path, and one contiguous region per lane keeps the door open
//! for a single RDMA registration.
//! KV-cache values are near-uniform in size per model, so first fit with coalescing fragments little.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

/// Allocation granularity: keeps values cache-line aligned.
const ALIGN: u64 = 64;

/// Bytes of the arena a value of `len` bytes occupies.
pub fn footprint(len: u64) -> u64 {
    len.max(1).div_ceil(ALIGN) * ALIGN
}

pub struct Region {
    base: *mut u8,
    len: usize,
    /// The memfd behind a shared region (`new_shared`), sealed against resizing.
    fd: Option<OwnedFd>,
}

// SAFETY: the mapping lives as long as the Region and is only accessed through spans handed out
// by the allocator below, which never hands out overlapping live spans.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// Maps `len` bytes of private anonymous memory, pre-faulted, with transparent huge pages
    /// requested where the kernel supports them.
    pub fn new(len: usize) -> std::io::Result<Region> {
        Region::map(len, None)
    }

    /// `new`, over a memfd named `name` that same-host clients may map read-only
    /// (`reader_fd`): the value memory of `--shm-share-values`. The file is sealed so that no
    /// holder of a descriptor can grow or shrink it (a shrink would SIGBUS the server's
    /// copies), and the descriptors handed out are opened read-only.
    pub fn new_shared(len: usize, name: &str) -> std::io::Result<Region> {
        let cname = CString::new(name).map_err(std::io::Error::other)?;
        // SAFETY: memfd_create with a valid C string; the result is checked.
        let fd = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor memfd_create just returned, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate and fcntl on our own memfd.
        unsafe {
            if libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
            if libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Region::map(len, Some(fd))
    }

    fn map(len: usize, fd: Option<OwnedFd>) -> std::io::Result<Region> {
        if len == 0 {
            return Ok(Region {
                base: std::ptr::NonNull::dangling().as_ptr(),
                len: 0,
                fd,
            });
        }
        let (flags, raw) = match &fd {
            Some(f) => (libc::MAP_SHARED, f.as_raw_fd()),
            None => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1),
        };
        // SAFETY: a fresh mapping (anonymous, or of our own memfd of `len` bytes); arguments
        // are valid and the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                raw,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // Ask for huge pages first and fault the memory in after, so the faults can take them:
        // pre-faulting at mmap (MAP_POPULATE) would fill the region with 4 KiB pages before the
        // advice is seen. Fewer TLB misses matter when every value is copied in and out.
        // SAFETY: advice on our own mapping; failure is harmless (no THP on this kernel).
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        // SAFETY: populating our own mapping; on kernels before 5.14 it fails and we touch instead.
        if unsafe { libc::madvise(p, len, libc::MADV_POPULATE_WRITE) } != 0 {
            for off in (0..len).step_by(4096) {
                // SAFETY: `off < len`, inside the mapping.
                unsafe { (p as *mut u8).add(off).write_volatile(0) };
            }
        }
        Ok(Region {
            base: p as *mut u8,
            len,
            fd,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// A new read-only descriptor of a shared region's memfd (None for a private region):
    /// what a same-host client maps. Reopened through /proc so that the client's descriptor
    /// cannot write, map writable or punch holes, whatever it does with it.
    pub fn reader_fd(&self) -> Option<std::io::Result<OwnedFd>> {
        let fd = self.fd.as_ref()?;
        let path = format!("/proc/self/fd/{}\0", fd.as_raw_fd());
        // SAFETY: open of a NUL-terminated path; the result is checked.
        let r = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
        Some(if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            // SAFETY: a descriptor open just returned.
            Ok(unsafe { OwnedFd::from_raw_fd(r) })
        })
    }

    /// The whole region, for an owner that uses it as one buffer (the bench's TCP ceiling).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` bytes, lives as long as `self`, and `&mut self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.base, self.len) }
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: unmapping the mapping created in `new`; no span outlives the Region because
            // every Span holds an Arc to its LaneMemory.
            unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
        }
    }
}

/// A lane's memory: the region and its free list. Shared by the lane and every live span.
pub struct LaneMemory {
    region: Region,
    free: Mutex<FreeList>,
}

struct FreeList {
    /// offset -> length of each free span; adjacent spans are always merged.
    spans: BTreeMap<u64, u64>,
    used: u64,
}

impl LaneMemory {
    pub fn new(len: usize) -> std::io::Result<Arc<LaneMemory>> {
        LaneMemory::over(Region::new(len)?)
    }

    /// A lane's memory that same-host clients may map read-only (`Region::new_shared`).
    pub fn new_shared(len: usize, name: &str) -> std::io::Result<Arc<LaneMemory>> {
        LaneMemory::over(Region::new_shared(len, name)?)
    }

    fn over(region: Region) -> std::io::Result<Arc<LaneMemory>> {
        let len = region.len();
        let mut spans = BTreeMap::new();
        let usable = (len as u64) / ALIGN * ALIGN;
        if usable > 0 {
            spans.insert(0, usable);
        }
        Ok(Arc::new(LaneMemory {
            region,
            free: Mutex::new(FreeList { spans, used: 0 }),
        }))
    }

    pub fn capacity(&self) -> u64 {
        self.region.len() as u64 / ALIGN * ALIGN
    }

    /// Start and length of the whole region, for one RDMA registration covering every span.
    pub fn range(&self) -> (usize, usize) {
        (self.region.base as usize, self.region.len)
    }

    pub fn used(&self) -> u64 {
        self.free.lock().unwrap().used
    }

    /// A read-only descriptor of the memory, when it is shared (`new_shared`).
    pub fn reader_fd(&self) -> Option<std::io::Result<OwnedFd>> {
        self.region.reader_fd()
    }

    /// First-fit allocation of `len` bytes (rounded up to ALIGN). None when no free span fits.
    pub fn alloc(self: &Arc<Self>, len: u64) -> Option<Span> {
        self.alloc_aligned(len, ALIGN)
    }

    /// First-fit allocation of `len` bytes rounded up to `align` (a power of two, at least
    /// ALIGN), starting at an address that is a multiple of `align`: the buffers of direct I/O,
    /// whose address and length must be multiples of the device's block size.
    pub fn alloc_aligned(self: &Arc<Self>, len: u64, align: u64) -> Option<Span> {
        debug_assert!(align.is_power_of_two() && align >= ALIGN);
        let need = len.max(1).div_ceil(align) * align;
        let base = self.region.base as u64;
        let start_of = |off: u64| (base + off).div_ceil(align) * align - base;
        let mut fl = self.free.lock().unwrap();
        let (&off, &flen) = fl
            .spans
            .iter()
            .find(|(&o, &l)| start_of(o) - o + need <= l)?;
        let start = start_of(off);
        fl.spans.remove(&off);
        if start > off {
            fl.spans.insert(off, start - off);
        }
        let end = start + need;
        if off + flen > end {
            fl.spans.insert(end, off + flen - end);
        }
        fl.used += need;
        Some(Span {
            mem: self.clone(),
            off: start,
            len,
            cap: need,
        })
    }

    fn release(&self, off: u64, cap: u64) {
        let mut fl = self.free.lock().unwrap();
        fl.used -= cap;
        let (mut start, mut len) = (off, cap);
        if let Some((&poff, &plen)) = fl.spans.range(..off).next_back() {
            if poff + plen == off {
                fl.spans.remove(&poff);
                start = poff;
                len += plen;
            }
        }
        if let Some(&nlen) = fl.spans.get(&(off + cap)) {
            fl.spans.remove(&(off + cap));
            len += nlen;
        }
        fl.spans.insert(start, len);
    }
}

/// An allocated piece of a lane's region. Freed when dropped, so a value being read or written
/// keeps its bytes alive even after eviction unlinked it from the index.
pub struct Span {
    mem: Arc<LaneMemory>,
    off: u64,
    len: u64,
    cap: u64,
}

impl Span {
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The span's memory including its rounding past `len`: `cap` bytes, for a direct read
    /// that must cover whole blocks.
    pub fn as_mut_ptr_cap(&mut self) -> (*mut u8, usize) {
        // SAFETY: [off, off+cap) lies inside the region and belongs to this span alone.
        let p = unsafe { self.mem.region.base.add(self.off as usize) };
        (p, self.cap as usize)
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: [off, off+len) lies inside the region and belongs to this span alone.
        unsafe {
            std::slice::from_raw_parts(
                self.mem.region.base.add(self.off as usize),
                self.len as usize,
            )
        }
    }

    /// Mutable view for filling the span. Only the connection that allocated the span writes it,
    /// before it is committed (shared) through the index.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` proves no other reference to this span exists.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.mem.region.base.add(self.off as usize),
                self.len as usize,
            )
        }
    }
}

#[cfg(test)]
impl Span {
    /// Flips a byte in place, to simulate memory corruption in tests.
    pub fn corrupt_for_test(&self, i: usize) {
        assert!((i as u64) < self.len);
        // SAFETY: test-only; no reader is active in the tests that call this.
        unsafe { *self.mem.region.base.add(self.off as usize + i) ^= 0xFF };
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        self.mem.release(self.off, self.cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_coalesces() {
        let m = LaneMemory::new(64 * 1024).unwrap();
        let a = m.alloc(1000).unwrap();
        let b = m.alloc(1000).unwrap();
        let c = m.alloc(1000).unwrap();
        assert_eq!(m.used(), 3 * 1024);
        drop(b);
        drop(a);
        drop(c);
        assert_eq!(m.used(), 0);
        // Everything merged back: the whole capacity fits again.
        assert!(m.alloc(64 * 1024).is_some());
    }

    #[test]
    fn aligned_spans_start_on_the_boundary_and_free_whole() {
        let m = LaneMemory::new(1 << 20).unwrap();
        let _a = m.alloc(100).unwrap();
        let mut b = m.alloc_aligned(5000, 4096).unwrap();
        let (p, cap) = b.as_mut_ptr_cap();
        assert_eq!((p as usize % 4096, cap), (0, 8192));
        assert_eq!(b.len(), 5000);
        let c = m.alloc(64).unwrap();
        drop(b);
        drop(c);
        drop(_a);
        assert_eq!(m.used(), 0);
        assert!(
            m.alloc(1 << 20).is_some(),
            "the gap before the aligned span merged back"
        );
    }

    #[test]
    fn refuses_when_full_and_spans_do_not_overlap() {
        let m = LaneMemory::new(4096).unwrap();
        let mut spans: Vec<Span> = (0..4).map(|_| m.alloc(1024).unwrap()).collect();
        assert!(m.alloc(1).is_none());
        for (i, s) in spans.iter_mut().enumerate() {
            s.as_mut_slice().fill(i as u8);
        }
        for (i, s) in spans.iter().enumerate() {
            assert!(s.as_slice().iter().all(|&b| b == i as u8));
        }
    }
}
