//! Memory registrations, and the client's bounded cache of them.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::fabric::Fabric;
use crate::memory::{self, Memory};
use crate::sys::{self, Fid};

/// A registered memory range. Closed when dropped, or earlier by `revoke`: from then on no
/// remote operation under its key can touch the memory.
pub struct Mr {
    fab: Arc<Fabric>,
    fid: Mutex<Option<usize>>,
    desc: usize,
    pub key: u64,
    pub base: usize,
    pub len: usize,
    /// Where the registered memory lives (host, or a CUDA device).
    pub mem: Memory,
}

impl Mr {
    pub(crate) fn new(
        fab: Arc<Fabric>,
        fid: Fid,
        desc: *mut c_void,
        key: u64,
        base: usize,
        len: usize,
        mem: Memory,
    ) -> Mr {
        Mr {
            fab,
            fid: Mutex::new(Some(fid as usize)),
            desc: desc as usize,
            key,
            base,
            len,
            mem,
        }
    }

    /// The local descriptor for operations on this memory (`Rma::desc`).
    pub fn desc(&self) -> usize {
        self.desc
    }

    /// Whether `[ptr, ptr + len)` lies inside this registration.
    pub fn covers(&self, ptr: usize, len: usize) -> bool {
        ptr >= self.base
            && ptr
                .checked_add(len)
                .is_some_and(|e| e <= self.base + self.len)
    }

    /// The address a peer names `ptr` (inside this registration) by.
    pub fn remote_addr(&self, ptr: usize) -> u64 {
        self.fab.remote_addr(self.base, ptr)
    }

    /// Closes the registration now (idempotent); remote operations under its key fail after.
    pub fn revoke(&self) {
        if let Some(fid) = self.fid.lock().unwrap().take() {
            // SAFETY: the registration is open and closed only here.
            unsafe { sys::mk_close(fid as Fid) };
        }
    }

    pub fn revoked(&self) -> bool {
        self.fid.lock().unwrap().is_none()
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        self.revoke();
    }
}

/// The client's registrations, looked up by address: a buffer inside a cached registration
/// reuses it, any other is registered exactly (no byte more, so a key grants the server
/// nothing beyond the buffers it was sent). At most `max_entries` are kept; the least recently
/// used ones are dropped first (closed once no transfer holds them). Regions the caller
/// registers explicitly (`pin`: e.g. a whole KV-cache pool, so that its blocks share one
/// registration) are not counted and stay until `unpin` or an `invalidate` that overlaps them.
/// Each new registration is of the memory `memory::locate` finds at its start (GPU memory is
/// refused on a domain that does not register it); a buffer inside a registration is of the
/// same memory, so hits ask nothing.
pub struct MrCache {
    fab: Arc<Fabric>,
    max_entries: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// By start address: the registration and its last use (`PINNED` for pinned regions).
    by_start: BTreeMap<usize, (Arc<Mr>, u64)>,
    tick: u64,
    pinned: usize,
}

/// The "last use" of a pinned region: never the least recently used.
const PINNED: u64 = u64::MAX;

impl MrCache {
    pub fn new(fab: Arc<Fabric>, max_entries: usize) -> MrCache {
        MrCache {
            fab,
            max_entries: max_entries.max(1),
            inner: Mutex::default(),
        }
    }

    pub fn fabric(&self) -> &Arc<Fabric> {
        &self.fab
    }

    /// A registration covering `[ptr, ptr + len)`.
    ///
    /// # Safety
    /// The memory must stay mapped while any registration of it is open: until the caller
    /// `invalidate`s it, or the cache drops it (its bound) and no transfer holds it.
    pub unsafe fn get(&self, ptr: usize, len: usize) -> Result<Arc<Mr>> {
        let mut g = self.inner.lock().unwrap();
        g.tick += 1;
        let tick = g.tick;
        if let Some((_, (mr, used))) = g.by_start.range_mut(..=ptr).next_back() {
            if mr.covers(ptr, len) && !mr.revoked() {
                if *used != PINNED {
                    *used = tick;
                }
                return Ok(mr.clone());
            }
        }
        drop(g);
        let mr = Arc::new(
            self.fab
                .register_memory(ptr, len.max(1), true, memory::locate(ptr))?,
        );
        let mut g = self.inner.lock().unwrap();
        if let Some((old, used)) = g.by_start.insert(ptr, (mr.clone(), tick)) {
            // A pinned region starting here did not cover the buffer: it stays pinned.
            if used == PINNED {
                g.by_start.insert(ptr, (old, used));
                return Ok(mr);
            }
        }
        while g.by_start.len() > self.max_entries + g.pinned {
            let oldest = g
                .by_start
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| *k)
                .expect("not empty");
            g.by_start.remove(&oldest);
        }
        Ok(mr)
    }

    /// Where `[ptr, ptr + len)` lives: the memory of a live registration covering it, else
    /// what `memory::locate` finds.
    pub fn memory_of(&self, ptr: usize, len: usize) -> Memory {
        let g = self.inner.lock().unwrap();
        if let Some((_, (mr, _))) = g.by_start.range(..=ptr).next_back() {
            if mr.covers(ptr, len) && !mr.revoked() {
                return mr.mem;
            }
        }
        drop(g);
        memory::locate(ptr)
    }

    /// Revokes and forgets every registration overlapping `[ptr, ptr + len)`, at once even if a
    /// transfer holds it: after this no remote operation can touch that memory.
    pub fn invalidate(&self, ptr: usize, len: usize) {
        let end = ptr.saturating_add(len);
        let mut g = self.inner.lock().unwrap();
        let hit: Vec<usize> = g
            .by_start
            .range(..end)
            .filter(|(_, (mr, _))| mr.base + mr.len > ptr)
            .map(|(k, _)| *k)
            .collect();
        for k in hit {
            if let Some((mr, used)) = g.by_start.remove(&k) {
                g.pinned -= usize::from(used == PINNED);
                mr.revoke();
            }
        }
    }

    /// Registers `[ptr, ptr + len)` as one region kept until `unpin(ptr)`; buffers inside it
    /// use it instead of registrations of their own. The region keeps the memory kind it was
    /// registered with (host, or its CUDA device).
    ///
    /// # Safety
    /// The memory must stay mapped until `unpin` (or an overlapping `invalidate`).
    pub unsafe fn pin(&self, ptr: usize, len: usize) -> Result<()> {
        let mr = Arc::new(
            self.fab
                .register_memory(ptr, len.max(1), true, memory::locate(ptr))?,
        );
        let mut g = self.inner.lock().unwrap();
        if let Some((old, used)) = g.by_start.insert(ptr, (mr, PINNED)) {
            g.pinned -= usize::from(used == PINNED);
            old.revoke();
        }
        g.pinned += 1;
        Ok(())
    }

    /// Drops the pinned region starting at `ptr` (no transfer in it may be running).
    pub fn unpin(&self, ptr: usize) {
        let mut g = self.inner.lock().unwrap();
        if g.by_start
            .get(&ptr)
            .is_some_and(|(_, used)| *used == PINNED)
        {
            if let Some((mr, _)) = g.by_start.remove(&ptr) {
                g.pinned -= 1;
                mr.revoke();
            }
        }
    }

    pub fn len(&self) -> usize {
        self.inner.lock().unwrap().by_start.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
