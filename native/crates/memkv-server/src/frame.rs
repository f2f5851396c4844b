//! Frames over a `Transport`, with the time limits that keep slow and silent peers from holding
//! memory or slots: a wait for the next frame that ends at shutdown (and, before authentication,
//! at the handshake deadline), and for every frame in either direction a deadline of the frame
//! timeout plus its bytes at the minimum rate, which it must also keep pace with on the way
//! (`Pace`): the announced size of a frame lengthens its deadline only as its bytes move.

use std::io::{self, IoSlice, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memkv_proto::{io::READ_PIECE, HEADER_LEN};

use crate::transport::Transport;

/// How often a connection waiting for its next frame looks at the shutdown flag.
const POLL: Duration = Duration::from_millis(200);

/// The time limits of a frame.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Allowance for any frame (its latency), on top of its bytes at `min_rate`.
    pub frame_timeout: Duration,
    /// Slowest transfer accepted, in bytes per second: below it a peer is cut off.
    pub min_rate: u64,
}

impl Timing {
    /// When a frame (or reply) of `bytes` bytes started now must be complete.
    pub fn deadline(&self, bytes: u64) -> Instant {
        self.after(Instant::now(), bytes)
    }

    /// The frame timeout plus `bytes` at the minimum rate, from `start`.
    fn after(&self, start: Instant, bytes: u64) -> Instant {
        let secs = bytes as f64 / self.min_rate.max(1) as f64;
        start + self.frame_timeout + Duration::from_secs_f64(secs.min(1e9))
    }
}

/// The bytes of a frame moved so far in one direction, since its first one. A frame keeps pace
/// while they, at the minimum rate, cover all but the frame timeout of the time since its start:
/// it falls behind at `Timing::after(start, bytes)`. Without this a peer could announce a huge
/// frame (a PUT payload far beyond the values it will send) and then send nothing until the
/// deadline of the size it announced, holding its buffers for years.
#[derive(Debug, Clone, Copy)]
struct Pace {
    start: Instant,
    bytes: u64,
}

impl Pace {
    fn new() -> Pace {
        Pace {
            start: Instant::now(),
            bytes: 0,
        }
    }
}

/// Why a read did not fill its buffer.
#[derive(Debug)]
pub enum ReadEnd {
    /// End of stream between frames, or the server is shutting down.
    Closed,
    /// No frame started before the idle deadline (an unauthenticated connection's handshake).
    Idle,
    /// A started frame missed its deadline.
    Stalled,
    Io(io::Error),
}

pub struct FrameIo<T: Transport> {
    t: T,
    shutdown: Arc<AtomicBool>,
    pub timing: Timing,
    /// The request being read, from its first header byte on.
    read: Pace,
}

impl<T: Transport> FrameIo<T> {
    pub fn new(t: T, shutdown: Arc<AtomicBool>, timing: Timing) -> FrameIo<T> {
        FrameIo {
            t,
            shutdown,
            timing,
            read: Pace::new(),
        }
    }

