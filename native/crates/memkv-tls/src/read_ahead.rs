//! A read-ahead buffer beneath rustls. rustls asks its socket for at most 4 KiB a call, so a
//! 16 KiB record costs four system calls (and, on the server, four socket-timeout changes); this
//! takes up to `READ_AHEAD` bytes a call and hands them to rustls from memory.

use std::io;

/// Bytes taken from the socket a call, at most: four full records.
pub const READ_AHEAD: usize = 64 << 10;

#[derive(Default)]
pub struct ReadAhead {
    /// Allocated on first use, so a connection that never gets past its handshake costs none.
    buf: Vec<u8>,
    pos: usize,
    len: usize,
}

impl ReadAhead {
    /// Whether bytes taken from the socket wait to be read.
    pub fn pending(&self) -> bool {
        self.pos < self.len
    }

    /// Copies buffered bytes into `out`; when none are, first refills the buffer with one call
    /// of `fill` (a socket read: its errors and end of stream come back as they are).
    pub fn read(
        &mut self,
        out: &mut [u8],
        fill: impl FnOnce(&mut [u8]) -> io::Result<usize>,
    ) -> io::Result<usize> {
        if !self.pending() {
            if self.buf.is_empty() {
                self.buf = vec![0; READ_AHEAD];
            }
            self.len = fill(&mut self.buf)?;
            self.pos = 0;
        }
        let n = out.len().min(self.len - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_fill_serves_several_small_reads_and_errors_pass_through() {
        let mut r = ReadAhead::default();
        let mut fills = 0;
        let mut out = [0u8; 3];
        for want in [[0u8, 1, 2], [3, 4, 5]] {
            let n = r
                .read(&mut out, |b| {
                    fills += 1;
                    b[..6].copy_from_slice(&[0, 1, 2, 3, 4, 5]);
                    Ok(6)
                })
                .unwrap();
            assert_eq!((n, out), (3, want));
        }
        assert_eq!(fills, 1);
        assert!(!r.pending());
        let e = r
            .read(&mut out, |_| Err(io::ErrorKind::WouldBlock.into()))
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert_eq!(r.read(&mut out, |_| Ok(0)).unwrap(), 0);
    }
}
