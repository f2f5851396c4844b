//! The caller memory the shared-memory transport can hand a server: regions registered with
//! `Client::register_memory` that are mappings of a memfd or a /dev/shm (tmpfs) file, found in
//! /proc/self/maps with a descriptor of the file (one the process holds open, found in
//! /proc/self/fd, or the file reopened by its path). Memory that is no such mapping (malloc,
//! anonymous, GPU) is not a region: its transfers go over the stream.

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// A registered region: the caller's address range and where it lies in its file.
#[derive(Debug)]
pub struct Region {
    /// Unique for the client's lifetime (a server keys its mappings by it, per connection).
    pub id: u32,
    pub ptr: usize,
    pub len: usize,
    pub fd: Arc<OwnedFd>,
    pub file_offset: u64,
}

impl Region {
    fn covers(&self, ptr: usize, len: usize) -> bool {
        ptr >= self.ptr
            && ptr
                .checked_add(len)
                .is_some_and(|e| e <= self.ptr + self.len)
    }
}

/// Every registered region; shared by all connections of a client.
#[derive(Default)]
pub struct Regions {
    list: Mutex<Vec<Arc<Region>>>,
    next_id: AtomicU32,
}

impl Regions {
    /// Adds `[ptr, ptr + len)` when it is a shared mapping of a memfd or tmpfs file; Err says
    /// why it is not (its transfers then go over the stream).
    pub fn register(&self, ptr: usize, len: usize) -> Result<(), String> {
        let (fd, file_offset) = find_file(ptr, len)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let mut list = self.list.lock().unwrap();
        list.retain(|r| r.ptr != ptr);
        list.push(Arc::new(Region {
            id,
            ptr,
            len,
            fd: Arc::new(fd),
            file_offset,
        }));
        Ok(())
    }

    /// Forgets the region starting at `ptr` (connections tell their servers before their next
    /// transfer).
    pub fn unregister(&self, ptr: usize) {
        self.list.lock().unwrap().retain(|r| r.ptr != ptr);
    }

    /// The region holding all of `[ptr, ptr + len)`.
    pub fn find(&self, ptr: usize, len: usize) -> Option<Arc<Region>> {
        let list = self.list.lock().unwrap();
        list.iter().find(|r| r.covers(ptr, len)).cloned()
    }

    /// Whether region `id` is still registered.
    pub fn holds(&self, id: u32) -> bool {
        self.list.lock().unwrap().iter().any(|r| r.id == id)
    }
}

/// One line of /proc/self/maps.
struct Mapping {
    start: usize,
    end: usize,
    shared: bool,
    offset: u64,
    dev: (u32, u32),
    inode: u64,
    path: String,
}

