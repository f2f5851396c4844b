//! `memkv serve`: an in-memory store for KV-cache blocks.
//!
//! Read top-down: `server` (accept loop, shutdown) admits each connection under `limits` and
//! hands it, as a `transport` (plain TCP, or TLS through `tls`), to `conn` (the session: handshake, then requests), which reads and
//! writes frames through `frame` (deadlines) and runs one module of `cmd` per command on the
//! `store` (lanes by key hash); each `lane` holds an index, S3-FIFO eviction, leases and pins
//! over memory from `arena`; `verify` checks GET chunks ahead of the send; `metrics` counts it and
//! `metrics_http` serves the counters on `--metrics`. `tenants` says whose each connection and
//! value is: its prefix bounds the keys a connection names, its quota the memory its values
//! take.

pub mod arena;
mod cmd;
pub mod conn;
pub mod disk;
mod fault_guard;
pub mod frame;
pub mod lane;
pub mod limits;
mod mapped;
pub mod metrics;
pub mod metrics_http;
pub mod rdma;
pub mod server;
pub mod shm;
mod shm_copy;
#[cfg(test)]
mod shm_tests;
pub mod store;
pub mod tenants;
pub mod tls;
pub mod transport;
pub mod unix_transport;
pub mod verify;

pub use server::{default_buffer_budget, Server, ServerConfig};

/// Tunes the C allocator for a long-running server process (glibc only; elsewhere a no-op):
/// at most 4 malloc arenas instead of 8 per core, since each reserves 64 MiB of address space
/// and connection threads allocate little; and a fixed mmap threshold of 1 MiB, so request
/// buffers above it are always mapped and unmapped whole instead of being kept in an arena
/// after glibc's dynamic threshold rose. Together they keep the address space and RSS within
/// the bounds docs/security.md states. Call before starting threads; `memkv serve` does.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it is called before other threads start.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 4);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

/// Parses a size such as `512M`, `4G`, `1GiB`, `65536` (binary units: K = 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let digits_end = lower
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(lower.len());
    let (num, unit) = lower.split_at(digits_end);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected e.g. 512M, 4G"))?;
    let mult: u64 = match unit.trim() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(format!("invalid size unit in {s:?}: use K, M, G or T")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} overflows"))
}

/// Parses a 64-hex-character auth key into its 32 bytes.
pub fn parse_auth_key(hex_key: &str) -> Result<Vec<u8>, String> {
    let h = hex_key.trim();
    if h.len() != 64 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "auth key must be 64 hex characters (32 bytes), got {} characters",
            h.len()
        ));
    }
    Ok((0..32)
        .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).unwrap())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("12X").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn auth_keys() {
        assert_eq!(parse_auth_key(&"ab".repeat(32)).unwrap(), vec![0xab; 32]);
        assert!(parse_auth_key("abcd").is_err());
        assert!(parse_auth_key(&"zz".repeat(32)).is_err());
    }
}
