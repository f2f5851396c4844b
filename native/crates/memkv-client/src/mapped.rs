//! Mapped reads: values read straight out of a same-host server's memory
//! (`memkv serve --shm-share-values`), for a GPU to copy with one host-to-device copy.
//!
//! Per server the client keeps a few connections of its own (outside the pool: their pins live
//! on them) and one read-only mapping of each of the server's lanes (SHM_VALUES; every
//! connection's descriptor of a lane names the same file, mapped once). `get` asks where the
//! values lie (GET_MAPPED); the server holds them in place until `release` and verifies their
//! checksums meanwhile, and the release's answer says whether they were held throughout and
//! intact. Only then are the bytes a caller copied out of the mapping known to be the stored
//! ones: a connection that broke in between let the server free them, and a value that failed
//! its checksums was dropped, so such a release answers false and the caller must treat those
//! keys as failed.
//!
//! A mapping is handed to the caller's `MapHook` when made (a GPU engine registers it with
//! CUDA) and before it goes; it goes once its connection is gone and no ticket uses it.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use memkv_proto as proto;

use crate::conn::{Conn, ConnError};
use crate::pool::Pool;
use crate::Status;

/// What the caller does with each mapping of a server's memory: `mapped` once it is made (an
/// Err keeps it unused: that server's keys fail as UNAVAILABLE), `unmapping` before it goes.
pub trait MapHook: Send + Sync {
    fn mapped(&self, ptr: usize, len: usize) -> Result<(), String>;
    fn unmapping(&self, ptr: usize, len: usize);
}

/// One lane of a server, mapped read-only.
struct LaneMap {
    ptr: usize,
    len: usize,
    hook: Arc<dyn MapHook>,
}

impl LaneMap {
    fn new(fd: &OwnedFd, len: u64, hook: &Arc<dyn MapHook>) -> Result<LaneMap, String> {
        let len = usize::try_from(len).map_err(|_| "lane too large to map".to_string())?;
        if len == 0 {
            return Err("the server's lane is empty".into());
        }
        // SAFETY: a fresh read-only shared mapping of the descriptor the server passed; the
        // result is checked. The server sealed the file's size, so no page of it can vanish.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!(
                "cannot map the server's lane: {}",
                std::io::Error::last_os_error()
            ));
        }
        if let Err(e) = hook.mapped(p as usize, len) {
            // SAFETY: the mapping made above; nobody else saw it.
            unsafe { libc::munmap(p, len) };
            return Err(e);
        }
        Ok(LaneMap {
            ptr: p as usize,
            len,
            hook: hook.clone(),
        })
    }
}

impl Drop for LaneMap {
    fn drop(&mut self) {
        self.hook.unmapping(self.ptr, self.len);
        // SAFETY: our mapping; the last ticket reading it and its connection are gone.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// One server's side: its connection (None until made, or after it broke) and lane mappings.
#[derive(Default)]
struct Side {
    conn: Option<Conn>,
    lanes: Vec<Arc<LaneMap>>,
    /// Counts connections, so a release knows whether its pin's connection is this one.
    gen: u64,
}

struct Part {
    server: usize,
    side: usize,
    gen: u64,
    pin: u64,
}

/// Kept connections per server: reads from several threads, and a release beside the next
/// read, do not queue behind one another on one connection (the server verifies each read's
/// values before it answers).
const CONNS_PER_SERVER: usize = 4;

/// A lane file, by device and inode: what every connection's descriptor of it names.
type FileId = (u64, u64);

/// One server: its kept connections and the lane mappings they share.
struct Server {
    /// An address of it is on this host: none of its memory can be mapped otherwise.
    local: bool,
    sides: Vec<Mutex<Side>>,
    maps: Mutex<HashMap<FileId, Weak<LaneMap>>>,
}

impl Server {
    /// The live mapping of the file `fd` names, or a new one.
    fn lane(
        &self,
        fd: &OwnedFd,
        len: u64,
        hook: &Arc<dyn MapHook>,
    ) -> Result<Arc<LaneMap>, String> {
        // SAFETY: fstat of a descriptor we own, into a local struct.
        let id = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
                return Err(format!(
                    "cannot inspect the server's lane: {}",
                    std::io::Error::last_os_error()
                ));
            }
            (st.st_dev, st.st_ino)
        };
        let mut maps = self.maps.lock().unwrap();
        if let Some(m) = maps.get(&id).and_then(Weak::upgrade) {
            if m.len as u64 == len {
                return Ok(m);
            }
        }
        maps.retain(|_, w| w.strong_count() > 0);
        let m = Arc::new(LaneMap::new(fd, len, hook)?);
        maps.insert(id, Arc::downgrade(&m));
        Ok(m)
    }
}

/// What one `get` pinned: released together.
struct Ticket {
    parts: Vec<Part>,
    /// The mappings its values lie in stay mapped until the release.
    _lanes: Vec<Arc<LaneMap>>,
}

pub struct MappedReads {
    hook: Arc<dyn MapHook>,
    servers: Vec<Server>,
    tickets: Mutex<HashMap<u64, Ticket>>,
    next: AtomicU64,
    /// Which kept connection the next read takes.
    turn: AtomicU64,
}

impl MappedReads {
    /// Over the servers whose `local` entry says an address of theirs is on this host (the
    /// others' reads answer UNAVAILABLE).
    pub fn new(local: Vec<bool>, hook: Arc<dyn MapHook>) -> MappedReads {
        MappedReads {
            hook,
            servers: local
                .into_iter()
                .map(|local| Server {
                    local,
                    sides: (0..CONNS_PER_SERVER).map(|_| Mutex::default()).collect(),
                    maps: Mutex::default(),
                })
                .collect(),
            tickets: Mutex::default(),
            next: AtomicU64::new(1),
            turn: AtomicU64::new(0),
        }
    }

