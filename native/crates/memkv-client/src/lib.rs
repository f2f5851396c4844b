//! memkv client core: places keys on servers (rendezvous hashing), fans batches out per server
//! in parallel over pooled connections, and moves values between caller memory and sockets.
//!
//! Failure policy: a server that is down, slow or misbehaving turns its keys into
//! `Status::Unavailable` (a miss for EXISTS/GET, a dropped store for PUT). Nothing here panics on
//! server input or blocks past the op timeout.

pub mod conn;
pub mod exec;
pub mod placement;
pub mod pool;

use std::sync::Arc;
use std::time::Duration;

pub use conn::Buf;
pub use exec::{Executor, Op, OpResult};
pub use memkv_proto::Status;
use pool::{Pool, PoolConfig};

#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub servers: Vec<String>,
    pub auth_key: Option<Vec<u8>>,
    pub connections_per_server: usize,
    pub connect_timeout: Duration,
    pub op_timeout: Duration,
    /// Threads running submitted (asynchronous) operations.
    pub io_threads: usize,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            servers: vec!["127.0.0.1:7390".into()],
            auth_key: None,
            connections_per_server: 2,
            connect_timeout: Duration::from_secs(1),
            op_timeout: Duration::from_secs(10),
            io_threads: 8,
        }
    }
}

/// Per-server answer of `ping` / `stats`.
pub type PerServer<T> = Vec<(String, Result<T, String>)>;

pub struct Client {
    pools: Vec<Pool>,
    ids: Vec<String>,
    cfg: ClientConfig,
    exec: Executor,
}

impl Client {
    pub fn new(cfg: ClientConfig) -> Result<Arc<Client>, String> {
        if cfg.servers.is_empty() {
            return Err("no memkv servers configured".into());
        }
        let pc = Arc::new(PoolConfig {
            auth_key: cfg.auth_key.clone(),
            max_connections: cfg.connections_per_server.max(1),
            connect_timeout: cfg.connect_timeout,
            op_timeout: cfg.op_timeout,
        });
        let pools = cfg
            .servers
            .iter()
            .map(|s| Pool::new(s.clone(), pc.clone()))
            .collect();
        Ok(Arc::new(Client {
            pools,
            ids: cfg.servers.clone(),
            exec: Executor::new(cfg.io_threads.max(1)),
            cfg,
        }))
    }

    pub fn config(&self) -> &ClientConfig {
        &self.cfg
    }

    /// Index of the server that owns `key`.
    pub fn server_of(&self, key: &[u8]) -> usize {
        placement::rendezvous(key, &self.ids)
    }

    pub fn exists(&self, keys: &[Vec<u8>], lease_ms: u32) -> Vec<(Status, u64)> {
        let mut out = vec![(Status::Unavailable, 0); keys.len()];
        self.fan_out(keys, |pool, idx| {
            let ks: Vec<&[u8]> = idx.iter().map(|&i| keys[i].as_slice()).collect();
            pool.with_conn(|c| c.exists(&ks, lease_ms)).ok()
        })
        .into_iter()
        .for_each(|(idx, r)| scatter(&mut out, &idx, r, (Status::Unavailable, 0)));
        mark_invalid(keys, &mut out, (Status::InvalidKey, 0));
        out
    }

    pub fn delete(&self, keys: &[Vec<u8>]) -> Vec<Status> {
        let mut out = vec![Status::Unavailable; keys.len()];
        self.fan_out(keys, |pool, idx| {
            let ks: Vec<&[u8]> = idx.iter().map(|&i| keys[i].as_slice()).collect();
            pool.with_conn(|c| c.delete(&ks)).ok()
        })
        .into_iter()
        .for_each(|(idx, r)| scatter(&mut out, &idx, r, Status::Unavailable));
        mark_invalid(keys, &mut out, Status::InvalidKey);
        out
    }

    /// Stores each key's bytes from caller memory. Values become visible atomically per key.
    ///
    /// # Safety
    /// Every `Buf` must stay valid for reads until this returns.
    pub unsafe fn put(&self, keys: &[Vec<u8>], bufs: &[Buf]) -> Vec<Status> {
        self.transfer(keys, bufs, true)
    }

    /// Reads each key's value into caller memory; a buffer is written only if its status is Ok.
    ///
    /// # Safety
    /// Every `Buf` must stay valid for writes, and not be accessed by anyone else, until this
    /// returns. Buffers must not overlap.
    pub unsafe fn get(&self, keys: &[Vec<u8>], bufs: &[Buf]) -> Vec<Status> {
        self.transfer(keys, bufs, false)
    }

