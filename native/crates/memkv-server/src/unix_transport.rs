//! The byte stream of a same-host connection: a unix socket whose reads also collect the file
//! descriptors the client passes (SCM_RIGHTS) with its SHM_REGION requests. At most
//! `MAX_QUEUED_FDS` wait to be taken; the kernel closes any beyond the room a read offers, and
//! this closes those beyond the queue's bound, so a peer cannot make the server hold descriptors.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::limits::Closer;
use crate::transport::Transport;

/// Passed descriptors held untaken at most (one SHM_REGION carries one).
const MAX_QUEUED_FDS: usize = 2;

pub struct UnixTransport {
    stream: UnixStream,
    read_wait: Option<Duration>,
    write_wait: Option<Duration>,
    fds: VecDeque<OwnedFd>,
    /// Descriptors to send with the next bytes written (`attach_fd`).
    outgoing: Vec<OwnedFd>,
}

impl UnixTransport {
    pub fn new(stream: UnixStream) -> io::Result<UnixTransport> {
        stream.set_nonblocking(false)?;
        Ok(UnixTransport {
            stream,
            read_wait: None,
            write_wait: None,
            fds: VecDeque::new(),
            outgoing: Vec::new(),
        })
    }

    /// recvmsg into `buf`, keeping the descriptors that came with the bytes.
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let sock = self.stream.as_raw_fd();
        memkv_proto::fd_passing::recv_with_fds(sock, buf, MAX_QUEUED_FDS, &mut self.fds)
    }

    /// sendmsg of `parts` with the outgoing descriptors, which go with its first byte and are
    /// closed here once sent.
    fn send_with_fds(&mut self, parts: &[IoSlice<'_>]) -> io::Result<usize> {
        let fds: Vec<libc::c_int> = self.outgoing.iter().map(|f| f.as_raw_fd()).collect();
        let n = memkv_proto::fd_passing::send_with_fds(self.stream.as_raw_fd(), parts, &fds)?;
        self.outgoing.clear();
        Ok(n)
    }
}

/// A zero timeout means "block forever" to the socket API; the smallest real one stands in.
fn nonzero(d: Duration) -> Duration {
    d.max(Duration::from_millis(1))
}

impl Transport for UnixTransport {
    fn read(&mut self, buf: &mut [u8], wait: Duration) -> io::Result<usize> {
        let wait = nonzero(wait);
        if self.read_wait != Some(wait) {
            self.stream.set_read_timeout(Some(wait))?;
            self.read_wait = Some(wait);
        }
        self.recv(buf)
    }

    fn write_vectored(&mut self, parts: &[IoSlice<'_>], wait: Duration) -> io::Result<usize> {
        let wait = nonzero(wait);
        if self.write_wait != Some(wait) {
            self.stream.set_write_timeout(Some(wait))?;
            self.write_wait = Some(wait);
        }
        if self.outgoing.is_empty() {
            self.stream.write_vectored(parts)
        } else {
            self.send_with_fds(parts)
        }
    }

    /// The peer process, by its credentials (a unix socket has no address).
    fn peer(&self) -> String {
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        let mut len = size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `cred`.
        let r = unsafe {
            libc::getsockopt(
                self.stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                std::ptr::from_mut(&mut cred).cast(),
                &mut len,
            )
        };
        if r == 0 {
            format!("unix:pid={},uid={}", cred.pid, cred.uid)
        } else {
            "unix".into()
        }
    }

    fn closer(&self) -> io::Result<Closer> {
        let s = self.stream.try_clone()?;
        Ok(Box::new(move || {
            let _ = s.shutdown(Shutdown::Both);
        }))
    }

    fn take_fd(&mut self) -> Option<OwnedFd> {
        self.fds.pop_front()
    }

    fn attach_fd(&mut self, fd: OwnedFd) -> io::Result<()> {
        self.outgoing.push(fd);
        Ok(())
    }
}