    /// Connects `side` to its server and maps the server's lanes, unless that is done.
    fn open(
        &self,
        server: &Server,
        side: &mut Side,
        pool: &Pool,
        deadline: Instant,
    ) -> Result<(), String> {
        if side.conn.is_some() {
            return Ok(());
        }
        if !server.local {
            return Err("the server is not on this host".into());
        }
        side.lanes.clear();
        let mut conn = pool.connect_kept(deadline).map_err(|e| e.to_string())?;
        let broken = |pool: &Pool, e: ConnError| pool.fail_kept(e).to_string();
        let first = conn.shm_values(0).map_err(|e| broken(pool, e))??;
        let mut lanes = vec![server.lane(&first.1, first.0.len, &self.hook)?];
        for lane in 1..first.0.lanes {
            let (rep, fd) = conn.shm_values(lane).map_err(|e| broken(pool, e))??;
            lanes.push(server.lane(&fd, rep.len, &self.hook)?);
        }
        side.gen += 1;
        side.lanes = lanes;
        side.conn = Some(conn);
        Ok(())
    }

    /// Opens every server's side now (what `get` would do at its first call), so the mappings
    /// are made and handed to the hook before the first read; one line per server.
    pub fn open_all(&self, pools: &[Pool], deadline: Instant) -> Vec<Result<(), String>> {
        pools
            .iter()
            .zip(&self.servers)
            .map(|(p, s)| self.open(s, &mut s.sides[0].lock().unwrap(), p, deadline))
            .collect()
    }

    /// Where each key's value lies in this process (its status, and its address for Ok),
    /// and the ticket to `release` once every copy out of them is done (0: nothing pinned).
    /// `groups` are the key indices per server.
    pub fn get(
        &self,
        pools: &[Pool],
        keys: &[Vec<u8>],
        lens: &[u64],
        groups: Vec<(usize, Vec<usize>)>,
        deadline: Instant,
    ) -> (Vec<(Status, usize)>, u64) {
        let mut out = vec![(Status::InvalidKey, 0usize); keys.len()];
        let mut parts = Vec::new();
        let mut held = Vec::new();
        let turn = self.turn.fetch_add(1, Ordering::Relaxed) as usize % CONNS_PER_SERVER;
        for (s, idx) in groups {
            let server = &self.servers[s];
            let mut side = server.sides[turn].lock().unwrap();
            let pool = &pools[s];
            if let Err(why) = self.open(server, &mut side, pool, deadline) {
                tracing::debug!(server = %pool.addr, reason = %why, "memkv mapped reads unavailable");
                idx.iter().for_each(|&i| out[i] = (Status::Unavailable, 0));
                continue;
            }
            let ks: Vec<&[u8]> = idx.iter().map(|&i| keys[i].as_slice()).collect();
            let ls: Vec<u64> = idx.iter().map(|&i| lens[i]).collect();
            let conn = side.conn.as_mut().expect("opened above");
            conn.set_deadline(deadline);
            let r = conn.get_mapped(&ks, &ls).and_then(|(pin, vals)| {
                let lanes = &side.lanes;
                let placed: Option<Vec<(Status, usize)>> = vals
                    .iter()
                    .map(|v| {
                        if v.status != proto::Status::Ok {
                            return Some((Status::from(v.status), 0));
                        }
                        let lane = lanes.get(v.lane as usize)?;
                        let end = v.offset.checked_add(v.len)?;
                        (end <= lane.len as u64).then(|| (Status::Ok, lane.ptr + v.offset as usize))
                    })
                    .collect();
                placed.map(|p| (pin, p)).ok_or_else(|| {
                    proto::ProtoError::Malformed("GET_MAPPED place outside its lane").into()
                })
            });
            match r {
                Ok((pin, placed)) => {
                    idx.iter().zip(placed).for_each(|(&i, p)| out[i] = p);
                    if pin != 0 {
                        parts.push(Part {
                            server: s,
                            side: turn,
                            gen: side.gen,
                            pin,
                        });
                        held.extend(side.lanes.iter().cloned());
                    }
                }
                Err(e) => {
                    let st = e.status();
                    side.conn = None;
                    side.lanes.clear();
                    pool.fail_kept(e);
                    idx.iter().for_each(|&i| out[i] = (st, 0));
                }
            }
        }
        if parts.is_empty() {
            return (out, 0);
        }
        let t = self.next.fetch_add(1, Ordering::Relaxed);
        self.tickets.lock().unwrap().insert(
            t,
            Ticket {
                parts,
                _lanes: held,
            },
        );
        (out, t)
    }

    /// Lets the values of `ticket` go; true when the server held every one of them until now
    /// (the bytes read out of them were the stored ones). An unknown ticket answers false.
    pub fn release(&self, pools: &[Pool], ticket: u64, deadline: Instant) -> bool {
        let Some(t) = self.tickets.lock().unwrap().remove(&ticket) else {
            return false;
        };
        let mut all = true;
        for p in &t.parts {
            let mut side = self.servers[p.server].sides[p.side].lock().unwrap();
            if side.gen != p.gen {
                all = false; // its connection is gone, and the pins with it
                continue;
            }
            let Some(conn) = side.conn.as_mut() else {
                all = false;
                continue;
            };
            conn.set_deadline(deadline);
            match conn.shm_release(p.pin) {
                Ok(held) => all &= held,
                Err(e) => {
                    all = false;
                    side.conn = None;
                    side.lanes.clear();
                    pools[p.server].fail_kept(e);
                }
            }
        }
        all
    }
}
