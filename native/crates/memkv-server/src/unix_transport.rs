//! The byte stream of a same-host connection: a unix socket whose reads also collect the file
//! descriptors the client passes (SCM_RIGHTS) with its SHM_REGION requests. At most
//! `MAX_QUEUED_FDS` wait to be taken; the kernel closes any beyond the room a read offers, and
//! this closes those beyond the queue's bound, so a peer cannot make the server hold descriptors.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
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
        // Room for MAX_QUEUED_FDS descriptors (the kernel closes any that do not fit).
        let mut cmsg = [0u64; 8];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: msghdr is plain data; zeroed is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE only computes a size.
        msg.msg_controllen =
            unsafe { libc::CMSG_SPACE((MAX_QUEUED_FDS * size_of::<libc::c_int>()) as u32) }
                as usize;
        // SAFETY: msg points at `iov` (over `buf`) and `cmsg`, both live for the call.
        let n = unsafe { libc::recvmsg(self.stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the CMSG_* walk stays inside the control buffer the kernel filled.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                    let count =
                        ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / size_of::<libc::c_int>();
                    for i in 0..count {
                        let fd = OwnedFd::from_raw_fd(data.add(i).read_unaligned());
                        if self.fds.len() < MAX_QUEUED_FDS {
                            self.fds.push_back(fd);
                        } // else dropped: closed
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        Ok(n as usize)
    }
}

impl UnixTransport {
    /// sendmsg of `parts` with the outgoing descriptors (SCM_RIGHTS), which go with its first
    /// byte and are closed here once sent.
    fn send_with_fds(&mut self, parts: &[IoSlice<'_>]) -> io::Result<usize> {
        let fds: Vec<libc::c_int> = self.outgoing.iter().map(|f| f.as_raw_fd()).collect();
        let data_len = std::mem::size_of_val(&fds[..]) as u32;
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE(data_len) } as usize;
        let mut cmsg = vec![0u64; space.div_ceil(8)];
        // SAFETY: msghdr is plain data; zeroed is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = parts.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = parts.len();
        msg.msg_control = cmsg.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: the control buffer has room for one header and `fds`; IoSlice is
        // ABI-compatible with iovec; all buffers live for the call.
        let n = unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(data_len) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(c).cast::<libc::c_int>(),
                fds.len(),
            );
            libc::sendmsg(self.stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        self.outgoing.clear();
        Ok(n as usize)
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
