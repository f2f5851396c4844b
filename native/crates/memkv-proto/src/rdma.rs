//! Bodies of the RDMA data path: the RDMA_HELLO exchange and the descriptor tables of PUT and
//! GET frames flagged `FLAG_RDMA`.
//!
//! ```text
//! RDMA_HELLO request: plen u8, provider [plen], alen u16, the client endpoint's address [alen]
//! RDMA_HELLO reply:   accepted u8 (1 yes, 0 no), UTF-8 reason when not
//! PUT/GET + FLAG_RDMA: count u32, count x (klen u16, key, value_len u64, addr u64, rkey u64)
//! ```

use crate::body::{Reader, Writer};
use crate::ProtoError;

type Result<T> = std::result::Result<T, ProtoError>;

/// Where one value sits in the client's registered memory: the address as the client's fabric
/// provider wants it in a remote operation, and the registration's remote key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub len: u64,
    pub addr: u64,
    pub rkey: u64,
}

/// Longest fabric address the RDMA_HELLO carries (a sockaddr_in6 is 28 bytes, an EFA address 32).
pub const MAX_FABRIC_ADDR: usize = 256;

pub fn encode_rdma_hello(provider: &str, addr: &[u8]) -> Vec<u8> {
    let mut w = Writer::with_capacity(3 + provider.len() + addr.len());
    w.u8(provider.len() as u8)
        .bytes(&provider.as_bytes()[..provider.len().min(255)])
        .u16(addr.len() as u16)
        .bytes(addr);
    w.0
}

/// The provider name and the client's address.
pub fn decode_rdma_hello(body: &[u8]) -> Result<(&str, &[u8])> {
    let mut r = Reader::new(body);
    let plen = r.u8()? as usize;
    let prov = std::str::from_utf8(r.take(plen)?)
        .map_err(|_| ProtoError::Malformed("provider name is not UTF-8"))?;
    let alen = r.u16()? as usize;
    if alen == 0 || alen > MAX_FABRIC_ADDR {
        return Err(ProtoError::Malformed("fabric address length out of range"));
    }
    let addr = r.take(alen)?;
    r.finish()?;
    Ok((prov, addr))
}

pub fn encode_rdma_hello_reply(accepted: bool, reason: &str) -> Vec<u8> {
    let mut w = Writer::with_capacity(1 + reason.len());
    w.u8(accepted as u8).bytes(reason.as_bytes());
    w.0
}

/// Whether the server accepted, and its reason when it did not.
pub fn decode_rdma_hello_reply(body: &[u8]) -> Result<(bool, String)> {
    let mut r = Reader::new(body);
    let ok = r.u8()? != 0;
    Ok((ok, String::from_utf8_lossy(r.rest()).into_owned()))
}

pub fn encode_descriptors<K: AsRef<[u8]>>(keys: &[K], descs: &[Descriptor]) -> Vec<u8> {
    assert_eq!(keys.len(), descs.len());
    let mut w =
        Writer::with_capacity(4 + keys.iter().map(|k| 26 + k.as_ref().len()).sum::<usize>());
    w.u32(keys.len() as u32);
    for (k, d) in keys.iter().zip(descs) {
        w.key(k.as_ref()).u64(d.len).u64(d.addr).u64(d.rkey);
    }
    w.0
}

pub fn decode_descriptors(body: &[u8]) -> Result<Vec<(&[u8], Descriptor)>> {
    let mut r = Reader::new(body);
    let n = r.count()?;
    let v = (0..n)
        .map(|_| {
            let key = r.key()?;
            let d = Descriptor {
                len: r.u64()?,
                addr: r.u64()?,
                rkey: r.u64()?,
            };
            Ok((key, d))
        })
        .collect::<Result<Vec<_>>>()?;
    r.finish()?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_round_trip_and_reject_garbage() {
        let b = encode_rdma_hello("tcp;ofi_rxm", &[1, 2, 3]);
        assert_eq!(
            decode_rdma_hello(&b).unwrap(),
            ("tcp;ofi_rxm", &[1u8, 2, 3][..])
        );
        assert!(decode_rdma_hello(&encode_rdma_hello("x", &[])).is_err());
        assert!(decode_rdma_hello(&b[..b.len() - 1]).is_err());
        let d = Descriptor {
            len: 5,
            addr: 0xdead_beef,
            rkey: 7,
        };
        let t = encode_descriptors(&[b"k".as_slice()], &[d]);
        assert_eq!(decode_descriptors(&t).unwrap(), vec![(&b"k"[..], d)]);
        assert!(decode_descriptors(&t[..t.len() - 1]).is_err());
        let r = encode_rdma_hello_reply(false, "off");
        assert_eq!(decode_rdma_hello_reply(&r).unwrap(), (false, "off".into()));
    }
}
