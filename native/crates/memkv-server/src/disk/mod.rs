//! The disk tier: values evicted from DRAM are written to log-structured segment files on one
//! or more directories (one per device), found again by GET, EXISTS and leases, and kept across
//! restarts. docs/disk.md describes it for operators.
//!
//! - `record`: the on-disk format (a checksummed header, then the value in whole blocks).
//! - `io`: direct I/O, aligned buffers and the read pool.
//! - `dir`: one directory's segments, its writer thread and the tier's own eviction (oldest
//!   segment first).
//! - `recover`: the index rebuilt from the segments at start.
//! - `stats`: the tier counters, shown per tier with DRAM's by `memkv stats` and `--metrics`.
//! - `fetch`: the GET of a disk-resident value into lane memory, and promotion.
//! - `leases`: leases on disk-resident values and the bound on the segments they hold.
//! - `flush`: the write of DRAM's values to disk at a graceful stop.
//!
//! The tier never makes a PUT wait: an evicted value is copied into the spill queue's staging
//! memory (a fixed region, counted inside `--memory`) and handed to its directory's writer, or
//! dropped when the queue is full. The index maps each key on disk to its record; it lives in
//! shards (by key hash) apart from the lanes, and a lane's lock is never held while a shard's
//! is taken except in one order (lane, then shard).

mod dir;
mod fetch;
mod flush;
pub mod io;
mod leases;
pub mod record;
mod recover;
pub mod stats;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use memkv_proto::Status;

use crate::arena::LaneMemory;
use crate::lane::Value;
use dir::{DirHandle, Job};
pub use flush::FlushReport;
use leases::DiskLeases;
use record::{record_len, Kind, BLOCK};
pub use stats::DiskStats;

/// Index shards: the index is looked up on every DRAM miss and every PUT, so one lock for it
/// would serialize the connection threads.
const SHARDS: usize = 64;

/// Heap bytes charged per disk-resident value on top of its key and checksums: the hash table
/// slot (key, location, at its worst load factor), the location's shared checksum list and its
/// segment's record list entry. docs/disk.md states the bound this gives.
pub const DISK_ENTRY_OVERHEAD: u64 = 256;

/// A value read from disk goes back to DRAM on its second hit: one hit may be a one-off (a
/// request whose prefix is never asked again); a second says the value is warm again.
pub const PROMOTE_AFTER: u8 = 2;

/// What an entry of the disk index is charged for its memory.
pub fn disk_index_charge(key_len: usize, chunks: usize) -> u64 {
    DISK_ENTRY_OVERHEAD + key_len as u64 + 8 * chunks as u64
}

#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// Directories, one per device; `size` is split evenly over them.
    pub dirs: Vec<PathBuf>,
    /// Bytes of segment files at most, over all directories.
    pub size: u64,
    /// Staging memory of the spill queue: evicted values waiting for their write. Taken out of
    /// `--memory`.
    pub queue_bytes: u64,
    /// Bound on the disk index's memory (next to `--memory`): the oldest segments are evicted
    /// to keep it.
    pub index_bytes: u64,
    /// Threads reading pieces of values.
    pub read_threads: usize,
    /// Longest the index rebuild at start may take; segments not read by then are removed.
    pub recovery_timeout: Duration,
    /// Share of each directory's capacity that segments held by leases may take
    /// (`--max-leased-fraction`, as for DRAM); an EXISTS past it answers OK_NO_LEASE.
    pub max_leased_fraction: f64,
    /// Longest a graceful stop spends writing DRAM's values to disk (`flush`); zero: none.
    pub flush_timeout: Duration,
}

type Key = Arc<[u8]>;

/// Where a disk-resident value lies.
struct Loc {
    file: Arc<File>,
    dir: u16,
    /// Id of its segment file.
    seg: u64,
    /// Offset of the value's first byte in its segment file.
    at: u64,
    len: u64,
    seq: u64,
    checksums: Arc<[u64]>,
    hits: u8,
    /// Address of the DRAM copy made when the value was promoted (0: none): evicting that copy
    /// again needs no write, its bytes are here already.
    promoted_as: usize,
}

impl Loc {
    fn charge(&self, key_len: usize) -> u64 {
        disk_index_charge(key_len, self.checksums.len())
    }

    fn segment(&self) -> (u16, u64) {
        (self.dir, self.seg)
    }
}

#[derive(Default)]
struct Shard {
    index: HashMap<Key, Loc>,
    /// Values in the spill queue: their sequence number and directory.
    pending: HashMap<Key, (u64, u16)>,
}

