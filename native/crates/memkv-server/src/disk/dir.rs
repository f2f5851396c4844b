//! One directory of the disk tier: its segment files and the writer thread that appends records
//! to the newest one and evicts the oldest.
//!
//! Eviction is oldest segment first, the whole file at once: records are written once and never
//! moved, so reclaiming space costs one unlink and no rewriting (no write amplification, the
//! device's bandwidth all goes to spills and reads), and a FIFO over KV-cache blocks, whose reuse
//! falls with age, is close to LRU at a fraction of its bookkeeping. A segment holding a leased
//! value is not evicted until the lease lapses or a GET loads the value; eviction takes the
//! oldest segment no lease holds instead (leases hold a bounded share, `super::leases`), and
//! only when every segment is held is a spill dropped (counted as `leased`).
//!
//! A write that fails degrades the directory: with ENOSPC (the filesystem is smaller than
//! `--disk-size`, or shared) its capacity is cut to what it holds and writing goes on within it;
//! any other error (read-only, I/O error) stops writes to it. Either is logged loudly and counted;
//! the server keeps serving from DRAM and from the records already written.

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{unbounded, Receiver, Sender};

use super::io::{open_segment, AlignedBuf};
use super::record::{self, Kind, BLOCK};
use super::{disk_index_charge, Key, Loc, Shared};
use crate::arena::Span;

/// Segment files per directory at its capacity: small enough that evicting one frees a small
/// share of the tier, large enough that files stay few (and a restart opens few).
const SEGMENTS_PER_DIR: u64 = 64;
const MIN_SEGMENT: u64 = 1 << 20;
const MAX_SEGMENT: u64 = 1 << 30;

/// The size segments are cut at in a directory of `cap` bytes.
pub(super) fn segment_size(cap: u64) -> u64 {
    (cap / SEGMENTS_PER_DIR).clamp(MIN_SEGMENT, MAX_SEGMENT) / BLOCK * BLOCK
}

pub(super) fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016x}.seg"))
}

/// A segment file and the records in it that were indexed (key, sequence number).
pub(super) struct Segment {
    pub(super) id: u64,
    pub(super) file: Arc<File>,
    pub(super) len: u64,
    pub(super) records: Vec<(Key, u64)>,
}

/// A directory as recovery left it.
pub(super) struct Recovered {
    pub(super) path: PathBuf,
    /// Oldest first.
    pub(super) segments: VecDeque<Segment>,
    pub(super) next_id: u64,
    /// Unusable from the start (cannot be created or listed).
    pub(super) degraded: bool,
}

pub(super) enum Job {
    Spill {
        key: Key,
        seq: u64,
        /// The whole record, in staging memory.
        rec: Span,
        /// Offset of the value inside the record.
        value_at: u64,
        len: u64,
        checksums: Arc<[u64]>,
    },
    Tombstone {
        key: Key,
        seq: u64,
    },
    Flush(Sender<()>),
}

/// The tier's side of a directory: its writer's queue and its state.
pub(super) struct DirHandle {
    pub(super) path: PathBuf,
    jobs: Sender<Job>,
    degraded: Arc<AtomicBool>,
}

impl DirHandle {
    pub(super) fn degraded(&self) -> bool {
        self.degraded.load(Relaxed)
    }

    pub(super) fn send(&self, job: Job) {
        // The writer only stops when the tier is dropped.
        let _ = self.jobs.send(job);
    }

    pub(super) fn flush(&self) {
        let _ = self.mark().recv();
    }

    /// A marker behind the jobs queued so far: it answers once the writer is past them.
    pub(super) fn mark(&self) -> Receiver<()> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.send(Job::Flush(tx));
        rx
    }
}

struct Writer {
    id: u16,
    path: PathBuf,
    cap: u64,
    index_limit: u64,
    segment_size: u64,
    segments: VecDeque<Segment>,
    /// Bytes of the segment files.
    used: u64,
    next_id: u64,
    /// Whether the newest segment takes appends (recovered ones never do).
    open: bool,
    buffered_warned: bool,
    degraded: Arc<AtomicBool>,
    shared: Arc<Shared>,
}