    fn transfer(&self, keys: &[Vec<u8>], bufs: &[Buf], put: bool) -> Vec<Status> {
        assert_eq!(keys.len(), bufs.len(), "one buffer per key");
        let mut out = vec![Status::Unavailable; keys.len()];
        // Values bigger than a server accepts are refused here rather than sent and discarded.
        let results = self.fan_out(keys, |pool, idx| {
            pool.with_conn(|c| {
                let max = c.max_value_len as usize;
                let (ok, too_big): (Vec<usize>, Vec<usize>) =
                    idx.iter().partition(|&&i| !put || bufs[i].len <= max);
                let ks: Vec<&[u8]> = ok.iter().map(|&i| keys[i].as_slice()).collect();
                let bs: Vec<Buf> = ok.iter().map(|&i| bufs[i]).collect();
                let st = if ks.is_empty() {
                    vec![]
                } else if put {
                    c.put(&ks, &bs)?
                } else {
                    c.get(&ks, &bs)?
                };
                let mut res: Vec<(usize, Status)> = ok.into_iter().zip(st).collect();
                res.extend(too_big.into_iter().map(|i| (i, Status::TooLarge)));
                res.sort_unstable_by_key(|(i, _)| *i);
                Ok(res.into_iter().map(|(_, s)| s).collect::<Vec<_>>())
            })
            .ok()
        });
        for (idx, r) in results {
            scatter(&mut out, &idx, r, Status::Unavailable);
        }
        mark_invalid(keys, &mut out, Status::InvalidKey);
        out
    }

    pub fn ping(&self) -> PerServer<Duration> {
        self.pools
            .iter()
            .map(|p| {
                let t = std::time::Instant::now();
                let r = p
                    .with_conn(|c| c.ping())
                    .map(|_| t.elapsed())
                    .map_err(|e| e.to_string());
                (p.addr.clone(), r)
            })
            .collect()
    }

    pub fn stats(&self) -> PerServer<String> {
        self.pools
            .iter()
            .map(|p| {
                (
                    p.addr.clone(),
                    p.with_conn(|c| c.stats()).map_err(|e| e.to_string()),
                )
            })
            .collect()
    }

    /// Runs `f` for each (server, key indices) group in parallel, splitting a server's group over
    /// its connections when it has several. Invalid keys never reach a server.
    fn fan_out<T: Send>(
        &self,
        keys: &[Vec<u8>],
        f: impl Fn(&Pool, &[usize]) -> Option<Vec<T>> + Sync,
    ) -> Vec<(Vec<usize>, Option<Vec<T>>)> {
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); self.pools.len()];
        for (i, k) in keys.iter().enumerate() {
            if memkv_proto::key_ok(k) {
                groups[self.server_of(k)].push(i);
            }
        }
        let per = self.cfg.connections_per_server.max(1);
        let mut tasks: Vec<(usize, Vec<usize>)> = Vec::new();
        for (s, g) in groups
            .into_iter()
            .enumerate()
            .filter(|(_, g)| !g.is_empty())
        {
            // Split only batches worth it: several keys per connection.
            let parts = per.min(g.len().div_ceil(4)).max(1);
            let chunk = g.len().div_ceil(parts);
            tasks.extend(g.chunks(chunk).map(|c| (s, c.to_vec())));
        }
        let run = |(s, idx): (usize, Vec<usize>)| {
            let r = f(&self.pools[s], &idx).filter(|v| v.len() == idx.len());
            (idx, r)
        };
        if tasks.len() <= 1 {
            return tasks.into_iter().map(run).collect();
        }
        std::thread::scope(|sc| {
            let mut it = tasks.into_iter();
            let first = it.next().unwrap();
            let handles: Vec<_> = it.map(|t| sc.spawn(move || run(t))).collect();
            let mut res = vec![run(first)];
            res.extend(
                handles
                    .into_iter()
                    .map(|h| h.join().expect("fan-out task panicked")),
            );
            res
        })
    }

    /// Runs `job` on the I/O threads; the returned Op completes with its result.
    pub fn submit(self: &Arc<Self>, job: impl FnOnce(&Client) -> OpResult + Send + 'static) -> Op {
        let me = self.clone();
        self.exec.submit(move || job(&me))
    }
}

/// Writes a group's results back to the caller's order; keys without a result get `missing`.
fn scatter<T: Copy>(out: &mut [T], idx: &[usize], r: Option<Vec<T>>, missing: T) {
    match r {
        Some(v) => idx.iter().zip(v).for_each(|(&i, s)| out[i] = s),
        None => idx.iter().for_each(|&i| out[i] = missing),
    }
}

/// Invalid keys (empty or over the maximum) answer `InvalidKey` rather than Unavailable.
fn mark_invalid<T: Copy>(keys: &[Vec<u8>], out: &mut [T], invalid: T) {
    for (k, o) in keys.iter().zip(out.iter_mut()) {
        if !memkv_proto::key_ok(k) {
            *o = invalid;
        }
    }
}
