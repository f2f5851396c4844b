//! Counters per tier: the DRAM tier's (from the lanes and the GET path) beside the disk tier's,
//! rendered into `memkv stats`'s JSON (`tiers`) and the Prometheus text (`memkv_tier_*`,
//! `memkv_disk_*`).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use serde_json::json;

use crate::lane::LaneStats;

/// Why a value evicted from DRAM was not written to disk; each a label of
/// `memkv_disk_spill_dropped_total`.
pub const DROP_REASONS: [&str; 7] = [
    // The spill queue's staging memory was full: the writers are behind.
    "queue_full",
    // Every directory is degraded.
    "degraded",
    // Larger than a directory's capacity.
    "too_large",
    // Its room is held by leased values: every segment it could evict holds one.
    "leased",
    // The disk index is at its bound and this directory has nothing left to evict.
    "index_full",
    // The filesystem ran out of space (the capacity was cut to what it holds).
    "disk_full",
    // The write failed (read-only, I/O error): the directory is degraded.
    "write_error",
];

/// The GET path's DRAM counters (the lanes count the rest).
#[derive(Default)]
pub struct DramCounters {
    pub hits: AtomicU64,
    pub read_bytes: AtomicU64,
}

#[derive(Default)]
pub struct DiskStats {
    pub capacity: AtomicU64,
    /// Bytes of segment files.
    pub used: AtomicU64,
    pub items: AtomicU64,
    /// Value bytes of the indexed records.
    pub bytes: AtomicU64,
    pub index_bytes: AtomicU64,
    pub queued_bytes: AtomicU64,
    pub hits: AtomicU64,
    pub corrupt: AtomicU64,
    pub read_errors: AtomicU64,
    pub write_errors: AtomicU64,
    pub disk_full: AtomicU64,
    pub spills: AtomicU64,
    /// Evictions of a promoted value whose record was still on disk: nothing to write.
    pub spill_skipped: AtomicU64,
    pub promotions: AtomicU64,
    pub tombstones: AtomicU64,
    pub read_bytes: AtomicU64,
    pub read_ns: AtomicU64,
    pub evicted_items: AtomicU64,
    pub evicted_segments: AtomicU64,
    pub degraded_dirs: AtomicU64,
    pub recovered_items: AtomicU64,
    pub recovery_ms: AtomicU64,
    /// Bytes of segments held by leases (`leases`), as of the last `DiskTier::stats`.
    pub leased_bytes: AtomicU64,
    /// EXISTS leases refused on disk-resident values (answered OK_NO_LEASE): the segments
    /// leases hold were at their bound.
    pub lease_denied: AtomicU64,
    dropped: [AtomicU64; DROP_REASONS.len()],
}

impl DiskStats {
    pub fn drop_spill(&self, reason: &str) {
        if let Some(i) = DROP_REASONS.iter().position(|r| *r == reason) {
            self.dropped[i].fetch_add(1, Relaxed);
        }
    }

    pub fn dropped(&self, reason: &str) -> u64 {
        DROP_REASONS
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.dropped[i].load(Relaxed))
    }

    pub(super) fn add_item(&self, len: u64, charge: u64) {
        self.items.fetch_add(1, Relaxed);
        self.bytes.fetch_add(len, Relaxed);
        self.index_bytes.fetch_add(charge, Relaxed);
    }

    pub(super) fn remove_item(&self, len: u64, charge: u64) {
        self.items.fetch_sub(1, Relaxed);
        self.bytes.fetch_sub(len, Relaxed);
        self.index_bytes.fetch_sub(charge, Relaxed);
    }

    pub(super) fn count_read(&self, len: u64, took: Duration) {
        self.hits.fetch_add(1, Relaxed);
        self.read_bytes.fetch_add(len, Relaxed);
        self.read_ns.fetch_add(took.as_nanos() as u64, Relaxed);
    }

    /// Mean rate of the disk tier's reads while they ran (bytes over the summed read times).
    fn read_gbps(&self) -> f64 {
        let ns = self.read_ns.load(Relaxed);
        if ns == 0 {
            return 0.0;
        }
        self.read_bytes.load(Relaxed) as f64 / ns as f64
    }
}

/// The `tiers` object of the stats JSON: one entry per tier, the same keys in each.
pub fn tiers_json(
    dram: &DramCounters,
    lanes: &LaneStats,
    disk: Option<(&DiskStats, Vec<(String, bool)>)>,
) -> serde_json::Value {
    let mut tiers = json!({
        "dram": {
            "bytes": lanes.used_bytes,
            "capacity_bytes": lanes.capacity_bytes,
            "items": lanes.items,
            "hits": dram.hits.load(Relaxed),
            "read_bytes": dram.read_bytes.load(Relaxed),
            "spills": 0,
            "promotions": 0,
            "evictions": lanes.evictions,
        }
    });
    if let Some((d, dirs)) = disk {
        let dropped: serde_json::Map<_, _> = DROP_REASONS
            .iter()
            .map(|r| (r.to_string(), d.dropped(r).into()))
            .collect();
        let dirs: Vec<_> = dirs
            .into_iter()
            .map(|(path, degraded)| json!({"path": path, "degraded": degraded}))
            .collect();
        tiers["disk"] = json!({
            "bytes": d.bytes.load(Relaxed),
            "capacity_bytes": d.capacity.load(Relaxed),
            "items": d.items.load(Relaxed),
            "hits": d.hits.load(Relaxed),
            "read_bytes": d.read_bytes.load(Relaxed),
            "spills": d.spills.load(Relaxed),
            "promotions": d.promotions.load(Relaxed),
            "evictions": d.evicted_items.load(Relaxed),
            "read_gbps": d.read_gbps(),
            "file_bytes": d.used.load(Relaxed),
            "index_bytes": d.index_bytes.load(Relaxed),
            "queued_bytes": d.queued_bytes.load(Relaxed),
            "leased_bytes": d.leased_bytes.load(Relaxed),
            "lease_denied": d.lease_denied.load(Relaxed),
            "spill_dropped": dropped,
            "spill_skipped": d.spill_skipped.load(Relaxed),
            "corrupt": d.corrupt.load(Relaxed),
            "read_errors": d.read_errors.load(Relaxed),
            "write_errors": d.write_errors.load(Relaxed),
            "disk_full": d.disk_full.load(Relaxed),
            "tombstones": d.tombstones.load(Relaxed),
            "evicted_segments": d.evicted_segments.load(Relaxed),
            "degraded_dirs": d.degraded_dirs.load(Relaxed),
            "recovered_items": d.recovered_items.load(Relaxed),
            "recovery_ms": d.recovery_ms.load(Relaxed),
            "dirs": dirs,
        });
    }
    tiers
}

