//! The accept loop, connection limits, the metrics endpoint and graceful shutdown.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use memkv_proto::{self as proto, ErrorCode, Header, Opcode};

use crate::conn::{self, ConnCtx};
use crate::store::Store;
use crate::verify::Verifier;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: String,
    pub memory: u64,
    pub lanes: usize,
    pub auth_key: Option<Vec<u8>>,
    pub metrics_listen: Option<String>,
    pub max_connections: usize,
    /// Share of each lane's memory that leases may pin.
    pub max_leased_fraction: f64,
    pub frame_timeout: Duration,
    /// How long shutdown waits for open connections to finish their requests.
    pub drain_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:7390".into(),
            memory: 1 << 30,
            lanes: 4,
            auth_key: None,
            metrics_listen: None,
            max_connections: 1024,
            max_leased_fraction: 0.5,
            frame_timeout: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(10),
        }
    }
}

/// A running server. Dropping it does not stop it; call `shutdown` then `wait`.
pub struct Server {
    pub addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    pub store: Arc<Store>,
    shutdown: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    drain_timeout: Duration,
}

impl Server {
    /// Reserves memory, binds the listeners and starts serving in background threads.
    pub fn start(cfg: ServerConfig) -> io::Result<Server> {
        let store = Arc::new(Store::new(cfg.memory, cfg.lanes, cfg.max_leased_fraction)?);
        let listener = TcpListener::bind(&cfg.listen)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shutdown = Arc::new(AtomicBool::new(false));
        let ctx = Arc::new(ConnCtx {
            store: store.clone(),
            auth_key: cfg.auth_key.clone(),
            shutdown: shutdown.clone(),
            frame_timeout: cfg.frame_timeout,
            verifier: Verifier::new(std::thread::available_parallelism().map_or(1, |n| n.get()))?,
        });
        let mut threads = Vec::new();
        let max_conn = cfg.max_connections;
        threads.push(
            std::thread::Builder::new()
                .name("memkv-accept".into())
                .spawn(move || accept_loop(listener, ctx, max_conn))?,
        );
        let mut metrics_addr = None;
        if let Some(m) = &cfg.metrics_listen {
            let http = tiny_http::Server::http(m)
                .map_err(|e| io::Error::other(format!("metrics listener {m}: {e}")))?;
            metrics_addr = http.server_addr().to_ip();
            let (store, stop) = (store.clone(), shutdown.clone());
            threads.push(
                std::thread::Builder::new()
                    .name("memkv-metrics".into())
                    .spawn(move || metrics_loop(http, store, stop))?,
            );
        }
        tracing::info!(
            listen = %addr,
            memory_bytes = store.lane_stats().capacity_bytes,
            lanes = store.lane_count(),
            max_value_bytes = store.max_value_len,
            auth = cfg.auth_key.is_some(),
            metrics = %metrics_addr.map_or("off".to_string(), |a| a.to_string()),
            "memkv serving"
        );
        Ok(Server {
            addr,
            metrics_addr,
            store,
            shutdown,
            threads,
            drain_timeout: cfg.drain_timeout,
        })
    }

    /// The flag that stops the server (set it from a signal handler).
    pub fn shutdown_flag(&self) -> Arc<AtomicBool> {
        self.shutdown.clone()
    }

    pub fn shutdown(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
    }

    /// Blocks until shutdown is requested, then drains: stops accepting, lets requests in flight
    /// finish (up to the drain timeout) and returns.
    pub fn wait(self) {
        for t in self.threads {
            let _ = t.join();
        }
        let deadline = Instant::now() + self.drain_timeout;
        while self.store.metrics.connections.load(Ordering::SeqCst) > 0 && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        tracing::info!(
            open_connections = self.store.metrics.connections.load(Ordering::SeqCst),
            "memkv stopped"
        );
    }
}

