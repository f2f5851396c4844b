//! Bodies and names of the shared-memory data path (a client on the server's host, over a unix
//! socket): the SHM_REGION request that hands the server one of the client's memory regions,
//! and the abstract socket name a server listening on a TCP address serves it under.
//!
//! ```text
//! SHM_REGION request: id u32, len u64, file_offset u64; with len > 0 the frame carries one
//!                     file descriptor (SCM_RIGHTS) of the memory the region lies in, which
//!                     the server maps [file_offset, file_offset + len) of; len 0 forgets id.
//! SHM_REGION reply:   accepted u8 (1 yes, 0 no), UTF-8 reason when not (RDMA_HELLO's form)
//! PUT/GET + FLAG_SHM: the descriptor table of FLAG_RDMA, each descriptor naming
//!                     (len, offset in the region, region id)
//! ```
//!
//! Mapped reads, from a server started with `--shm-share-values` (its value memory is one
//! sealed memfd per lane, and a GPU can copy straight out of it):
//!
//! ```text
//! SHM_VALUES request:  lane u32
//! SHM_VALUES reply:    accepted u8, lanes u32, len u64, UTF-8 reason when not accepted; when
//!                      accepted the frame carries a read-only descriptor of that lane's memory
//! GET_MAPPED request:  the GET key table (count u32, count x (klen u16, key, expected_len u64))
//! GET_MAPPED reply:    pin u64, count u32, count x (status u8, value_len u64, lane u32,
//!                      offset u64): where each Ok value lies in its lane's memory; the values
//!                      stay there, unmoved, until SHM_RELEASE of `pin` or the connection's
//!                      end, and are verified meanwhile
//! SHM_RELEASE request: pin u64
//! SHM_RELEASE reply:   answer u8: 1 the pin set was held until now and every value matched
//!                      its checksums, 2 a value did not (it is dropped), 0 unknown pin (or no
//!                      verdict by the deadline): only 1 makes the client's copies count
//! ```

use std::net::SocketAddr;

use crate::body::{Reader, Writer};
use crate::{ProtoError, Status};

pub use crate::rdma::{
    decode_rdma_hello_reply as decode_shm_region_reply,
    encode_rdma_hello_reply as encode_shm_region_reply,
};

/// One SHM_REGION request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmRegion {
    pub id: u32,
    /// Bytes of the region; 0 forgets the region `id`.
    pub len: u64,
    /// Where the region starts in the file the descriptor names.
    pub file_offset: u64,
}

pub fn encode_shm_region(r: &ShmRegion) -> Vec<u8> {
    let mut w = Writer::with_capacity(20);
    w.u32(r.id).u64(r.len).u64(r.file_offset);
    w.0
}

pub fn decode_shm_region(body: &[u8]) -> Result<ShmRegion, ProtoError> {
    let mut r = Reader::new(body);
    let region = ShmRegion {
        id: r.u32()?,
        len: r.u64()?,
        file_offset: r.u64()?,
    };
    r.finish()?;
    Ok(region)
}

/// A SHM_VALUES reply: the server's lane count and the length of the lane asked for, or why
/// its value memory is not shared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmValuesReply {
    pub lanes: u32,
    pub len: u64,
    /// None: accepted (the frame carries the lane's descriptor).
    pub refused: Option<String>,
}

pub fn encode_shm_values(lane: u32) -> Vec<u8> {
    lane.to_le_bytes().to_vec()
}

pub fn decode_shm_values(body: &[u8]) -> Result<u32, ProtoError> {
    let mut r = Reader::new(body);
    let lane = r.u32()?;
    r.finish()?;
    Ok(lane)
}

pub fn encode_shm_values_reply(rep: &ShmValuesReply) -> Vec<u8> {
    let why = rep.refused.as_deref().unwrap_or("");
    let mut w = Writer::with_capacity(13 + why.len());
    w.u8(rep.refused.is_none() as u8)
        .u32(rep.lanes)
        .u64(rep.len)
        .bytes(why.as_bytes());
    w.0
}

pub fn decode_shm_values_reply(body: &[u8]) -> Result<ShmValuesReply, ProtoError> {
    let mut r = Reader::new(body);
    let accepted = r.u8()? != 0;
    let lanes = r.u32()?;
    let len = r.u64()?;
    let why = String::from_utf8_lossy(r.rest()).into_owned();
    Ok(ShmValuesReply {
        lanes,
        len,
        refused: (!accepted).then_some(why),
    })
}

