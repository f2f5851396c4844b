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

use std::net::SocketAddr;

use crate::body::{Reader, Writer};
use crate::ProtoError;

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
