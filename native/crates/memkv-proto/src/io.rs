//! The socket helpers both sides share: writing a frame (header, body, payload) with vectored
//! writes, reading values in pieces.

use std::io::{self, IoSlice, Read, Write};

use crate::{Header, Opcode};

/// Writes one whole frame: its header (made here from the parts' lengths), its control body and
/// its payload pieces, back to back, with as few `writev` calls as the writer allows.
pub fn write_frame(
    w: &mut impl Write,
    op: Opcode,
    request_id: u64,
    body: &[u8],
    payload: &[&[u8]],
) -> io::Result<()> {
    let plen: u64 = payload.iter().map(|p| p.len() as u64).sum();
    let hdr = Header::new(op, request_id, body.len(), plen).encode();
    let mut parts: Vec<&[u8]> = Vec::with_capacity(2 + payload.len());
    parts.push(&hdr);
    parts.push(body);
    parts.extend_from_slice(payload);
    write_all_vectored(w, &parts)
}

/// Values are read from a socket at most this many bytes per `read`. A piece lands in the core's
/// L2 cache, where the server hashes a PUT's bytes (1 MiB reads measured ~20% slower PUTs), and
/// on loopback, reads of a few hundred KiB
/// instead of one read of a whole multi-MiB value let the kernel take in the sender's queued
/// segments and send window updates sooner, so the sender rarely stalls (in alternating runs,
/// 16-64 MiB GETs at one client thread went from 100-125% to 116-157% of a TCP ceiling that
/// read whole values; the ceiling in `memkv bench` now reads in the same pieces).
pub const READ_PIECE: usize = 256 << 10;

/// `read_exact` in reads of at most `READ_PIECE`.
pub fn read_exact_in_pieces(r: &mut impl Read, buf: &mut [u8]) -> io::Result<()> {
    buf.chunks_mut(READ_PIECE).try_for_each(|p| r.read_exact(p))
}

/// `write_all` over several slices (header, body, values) with `writev`, at most IOV_MAX (1024)
/// slices per call, resuming after partial writes.
pub fn write_all_vectored(w: &mut impl Write, parts: &[&[u8]]) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = parts
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| IoSlice::new(p))
        .collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = rest.len().min(1024);
        match w.write_vectored(&rest[..n]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(k) => IoSlice::advance_slices(&mut rest, k),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that takes at most 3 bytes per call, to exercise partial writes.
    struct Trickle(Vec<u8>);

    impl Write for Trickle {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            let n = b.len().min(3);
            self.0.extend_from_slice(&b[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A reader of a fixed byte stream that records the largest read asked of it.
    struct Source {
        data: Vec<u8>,
        at: usize,
        largest_ask: usize,
    }

    impl Read for Source {
        fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
            self.largest_ask = self.largest_ask.max(b.len());
            let n = b.len().min(self.data.len() - self.at);
            b[..n].copy_from_slice(&self.data[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
    }

    #[test]
    fn reads_in_pieces_fill_the_buffer_exactly() {
        let data: Vec<u8> = (0..3 * READ_PIECE + 5)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let mut src = Source {
            data: data.clone(),
            at: 0,
            largest_ask: 0,
        };
        let mut buf = vec![0u8; data.len() - 1];
        read_exact_in_pieces(&mut src, &mut buf).unwrap();
        assert_eq!(buf[..], data[..data.len() - 1]);
        assert_eq!(src.largest_ask, READ_PIECE);
        let mut more = [0u8; 2];
        let err = read_exact_in_pieces(&mut src, &mut more).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn a_frame_is_its_header_body_and_payload_back_to_back() {
        let mut w = Trickle(Vec::new());
        write_frame(&mut w, Opcode::Put, 7, b"body", &[b"ab", b"", b"cde"]).unwrap();
        let h = Header::decode(w.0[..crate::HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!(h, Header::new(Opcode::Put, 7, 4, 5));
        assert_eq!(&w.0[crate::HEADER_LEN..], b"bodyabcde");
    }

    #[test]
    fn writes_every_part_in_order_across_partial_writes() {
        let parts: Vec<Vec<u8>> = (0..2000u32)
            .map(|i| vec![(i % 256) as u8; (i % 5) as usize])
            .collect();
        let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
        let mut w = Trickle(Vec::new());
        write_all_vectored(&mut w, &refs).unwrap();
        assert_eq!(w.0, parts.concat());
    }
}
