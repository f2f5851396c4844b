//! Helpers the integration tests share: one value in and out of a client, blocking.

use memkv_client::{Buf, Client, Status};

pub fn put(c: &Client, key: &[u8], val: &[u8]) -> Status {
    // SAFETY: `val` outlives the blocking call.
    unsafe { c.put(&[key.to_vec()], &[Buf::of(val)])[0] }
}

pub fn get(c: &Client, key: &[u8], len: usize) -> (Status, Vec<u8>) {
    let mut v = vec![0u8; len];
    let b = Buf::of_mut(&mut v);
    // SAFETY: `v` outlives the blocking call and is not touched meanwhile.
    let s = unsafe { c.get(&[key.to_vec()], &[b])[0] };
    (s, v)
}