/// What the tier's parts share: the index, the counters, the sequence numbers.
struct Shared {
    shards: Vec<Mutex<Shard>>,
    stats: DiskStats,
    seq: AtomicU64,
    /// Taken after a shard's lock, never before it.
    leases: Mutex<DiskLeases>,
    /// Per directory: the size its segments are cut at (what a leased segment is charged).
    segment_size: Vec<u64>,
}

impl Shared {
    fn shard(&self, key: &[u8]) -> &Mutex<Shard> {
        let h = twox_hash::XxHash3_64::oneshot_with_seed(0x6469_736b, key);
        &self.shards[(h % SHARDS as u64) as usize]
    }

    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Relaxed)
    }

    /// Indexes a record just written, unless its key was forgotten or spilled again since.
    fn index_written(&self, key: &Key, loc: Loc) -> bool {
        let mut s = self.shard(key).lock().unwrap();
        if s.pending.get(key).map(|p| p.0) != Some(loc.seq) {
            return false;
        }
        s.pending.remove(key);
        self.insert(&mut s, key.clone(), loc);
        true
    }

    /// Indexes `loc` under `key`, replacing an older location.
    fn insert(&self, s: &mut Shard, key: Key, loc: Loc) {
        self.stats.add_item(loc.len, loc.charge(key.len()));
        if let Some(old) = s.index.insert(key.clone(), loc) {
            self.stats.remove_item(old.len, old.charge(key.len()));
            self.leases.lock().unwrap().release(old.segment(), &key);
        }
    }

    /// Drops `key`'s location if it is still the record `seq` (a segment evicted, a read that
    /// failed). True when it was.
    fn drop_if_seq(&self, key: &[u8], seq: u64) -> bool {
        let mut s = self.shard(key).lock().unwrap();
        if s.index.get(key).is_some_and(|l| l.seq == seq) {
            let l = s.index.remove(key).unwrap();
            self.stats.remove_item(l.len, l.charge(key.len()));
            self.leases.lock().unwrap().release(l.segment(), key);
            return true;
        }
        false
    }

    /// Bytes a lease on `loc` holds: its segment, at most the size segments are cut at, or
    /// the one record that is larger.
    fn lease_charge(&self, loc: &Loc) -> u64 {
        let cut = self
            .segment_size
            .get(loc.dir as usize)
            .copied()
            .unwrap_or(0);
        cut.max(loc.at + loc.len.div_ceil(BLOCK) * BLOCK)
    }
}

/// What became of a value handed to the spill queue.
enum Staged {
    Queued,
    /// Its record is on disk already (a promoted value): nothing to write.
    OnDisk,
    /// Not written, for this reason (one of `stats::DROP_REASONS`).
    Dropped(&'static str),
}

/// What a GET needs to read a disk-resident value.
pub(crate) struct ReadPlan {
    file: Arc<File>,
    at: u64,
    pub(crate) len: u64,
    seq: u64,
    dir: u16,
    checksums: Arc<[u64]>,
    promote: bool,
}

pub struct DiskTier {
    shared: Arc<Shared>,
    dirs: Vec<DirHandle>,
    staging: Arc<LaneMemory>,
    reads: io::ReadPool,
    flush_timeout: Duration,
}

impl DiskTier {
    /// Opens the directories, rebuilds the index from their segments (within the recovery
    /// timeout, logging progress) and starts a writer per directory. A directory that cannot be
    /// used is logged and left out (degraded), never fatal: the server runs from DRAM alone.
    pub fn open(cfg: &DiskConfig) -> std::io::Result<Arc<DiskTier>> {
        let per_dir = cfg.size / cfg.dirs.len().max(1) as u64;
        let lease_limit = (per_dir as f64 * cfg.max_leased_fraction) as u64;
        let shared = Arc::new(Shared {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            stats: DiskStats::default(),
            seq: AtomicU64::new(1),
            leases: Mutex::new(DiskLeases::new(vec![lease_limit; cfg.dirs.len()])),
            segment_size: vec![dir::segment_size(per_dir); cfg.dirs.len()],
        });
        shared
            .stats
            .capacity
            .store(per_dir * cfg.dirs.len() as u64, Relaxed);
        let deadline = Instant::now() + cfg.recovery_timeout;
        let recovered = recover::recover_all(&cfg.dirs, deadline, &shared);
        let index_limit = cfg.index_bytes;
        let dirs = recovered
            .into_iter()
            .enumerate()
            .map(|(i, r)| dir::start(i as u16, r, per_dir, index_limit, shared.clone()))
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Arc::new(DiskTier {
            shared,
            dirs,
            staging: LaneMemory::new(cfg.queue_bytes as usize)?,
            reads: io::ReadPool::new(cfg.read_threads)?,
            flush_timeout: cfg.flush_timeout,
        }))
    }