    pub fn transport(&self) -> &T {
        &self.t
    }

    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.t
    }

    /// Waits for the next frame's header until shutdown or `idle_until`; once its first byte
    /// arrived, the rest must follow within the frame timeout (and by `idle_until`).
    pub fn next_header(
        &mut self,
        idle_until: Option<Instant>,
    ) -> Result<[u8; HEADER_LEN], ReadEnd> {
        let mut hb = [0u8; HEADER_LEN];
        let first = loop {
            if self.shutdown.load(Ordering::Relaxed) {
                return Err(ReadEnd::Closed);
            }
            let wait = match idle_until {
                Some(t) => match t.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left.min(POLL),
                    _ => return Err(ReadEnd::Idle),
                },
                None => POLL,
            };
            match self.t.read(&mut hb, wait) {
                Ok(0) => return Err(ReadEnd::Closed),
                Ok(n) => {
                    self.read = Pace {
                        start: Instant::now(),
                        bytes: n as u64,
                    };
                    break n;
                }
                Err(e) if waiting(&e) => {}
                Err(e) => return Err(ReadEnd::Io(e)),
            }
        };
        // Before authentication the handshake deadline bounds the whole frame, not only its
        // first byte: a peer trickling its HELLO would otherwise hold on for the frame timeout.
        let deadline = self.timing.deadline(HEADER_LEN as u64);
        let deadline = idle_until.map_or(deadline, |t| deadline.min(t));
        self.read_exact(&mut hb[first..], deadline, |_| {})
            .map_err(|e| match e {
                ReadEnd::Stalled if idle_until.is_some_and(|t| t <= Instant::now()) => {
                    ReadEnd::Idle
                }
                e => e,
            })?;
        Ok(hb)
    }

    /// The earlier of `deadline` and the moment the request being read falls behind its pace
    /// if no byte of it moves: the longest the server may wait on its behalf (for buffer
    /// memory) without reading.
    pub fn keep_pace(&self, deadline: Instant) -> Instant {
        deadline.min(self.timing.after(self.read.start, self.read.bytes))
    }

    /// Fills `buf` by `deadline`, keeping the request's pace, handing each piece to `seen` as it
    /// lands.
    pub fn read_exact(
        &mut self,
        buf: &mut [u8],
        deadline: Instant,
        mut seen: impl FnMut(&[u8]),
    ) -> Result<(), ReadEnd> {
        let mut done = 0;
        while done < buf.len() {
            let left = self
                .keep_pace(deadline)
                .saturating_duration_since(Instant::now());
            let end = buf.len().min(done + READ_PIECE);
            match self.t.read(&mut buf[done..end], left) {
                Ok(0) => {
                    return Err(ReadEnd::Io(io::ErrorKind::UnexpectedEof.into()));
                }
                Ok(n) => {
                    self.read.bytes += n as u64;
                    seen(&buf[done..done + n]);
                    done += n;
                }
                // Behind, and nothing waiting either. Bytes already here are read however late
                // the server comes to them: its own delays (a busy machine) are not the peer's.
                Err(e) if waiting(&e) && left.is_zero() => return Err(ReadEnd::Stalled),
                Err(e) if waiting(&e) => {}
                Err(e) => return Err(ReadEnd::Io(e)),
            }
        }
        Ok(())
    }

    /// A writer whose writes fail with TimedOut once `deadline` passed or the bytes written
    /// fall behind their pace.
    pub fn writer(&mut self, deadline: Instant) -> DeadlineWriter<'_, T> {
        DeadlineWriter {
            io: self,
            deadline,
            pace: Pace::new(),
        }
    }
}

fn waiting(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

pub struct DeadlineWriter<'a, T: Transport> {
    io: &'a mut FrameIo<T>,
    deadline: Instant,
    pace: Pace,
}

impl<T: Transport> Write for DeadlineWriter<'_, T> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, parts: &[IoSlice<'_>]) -> io::Result<usize> {
        loop {
            let until = (self.io.timing).after(self.pace.start, self.pace.bytes);
            let left = self
                .deadline
                .min(until)
                .saturating_duration_since(Instant::now());
            // As for reads: room the peer made is used however late the server comes to it.
            match self.io.t.write_vectored(parts, left) {
                Err(e) if waiting(&e) && left.is_zero() => {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "reply stalled"));
                }
                Err(e) if waiting(&e) => {}
                Ok(n) => {
                    self.pace.bytes += n as u64;
                    return Ok(n);
                }
                r => return r,
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// A transport whose reads return scripted pieces, each after a delay on a fake clock:
    /// a piece that would arrive after the wait reports a timeout.
    struct Script {
        pieces: VecDeque<(Duration, Vec<u8>)>,
    }

