//! The fence of `WriteCompletion::ReadFence`: one-byte reads, ordered after a batch's writes,
//! that prove the written bytes are in the target's memory.

use std::sync::Arc;

use crate::endpoint::Rma;
use crate::error::{FabricError, Result};
use crate::fabric::Fabric;
use crate::mr::Mr;

/// Bytes the fencing reads of `WriteCompletion::ReadFence` land in and nobody reads, registered
/// once per endpoint (the registration drops before the memory).
pub(crate) struct FenceTarget {
    mr: Mr,
    _mem: Box<[u8]>,
}

/// Bytes of a `FenceTarget`: concurrent fencing reads mostly land in different bytes, though
/// nothing depends on it.
const FENCE_BYTES: usize = 64;

impl FenceTarget {
    /// Registers an endpoint's fence target on `fab`.
    pub(crate) fn new(fab: &Arc<Fabric>) -> Result<FenceTarget> {
        let mem = vec![0u8; FENCE_BYTES].into_boxed_slice();
        // SAFETY: the memory lives in the FenceTarget, which drops the registration first.
        let mr = unsafe { fab.register(mem.as_ptr() as usize, mem.len(), false) }?;
        Ok(FenceTarget { mr, _mem: mem })
    }

    /// `fence_reads` of `ops`, landing in this target.
    pub(crate) fn reads(&self, ops: &[Rma], errors: &[Option<FabricError>]) -> Vec<Rma> {
        fence_reads(ops, errors, self.mr.base, self.mr.desc())
    }
}

/// The reads that prove a batch's writes are in the target's memory (`ReadFence`): per group
/// with writes and no error, one byte read back from the end of its last write, landing in
/// `[base, base + FENCE_BYTES)` (registered, `desc`).
fn fence_reads(ops: &[Rma], errors: &[Option<FabricError>], base: usize, desc: usize) -> Vec<Rma> {
    let mut last: Vec<Option<&Rma>> = vec![None; errors.len()];
    for op in ops.iter().filter(|op| op.write && op.len > 0) {
        last[op.group] = Some(op);
    }
    last.iter()
        .zip(errors)
        .filter_map(|(op, e)| if e.is_none() { *op } else { None })
        .enumerate()
        .map(|(i, op)| Rma {
            write: false,
            local: base + i % FENCE_BYTES,
            desc,
            len: 1,
            remote_addr: op.remote_addr.wrapping_add(op.len as u64 - 1),
            rkey: op.rkey,
            group: op.group,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fence_reads_the_last_byte_of_each_written_groups_last_write() {
        let op = |write, group, remote_addr, len| Rma {
            write,
            local: 0,
            desc: 0,
            len,
            remote_addr,
            rkey: 10 + group as u64,
            group,
        };
        // Group 0: two pieces; group 1: failed; group 2: a read (a PUT's); group 3: one write.
        let ops = [
            op(true, 0, 1000, 4),
            op(true, 0, 1004, 6),
            op(true, 1, 5000, 8),
            op(false, 2, 7000, 8),
            op(true, 3, 9000, 1),
        ];
        let errors = [None, Some(FabricError::other("x", "failed")), None, None];
        let f = fence_reads(&ops, &errors, 0x100, 77);
        let got: Vec<_> = f
            .iter()
            .map(|r| {
                (
                    r.write,
                    r.group,
                    r.remote_addr,
                    r.rkey,
                    r.len,
                    r.local,
                    r.desc,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (false, 0, 1009, 10, 1, 0x100, 77),
                (false, 3, 9000, 13, 1, 0x101, 77)
            ]
        );
        assert!(fence_reads(&ops[3..4], &[None, None, None], 0, 0).is_empty());
    }
}
