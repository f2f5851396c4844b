//! The flush at a graceful stop: the values DRAM holds that are not on disk are written to the
//! disk tier before the process exits, within `--disk-flush-timeout`, so that a planned restart
//! (an upgrade) serves what DRAM held. A `kill -9` skips it: the disk keeps what was spilled.
//!
//! The values go through the spill queue like evictions, hottest first, but a full queue is
//! waited for instead of dropping the value. Markers sent behind every quarter of the queue let
//! the copy into staging memory go on while the writers drain what is ahead of it.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use super::{DiskTier, Staged};
use crate::store::Store;

/// How often the flush logs its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// What a flush did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FlushReport {
    /// Values in DRAM when it began.
    pub values: u64,
    /// Of those, written to disk by the flush.
    pub written: u64,
    /// Of those, on disk already (promoted values whose record was kept).
    pub on_disk: u64,
    /// Of those, not on disk when it ended (out of time, or dropped by the tier: full of
    /// leased segments, degraded, too large).
    pub left: u64,
    pub timed_out: bool,
}

impl Store {
    /// Writes the DRAM-resident values that are not on disk to the disk tier, waiting at most
    /// the tier's flush timeout (nothing without a disk tier or with a zero timeout). Progress
    /// and the outcome are logged.
    pub fn flush_to_disk(&self) -> FlushReport {
        let Some(disk) = self.disk() else {
            return FlushReport::default();
        };
        if disk.flush_timeout.is_zero() {
            return FlushReport::default();
        }
        let start = Instant::now();
        let deadline = start + disk.flush_timeout;
        let values: Vec<_> = self.lanes().iter().flat_map(|l| l.resident()).collect();
        let total = values.len() as u64;
        let bytes: u64 = values.iter().map(|(_, v)| v.span.len()).sum();
        tracing::info!(
            values = total,
            bytes,
            timeout_s = disk.flush_timeout.as_secs_f64(),
            "disk tier: flushing DRAM to disk before stopping"
        );
        let st = disk.stats();
        let spills0 = st.spills.load(Relaxed);
        let mut marks = Marks::new(disk);
        let mut on_disk = 0;
        let mut next_log = start + PROGRESS_EVERY;
        let mut timed_out = false;
        'values: for (key, value) in &values {
            loop {
                if Instant::now() >= deadline {
                    timed_out = true;
                    break 'values;
                }
                match disk.stage(key, value) {
                    Staged::Queued => {
                        marks.staged(value.span.len());
                        break;
                    }
                    Staged::OnDisk => {
                        on_disk += 1;
                        break;
                    }
                    // Larger than the whole (empty) queue: it cannot be written.
                    Staged::Dropped("queue_full") if st.queued_bytes.load(Relaxed) == 0 => {
                        st.drop_spill("queue_full");
                        break;
                    }
                    Staged::Dropped("queue_full") => {
                        if !marks.wait_oldest(deadline) {
                            timed_out = true;
                            break 'values;
                        }
                    }
                    Staged::Dropped(reason) => {
                        st.drop_spill(reason);
                        break;
                    }
                }
            }
            if Instant::now() >= next_log {
                next_log += PROGRESS_EVERY;
                tracing::info!(
                    written = st.spills.load(Relaxed) - spills0,
                    of = total,
                    "disk tier: flushing"
                );
            }
        }
        timed_out |= !marks.wait_all(deadline);
        let written = st.spills.load(Relaxed) - spills0;
        let r = FlushReport {
            values: total,
            written,
            on_disk,
            left: total.saturating_sub(written + on_disk),
            timed_out,
        };
        let took_s = start.elapsed().as_secs_f64();
        if r.left > 0 {
            tracing::warn!(
                written = r.written,
                already_on_disk = r.on_disk,
                left = r.left,
                timed_out,
                took_s,
                "disk tier: flush ended with values left in DRAM only (lost at exit); \
                 --disk-flush-timeout bounds it"
            );
        } else {
            tracing::info!(
                written = r.written,
                already_on_disk = r.on_disk,
                took_s,
                "disk tier: flushed"
            );
        }
        r
    }
}

/// The markers behind the values staged so far: each answers once its directory's writer has
/// written everything queued before it.
struct Marks<'a> {
    disk: &'a DiskTier,
    sent: VecDeque<Vec<Receiver<()>>>,
    /// Bytes staged since the last markers.
    since: u64,
    every: u64,
}

impl<'a> Marks<'a> {
    fn new(disk: &'a DiskTier) -> Marks<'a> {
        Marks {
            disk,
            sent: VecDeque::new(),
            since: 0,
            every: (disk.staging.capacity() / 4).max(1),
        }
    }

    fn staged(&mut self, len: u64) {
        self.since += len;
        if self.since >= self.every {
            self.mark();
        }
    }

    fn mark(&mut self) {
        self.since = 0;
        self.sent
            .push_back(self.disk.dirs.iter().map(|d| d.mark()).collect());
    }

    /// Waits until the writers are past the oldest markers (sending some first when there are
    /// none), so that staging memory has room again. False at the deadline.
    fn wait_oldest(&mut self, deadline: Instant) -> bool {
        if self.sent.is_empty() {
            self.mark();
        }
        let oldest = self.sent.pop_front().expect("marked");
        oldest.iter().all(|rx| rx.recv_deadline(deadline).is_ok())
    }

    /// Waits until every staged value is written. False at the deadline.
    fn wait_all(&mut self, deadline: Instant) -> bool {
        self.mark();
        while !self.sent.is_empty() {
            if !self.wait_oldest(deadline) {
                return false;
            }
        }
        true
    }
}
