//! The disk tier's flags of `memkv serve` (docs/disk.md).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use memkv_server::disk::DiskConfig;
use memkv_server::parse_size;

#[derive(Args)]
pub struct DiskArgs {
    /// A directory for the disk tier behind DRAM, one per device (repeat the flag, or separate
    /// with commas). Values evicted from DRAM are written there and kept across restarts.
    #[arg(
        long,
        env = "MEMKV_DISK",
        hide_env_values = true,
        value_delimiter = ','
    )]
    disk: Vec<PathBuf>,
    /// Bytes of segment files the disk tier keeps, over all --disk directories (e.g. 500G).
    #[arg(long, env = "MEMKV_DISK_SIZE", hide_env_values = true)]
    disk_size: Option<String>,
    /// Staging memory of the spill queue, taken out of --memory: evicted values wait there for
    /// their write; with it full they are dropped, never waited for [default: an eighth of
    /// --memory, within 4M..1G].
    #[arg(long)]
    disk_queue: Option<String>,
    /// Bound on the disk tier's index memory, next to --memory: the oldest segments are evicted
    /// to keep it (about 300 bytes a value; docs/disk.md).
    #[arg(long, default_value = "256M")]
    disk_index_memory: String,
    /// Threads reading pieces of disk-resident values.
    #[arg(long, default_value_t = 8)]
    disk_read_threads: usize,
    /// Seconds the index rebuild at start may take; the older segments not read by then are
    /// removed.
    #[arg(long, default_value_t = 300.0)]
    disk_recovery_timeout: f64,
    /// Seconds a graceful stop (SIGTERM, SIGINT) may spend writing the values only DRAM holds
    /// to the disk tier, after the connections drain, so that a planned restart keeps them; 0:
    /// none. Keep the drain and this within the supervisor's stop timeout.
    #[arg(long, default_value_t = 15.0)]
    disk_flush_timeout: f64,
}

impl DiskArgs {
    /// The disk tier's settings; None without --disk. Leases hold at most
    /// `max_leased_fraction` of its capacity, as of DRAM's.
    pub fn config(
        &self,
        memory: u64,
        max_leased_fraction: f64,
    ) -> Result<Option<DiskConfig>, String> {
        if self.disk.is_empty() {
            return match self.disk_size {
                Some(_) => Err("--disk-size needs --disk".into()),
                None => Ok(None),
            };
        }
        let size = |flag: &str, v: &str| parse_size(v).map_err(|e| format!("{flag}: {e}"));
        let total = size(
            "--disk-size",
            self.disk_size
                .as_deref()
                .ok_or("--disk needs --disk-size")?,
        )?;
        let queue_bytes = match &self.disk_queue {
            Some(q) => size("--disk-queue", q)?,
            None => (memory / 8).clamp(4 << 20, 1 << 30),
        };
        if queue_bytes >= memory / 2 {
            return Err("--disk-queue must be less than half of --memory".into());
        }
        let t = self.disk_recovery_timeout;
        if !(t.is_finite() && t > 0.0 && t < 1e6) {
            return Err("--disk-recovery-timeout must be a number of seconds above 0".into());
        }
        let f = self.disk_flush_timeout;
        if !(f.is_finite() && (0.0..1e6).contains(&f)) {
            return Err("--disk-flush-timeout must be a number of seconds, 0 or more".into());
        }
        if self.disk_read_threads == 0 || self.disk_read_threads > 256 {
            return Err("--disk-read-threads must be between 1 and 256".into());
        }
        Ok(Some(DiskConfig {
            dirs: self.disk.clone(),
            size: total,
            queue_bytes,
            index_bytes: size("--disk-index-memory", &self.disk_index_memory)?,
            read_threads: self.disk_read_threads,
            recovery_timeout: Duration::from_secs_f64(t),
            max_leased_fraction,
            flush_timeout: Duration::from_secs_f64(f),
        }))
    }
}
