//! Per-server connection pools with a health state. After a transport failure the server is
//! marked down: its keys answer `Unavailable` at once until a backoff expires, so a dead server
//! costs one timeout, not one per request. The state and its reason are logged once per change
//! (up to down with the reason, down to up) and reported by `health()`.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::conn::{Conn, ConnError};
use crate::transport::Transport;
use crate::Status;

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

pub struct PoolConfig {
    pub auth_key: Option<Vec<u8>>,
    pub max_connections: usize,
    pub connect_timeout: Duration,
    pub transport: Arc<dyn Transport>,
}

/// Why a server is (or last was) down.
#[derive(Debug, Clone)]
pub struct Failure {
    pub status: Status,
    pub reason: String,
    pub at: Instant,
}

/// A server's state as the client sees it.
#[derive(Debug, Clone)]
pub struct Health {
    pub addr: String,
    /// False from a transport failure until a request succeeds again.
    pub up: bool,
    /// The failure that marked it down (while down), or the last one (once up again).
    pub last_failure: Option<Failure>,
}

struct State {
    idle: Vec<Conn>,
    open: usize,
    up: bool,
    down_until: Option<Instant>,
    backoff: Duration,
    /// When the server last went from up to down.
    down_since: Option<Instant>,
    last_failure: Option<Failure>,
}

pub struct Pool {
    pub addr: String,
    cfg: Arc<PoolConfig>,
    state: Mutex<State>,
    freed: Condvar,
}

/// Why no request could be run on a server.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("{addr} is marked down for {left_ms} ms more after: {why}")]
    Down {
        addr: String,
        left_ms: u64,
        why: String,
    },
    #[error("{addr}: no connection free before the operation's deadline")]
    Busy { addr: String },
    #[error("{addr}: {err}")]
    Conn { addr: String, err: ConnError },
}

impl PoolError {
    pub fn status(&self) -> Status {
        match self {
            PoolError::Down { .. } => Status::Unavailable,
            PoolError::Busy { .. } => Status::Timeout,
            PoolError::Conn { err, .. } => err.status(),
        }
    }
}

impl Pool {
    pub fn new(addr: String, cfg: Arc<PoolConfig>) -> Pool {
        Pool {
            addr,
            cfg,
            state: Mutex::new(State {
                idle: Vec::new(),
                open: 0,
                up: true,
                down_until: None,
                backoff: BACKOFF_MIN,
                down_since: None,
                last_failure: None,
            }),
            freed: Condvar::new(),
        }
    }

    /// Runs `f` on a pooled connection bounded by `deadline`. On error the connection is closed,
    /// and the server is marked down if the error says the server or the path to it failed.
    pub fn with_conn<T>(
        &self,
        deadline: Instant,
        f: impl FnOnce(&mut Conn) -> Result<T, ConnError>,
    ) -> Result<T, PoolError> {
        let mut conn = self.acquire(deadline)?;
        match f(&mut conn) {
            Ok(v) if !conn.reusable() => {
                self.discard(conn);
                Ok(v)
            }
            Ok(v) => {
                self.release(conn);
                Ok(v)
            }
            Err(err) => Err(self.fail(err)),
        }
    }