/// Where one key of a GET_MAPPED reply lies: its status and length as in a GET reply, and for
/// an Ok value its lane and offset in that lane's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MappedValue {
    pub status: Status,
    pub len: u64,
    pub lane: u32,
    pub offset: u64,
}

pub fn encode_get_mapped_reply(pin: u64, values: &[MappedValue]) -> Vec<u8> {
    let mut w = Writer::with_capacity(12 + 21 * values.len());
    w.u64(pin).u32(values.len() as u32);
    for v in values {
        w.u8(v.status as u8).u64(v.len).u32(v.lane).u64(v.offset);
    }
    w.0
}

/// The pin and the values of a GET_MAPPED reply to a request of `expected` keys.
pub fn decode_get_mapped_reply(
    body: &[u8],
    expected: usize,
) -> Result<(u64, Vec<MappedValue>), ProtoError> {
    let mut r = Reader::new(body);
    let pin = r.u64()?;
    if r.count()? != expected {
        return Err(ProtoError::Malformed(
            "reply count differs from request count",
        ));
    }
    let values = (0..expected)
        .map(|_| {
            let status =
                Status::from_u8(r.u8()?).ok_or(ProtoError::Malformed("unknown status byte"))?;
            Ok(MappedValue {
                status,
                len: r.u64()?,
                lane: r.u32()?,
                offset: r.u64()?,
            })
        })
        .collect::<Result<Vec<_>, ProtoError>>()?;
    r.finish()?;
    Ok((pin, values))
}

pub fn encode_shm_release(pin: u64) -> Vec<u8> {
    pin.to_le_bytes().to_vec()
}

pub fn decode_shm_release(body: &[u8]) -> Result<u64, ProtoError> {
    let mut r = Reader::new(body);
    let pin = r.u64()?;
    r.finish()?;
    Ok(pin)
}

/// The abstract unix socket name (without its leading NUL) of the shared-memory path of a
/// server listening on `listen`: `memkv/IP:PORT`, with `*` for an unspecified address.
pub fn shm_socket_name(listen: SocketAddr) -> String {
    if listen.ip().is_unspecified() {
        format!("memkv/*:{}", listen.port())
    } else {
        format!("memkv/{listen}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_read_bodies_round_trip() {
        let rep = ShmValuesReply {
            lanes: 4,
            len: 1 << 30,
            refused: None,
        };
        assert_eq!(
            decode_shm_values_reply(&encode_shm_values_reply(&rep)).unwrap(),
            rep
        );
        let no = ShmValuesReply {
            refused: Some("off".into()),
            ..rep
        };
        assert_eq!(
            decode_shm_values_reply(&encode_shm_values_reply(&no)).unwrap(),
            no
        );
        assert_eq!(decode_shm_values(&encode_shm_values(3)).unwrap(), 3);
        let vals = [
            MappedValue {
                status: Status::Ok,
                len: 100,
                lane: 2,
                offset: 4096,
            },
            MappedValue {
                status: Status::NotFound,
                len: 0,
                lane: 0,
                offset: 0,
            },
        ];
        let body = encode_get_mapped_reply(9, &vals);
        assert_eq!(
            decode_get_mapped_reply(&body, 2).unwrap(),
            (9, vals.to_vec())
        );
        assert!(decode_get_mapped_reply(&body, 1).is_err());
        assert!(decode_get_mapped_reply(&body[..body.len() - 1], 2).is_err());
        assert_eq!(decode_shm_release(&encode_shm_release(7)).unwrap(), 7);
    }

    #[test]
    fn region_round_trip_and_names() {
        let r = ShmRegion {
            id: 7,
            len: 1 << 30,
            file_offset: 4096,
        };
        assert_eq!(decode_shm_region(&encode_shm_region(&r)).unwrap(), r);
        assert!(decode_shm_region(&encode_shm_region(&r)[..19]).is_err());
        assert_eq!(
            shm_socket_name("127.0.0.1:7390".parse().unwrap()),
            "memkv/127.0.0.1:7390"
        );
        assert_eq!(
            shm_socket_name("[::]:7390".parse().unwrap()),
            "memkv/*:7390"
        );
        assert_eq!(
            shm_socket_name("[::1]:7390".parse().unwrap()),
            "memkv/[::1]:7390"
        );
    }
}