    pub fn stats(&self) -> &DiskStats {
        let held = self
            .shared
            .leases
            .lock()
            .unwrap()
            .held_total(Instant::now());
        self.shared.stats.leased_bytes.store(held, Relaxed);
        &self.shared.stats
    }

    /// The directory for a spill of `key`: its hash's, or the next one not degraded.
    fn dir_for(&self, key: &[u8]) -> Option<u16> {
        let n = self.dirs.len();
        // Seeded apart from the lanes' hash, so that a lane's keys spread over every directory.
        let h = twox_hash::XxHash3_64::oneshot_with_seed(0x0073_7069_6c6c, key) as usize;
        (0..n)
            .map(|i| (h + i) % n)
            .find(|&d| !self.dirs[d].degraded())
            .map(|d| d as u16)
    }

    /// Takes a value evicted from DRAM: copies it, as its record, into the spill queue's staging
    /// memory and hands it to its directory's writer. Never waits: with the queue full, the
    /// directories degraded or the value too large, the value is dropped (and counted).
    pub fn offer(&self, key: &[u8], value: Arc<Value>) {
        match self.stage(key, &value) {
            Staged::Queued | Staged::OnDisk => {}
            Staged::Dropped(reason) => self.shared.stats.drop_spill(reason),
        }
    }

    /// `offer`'s work, leaving the drop to the caller (a graceful stop waits and asks again
    /// when the queue is full).
    fn stage(&self, key: &[u8], value: &Value) -> Staged {
        let st = &self.shared.stats;
        {
            let s = self.shared.shard(key).lock().unwrap();
            if s.index
                .get(key)
                .is_some_and(|l| l.promoted_as == std::ptr::from_ref(value) as usize)
            {
                st.spill_skipped.fetch_add(1, Relaxed);
                return Staged::OnDisk;
            }
        }
        let Some(dir) = self.dir_for(key) else {
            return Staged::Dropped("degraded");
        };
        let len = value.span.len();
        let sums = &value.checksums;
        let rlen = record_len(key.len(), sums.len(), len);
        let Some(mut rec) = self.staging.alloc_aligned(rlen, BLOCK) else {
            return Staged::Dropped("queue_full");
        };
        let seq = self.shared.next_seq();
        let hlen = record::header_len(key.len(), sums.len()) as usize;
        let buf = rec.as_mut_slice();
        record::encode_header(&mut buf[..hlen], Kind::Value, key, len, seq, sums);
        buf[hlen..hlen + len as usize].copy_from_slice(value.span.as_slice());
        buf[hlen + len as usize..].fill(0);
        let checksums: Arc<[u64]> = sums.as_slice().into();
        let key: Key = Arc::from(key);
        self.shared
            .shard(&key)
            .lock()
            .unwrap()
            .pending
            .insert(key.clone(), (seq, dir));
        st.queued_bytes.fetch_add(rlen, Relaxed);
        self.dirs[dir as usize].send(Job::Spill {
            key,
            seq,
            rec,
            value_at: hlen as u64,
            len,
            checksums,
        });
        Staged::Queued
    }

    /// Forgets `key` (overwritten or deleted): its record and any spill of it in the queue are
    /// dead from now on, and a tombstone is written so that a restart does not bring it back.
    /// True when the tier had it.
    pub fn forget(&self, key: &[u8]) -> bool {
        let (loc, pending) = {
            let mut s = self.shared.shard(key).lock().unwrap();
            if s.index.is_empty() && s.pending.is_empty() {
                return false;
            }
            (s.index.remove(key), s.pending.remove(key))
        };
        let had = loc.is_some();
        if let Some(l) = &loc {
            self.shared.stats.remove_item(l.len, l.charge(key.len()));
            self.shared.leases.lock().unwrap().release(l.segment(), key);
        }
        let mut dirs: Vec<u16> = loc.map(|l| l.dir).into_iter().collect();
        dirs.extend(pending.map(|p| p.1).filter(|d| !dirs.contains(d)));
        for d in dirs {
            let seq = self.shared.next_seq();
            self.dirs[d as usize].send(Job::Tombstone {
                key: Arc::from(key),
                seq,
            });
        }
        had
    }

