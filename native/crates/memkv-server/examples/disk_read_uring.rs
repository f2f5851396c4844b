//! Plain preads from a thread pool (the disk tier's read path, `disk::io::ReadPool`) against
//! io_uring (the `io-uring` crate), reading the same O_DIRECT file the same way: each value split
//! into 1 MiB pieces, all in flight at once, T values read at a time. Runs alternate between the
//! two (ABAB, the order flipped every round) so that a noisy host's drift hits both alike; each
//! prints its GB/s, and the summary the range per interface and the ratio of medians.
//!
//!     cargo run --release -p memkv-server --example disk_read_uring -- \
//!         --dir /mnt/nvme/bench [--file-mib 2048] [--sizes 1,4,16,64] [--threads 1,2,4,8] \
//!         [--rounds 5] [--pool 8]
//!
//! --dir must be on the device to measure (tmpfs measures memory copies). Reads only, no
//! checksums: those cost the same whichever interface brought the bytes.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use crossbeam_channel::{unbounded, Sender};
use io_uring::{opcode, types, IoUring};
use memkv_server::disk::io::AlignedBuf;

const MIB: usize = 1 << 20;
const PIECE: usize = MIB;

struct Args {
    dir: PathBuf,
    file_mib: usize,
    sizes: Vec<usize>,
    threads: Vec<usize>,
    rounds: usize,
    pool: usize,
}

fn args() -> Args {
    let mut a = Args {
        dir: PathBuf::new(),
        file_mib: 2048,
        sizes: vec![1, 4, 16, 64],
        threads: vec![1, 2, 4, 8],
        rounds: 5,
        pool: 8,
    };
    let list = |v: &str| v.split(',').map(|x| x.parse().expect("a number")).collect();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().expect("a value after each flag");
        match flag.as_str() {
            "--dir" => a.dir = v.into(),
            "--file-mib" => a.file_mib = v.parse().expect("MiB"),
            "--sizes" => a.sizes = list(&v),
            "--threads" => a.threads = list(&v),
            "--rounds" => a.rounds = v.parse().expect("a count"),
            "--pool" => a.pool = v.parse().expect("a count"),
            _ => panic!("unknown flag {flag}"),
        }
    }
    assert!(!a.dir.as_os_str().is_empty(), "--dir is required");
    a
}

fn open_direct(path: &PathBuf, write: bool) -> File {
    OpenOptions::new()
        .read(true)
        .write(write)
        .create(write)
        .truncate(write)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("O_DIRECT open (tmpfs and some filesystems refuse it)")
}

/// Writes `mib` MiB of pseudo-random bytes (not zeroes: a device may shortcut those).
fn make_file(path: &PathBuf, mib: usize) -> File {
    let f = open_direct(path, true);
    let mut buf = AlignedBuf::new(8 * MIB);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for c in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    for i in 0..mib.div_ceil(8) {
        f.write_all_at(&buf, (i * 8 * MIB) as u64).expect("write");
    }
    f.sync_all().expect("fsync");
    f
}

/// A piece to read: (offset in the file, destination, length, where to say it is done).
type Job = (u64, usize, usize, Sender<()>);

/// The tier's way: each value's first piece on the caller's thread, the rest on the pool.
fn read_preads(file: &File, pool: &Sender<Job>, at: u64, buf: &mut [u8]) {
    let (tx, rx) = unbounded();
    let pieces = buf.len().div_ceil(PIECE);
    let base = buf.as_mut_ptr() as usize;
    for i in 1..pieces {
        let len = PIECE.min(buf.len() - i * PIECE);
        pool.send((at + (i * PIECE) as u64, base + i * PIECE, len, tx.clone()))
            .unwrap();
    }
    let first = PIECE.min(buf.len());
    file.read_exact_at(&mut buf[..first], at).expect("pread");
    for _ in 1..pieces {
        rx.recv().unwrap();
    }
}

