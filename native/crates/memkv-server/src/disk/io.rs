//! Direct I/O on segment files: opening them with O_DIRECT (plain buffered I/O where the
//! filesystem refuses it), block-aligned heap buffers, and the read pool that splits a value's
//! read into pieces read in parallel (an NVMe device reaches its rate only with several reads in
//! flight) and checks each piece's chunks against their checksums as soon as it lands.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};

use crossbeam_channel::{unbounded, Sender};
use memkv_proto::CHECKSUM_CHUNK;

use super::record::BLOCK;

/// Bytes of a value one read covers: four checksum chunks, so a piece is checked whole, and
/// large enough that a read costs one request on the device.
pub const PIECE: usize = 4 * CHECKSUM_CHUNK;

/// Opens (or creates) a segment file for direct I/O. Returns whether O_DIRECT was taken: a
/// filesystem that refuses it (EINVAL) gets buffered I/O, with the same alignment.
pub fn open_segment(path: &Path, create: bool) -> io::Result<(File, bool)> {
    let open = |direct: bool| {
        let mut o = OpenOptions::new();
        o.read(true).write(create).create(create);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(path)
    };
    match open(true) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((open(false)?, false)),
        r => r.map(|f| (f, true)),
    }
}

/// A zeroed heap buffer aligned to `BLOCK`, for direct I/O outside lane memory (headers at
/// recovery, tombstones).
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is owned memory like a Vec's.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub fn new(len: usize) -> AlignedBuf {
        let len = (len.max(1) as u64).div_ceil(BLOCK) as usize * BLOCK as usize;
        let layout = std::alloc::Layout::from_size_align(len, BLOCK as usize).unwrap();
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` initialized bytes owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, BLOCK as usize).unwrap();
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// Why a read gave no value.
#[derive(Debug)]
pub enum ReadError {
    /// The device or filesystem failed the read, or the file ends before the record does.
    Io(io::Error),
    /// A chunk does not match its checksum: a torn write or a rotten sector.
    Corrupt,
}

/// One read of a value: where it lies and where it goes.
struct ValueRead {
    file: Arc<File>,
    /// Offset of the value's first byte in the file (block-aligned).
    at: u64,
    len: usize,
    /// The destination, block-aligned and at least `len` rounded up to `BLOCK` long.
    buf: usize,
    checksums: Arc<[u64]>,
    left: Mutex<(usize, Option<ReadError>)>,
    done: Condvar,
}

impl ValueRead {
    /// Reads and checks piece `i`.
    fn piece(&self, i: usize) -> Result<(), ReadError> {
        let start = i * PIECE;
        let end = (start + PIECE).min(self.len);
        let io_len = ((end - start) as u64).div_ceil(BLOCK) as usize * BLOCK as usize;
        // SAFETY: [buf + start, buf + start + io_len) lies inside the destination (rounded up to
        // BLOCK), pieces are disjoint, and the caller keeps the destination alive until every
        // piece answered.
        let dst = unsafe { std::slice::from_raw_parts_mut((self.buf + start) as *mut u8, io_len) };
        self.file
            .read_exact_at(dst, self.at + start as u64)
            .map_err(ReadError::Io)?;
        let data = &dst[..end - start];
        for (j, c) in data.chunks(CHECKSUM_CHUNK).enumerate() {
            let n = start / CHECKSUM_CHUNK + j;
            if self.checksums.get(n) != Some(&memkv_proto::checksum(c)) {
                return Err(ReadError::Corrupt);
            }
        }
        Ok(())
    }

    fn finish(&self, r: Result<(), ReadError>) {
        let mut g = self.left.lock().unwrap();
        g.0 -= 1;
        if let Err(e) = r {
            g.1.get_or_insert(e);
        }
        if g.0 == 0 {
            self.done.notify_all();
        }
    }
}

/// Threads that read pieces of values.
pub struct ReadPool {
    jobs: Sender<(Arc<ValueRead>, usize)>,
}

impl ReadPool {
    pub fn new(threads: usize) -> io::Result<ReadPool> {
        let (jobs, rx) = unbounded::<(Arc<ValueRead>, usize)>();
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("memkv-disk-read-{i}"))
                .spawn(move || {
                    while let Ok((r, i)) = rx.recv() {
                        let res = r.piece(i);
                        r.finish(res);
                    }
                })?;
        }
        Ok(ReadPool { jobs })
    }

    /// Reads the `len` bytes at `at` of `file` into `buf` and checks them against `checksums`
    /// (one per `CHECKSUM_CHUNK`). The first piece is read by the calling thread, the others by
    /// the pool, all at once.
    ///
    /// # Safety
    /// `buf` must be aligned to `BLOCK` and valid for writes of `len` rounded up to `BLOCK`
    /// bytes, with nothing else reading or writing it until this returns.
    pub unsafe fn read(
        &self,
        file: Arc<File>,
        at: u64,
        len: usize,
        buf: *mut u8,
        checksums: Arc<[u64]>,
    ) -> Result<(), ReadError> {
        let pieces = len.div_ceil(PIECE).max(1);
        let r = Arc::new(ValueRead {
            file,
            at,
            len,
            buf: buf as usize,
            checksums,
            left: Mutex::new((pieces, None)),
            done: Condvar::new(),
        });
        for i in 1..pieces {
            if let Err(e) = self.jobs.send((r.clone(), i)) {
                // No pool thread is left: read the piece here.
                let (r, i) = e.into_inner();
                let res = r.piece(i);
                r.finish(res);
            }
        }
        let first = r.piece(0);
        r.finish(first);
        let mut g = r.left.lock().unwrap();
        while g.0 > 0 {
            g = r.done.wait(g).unwrap();
        }
        match g.1.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_read_in_pieces_is_byte_exact_and_a_flipped_byte_fails_it() {
        let dir = std::env::temp_dir().join(format!("memkv-io-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("v.seg");
        let len = 3 * PIECE + 12345;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let mut padded = AlignedBuf::new(len);
        padded[..len].copy_from_slice(&data);
        let (f, _) = open_segment(&path, true).unwrap();
        f.write_all_at(&padded, BLOCK).unwrap();
        let f = Arc::new(f);
        let sums: Arc<[u64]> = memkv_proto::chunk_checksums(&data).into();
        let pool = ReadPool::new(3).unwrap();
        let mut out = AlignedBuf::new(len);
        // SAFETY: `out` is aligned and rounded up; nothing else touches it.
        let r = unsafe { pool.read(f.clone(), BLOCK, len, out.as_mut_ptr(), sums.clone()) };
        assert!(r.is_ok());
        assert_eq!(&out[..len], &data[..]);
        let mut rotten = data.clone();
        rotten[2 * PIECE + 5] ^= 1;
        padded[..len].copy_from_slice(&rotten);
        f.write_all_at(&padded, BLOCK).unwrap();
        // SAFETY: as above.
        let r = unsafe { pool.read(f.clone(), BLOCK, len, out.as_mut_ptr(), sums.clone()) };
        assert!(matches!(r, Err(ReadError::Corrupt)));
        // SAFETY: as above; a read past the end of the file fails rather than answering.
        let r = unsafe { pool.read(f, 1 << 30, len, out.as_mut_ptr(), sums) };
        assert!(matches!(r, Err(ReadError::Io(_))));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
