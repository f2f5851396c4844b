//! File descriptors passed over a unix socket with the bytes of a frame (SCM_RIGHTS): the one
//! piece of socket code both ends share, since the same-host path passes descriptors both ways
//! (a client's regions to the server, a server's value memory to a client).

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Most descriptors `recv_with_fds` takes from one read.
pub const MAX_FDS_PER_READ: usize = 4;

/// sendmsg of `parts` on `sock` with `fds` attached to its first byte. The descriptors stay
/// the caller's (the kernel duplicates them into the message).
pub fn send_with_fds(sock: RawFd, parts: &[IoSlice<'_>], fds: &[RawFd]) -> io::Result<usize> {
    let data_len = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(data_len) } as usize;
    let mut cmsg = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = parts.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = parts.len();
    msg.msg_control = cmsg.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: the control buffer has room for one header and `fds`; IoSlice is ABI-compatible
    // with iovec; all buffers live for the call.
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
        libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL)
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// recvmsg on `sock` into `buf`, pushing the descriptors that came with the bytes onto `into`
/// while it holds fewer than `keep` (at most `MAX_FDS_PER_READ`); any others are closed, so a
/// peer cannot make the reader hold descriptors.
pub fn recv_with_fds(
    sock: RawFd,
    buf: &mut [u8],
    keep: usize,
    into: &mut VecDeque<OwnedFd>,
) -> io::Result<usize> {
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
    // SAFETY: CMSG_SPACE only computes a size; four descriptors fit the 64-byte buffer.
    msg.msg_controllen =
        unsafe { libc::CMSG_SPACE((MAX_FDS_PER_READ * size_of::<libc::c_int>()) as u32) } as usize;
    // SAFETY: msg points at `iov` (over `buf`) and `cmsg`, both live for the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the CMSG_* walk stays inside the control buffer the kernel filled.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                let count = ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / size_of::<libc::c_int>();
                for i in 0..count {
                    let fd = OwnedFd::from_raw_fd(data.add(i).read_unaligned());
                    if into.len() < keep.min(MAX_FDS_PER_READ) {
                        into.push_back(fd);
                    } // else dropped: closed
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(n as usize)
}