/// One ring per reader thread: every piece of the value submitted at once, one wait for all.
fn read_uring(ring: &mut IoUring, fd: i32, at: u64, buf: &mut [u8]) {
    let pieces = buf.len().div_ceil(PIECE);
    for i in 0..pieces {
        let len = PIECE.min(buf.len() - i * PIECE);
        // SAFETY: the pointer stays valid (and untouched) until its completion is reaped below.
        let ptr = unsafe { buf.as_mut_ptr().add(i * PIECE) };
        let e = opcode::Read::new(types::Fd(fd), ptr, len as u32)
            .offset(at + (i * PIECE) as u64)
            .build()
            .user_data(i as u64);
        // SAFETY: as above; the ring has room for `pieces` entries (sized by the caller).
        unsafe { ring.submission().push(&e).expect("ring room") };
    }
    ring.submit_and_wait(pieces).expect("io_uring submit");
    let mut done = 0;
    while done < pieces {
        for c in ring.completion() {
            let i = c.user_data() as usize;
            let want = PIECE.min(buf.len() - i * PIECE) as i32;
            assert_eq!(c.result(), want, "io_uring read of piece {i}");
            done += 1;
        }
        if done < pieces {
            ring.submit_and_wait(1).expect("io_uring wait");
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Preads,
    Uring,
}

/// GB/s of `threads` readers each reading its share of the file's `size`-byte values once.
fn run(file: &Arc<File>, pool: &Sender<Job>, mode: Mode, size: usize, threads: usize) -> f64 {
    let values = file.metadata().unwrap().len() as usize / size;
    let start = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (file, pool, start) = (file.clone(), pool.clone(), start.clone());
            std::thread::spawn(move || {
                let mut buf = AlignedBuf::new(size);
                let mut ring = IoUring::new(size.div_ceil(PIECE).next_power_of_two() as u32)
                    .expect("io_uring (kernel.io_uring_disabled?)");
                start.wait();
                let mut bytes = 0;
                for v in (t..values).step_by(threads) {
                    let at = (v * size) as u64;
                    match mode {
                        Mode::Preads => read_preads(&file, &pool, at, &mut buf),
                        Mode::Uring => read_uring(&mut ring, file.as_raw_fd(), at, &mut buf),
                    }
                    bytes += size;
                }
                bytes
            })
        })
        .collect();
    start.wait();
    let t0 = Instant::now();
    let bytes: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    bytes as f64 / t0.elapsed().as_secs_f64() / 1e9
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let a = args();
    std::fs::create_dir_all(&a.dir).expect("--dir");
    let path = a.dir.join("disk_read_uring.bin");
    let file = Arc::new(make_file(&path, a.file_mib));
    let (pool, rx) = unbounded::<Job>();
    for _ in 0..a.pool {
        let (rx, file) = (rx.clone(), file.clone());
        std::thread::spawn(move || {
            while let Ok((at, dst, len, done)) = rx.recv() {
                // SAFETY: the caller keeps [dst, dst + len) alive and untouched until `done`.
                let buf = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
                file.read_exact_at(buf, at).expect("pread");
                let _ = done.send(());
            }
        });
    }
    println!(
        "{} MiB file in {}, {} pread pool threads, {} rounds",
        a.file_mib,
        a.dir.display(),
        a.pool,
        a.rounds
    );
    for &s in &a.sizes {
        for &t in &a.threads {
            let (mut p, mut u) = (Vec::new(), Vec::new());
            for r in 0..a.rounds {
                let order = if r % 2 == 0 {
                    [Mode::Preads, Mode::Uring]
                } else {
                    [Mode::Uring, Mode::Preads]
                };
                for m in order {
                    let g = run(&file, &pool, m, s * MIB, t);
                    match m {
                        Mode::Preads => p.push(g),
                        Mode::Uring => u.push(g),
                    }
                }
            }
            let range = |v: &[f64]| {
                let lo = v.iter().copied().fold(f64::MAX, f64::min);
                let hi = v.iter().copied().fold(0.0, f64::max);
                format!("{lo:5.2}-{hi:5.2}")
            };
            let (rp, ru) = (range(&p), range(&u));
            let ratio = median(&mut u) / median(&mut p);
            println!(
                "{s:>3} MiB x{t}: preads {rp} GB/s  io_uring {ru} GB/s  uring/preads (medians) {ratio:5.2}"
            );
        }
    }
    let _ = std::fs::remove_file(&path);
}