/// The per-tier Prometheus series, appended to the server's.
pub fn tiers_prometheus(
    dram: &DramCounters,
    lanes: &LaneStats,
    disk: Option<&DiskStats>,
) -> String {
    let mut s = String::new();
    let dram_row = [
        lanes.used_bytes,
        lanes.capacity_bytes,
        lanes.items,
        dram.hits.load(Relaxed),
        dram.read_bytes.load(Relaxed),
        0,
        0,
        lanes.evictions,
    ];
    let disk_row = disk.map(|d| {
        [
            d.bytes.load(Relaxed),
            d.capacity.load(Relaxed),
            d.items.load(Relaxed),
            d.hits.load(Relaxed),
            d.read_bytes.load(Relaxed),
            d.spills.load(Relaxed),
            d.promotions.load(Relaxed),
            d.evicted_items.load(Relaxed),
        ]
    });
    let series = [
        ("memkv_tier_bytes", "gauge", "value bytes held per tier"),
        ("memkv_tier_capacity_bytes", "gauge", "capacity per tier"),
        ("memkv_tier_items", "gauge", "values held per tier"),
        (
            "memkv_tier_hits_total",
            "counter",
            "GET values answered per tier",
        ),
        (
            "memkv_tier_read_bytes_total",
            "counter",
            "value bytes read per tier",
        ),
        (
            "memkv_tier_spills_total",
            "counter",
            "values written into the tier by DRAM eviction",
        ),
        (
            "memkv_tier_promotions_total",
            "counter",
            "values copied back to DRAM from the tier",
        ),
        (
            "memkv_tier_evictions_total",
            "counter",
            "values evicted from the tier",
        ),
    ];
    for (i, (name, kind, help)) in series.iter().enumerate() {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
        let _ = writeln!(s, "{name}{{tier=\"dram\"}} {}", dram_row[i]);
        if let Some(row) = &disk_row {
            let _ = writeln!(s, "{name}{{tier=\"disk\"}} {}", row[i]);
        }
    }
    let Some(d) = disk else {
        return s;
    };
    let _ = writeln!(
        s,
        "# HELP memkv_disk_spill_dropped_total values evicted from DRAM and not written to disk\n\
         # TYPE memkv_disk_spill_dropped_total counter"
    );
    for r in DROP_REASONS {
        let _ = writeln!(
            s,
            "memkv_disk_spill_dropped_total{{reason=\"{r}\"}} {}",
            d.dropped(r)
        );
    }
    for (name, kind, help, v) in [
        (
            "memkv_disk_read_seconds_total",
            "counter",
            "time spent in disk-tier reads",
            d.read_ns.load(Relaxed) as f64 / 1e9,
        ),
        (
            "memkv_disk_file_bytes",
            "gauge",
            "bytes of segment files",
            d.used.load(Relaxed) as f64,
        ),
        (
            "memkv_disk_index_bytes",
            "gauge",
            "memory of the disk tier's index",
            d.index_bytes.load(Relaxed) as f64,
        ),
        (
            "memkv_disk_queued_bytes",
            "gauge",
            "bytes in the spill queue",
            d.queued_bytes.load(Relaxed) as f64,
        ),
        (
            "memkv_disk_leased_bytes",
            "gauge",
            "bytes of segment files held by leases",
            d.leased_bytes.load(Relaxed) as f64,
        ),
        (
            "memkv_disk_lease_denied_total",
            "counter",
            "leases refused on disk values, leased segments at their bound",
            d.lease_denied.load(Relaxed) as f64,
        ),
        (
            "memkv_disk_corrupt_total",
            "counter",
            "disk reads that failed their checksums (dropped)",
            d.corrupt.load(Relaxed) as f64,
        ),
        (
            "memkv_disk_read_errors_total",
            "counter",
            "disk reads that failed",
            d.read_errors.load(Relaxed) as f64,
        ),
        (
            "memkv_disk_write_errors_total",
            "counter",
            "disk writes that failed",
            d.write_errors.load(Relaxed) as f64,
        ),
        (
            "memkv_disk_degraded_dirs",
            "gauge",
            "disk-tier directories that take no more writes",
            d.degraded_dirs.load(Relaxed) as f64,
        ),
        (
            "memkv_disk_recovered_items",
            "gauge",
            "values indexed from disk at start",
            d.recovered_items.load(Relaxed) as f64,
        ),
    ] {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
    }
    s
}