/// Starts the writer of directory `id` with `cap` bytes of segments.
pub(super) fn start(
    id: u16,
    r: Recovered,
    cap: u64,
    index_limit: u64,
    shared: Arc<Shared>,
) -> std::io::Result<DirHandle> {
    let (jobs, rx) = unbounded();
    let degraded = Arc::new(AtomicBool::new(r.degraded));
    if r.degraded {
        shared.stats.degraded_dirs.fetch_add(1, Relaxed);
    }
    let used: u64 = r.segments.iter().map(|s| s.len).sum();
    shared.stats.used.fetch_add(used, Relaxed);
    let mut w = Writer {
        id,
        path: r.path.clone(),
        cap,
        index_limit,
        segment_size: segment_size(cap),
        segments: r.segments,
        used,
        next_id: r.next_id,
        open: false,
        buffered_warned: false,
        degraded: degraded.clone(),
        shared,
    };
    // A smaller --disk-size than before the restart: the oldest segments go now.
    while w.used > w.cap && w.evict(0) {}
    std::thread::Builder::new()
        .name(format!("memkv-disk-write-{id}"))
        .spawn(move || w.run(rx))?;
    Ok(DirHandle {
        path: r.path,
        jobs,
        degraded,
    })
}

impl Writer {
    fn run(mut self, rx: Receiver<Job>) {
        while let Ok(job) = rx.recv() {
            match job {
                Job::Spill {
                    key,
                    seq,
                    rec,
                    value_at,
                    len,
                    checksums,
                } => self.spill(key, seq, rec, value_at, len, checksums),
                Job::Tombstone { key, seq } => self.tombstone(&key, seq),
                Job::Flush(done) => {
                    let _ = done.send(());
                }
            }
        }
    }

    fn spill(
        &mut self,
        key: Key,
        seq: u64,
        rec: Span,
        value_at: u64,
        len: u64,
        checksums: Arc<[u64]>,
    ) {
        let shared = self.shared.clone();
        let st = &shared.stats;
        let queued = rec.len();
        let charge = disk_index_charge(key.len(), checksums.len());
        let placed = match self.degraded.load(Relaxed) {
            true => Err("degraded"),
            false => self.append(rec.as_slice(), charge),
        };
        drop(rec);
        match placed {
            Ok((file, off)) => {
                let loc = Loc {
                    file,
                    dir: self.id,
                    seg: self.segments.back().expect("appended to it").id,
                    at: off + value_at,
                    len,
                    seq,
                    checksums,
                    hits: 0,
                    promoted_as: 0,
                };
                if self.shared.index_written(&key, loc) {
                    st.spills.fetch_add(1, Relaxed);
                    let seg = self.segments.back_mut().expect("appended to it");
                    seg.records.push((key, seq));
                }
            }
            Err(reason) => {
                let mut s = self.shared.shard(&key).lock().unwrap();
                if s.pending.get(&key).map(|p| p.0) == Some(seq) {
                    s.pending.remove(&key);
                }
                drop(s);
                st.drop_spill(reason);
            }
        }
        // Counted out only now, so that an empty queue means every spill so far is indexed.
        st.queued_bytes.fetch_sub(queued, Relaxed);
    }

    fn tombstone(&mut self, key: &[u8], seq: u64) {
        if self.degraded.load(Relaxed) {
            return;
        }
        let mut buf = AlignedBuf::new(record::header_len(key.len(), 0) as usize);
        record::encode_header(&mut buf, Kind::Tombstone, key, 0, seq, &[]);
        if self.append(&buf, 0).is_ok() {
            self.shared.stats.tombstones.fetch_add(1, Relaxed);
        }
    }