    /// A connection bounded by `deadline`: an idle one, a new one, or one freed before then.
    pub fn acquire(&self, deadline: Instant) -> Result<Conn, PoolError> {
        let mut st = self.state.lock().unwrap();
        loop {
            if let Some(down) = self.down(&st) {
                return Err(down);
            }
            if let Some(mut c) = st.idle.pop() {
                c.set_deadline(deadline);
                return Ok(c);
            }
            if st.open < self.cfg.max_connections {
                st.open += 1;
                drop(st);
                return self.connect(deadline).map_err(|err| self.fail(err));
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

    /// A connection of its own for a caller that keeps it (mapped reads hold their pins on
    /// one connection), outside the pool's count; fails at once while the server is down.
    /// Its failures go to `fail_kept`.
    pub fn connect_kept(&self, deadline: Instant) -> Result<Conn, PoolError> {
        if let Some(down) = self.down(&self.state.lock().unwrap()) {
            return Err(down);
        }
        self.connect(deadline).map_err(|err| self.fail_kept(err))
    }

    /// The error for a request while the server is marked down (until its backoff expires).
    fn down(&self, st: &State) -> Option<PoolError> {
        let now = Instant::now();
        let t = st.down_until.filter(|t| now < *t)?;
        Some(PoolError::Down {
            addr: self.addr.clone(),
            left_ms: (t - now).as_millis() as u64,
            why: st
                .last_failure
                .as_ref()
                .map_or_else(String::new, |f| f.reason.clone()),
        })
    }

    /// A new connection, its handshake bounded by the connect timeout, then by `deadline`.
    fn connect(&self, deadline: Instant) -> Result<Conn, ConnError> {
        let connect_by = deadline.min(Instant::now() + self.cfg.connect_timeout);
        let mut c = Conn::connect(
            &*self.cfg.transport,
            &self.addr,
            self.cfg.auth_key.as_deref(),
            connect_by,
        )?;
        c.set_deadline(deadline);
        Ok(c)
    }

    /// `fail` for a connection of `connect_kept`, which the pool does not count.
    pub fn fail_kept(&self, err: ConnError) -> PoolError {
        self.failed(err, false)
    }

    /// Returns a connection whose last request succeeded; the server answers, so it is up.
    pub fn release(&self, conn: Conn) {
        let mut st = self.state.lock().unwrap();
        st.idle.push(conn);
        st.backoff = BACKOFF_MIN;
        let came_back = !st.up;
        if came_back {
            st.up = true;
            st.down_until = None;
        }
        let down_ms = st.down_since.map_or(0, |t| t.elapsed().as_millis() as u64);
        drop(st);
        self.freed.notify_one();
        // Logged outside the lock: in a Python process a log record takes the GIL.
        if came_back {
            tracing::info!(server = %self.addr, down_ms, "memkv server answers again");
        }
    }

    /// Drops a connection that worked but cannot be reused (the server closed it after its
    /// reply); the server stays up.
    pub fn discard(&self, conn: Conn) {
        drop(conn);
        self.state.lock().unwrap().open -= 1;
        self.freed.notify_one();
    }

    /// Drops the connection `err` happened on (its stream is in an unknown state) and marks the
    /// server down when the error is a transport failure.
    pub fn fail(&self, err: ConnError) -> PoolError {
        self.failed(err, true)
    }

    /// `fail`; `counted`: the connection was one of the pool's `open` ones.
    fn failed(&self, err: ConnError, counted: bool) -> PoolError {
        let status = err.status();
        let reason = err.to_string();
        let mut st = self.state.lock().unwrap();
        if counted {
            st.open -= 1;
        }
        let was_up = st.up;
        let backoff = st.backoff;
        if err.marks_down() {
            st.down_until = Some(Instant::now() + backoff);
            st.backoff = (backoff * 2).min(BACKOFF_MAX);
            // Idle connections to a failing server are likely dead too.
            let n = st.idle.len();
            st.idle.clear();
            st.open -= n;
            if was_up {
                st.down_since = Some(Instant::now());
            }
            st.up = false;
            st.last_failure = Some(Failure {
                status,
                reason: reason.clone(),
                at: Instant::now(),
            });
        }
        drop(st);
        self.freed.notify_one();
        if !err.marks_down() {
            tracing::debug!(server = %self.addr, outcome = %status, error = %reason,
                "memkv request refused; the server stays up");
        } else if was_up {
            tracing::warn!(server = %self.addr, outcome = %status, error = %reason,
                "memkv server down; its keys are misses until it recovers");
        } else {
            tracing::debug!(server = %self.addr, outcome = %status, error = %reason,
                backoff_ms = backoff.as_millis() as u64, "memkv server still down");
        }
        PoolError::Conn {
            addr: self.addr.clone(),
            err,
        }
    }

    pub fn health(&self) -> Health {
        let st = self.state.lock().unwrap();
        Health {
            addr: self.addr.clone(),
            up: st.up,
            last_failure: st.last_failure.clone(),
        }
    }
}
