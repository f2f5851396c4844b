//! A lane of a few fixed-size values and the commands the lane tests run on it.

use std::time::Duration;

use memkv_proto::Status;

use super::index::index_charge;
use super::{Lane, Pinned};

/// Values in these tests are V bytes under 2-byte keys.
pub const V: u64 = 4096;

/// A lane that holds exactly `n` values of V bytes, index charges included.
pub fn lane(n: u64, max_pinned_fraction: f64) -> Lane {
    let bytes = n * (V + index_charge(2, V)) + 63;
    Lane::new(bytes as usize, max_pinned_fraction).unwrap()
}

pub fn put_len(l: &Lane, k: &str, len: u64) -> Status {
    match l.reserve(k.len(), len) {
        Ok(mut r) => {
            r.bytes_mut().fill(k.as_bytes()[0]);
            let c = memkv_proto::chunk_checksums(r.bytes_mut());
            l.commit(k.as_bytes(), r, c);
            Status::Ok
        }
        Err(s) => s,
    }
}

pub fn put(l: &Lane, k: &str) -> Status {
    put_len(l, k, V)
}

pub fn exists(l: &Lane, k: &[u8], lease: Duration) -> (Status, u64) {
    let mut out = [(Status::InvalidKey, 0)];
    l.exists(&[k], &[0], lease, &mut out);
    out[0]
}

pub fn has(l: &Lane, k: &str) -> bool {
    exists(l, k.as_bytes(), Duration::ZERO).0 == Status::Ok
}

pub fn fetch<'a>(l: &'a Lane, k: &str) -> Pinned<'a> {
    match l.fetch(k.as_bytes()) {
        Ok(Some(p)) => p,
        _ => panic!("{k} not served"),
    }
}