    /// Appends one record (whole blocks) to the newest segment, making room first. Where it
    /// went, or why it could not be written (a drop reason).
    fn append(&mut self, rec: &[u8], charge: u64) -> Result<(Arc<File>, u64), &'static str> {
        let rlen = rec.len() as u64;
        if rlen > self.cap {
            return Err("too_large");
        }
        self.make_room(rlen, charge)?;
        let rotate = match self.segments.back() {
            Some(s) => !self.open || (s.len > 0 && s.len + rlen > self.segment_size),
            None => true,
        };
        if rotate {
            self.new_segment().map_err(|e| self.failed(e))?;
        }
        let seg = self.segments.back_mut().expect("a segment was opened");
        let off = seg.len;
        if let Err(e) = seg.file.write_all_at(rec, off) {
            // Whatever part landed is cut off again, so the file ends on a whole record.
            let _ = seg.file.set_len(off);
            return Err(self.failed(e));
        }
        seg.len += rlen;
        self.used += rlen;
        self.shared.stats.used.fetch_add(rlen, Relaxed);
        Ok((seg.file.clone(), off))
    }

    /// Evicts the oldest segments until `rlen` more bytes fit the capacity and `charge` more
    /// index bytes fit the index bound.
    fn make_room(&mut self, rlen: u64, charge: u64) -> Result<(), &'static str> {
        let shared = self.shared.clone();
        let st = &shared.stats;
        loop {
            let space = self.used + rlen <= self.cap;
            let index = st.index_bytes.load(Relaxed) + charge <= self.index_limit;
            if space && index {
                return Ok(());
            }
            if self.segments.is_empty() {
                return Err(if space { "index_full" } else { "too_large" });
            }
            // The oldest segment no lease holds; leases hold a bounded share of the capacity,
            // so only a record larger than the rest finds none.
            let now = Instant::now();
            let leases = shared.leases.lock().unwrap();
            let victim = self
                .segments
                .iter()
                .position(|s| !leases.held(self.id, s.id, now));
            drop(leases);
            let Some(i) = victim else {
                return Err("leased");
            };
            self.evict(i);
        }
    }

    /// Removes the `i`-th oldest segment and unindexes its records. False when there is none.
    fn evict(&mut self, i: usize) -> bool {
        let Some(seg) = self.segments.remove(i) else {
            return false;
        };
        if i == self.segments.len() {
            // The newest, which took the appends: the next record opens a new one.
            self.open = false;
        }
        self.shared
            .leases
            .lock()
            .unwrap()
            .segment_gone(self.id, seg.id);
        let st = &self.shared.stats;
        let dropped = seg
            .records
            .iter()
            .filter(|(k, seq)| self.shared.drop_if_seq(k, *seq))
            .count();
        st.evicted_items.fetch_add(dropped as u64, Relaxed);
        st.evicted_segments.fetch_add(1, Relaxed);
        self.used -= seg.len;
        st.used.fetch_sub(seg.len, Relaxed);
        if let Err(e) = std::fs::remove_file(segment_path(&self.path, seg.id)) {
            tracing::warn!(dir = %self.path.display(), "disk tier: cannot remove an evicted segment: {e}");
        }
        true
    }

    fn new_segment(&mut self) -> std::io::Result<()> {
        let id = self.next_id;
        let (file, direct) = open_segment(&segment_path(&self.path, id), true)?;
        self.next_id += 1;
        if !direct && !self.buffered_warned {
            self.buffered_warned = true;
            tracing::warn!(
                dir = %self.path.display(),
                "disk tier: the filesystem refuses O_DIRECT; using buffered I/O (page cache)"
            );
        }
        self.segments.push_back(Segment {
            id,
            file: Arc::new(file),
            len: 0,
            records: Vec::new(),
        });
        self.open = true;
        Ok(())
    }

    /// Degrades the directory after a failed write; the drop reason for the record.
    fn failed(&mut self, e: std::io::Error) -> &'static str {
        let st = &self.shared.stats;
        st.write_errors.fetch_add(1, Relaxed);
        if e.raw_os_error() == Some(libc::ENOSPC) && self.used >= BLOCK {
            tracing::error!(
                dir = %self.path.display(),
                "disk tier: filesystem full at {} bytes of segments (--disk-size gives this \
                 directory {}); its capacity is cut to what it holds",
                self.used,
                self.cap
            );
            st.disk_full.fetch_add(1, Relaxed);
            st.capacity.fetch_sub(self.cap - self.used, Relaxed);
            self.cap = self.used;
            return "disk_full";
        }
        if !self.degraded.swap(true, Relaxed) {
            tracing::error!(
                dir = %self.path.display(),
                "disk tier: write failed ({e}); this directory takes no more values, the server \
                 goes on from DRAM and the values already written"
            );
            st.degraded_dirs.fetch_add(1, Relaxed);
        }
        "write_error"
    }
}
