//! `memkv stats` as a table: one row per server and, for a cluster, a total row. The figures an
//! operator looks at first (items, memory in use, hit ratios) come first; the raw counters stay
//! available with `--json`.

use serde_json::Value;

const HEADER: [&str; 12] = [
    "SERVER",
    "ITEMS",
    "MEMORY",
    "USED",
    "GET HITS",
    "LOOKUP HITS",
    "PUTS",
    "EVICTED",
    "DISK",
    "DISK HITS",
    "CONNS",
    "ERRORS",
];

fn num(v: &Value, key: &str) -> u64 {
    v.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// Binary units, as `--memory` takes them.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{x:.1} {}", UNITS[u])
    }
}

/// `hits / (hits + misses)` as a percentage with the count it rests on; "-" before any request.
fn ratio(hits: u64, misses: u64) -> String {
    match hits + misses {
        0 => "-".into(),
        n => format!("{:.1}% of {n}", 100.0 * hits as f64 / n as f64),
    }
}

/// The counters the table shows, summed over servers for the total row.
#[derive(Default)]
struct Row {
    items: u64,
    used: u64,
    capacity: u64,
    hits: u64,
    misses: u64,
    exists_hits: u64,
    exists_misses: u64,
    puts: u64,
    evictions: u64,
    /// The disk tier's bytes, capacity and GET hits; None for a server without one.
    disk: Option<(u64, u64, u64)>,
    connections: u64,
    errors: u64,
}

impl Row {
    fn from_stats(v: &Value) -> Row {
        Row {
            items: num(v, "items"),
            used: num(v, "memory_used_bytes"),
            capacity: num(v, "memory_capacity_bytes"),
            hits: num(v, "hits"),
            misses: num(v, "misses"),
            exists_hits: num(v, "exists_hits"),
            exists_misses: num(v, "exists_misses"),
            puts: num(v, "puts"),
            evictions: num(v, "evictions"),
            disk: v
                .pointer("/tiers/disk")
                .map(|d| (num(d, "bytes"), num(d, "capacity_bytes"), num(d, "hits"))),
            connections: num(v, "connections"),
            errors: v
                .get("errors")
                .and_then(Value::as_object)
                .map_or(0, |m| m.values().filter_map(Value::as_u64).sum()),
        }
    }

    fn add(&mut self, o: &Row) {
        self.items += o.items;
        self.used += o.used;
        self.capacity += o.capacity;
        self.hits += o.hits;
        self.misses += o.misses;
        self.exists_hits += o.exists_hits;
        self.exists_misses += o.exists_misses;
        self.puts += o.puts;
        self.evictions += o.evictions;
        if let Some((b, c, h)) = o.disk {
            let (tb, tc, th) = self.disk.unwrap_or_default();
            self.disk = Some((tb + b, tc + c, th + h));
        }
        self.connections += o.connections;
        self.errors += o.errors;
    }

    fn cells(&self, name: &str) -> Vec<String> {
        let used_pct = if self.capacity == 0 {
            "-".to_string()
        } else {
            format!("{:.1}%", 100.0 * self.used as f64 / self.capacity as f64)
        };
        vec![
            name.to_string(),
            self.items.to_string(),
            format!("{} / {}", bytes(self.used), bytes(self.capacity)),
            used_pct,
            ratio(self.hits, self.misses),
            ratio(self.exists_hits, self.exists_misses),
            self.puts.to_string(),
            self.evictions.to_string(),
            self.disk.map_or("-".into(), |(b, c, _)| {
                format!("{} / {}", bytes(b), bytes(c))
            }),
            self.disk.map_or("-".into(), |(_, _, h)| h.to_string()),
            self.connections.to_string(),
            self.errors.to_string(),
        ]
    }
}

