//! The on-disk record: a header block (or several) naming the key, the value's length, its
//! sequence number and the value's chunk checksums (those taken at PUT, `memkv_proto::checksum`
//! per `CHECKSUM_CHUNK`), then the value padded to whole blocks. The header carries a checksum of
//! its own, so a torn or rotten header is told from a valid one at recovery; the value's chunks
//! are checked against the header's checksums on every read.
//!
//! ```text
//! 0       4     5    8         12       16          24    32           40         48
//! | MKD1 | kind | 0 | key_len | chunks | value_len | seq | header_sum | reserved | key | sums |
//! ```
//! All integers are little-endian; `header_sum` is XXH3-64 of the header with its own 8 bytes
//! left out. A tombstone (kind 2) has no value: it records that the key's older records are
//! dead, so a restart does not bring back a deleted or overwritten value.

use std::hash::Hasher;

use memkv_proto::{CHECKSUM_CHUNK, MAX_KEY_LEN};

/// The unit of direct I/O: every record starts on it and covers whole blocks, and every read
/// buffer is aligned to it (the logical block size of the devices this targets is 512 or 4096).
pub const BLOCK: u64 = 4096;

const MAGIC: [u8; 4] = *b"MKD1";
const FIXED: usize = 48;
const SUM_AT: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Value = 1,
    Tombstone = 2,
}

/// A header as read back.
#[derive(Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub key: Vec<u8>,
    pub value_len: u64,
    pub seq: u64,
    pub checksums: Vec<u64>,
}

pub fn round_up(n: u64) -> u64 {
    n.div_ceil(BLOCK) * BLOCK
}

/// Bytes of the header of a record with a key of `key_len` bytes and `chunks` checksums.
pub fn header_len(key_len: usize, chunks: usize) -> u64 {
    round_up((FIXED + key_len + 8 * chunks) as u64)
}

/// Bytes of a whole record: its header and its value, padded.
pub fn record_len(key_len: usize, chunks: usize, value_len: u64) -> u64 {
    header_len(key_len, chunks) + round_up(value_len)
}

/// Writes the header into `out` (exactly `header_len` bytes, zero padding included).
pub fn encode_header(
    out: &mut [u8],
    kind: Kind,
    key: &[u8],
    value_len: u64,
    seq: u64,
    sums: &[u64],
) {
    debug_assert_eq!(out.len() as u64, header_len(key.len(), sums.len()));
    out.fill(0);
    out[0..4].copy_from_slice(&MAGIC);
    out[4] = kind as u8;
    out[8..12].copy_from_slice(&(key.len() as u32).to_le_bytes());
    out[12..16].copy_from_slice(&(sums.len() as u32).to_le_bytes());
    out[16..24].copy_from_slice(&value_len.to_le_bytes());
    out[24..32].copy_from_slice(&seq.to_le_bytes());
    let mut at = FIXED;
    out[at..at + key.len()].copy_from_slice(key);
    at += key.len();
    for s in sums {
        out[at..at + 8].copy_from_slice(&s.to_le_bytes());
        at += 8;
    }
    let sum = header_sum(&out[..at]);
    out[SUM_AT..SUM_AT + 8].copy_from_slice(&sum.to_le_bytes());
}

fn header_sum(used: &[u8]) -> u64 {
    let mut h = memkv_proto::checksum_hasher();
    h.write(&used[..SUM_AT]);
    h.write(&used[SUM_AT + 8..]);
    h.finish()
}

fn u32_at(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// The header length the first block of a record announces; None when the block is no header
/// (never written, torn, rotten, another format) or announces impossible sizes.
pub fn announced_len(first: &[u8]) -> Option<u64> {
    if first.len() < FIXED || first[0..4] != MAGIC {
        return None;
    }
    let (key_len, chunks, value_len) = (u32_at(first, 8), u32_at(first, 12), u64_at(first, 16));
    let want_chunks = value_len.div_ceil(CHECKSUM_CHUNK as u64).max(1);
    let kind_ok = match first[4] {
        1 => chunks as u64 == want_chunks,
        2 => chunks == 0 && value_len == 0,
        _ => false,
    };
    (kind_ok && (1..=MAX_KEY_LEN).contains(&key_len)).then(|| header_len(key_len, chunks))
}

/// Parses a whole header (`announced_len` bytes); None unless its checksum matches.
pub fn decode_header(b: &[u8]) -> Option<Header> {
    let len = announced_len(b)?;
    if (b.len() as u64) < len {
        return None;
    }
    let (key_len, chunks) = (u32_at(b, 8), u32_at(b, 12));
    let used = FIXED + key_len + 8 * chunks;
    if u64_at(b, SUM_AT) != header_sum(&b[..used]) {
        return None;
    }
    let key = b[FIXED..FIXED + key_len].to_vec();
    let checksums = (0..chunks)
        .map(|i| u64_at(b, FIXED + key_len + 8 * i))
        .collect();
    Some(Header {
        kind: if b[4] == 1 {
            Kind::Value
        } else {
            Kind::Tombstone
        },
        key,
        value_len: u64_at(b, 16),
        seq: u64_at(b, 24),
        checksums,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(kind: Kind, key: &[u8], len: u64, sums: &[u64]) -> Vec<u8> {
        let mut b = vec![0xAA; header_len(key.len(), sums.len()) as usize];
        encode_header(&mut b, kind, key, len, 77, sums);
        b
    }

    #[test]
    fn headers_round_trip() {
        let sums = [1u64, 2, 3];
        let b = encoded(Kind::Value, b"key", 2 * CHECKSUM_CHUNK as u64 + 5, &sums);
        assert_eq!(b.len() as u64, BLOCK);
        assert_eq!(announced_len(&b), Some(BLOCK));
        let h = decode_header(&b).unwrap();
        assert_eq!((h.kind, &h.key[..], h.seq), (Kind::Value, &b"key"[..], 77));
        assert_eq!(h.checksums, sums);
        let t = decode_header(&encoded(Kind::Tombstone, b"key", 0, &[])).unwrap();
        assert_eq!(t.kind, Kind::Tombstone);
    }

    #[test]
    fn a_header_with_any_flipped_byte_is_refused() {
        let b = encoded(Kind::Value, b"some/key", 10, &[9]);
        for i in 0..FIXED + 8 + 8 {
            let mut c = b.clone();
            c[i] ^= 0x10;
            assert!(
                decode_header(&c).is_none(),
                "byte {i} flipped, still accepted"
            );
        }
        assert!(decode_header(&vec![0; BLOCK as usize]).is_none());
    }

    #[test]
    fn long_keys_and_many_chunks_take_more_blocks() {
        let sums = vec![5u64; 600];
        let len = 600 * CHECKSUM_CHUNK as u64;
        let b = encoded(Kind::Value, &[b'k'; 1000], len, &sums);
        assert_eq!(b.len() as u64, 2 * BLOCK);
        assert_eq!(decode_header(&b).unwrap().checksums.len(), 600);
        assert_eq!(record_len(1000, 600, len), 2 * BLOCK + len);
    }
}