    impl Transport for Script {
        fn read(&mut self, buf: &mut [u8], wait: Duration) -> io::Result<usize> {
            let Some((delay, data)) = self.pieces.front_mut() else {
                return Ok(0);
            };
            if *delay > wait {
                *delay -= wait;
                std::thread::sleep(wait.min(Duration::from_millis(5)));
                return Err(io::ErrorKind::WouldBlock.into());
            }
            std::thread::sleep(*delay);
            let n = buf.len().min(data.len());
            buf[..n].copy_from_slice(&data[..n]);
            data.drain(..n);
            if data.is_empty() {
                self.pieces.pop_front();
            }
            Ok(n)
        }
        fn write_vectored(&mut self, _: &[IoSlice<'_>], _: Duration) -> io::Result<usize> {
            Err(io::ErrorKind::WouldBlock.into())
        }
        fn peer(&self) -> String {
            "script".into()
        }
        fn closer(&self) -> io::Result<crate::limits::Closer> {
            Ok(Box::new(|| {}))
        }
    }

    fn io(pieces: Vec<(u64, Vec<u8>)>, timing: Timing) -> FrameIo<Script> {
        let pieces = pieces
            .into_iter()
            .map(|(ms, d)| (Duration::from_millis(ms), d))
            .collect();
        FrameIo::new(Script { pieces }, Arc::default(), timing)
    }

    const FAST: Timing = Timing {
        frame_timeout: Duration::from_millis(100),
        min_rate: 1 << 20,
    };

    #[test]
    fn a_silent_peer_is_idle_at_the_handshake_deadline() {
        let mut f = io(vec![(60_000, vec![1; 32])], FAST);
        let t = Instant::now();
        let r = f.next_header(Some(Instant::now() + Duration::from_millis(50)));
        assert!(matches!(r, Err(ReadEnd::Idle)), "{r:?}");
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_frame_that_stops_halfway_stalls_and_one_that_keeps_pace_does_not() {
        let mut f = io(vec![(0, vec![1; 10]), (60_000, vec![1; 22])], FAST);
        assert!(matches!(f.next_header(None), Err(ReadEnd::Stalled)));
        let mut f = io(vec![(0, vec![1; 10]), (20, vec![1; 22])], FAST);
        assert!(f.next_header(None).is_ok());
    }

    #[test]
    fn the_deadline_grows_with_the_frame_at_the_minimum_rate() {
        let t = Timing {
            frame_timeout: Duration::from_secs(1),
            min_rate: 1 << 20,
        };
        let d = t.deadline(4 << 20) - Instant::now();
        assert!(
            d > Duration::from_millis(4900) && d <= Duration::from_secs(5),
            "{d:?}"
        );
    }

    #[test]
    fn a_frame_announced_large_that_stops_is_cut_off_at_its_pace_not_its_size() {
        let mut f = io(vec![(0, vec![1; 32]), (60_000, vec![1; 1])], FAST);
        assert!(f.next_header(None).is_ok());
        // Announced: 1 GiB, due in about 17 minutes at 1 MiB/s; sent: nothing more.
        let deadline = FAST.deadline(1 << 30);
        let t = Instant::now();
        let r = f.read_exact(&mut [0u8; 4096], deadline, |_| {});
        assert!(matches!(r, Err(ReadEnd::Stalled)), "{r:?}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(f.keep_pace(deadline) < deadline);
    }

    #[test]
    fn bytes_already_here_are_read_however_late_the_server_comes_to_them() {
        let mut f = io(vec![(0, vec![1; 32]), (0, vec![2; 64])], FAST);
        assert!(f.next_header(None).is_ok());
        // The server was busy past the request's pace (a loaded machine); the peer was not.
        std::thread::sleep(FAST.frame_timeout * 2);
        let mut body = [0u8; 64];
        let r = f.read_exact(&mut body, FAST.deadline(64), |_| {});
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(body, [2; 64]);
    }

    #[test]
    fn a_reply_nobody_takes_times_out_at_its_pace_not_its_size() {
        let mut f = io(vec![], FAST);
        let t = Instant::now();
        let e = f.writer(FAST.deadline(1 << 30)).write(b"x").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[test]
    fn writes_past_the_deadline_time_out() {
        let mut f = io(vec![], FAST);
        let e = f
            .writer(Instant::now() + Duration::from_millis(20))
            .write(b"x")
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    }
}