/// The table for `rows` (server address, its stats JSON or why it could not be read).
pub fn render(rows: &[(String, Result<Value, String>)]) -> String {
    let mut table: Vec<Vec<String>> = vec![HEADER.iter().map(|h| h.to_string()).collect()];
    let mut down: Vec<String> = Vec::new();
    let mut total = Row::default();
    let mut up = 0;
    for (addr, r) in rows {
        match r {
            Ok(v) => {
                let row = Row::from_stats(v);
                total.add(&row);
                up += 1;
                table.push(row.cells(addr));
            }
            Err(e) => {
                // The client's errors already name the server.
                let why = e.strip_prefix(&format!("{addr}: ")).unwrap_or(e);
                down.push(format!("{addr}: DOWN ({why})"));
            }
        }
    }
    if rows.len() > 1 {
        table.push(total.cells(&format!("total ({up} of {} up)", rows.len())));
    }
    let widths: Vec<usize> = (0..HEADER.len())
        .map(|c| table.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in &table {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .enumerate()
            // Names left-aligned, figures right-aligned.
            .map(|(i, (cell, w))| {
                if i == 0 {
                    format!("{cell:<w$}")
                } else {
                    format!("{cell:>w$}")
                }
            })
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    for d in down {
        out.push_str(&d);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_cluster_gets_a_row_per_server_a_total_and_its_down_servers() {
        let a = json!({"items": 3, "memory_used_bytes": 3 << 20, "memory_capacity_bytes": 1u64 << 30,
                       "hits": 3, "misses": 1, "exists_hits": 0, "exists_misses": 0, "puts": 3,
                       "evictions": 0, "connections": 2, "errors": {"malformed": 1, "corrupt": 0}});
        let rows = vec![
            ("10.0.0.1:7390".to_string(), Ok(a.clone())),
            ("10.0.0.2:7390".to_string(), Ok(a)),
            (
                "10.0.0.3:7390".to_string(),
                Err("connection refused".to_string()),
            ),
        ];
        let out = render(&rows);
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("SERVER") && lines[0].contains("GET HITS"));
        assert!(lines[1].starts_with("10.0.0.1:7390"));
        assert!(lines[1].contains("3.0 MiB / 1.0 GiB") && lines[1].contains("75.0% of 4"));
        assert!(lines[3].starts_with("total (2 of 3 up)"));
        assert!(lines[3].contains("6.0 MiB / 2.0 GiB") && lines[3].contains("75.0% of 8"));
        assert!(
            lines[3].trim_end().ends_with(" 2"),
            "errors summed: {}",
            lines[3]
        );
        assert_eq!(lines[4], "10.0.0.3:7390: DOWN (connection refused)");
    }

    #[test]
    fn a_server_with_a_disk_tier_shows_its_bytes_and_hits() {
        let d = json!({"tiers": {"disk": {"bytes": 5u64 << 30, "capacity_bytes": 1u64 << 40,
                                          "hits": 17}}});
        let rows = vec![
            ("a:1".to_string(), Ok(d.clone())),
            ("b:1".to_string(), Ok(d)),
            ("c:1".to_string(), Ok(json!({}))),
        ];
        let out = render(&rows);
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].contains("DISK HITS"));
        assert!(lines[1].contains("5.0 GiB / 1.0 TiB") && lines[1].contains(" 17 "));
        assert!(lines[3].contains(" - "), "no disk tier: {}", lines[3]);
        assert!(lines[4].contains("10.0 GiB / 2.0 TiB") && lines[4].contains(" 34 "));
    }

    #[test]
    fn a_fresh_server_shows_no_ratio_and_one_server_no_total() {
        let out = render(&[("s:1".to_string(), Ok(json!({})))]);
        assert_eq!(out.lines().count(), 2);
        assert!(out.lines().nth(1).unwrap().contains("0 B / 0 B"));
        assert!(out.lines().nth(1).unwrap().contains(" - "));
    }

    #[test]
    fn sizes_use_binary_units() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(8 << 30), "8.0 GiB");
    }
}