fn accept_loop(listener: TcpListener, ctx: Arc<ConnCtx>, max_conn: usize) {
    let fd = listener.as_raw_fd();
    while !ctx.shutdown.load(Ordering::Relaxed) {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the listener we own, for the duration of the call.
        let r = unsafe { libc::poll(&mut pfd, 1, 200) };
        if r <= 0 {
            continue;
        }
        let (stream, _) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let m = &ctx.store.metrics;
        if m.connections.load(Ordering::SeqCst) as usize >= max_conn {
            tracing::warn!(max_conn, "connection limit reached; refusing a connection");
            refuse(stream, "too many connections");
            continue;
        }
        let _ = stream.set_nonblocking(false);
        m.connections.fetch_add(1, Ordering::SeqCst);
        m.connections_accepted.fetch_add(1, Ordering::Relaxed);
        let ctx = ctx.clone();
        let spawned = std::thread::Builder::new()
            .name("memkv-conn".into())
            .spawn(move || {
                conn::serve(stream, &ctx);
                ctx.store.metrics.connections.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a connection thread");
            m.connections.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn refuse(mut stream: TcpStream, msg: &str) {
    let body = proto::encode_error(ErrorCode::ShuttingDown, msg);
    let hdr = Header::new(Opcode::Error, 0, body.len(), 0).encode();
    let _ = stream.set_nonblocking(false);
    let _ = proto::io::write_all_vectored(&mut stream, &[&hdr, &body]);
}

fn metrics_loop(http: tiny_http::Server, store: Arc<Store>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(Some(req)) = http.recv_timeout(Duration::from_millis(200)) else {
            continue;
        };
        let resp = if req.url() == "/metrics" {
            let text = store.metrics.to_prometheus(&store.lane_stats());
            let ct =
                tiny_http::Header::from_bytes("Content-Type", "text/plain; version=0.0.4").unwrap();
            tiny_http::Response::from_string(text).with_header(ct)
        } else {
            tiny_http::Response::from_string("see /metrics\n").with_status_code(404)
        };
        let _ = req.respond(resp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn call(s: &mut TcpStream, op: Opcode, body: &[u8], payload: &[u8]) -> (Header, Vec<u8>) {
        let h = Header::new(op, 1, body.len(), payload.len() as u64).encode();
        s.write_all(&h).unwrap();
        s.write_all(body).unwrap();
        s.write_all(payload).unwrap();
        let mut hb = [0u8; proto::HEADER_LEN];
        s.read_exact(&mut hb).unwrap();
        let h = Header::decode(&hb).unwrap();
        let mut b = vec![0u8; h.body_len as usize];
        s.read_exact(&mut b).unwrap();
        (h, b)
    }

    #[test]
    fn corruption_in_a_later_chunk_aborts_the_reply_and_drops_the_value() {
        let srv = Server::start(ServerConfig {
            listen: "127.0.0.1:0".into(),
            memory: 16 << 20,
            lanes: 1,
            ..ServerConfig::default()
        })
        .unwrap();
        let mut s = TcpStream::connect(srv.addr).unwrap();
        call(&mut s, Opcode::Hello, &[], &[]);
        let len = 3 * proto::CHECKSUM_CHUNK + 5;
        let val: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        let body = proto::encode_key_lens(&[b"big".as_slice()], &[len as u64]);
        call(&mut s, Opcode::Put, &body, &val);
        let v = srv.store.fetch_verified(b"big").ok().unwrap();
        v.span.corrupt_for_test(2 * proto::CHECKSUM_CHUNK + 7);
        drop(v);
        let get = Header::new(Opcode::Get, 2, body.len(), 0).encode();
        s.write_all(&get).unwrap();
        s.write_all(&body).unwrap();
        // The connection is aborted before the corrupt chunk: whatever arrived is a strict
        // prefix of the full reply, and no byte of it differs from what was stored.
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        let head = proto::HEADER_LEN + 4 + 9;
        assert!(
            got.len() <= head + 2 * proto::CHECKSUM_CHUNK,
            "no byte of the corrupt chunk may be sent"
        );
        if got.len() > head {
            assert_eq!(&got[head..], &val[..got.len() - head]);
        }
        assert!(
            srv.store.fetch_verified(b"big").is_err(),
            "corrupt value must be dropped"
        );
        assert_eq!(srv.store.metrics.errors("corrupt"), 1);
        srv.shutdown();
        srv.wait();
    }
}
