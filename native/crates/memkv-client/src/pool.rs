//! Per-server connection pools with a down-marker: after a failure the server is skipped (its
//! keys answer Unavailable at once) until a backoff expires, so a dead server costs one timeout,
//! not one per request.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::conn::{Conn, ConnError};

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

pub struct PoolConfig {
    pub auth_key: Option<Vec<u8>>,
    pub max_connections: usize,
    pub connect_timeout: Duration,
    pub op_timeout: Duration,
}

struct State {
    idle: Vec<Conn>,
    open: usize,
    down_until: Option<Instant>,
    backoff: Duration,
}

pub struct Pool {
    pub addr: String,
    cfg: std::sync::Arc<PoolConfig>,
    state: Mutex<State>,
    freed: Condvar,
}

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("{addr} is marked down for {left_ms} ms more after: {why}")]
    Down {
        addr: String,
        left_ms: u64,
        why: String,
    },
    #[error("{addr}: no connection free within the op timeout")]
    Busy { addr: String },
    #[error("{addr}: {err}")]
    Conn { addr: String, err: ConnError },
}

impl Pool {
    pub fn new(addr: String, cfg: std::sync::Arc<PoolConfig>) -> Pool {
        Pool {
            addr,
            cfg,
            state: Mutex::new(State {
                idle: Vec::new(),
                open: 0,
                down_until: None,
                backoff: BACKOFF_MIN,
            }),
            freed: Condvar::new(),
        }
    }

    /// Runs `f` on a pooled connection. On error the connection is closed and the server marked
    /// down; on success the connection returns to the pool.
    pub fn with_conn<T>(
        &self,
        f: impl FnOnce(&mut Conn) -> Result<T, ConnError>,
    ) -> Result<T, PoolError> {
        let mut conn = self.acquire()?;
        match f(&mut conn) {
            Ok(v) => {
                self.release(Some(conn));
                Ok(v)
            }
            Err(err) => {
                self.release(None);
                self.mark_down(&err.to_string());
                Err(PoolError::Conn {
                    addr: self.addr.clone(),
                    err,
                })
            }
        }
    }

    pub fn is_down(&self) -> bool {
        self.state
            .lock()
            .unwrap()
            .down_until
            .is_some_and(|t| Instant::now() < t)
    }

    fn acquire(&self) -> Result<Conn, PoolError> {
        let deadline = Instant::now() + self.cfg.op_timeout;
        let mut st = self.state.lock().unwrap();
        loop {
            if let Some(t) = st.down_until {
                let now = Instant::now();
                if now < t {
                    return Err(PoolError::Down {
                        addr: self.addr.clone(),
                        left_ms: (t - now).as_millis() as u64,
                        why: "earlier failure".into(),
                    });
                }
            }
            if let Some(c) = st.idle.pop() {
                return Ok(c);
            }
            if st.open < self.cfg.max_connections {
                st.open += 1;
                drop(st);
                let r = Conn::connect(
                    &self.addr,
                    self.cfg.auth_key.as_deref(),
                    self.cfg.connect_timeout,
                    self.cfg.op_timeout,
                );
                return r.map_err(|err| {
                    self.release(None);
                    self.mark_down(&err.to_string());
                    PoolError::Conn {
                        addr: self.addr.clone(),
                        err,
                    }
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(PoolError::Busy {
                    addr: self.addr.clone(),
                });
            }
            st = self.freed.wait_timeout(st, deadline - now).unwrap().0;
        }
    }

    fn release(&self, conn: Option<Conn>) {
        let mut st = self.state.lock().unwrap();
        match conn {
            Some(c) => {
                st.idle.push(c);
                st.backoff = BACKOFF_MIN;
            }
            None => st.open -= 1,
        }
        self.freed.notify_one();
    }

    fn mark_down(&self, why: &str) {
        let mut st = self.state.lock().unwrap();
        let b = st.backoff;
        st.down_until = Some(Instant::now() + b);
        st.backoff = (b * 2).min(BACKOFF_MAX);
        // Idle connections to a failing server are likely dead too.
        let n = st.idle.len();
        st.idle.clear();
        st.open -= n;
        tracing::warn!(server = %self.addr, backoff_ms = b.as_millis() as u64, error = %why,
            "memkv server unavailable; its keys are misses until it answers again");
    }
}