    /// EXISTS of a key not in DRAM: (Ok, length) when it is on disk, leased for `lease` when
    /// that is above zero (the lease keeps its segment from eviction until it lapses or a GET
    /// loads the value); (OkNoLease, length) when that lease would pass the bound on leased
    /// segments (`leases`).
    pub fn exists(&self, key: &[u8], lease: Duration, now: Instant) -> (Status, u64) {
        let s = self.shared.shard(key).lock().unwrap();
        let Some((k, l)) = s.index.get_key_value(key) else {
            return (Status::NotFound, 0);
        };
        if lease.is_zero() {
            return (Status::Ok, l.len);
        }
        let charge = self.shared.lease_charge(l);
        let mut leases = self.shared.leases.lock().unwrap();
        if leases.grant(l.segment(), charge, k, now + lease, now) {
            return (Status::Ok, l.len);
        }
        self.shared.stats.lease_denied.fetch_add(1, Relaxed);
        (Status::OkNoLease, l.len)
    }

    /// A GET's look-up: where the value lies, counting the hit (releasing any lease: the value
    /// is being loaded) and whether it is now due for promotion.
    pub(crate) fn plan_read(&self, key: &[u8]) -> Option<ReadPlan> {
        let mut s = self.shared.shard(key).lock().unwrap();
        let l = s.index.get_mut(key)?;
        l.hits = l.hits.saturating_add(1);
        self.shared.leases.lock().unwrap().release(l.segment(), key);
        Some(ReadPlan {
            file: l.file.clone(),
            at: l.at,
            len: l.len,
            seq: l.seq,
            dir: l.dir,
            checksums: l.checksums.clone(),
            promote: l.hits >= PROMOTE_AFTER,
        })
    }

    /// Reads the planned value into `buf`, checking every chunk.
    ///
    /// # Safety
    /// As `io::ReadPool::read`: `buf` is aligned to `BLOCK`, valid for `plan.len` rounded up to
    /// `BLOCK` bytes and not otherwise used until this returns.
    pub(crate) unsafe fn read(&self, plan: &ReadPlan, buf: *mut u8) -> Result<(), io::ReadError> {
        let t = Instant::now();
        // SAFETY: the caller's guarantees, passed on.
        let r = unsafe {
            self.reads.read(
                plan.file.clone(),
                plan.at,
                plan.len as usize,
                buf,
                plan.checksums.clone(),
            )
        };
        match &r {
            Ok(()) => self.shared.stats.count_read(plan.len, t.elapsed()),
            Err(e) => self.read_failed(plan, e),
        }
        r
    }

    /// A read that gave no value: the record is dropped (so it is not read again) and a
    /// tombstone written (so a restart does not index it again).
    fn read_failed(&self, plan: &ReadPlan, e: &io::ReadError) {
        let st = &self.shared.stats;
        match e {
            io::ReadError::Corrupt => {
                tracing::error!(
                    dir = %self.dirs[plan.dir as usize].path.display(),
                    "disk tier: checksum mismatch (torn write or rotten sector); value dropped"
                );
                st.corrupt.fetch_add(1, Relaxed);
            }
            io::ReadError::Io(err) => {
                tracing::error!(
                    dir = %self.dirs[plan.dir as usize].path.display(),
                    "disk tier: read failed ({err}); value dropped"
                );
                st.read_errors.fetch_add(1, Relaxed);
            }
        }
    }

    /// Drops `key`'s record `plan` after a failed read.
    pub(crate) fn drop_failed(&self, key: &[u8], plan: &ReadPlan) {
        if self.shared.drop_if_seq(key, plan.seq) {
            let seq = self.shared.next_seq();
            self.dirs[plan.dir as usize].send(Job::Tombstone {
                key: Arc::from(key),
                seq,
            });
        }
    }

    /// Records that `key`'s record `plan` now has a DRAM copy `value`; false when the record
    /// is no longer `key`'s (forgotten or replaced while it was read), so it is not promoted.
    pub(crate) fn mark_promoted(&self, key: &[u8], plan: &ReadPlan, value: &Arc<Value>) -> bool {
        let mut s = self.shared.shard(key).lock().unwrap();
        match s.index.get_mut(key) {
            Some(l) if l.seq == plan.seq => {
                l.promoted_as = Arc::as_ptr(value) as usize;
                self.shared.stats.promotions.fetch_add(1, Relaxed);
                true
            }
            _ => false,
        }
    }

    /// Waits until every spill handed over so far has been written or dropped (tests, bench).
    pub fn flush(&self) {
        for d in &self.dirs {
            d.flush();
        }
    }

    /// Directory paths with whether each is degraded.
    pub fn dirs(&self) -> Vec<(PathBuf, bool)> {
        self.dirs
            .iter()
            .map(|d| (d.path.clone(), d.degraded()))
            .collect()
    }
}
