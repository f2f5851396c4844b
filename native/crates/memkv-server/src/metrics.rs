//! Server counters, rendered as Prometheus text on `--metrics` and as JSON for the STATS op.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::lane::LaneStats;
use crate::tenants::usage::Slot;

/// Each tenant's name and slot, for a server with a tenants file.
pub type TenantRows<'a> = [(&'a str, &'a Slot)];

/// A tenant's figures: (name, help, Prometheus type, value). Names are the JSON keys; the
/// Prometheus names are `memkv_tenant_<name>` (`_total` for counters), labelled `tenant`.
fn tenant_figures(s: &Slot) -> [(&'static str, &'static str, &'static str, u64); 12] {
    let c = |a: &AtomicU64| a.load(Relaxed);
    [
        ("quota_bytes", "the tenant's memory quota", "gauge", s.quota),
        (
            "used_bytes",
            "memory charged to the tenant (values and their index entries)",
            "gauge",
            c(&s.used),
        ),
        ("items", "the tenant's values stored", "gauge", c(&s.items)),
        ("puts", "the tenant's values committed", "counter", c(&s.puts)),
        ("hits", "the tenant's GET keys served", "counter", c(&s.hits)),
        ("misses", "the tenant's GET keys not served", "counter", c(&s.misses)),
        ("exists_hits", "the tenant's EXISTS keys found", "counter", c(&s.exists_hits)),
        (
            "exists_misses",
            "the tenant's EXISTS keys not found",
            "counter",
            c(&s.exists_misses),
        ),
        (
            "evictions",
            "the tenant's values evicted",
            "counter",
            c(&s.evictions),
        ),
        (
            "quota_evictions",
            "the tenant's values evicted to make room under its own quota",
            "counter",
            c(&s.quota_evictions),
        ),
        (
            "forbidden",
            "keys answered FORBIDDEN (outside the tenant's prefix, or a write of a read-only tenant)",
            "counter",
            c(&s.forbidden),
        ),
        (
            "over_quota",
            "PUT keys answered OVER_QUOTA",
            "counter",
            c(&s.over_quota),
        ),
    ]
}

/// Error kinds counted separately; each is a label value of `memkv_errors_total`.
pub const ERROR_KINDS: [&str; 21] = [
    "bad_magic",
    "bad_version",
    "malformed",
    "too_large",
    "unauthenticated",
    "auth_failed",
    "no_space",
    "corrupt",
    "io",
    // A frame or reply that missed its deadline (the frame timeout plus its bytes at the minimum
    // rate), a handshake not done in time, an unauthenticated connection closed to admit a new
    // one, a request that waited too long for buffer memory, a GET hit not served because the
    // lane's pinned bytes were at their bound.
    "stalled",
    "handshake_timeout",
    "evicted_unauthenticated",
    "busy",
    "pin_denied",
    // A connection refused because every slot was taken by an authenticated one.
    "connection_limit",
    // RDMA: an RDMA_HELLO refused (RDMA off, other provider, client endpoint unreachable), and
    // a read or write of client memory that failed (bad descriptor, revoked key, client gone).
    // TLS: a failed handshake or record, or a plaintext client on the TLS listener.
    "tls",
    "rdma_refused",
    "rdma_remote",
    // The same-host path: a SHM_REGION refused (a bound, not shared memory, no descriptor), a
    // transfer that named memory outside the connection's regions, and a region whose file
    // shrank under a copy.
    "shm_refused",
    "shm_remote",
    "shm_fault",
];

#[derive(Default)]
pub struct Metrics {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub exists_hits: AtomicU64,
    pub exists_misses: AtomicU64,
    pub puts: AtomicU64,
    pub deletes: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub leases_granted: AtomicU64,
    pub leases_denied: AtomicU64,
    pub connections: AtomicU64,
    pub connections_accepted: AtomicU64,
    pub requests: AtomicU64,
    errors: [AtomicU64; ERROR_KINDS.len()],
}

impl Metrics {
    pub fn error(&self, kind: &str) {
        if let Some(i) = ERROR_KINDS.iter().position(|k| *k == kind) {
            self.errors[i].fetch_add(1, Relaxed);
        }
    }

    pub fn errors(&self, kind: &str) -> u64 {
        ERROR_KINDS
            .iter()
            .position(|k| *k == kind)
            .map_or(0, |i| self.errors[i].load(Relaxed))
    }

    fn counters(&self) -> [(&'static str, &'static str, u64); 12] {
        [
            ("hits", "GET keys served", self.hits.load(Relaxed)),
            (
                "misses",
                "GET keys not served (absent, length mismatch, corrupt)",
                self.misses.load(Relaxed),
            ),
            (
                "exists_hits",
                "EXISTS keys found",
                self.exists_hits.load(Relaxed),
            ),
            (
                "exists_misses",
                "EXISTS keys not found",
                self.exists_misses.load(Relaxed),
            ),
            ("puts", "values committed", self.puts.load(Relaxed)),
            ("deletes", "values deleted", self.deletes.load(Relaxed)),
            (
                "bytes_in",
                "value bytes received",
                self.bytes_in.load(Relaxed),
            ),
            (
                "bytes_out",
                "value bytes sent",
                self.bytes_out.load(Relaxed),
            ),
            (
                "leases_granted",
                "leases granted by EXISTS",
                self.leases_granted.load(Relaxed),
            ),
            (
                "leases_denied",
                "EXISTS hits not leased (leased-bytes bound)",
                self.leases_denied.load(Relaxed),
            ),
            (
                "connections_accepted",
                "connections accepted",
                self.connections_accepted.load(Relaxed),
            ),
            ("requests", "frames handled", self.requests.load(Relaxed)),
        ]
    }

    /// JSON object for the STATS op and `memkv stats`.
    /// `tenants`: a server with a tenants file adds `"tenants": {name: {figure: value}}`.
    pub fn to_json(
        &self,
        lanes: &LaneStats,
        n_lanes: usize,
        tenants: Option<&TenantRows<'_>>,
    ) -> String {
        let mut m = serde_json::Map::new();
        for (name, _, v) in self.counters() {
            m.insert(name.into(), v.into());
        }
        let errors: serde_json::Map<_, _> = ERROR_KINDS
            .iter()
            .map(|k| (k.to_string(), self.errors(k).into()))
            .collect();
        m.insert("errors".into(), errors.into());
        m.insert("connections".into(), self.connections.load(Relaxed).into());
        m.insert("evictions".into(), lanes.evictions.into());
        m.insert("items".into(), lanes.items.into());
        m.insert("memory_used_bytes".into(), lanes.used_bytes.into());
        m.insert("memory_capacity_bytes".into(), lanes.capacity_bytes.into());
        m.insert("leased_bytes".into(), lanes.leased_bytes.into());
        m.insert("in_transfer_bytes".into(), lanes.in_transfer_bytes.into());
        m.insert("receiving_bytes".into(), lanes.receiving_bytes.into());
        m.insert("index_bytes".into(), lanes.index_bytes.into());
        m.insert("lanes".into(), n_lanes.into());
        if let Some(rows) = tenants {
            let per: serde_json::Map<_, _> = rows
                .iter()
                .map(|(name, slot)| {
                    let figs: serde_json::Map<_, _> = tenant_figures(slot)
                        .iter()
                        .map(|(k, _, _, v)| (k.to_string(), (*v).into()))
                        .collect();
                    (name.to_string(), figs.into())
                })
                .collect();
            m.insert("tenants".into(), per.into());
        }
        serde_json::Value::Object(m).to_string()
    }

    pub fn to_prometheus(&self, lanes: &LaneStats, tenants: Option<&TenantRows<'_>>) -> String {
        let mut s = String::new();
        for (name, help, v) in self.counters() {
            let full = format!("memkv_{name}_total");
            let _ = writeln!(s, "# HELP {full} {help}\n# TYPE {full} counter\n{full} {v}");
        }
        let _ = writeln!(
            s,
            "# HELP memkv_errors_total errors by kind\n# TYPE memkv_errors_total counter"
        );
        for k in ERROR_KINDS {
            let _ = writeln!(s, "memkv_errors_total{{kind=\"{k}\"}} {}", self.errors(k));
        }
        for (name, help, kind, v) in [
            (
                "memkv_evictions_total",
                "values evicted",
                "counter",
                lanes.evictions,
            ),
            ("memkv_items", "values stored", "gauge", lanes.items),
            (
                "memkv_connections",
                "open connections",
                "gauge",
                self.connections.load(Relaxed),
            ),
            (
                "memkv_memory_used_bytes",
                "value memory in use",
                "gauge",
                lanes.used_bytes,
            ),
            (
                "memkv_memory_capacity_bytes",
                "value memory reserved",
                "gauge",
                lanes.capacity_bytes,
            ),
            (
                "memkv_leased_bytes",
                "bytes under lease",
                "gauge",
                lanes.leased_bytes,
            ),
            (
                "memkv_in_transfer_bytes",
                "bytes pinned by transfers in progress",
                "gauge",
                lanes.in_transfer_bytes,
            ),
            (
                "memkv_receiving_bytes",
                "bytes of values being received",
                "gauge",
                lanes.receiving_bytes,
            ),
            (
                "memkv_index_bytes",
                "index memory charged against the capacity",
                "gauge",
                lanes.index_bytes,
            ),
        ] {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        }
        if let Some(rows) = tenants {
            write_tenants(&mut s, rows);
        }
        s
    }
}

/// The per-tenant families, one sample per tenant (names are checked to need no escaping).
fn write_tenants(s: &mut String, rows: &TenantRows<'_>) {
    let Some((_, first)) = rows.first() else {
        return;
    };
    for (i, (name, help, kind, _)) in tenant_figures(first).iter().enumerate() {
        let full = if *kind == "counter" {
            format!("memkv_tenant_{name}_total")
        } else {
            format!("memkv_tenant_{name}")
        };
        let _ = writeln!(s, "# HELP {full} {help}\n# TYPE {full} {kind}");
        for (tenant, slot) in rows {
            let v = tenant_figures(slot)[i].3;
            let _ = writeln!(s, "{full}{{tenant=\"{tenant}\"}} {v}");
        }
    }
}
