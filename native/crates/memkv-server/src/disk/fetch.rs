//! The store's side of the disk tier: a DRAM miss read from disk into lane memory, promoted
//! back to DRAM on its second hit (`PROMOTE_AFTER`), else sent once and freed.

use memkv_proto::Status;

use super::io::ReadError;
use super::record::BLOCK;
use crate::lane::Pinned;
use crate::store::Store;

impl Store {
    /// GET of a value that is not in DRAM: read from the disk tier into a block-aligned
    /// reservation of its lane (which may evict, and so spill, other values), every chunk
    /// checked. NotFound when it is not on disk, its read fails or its bytes do not match their
    /// checksums (the record is dropped then); NoSpace when the lane cannot take it now (its
    /// pinned-bytes bound: the GET answers NOT_FOUND and counts `pin_denied`).
    pub(crate) fn fetch_from_disk(&self, key: &[u8]) -> Result<Pinned<'_>, Status> {
        let disk = self.disk().ok_or(Status::NotFound)?;
        let plan = disk.plan_read(key).ok_or(Status::NotFound)?;
        let lane = self.lane(key);
        let Ok(mut res) = lane.reserve_aligned(key.len(), plan.len, BLOCK) else {
            return Err(Status::NoSpace);
        };
        let (buf, _) = res.raw_buf();
        // SAFETY: `reserve_aligned` gave a BLOCK-aligned span covering `len` rounded up to
        // BLOCK, which only this thread uses until it is committed or detached below.
        if let Err(e) = unsafe { disk.read(&plan, buf) } {
            disk.drop_failed(key, &plan);
            self.metrics.error(match e {
                ReadError::Corrupt => "corrupt",
                ReadError::Io(_) => "io",
            });
            return Err(Status::NotFound);
        }
        Ok(
            lane.commit_or_detach(key, res, plan.checksums.to_vec(), |here, v| {
                plan.promote && !here && disk.mark_promoted(key, &plan, v)
            }),
        )
    }
}
