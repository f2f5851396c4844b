//! The `--metrics` endpoint: Prometheus text over HTTP (`/metrics`) and the health probe
//! (`/healthz`), one request a connection, within bounds like the data port's. One thread serves every connection (poll), at most `MAX_OPEN` at once
//! (a new one closes the oldest, so silent peers cannot keep a scraper out), reads at most
//! `MAX_HEAD` bytes of a request head, answers once and closes, and gives each connection
//! `DEADLINE` for all of it; `httparse` reads the head. A general-purpose HTTP server does not
//! fit here: tiny_http, used before, starts a thread for every connection and queues every
//! request a peer pipelines without reading the replies, so a flood of either grew the process
//! without bound.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::store::Store;

/// Connections served at once; a scraper needs one.
pub const MAX_OPEN: usize = 16;
/// Longest request head read (a scraper's is a few hundred bytes).
pub const MAX_HEAD: usize = 8 << 10;
/// Time a connection has to send its request and take the reply.
pub const DEADLINE: Duration = Duration::from_secs(5);
/// How often the loop looks at the shutdown flag when nothing happens.
const POLL_MS: i32 = 200;

/// One connection: its request head so far, then the reply and how much of it was written.
struct Exchange {
    stream: TcpStream,
    until: Instant,
    head: Vec<u8>,
    reply: Option<(Vec<u8>, usize)>,
    done: bool,
}

impl Exchange {
    fn new(stream: TcpStream) -> Exchange {
        Exchange {
            stream,
            until: Instant::now() + DEADLINE,
            head: Vec::new(),
            reply: None,
            done: false,
        }
    }

    /// Reads what arrived, answers once the head is whole, writes what the socket takes.
    fn progress(&mut self, store: &Store) {
        if self.reply.is_none() {
            let mut buf = [0u8; 1024];
            let room = MAX_HEAD - self.head.len();
            match self.stream.read(&mut buf[..room.min(1024)]) {
                Ok(0) => {
                    self.done = true;
                    return;
                }
                Ok(n) => self.head.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => {
                    self.done = true;
                    return;
                }
            }
            match respond(&self.head, store) {
                Some(reply) => self.reply = Some((reply, 0)),
                None => return,
            }
        }
        let Some((reply, sent)) = &mut self.reply else {
            return;
        };
        while *sent < reply.len() {
            match self.stream.write(&reply[*sent..]) {
                Ok(n) => *sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => break,
            }
        }
        self.done = true;
    }

    fn events(&self) -> libc::c_short {
        if self.reply.is_some() {
            libc::POLLOUT
        } else {
            libc::POLLIN
        }
    }
}

/// The reply to the request head received so far, or None while it is incomplete and may
/// still grow (httparse reads it; a head that reaches `MAX_HEAD` unfinished is refused).
fn respond(head: &[u8], store: &Store) -> Option<Vec<u8>> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    let (status, body) = match req.parse(head) {
        Ok(httparse::Status::Partial) if head.len() < MAX_HEAD => return None,
        Ok(httparse::Status::Partial) | Err(httparse::Error::TooManyHeaders) => (
            "431 Request Header Fields Too Large",
            "request head too long\n".into(),
        ),
        Err(_) => ("400 Bad Request", "GET /metrics or /healthz\n".into()),
        Ok(httparse::Status::Complete(_)) => {
            let path = req.path.unwrap_or_default();
            match (req.method, path.split('?').next()) {
                (Some("GET" | "HEAD"), Some("/metrics")) => ("200 OK", store.prometheus()),
                // The liveness and readiness probe (Kubernetes): this endpoint listens only once
                // the value memory is pre-faulted and the data port is bound, and stops at
                // SIGTERM with the rest. Reading every lane's counters takes each lane's lock, so
                // a server with a wedged lane does not answer and fails the probe's timeout.
                (Some("GET" | "HEAD"), Some("/healthz")) => {
                    let _ = store.lane_stats();
                    ("200 OK", "ok\n".into())
                }
                (Some("GET" | "HEAD"), _) => ("404 Not Found", "see /metrics or /healthz\n".into()),
                _ => (
                    "405 Method Not Allowed",
                    "GET /metrics or /healthz\n".into(),
                ),
            }
        }
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if req.method != Some("HEAD") {
        out.extend_from_slice(body.as_bytes());
    }
    Some(out)
}