fn parse_line(line: &str) -> Option<Mapping> {
    let mut f = line.splitn(6, ' ');
    let (range, perms, offset, dev, inode) =
        (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
    let path = f.next().unwrap_or("").trim_start().to_string();
    let (s, e) = range.split_once('-')?;
    let (maj, min) = dev.split_once(':')?;
    Some(Mapping {
        start: usize::from_str_radix(s, 16).ok()?,
        end: usize::from_str_radix(e, 16).ok()?,
        shared: perms.as_bytes().get(3) == Some(&b's'),
        offset: u64::from_str_radix(offset, 16).ok()?,
        dev: (
            u32::from_str_radix(maj, 16).ok()?,
            u32::from_str_radix(min, 16).ok()?,
        ),
        inode: inode.parse().ok()?,
        path,
    })
}

/// A descriptor of the file `[ptr, ptr + len)` is a shared mapping of, and the range's offset
/// in it. The range may span several lines of the maps (the kernel splits a mapping whose
/// parts differ, e.g. in protection) as long as they continue the same file.
fn find_file(ptr: usize, len: usize) -> Result<(OwnedFd, u64), String> {
    if len == 0 {
        return Err("an empty region".into());
    }
    let maps =
        fs::read_to_string("/proc/self/maps").map_err(|e| format!("/proc/self/maps: {e}"))?;
    let lines: Vec<Mapping> = maps.lines().filter_map(parse_line).collect();
    let first = lines
        .iter()
        .position(|m| m.start <= ptr && ptr < m.end)
        .ok_or("not mapped")?;
    let m = &lines[first];
    if !m.shared || m.inode == 0 {
        return Err("not a shared mapping of a file".into());
    }
    let end = ptr + len;
    let mut reach = m.end;
    for (prev, next) in lines[first..].iter().zip(&lines[first + 1..]) {
        if reach >= end {
            break;
        }
        let continues = next.start == prev.end
            && next.shared
            && (next.dev, next.inode) == (m.dev, m.inode)
            && next.offset == prev.offset + (prev.end - prev.start) as u64;
        if !continues {
            break;
        }
        reach = next.end;
    }
    if reach < end {
        return Err("the range is not one continuous mapping of its file".into());
    }
    let file_offset = m.offset + (ptr - m.start) as u64;
    let same = |md: &fs::Metadata| {
        md.ino() == m.inode && (libc::major(md.dev()), libc::minor(md.dev())) == (m.dev.0, m.dev.1)
    };
    // A descriptor the process holds (a memfd's only way back), else the file by its path.
    if let Ok(dir) = fs::read_dir("/proc/self/fd") {
        for e in dir.flatten() {
            if fs::metadata(e.path()).is_ok_and(|md| same(&md)) {
                if let Ok(f) = fs::OpenOptions::new().read(true).write(true).open(e.path()) {
                    return Ok((OwnedFd::from(f), file_offset));
                }
            }
        }
    }
    if m.path.starts_with('/') && !m.path.ends_with("(deleted)") {
        if let Ok(f) = fs::OpenOptions::new().read(true).write(true).open(&m.path) {
            if f.metadata().is_ok_and(|md| same(&md)) {
                return Ok((OwnedFd::from(f), file_offset));
            }
        }
    }
    Err(format!(
        "no descriptor of its file ({}) can be opened for reading and writing",
        if m.path.is_empty() {
            "unnamed"
        } else {
            &m.path
        }
    ))
}

/// A memfd of `len` bytes mapped shared: memory the shared-memory transport can hand over.
/// Unmapped (and the descriptor closed) on drop; unregister it from a client first.
pub struct SharedMemory {
    fd: OwnedFd,
    ptr: usize,
    len: usize,
}

impl SharedMemory {
    pub fn new(name: &str, len: usize) -> io::Result<SharedMemory> {
        let cname = std::ffi::CString::new(name).map_err(io::Error::other)?;
        // SAFETY: memfd_create with a NUL-terminated name; the descriptor is owned at once.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor we own.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        // SAFETY: ftruncate and mmap on the descriptor we own.
        let p = unsafe {
            if libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) != 0 {
                return Err(io::Error::last_os_error());
            }
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(SharedMemory {
            fd,
            ptr: p as usize,
            len,
        })
    }

    pub fn ptr(&self) -> usize {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd (a test shrinks it to make the server's copies fault).
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; its users are gone (the caller's contract).
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len.max(1)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_memfd_mapping_is_found_and_malloc_is_not() {
        let len = 1 << 20;
        let m = SharedMemory::new("memkv-test", len).unwrap();
        let p = m.ptr();
        let regions = Regions::default();
        regions.register(p, len).unwrap();
        assert!(regions.find(p + 4096, 4096).is_some());
        assert!(regions.find(p + len - 1, 2).is_none());
        let (_, off) = find_file(p + 8192, 4096).unwrap();
        assert_eq!(off, 8192);
        let v = vec![0u8; 1 << 20];
        assert!(regions.register(v.as_ptr() as usize, v.len()).is_err());
        regions.unregister(p);
        assert!(regions.find(p, 1).is_none());
    }
}