/// Serves `listener` (non-blocking) until `stop` is set.
pub fn serve(listener: TcpListener, store: &Store, stop: &AtomicBool) {
    let mut open: VecDeque<Exchange> = VecDeque::with_capacity(MAX_OPEN);
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(MAX_OPEN + 1);
    while !stop.load(Ordering::Relaxed) {
        fds.clear();
        fds.push(libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        fds.extend(open.iter().map(|x| libc::pollfd {
            fd: x.stream.as_raw_fd(),
            events: x.events(),
            revents: 0,
        }));
        let wait = open
            .iter()
            .map(|x| x.until.saturating_duration_since(Instant::now()))
            .min()
            .map_or(POLL_MS, |d| (d.as_millis() as i32 + 1).min(POLL_MS));
        // SAFETY: `fds` is a valid array of pollfd for sockets this function owns, for the call.
        if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait) } < 0 {
            continue;
        }
        for (x, p) in open.iter_mut().zip(&fds[1..]) {
            if p.revents != 0 {
                x.progress(store);
            }
        }
        let now = Instant::now();
        open.retain(|x| !x.done && x.until > now);
        if fds[0].revents != 0 {
            accept_all(&listener, &mut open);
        }
    }
}

/// Takes every pending connection, closing the oldest open ones to make room.
fn accept_all(listener: &TcpListener, open: &mut VecDeque<Exchange>) {
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                if s.set_nonblocking(true).is_err() {
                    continue;
                }
                if open.len() == MAX_OPEN {
                    open.pop_front();
                }
                open.push_back(Exchange::new(s));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Out of descriptors or memory: back off instead of spinning on a listener that
                // stays readable.
                tracing::debug!(error = %e, "metrics accept failed");
                std::thread::sleep(Duration::from_millis(50));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(head: &[u8]) -> Option<String> {
        let store = Store::new(4 << 20, 1, 0.5).unwrap();
        let out = respond(head, &store)?;
        Some(String::from_utf8_lossy(&out[9..12]).into_owned())
    }

    #[test]
    fn answers_get_metrics_and_refuses_the_rest() {
        let store = Store::new(4 << 20, 1, 0.5).unwrap();
        let ok = respond(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n", &store).unwrap();
        let text = String::from_utf8(ok).unwrap();
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n") && text.contains("memkv_items 0"));
        let head = respond(b"HEAD /metrics HTTP/1.1\r\n\r\n", &store).unwrap();
        assert!(String::from_utf8(head).unwrap().ends_with("\r\n\r\n"));
        assert_eq!(status(b"GET / HTTP/1.1\r\n\r\n").as_deref(), Some("404"));
        let health = respond(b"GET /healthz HTTP/1.1\r\n\r\n", &store).unwrap();
        let health = String::from_utf8(health).unwrap();
        assert!(health.starts_with("HTTP/1.1 200 OK\r\n") && health.ends_with("\r\n\r\nok\n"));
        assert_eq!(
            status(b"POST /healthz HTTP/1.1\r\n\r\n").as_deref(),
            Some("405")
        );
        assert_eq!(
            status(b"POST /metrics HTTP/1.1\r\n\r\n").as_deref(),
            Some("405")
        );
        assert_eq!(status(b"\x01\x02 garbage\r\n\r\n").as_deref(), Some("400"));
        assert_eq!(
            status(b"GET /metrics HTTP/1.1\r\nHost:"),
            None,
            "a head still arriving"
        );
        assert_eq!(status(&[b'x'; MAX_HEAD]).as_deref(), Some("431"));
        let many: Vec<u8> = [
            &b"GET /metrics HTTP/1.1\r\n"[..],
            &b"A: b\r\n".repeat(40),
            b"\r\n",
        ]
        .concat();
        assert_eq!(status(&many).as_deref(), Some("431"));
    }
}
