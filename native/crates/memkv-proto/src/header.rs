//! The fixed 32-byte frame header that starts every request and reply.
//!
//! ```text
//! 0      2        3        4       8            16         20         24            32
//! | "MK" | version| opcode | flags | request_id | body_len | reserved | payload_len |
//! ```
//! All integers are little-endian. `body_len` counts the control body that follows the header;
//! `payload_len` counts the bulk bytes after the body (PUT values, GET reply values).
//! `reserved` must be zero in version 1. The flags `FLAG_RDMA` and `FLAG_SHM` (at most one of
//! them) mark a PUT or GET whose body carries descriptors of the client's memory instead of
//! values moving in the payload.

use crate::{ProtoError, MAX_BODY_LEN};

pub const MAGIC: [u8; 2] = *b"MK";
pub const VERSION: u8 = 1;
pub const HEADER_LEN: usize = 32;
/// Reply opcodes are the request opcode with this bit set.
pub const REPLY_BIT: u8 = 0x80;
/// PUT or GET over RDMA: each key's table entry carries a descriptor of the client's memory
/// (`crate::Descriptor`) and no value travels in the payload; the server reads (PUT) or writes
/// (GET) the client's memory itself before it replies.
pub const FLAG_RDMA: u32 = 1;
/// PUT or GET over shared memory: as `FLAG_RDMA`, with descriptors naming the client's memory
/// regions announced by SHM_REGION on this connection (`crate::shm`).
pub const FLAG_SHM: u32 = 2;
/// Flags understood by version 1.
pub const KNOWN_FLAGS: u32 = FLAG_RDMA | FLAG_SHM;
/// The flags whose PUT and GET frames carry descriptors and no payload.
pub const ONE_SIDED_FLAGS: u32 = FLAG_RDMA | FLAG_SHM;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    Hello = 0x01,
    Auth = 0x02,
    Ping = 0x03,
    Exists = 0x04,
    Put = 0x05,
    Get = 0x06,
    Delete = 0x07,
    Stats = 0x08,
    RdmaHello = 0x09,
    ShmRegion = 0x0A,
    ShmValues = 0x0B,
    GetMapped = 0x0C,
    ShmRelease = 0x0D,
    HelloReply = 0x81,
    AuthReply = 0x82,
    Pong = 0x83,
    ExistsReply = 0x84,
    PutReply = 0x85,
    GetReply = 0x86,
    DeleteReply = 0x87,
    StatsReply = 0x88,
    RdmaHelloReply = 0x89,
    ShmRegionReply = 0x8A,
    ShmValuesReply = 0x8B,
    GetMappedReply = 0x8C,
    ShmReleaseReply = 0x8D,
    Error = 0xFF,
}

impl Opcode {
    pub fn from_u8(v: u8) -> Option<Opcode> {
        use Opcode::*;
        Some(match v {
            0x01 => Hello,
            0x02 => Auth,
            0x03 => Ping,
            0x04 => Exists,
            0x05 => Put,
            0x06 => Get,
            0x07 => Delete,
            0x08 => Stats,
            0x09 => RdmaHello,
            0x0A => ShmRegion,
            0x0B => ShmValues,
            0x0C => GetMapped,
            0x0D => ShmRelease,
            0x81 => HelloReply,
            0x82 => AuthReply,
            0x83 => Pong,
            0x84 => ExistsReply,
            0x85 => PutReply,
            0x86 => GetReply,
            0x87 => DeleteReply,
            0x88 => StatsReply,
            0x89 => RdmaHelloReply,
            0x8A => ShmRegionReply,
            0x8B => ShmValuesReply,
            0x8C => GetMappedReply,
            0x8D => ShmReleaseReply,
            0xFF => Error,
            _ => return None,
        })
    }

    /// The reply opcode for a request opcode.
    pub fn reply(self) -> Opcode {
        Opcode::from_u8(self as u8 | REPLY_BIT).unwrap_or(Opcode::Error)
    }

    /// Only PUT requests and GET replies carry a bulk payload.
    pub fn has_payload(self) -> bool {
        matches!(self, Opcode::Put | Opcode::GetReply)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub opcode: Opcode,
    pub flags: u32,
    pub request_id: u64,
    pub body_len: u32,
    pub payload_len: u64,
}

impl Header {
    pub fn new(opcode: Opcode, request_id: u64, body_len: usize, payload_len: u64) -> Header {
        Header {
            opcode,
            flags: 0,
            request_id,
            body_len: body_len as u32,
            payload_len,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC);
        b[2] = VERSION;
        b[3] = self.opcode as u8;
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.body_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Decodes and validates a header. Any error means the peer is not speaking our protocol
    /// (or a version of it we cannot read), so the connection cannot be resynchronised.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, ProtoError> {
        let magic = [b[0], b[1]];
        if magic != MAGIC {
            return Err(ProtoError::BadMagic(magic));
        }
        if b[2] != VERSION {
            return Err(ProtoError::BadVersion(b[2]));
        }
        let opcode = Opcode::from_u8(b[3]).ok_or(ProtoError::BadOpcode(b[3]))?;
        let flags = u32::from_le_bytes(b[4..8].try_into().unwrap());
        if flags & !KNOWN_FLAGS != 0 {
            return Err(ProtoError::BadFlags(flags));
        }
        let request_id = u64::from_le_bytes(b[8..16].try_into().unwrap());
        let body_len = u32::from_le_bytes(b[16..20].try_into().unwrap());
        if body_len > MAX_BODY_LEN {
            return Err(ProtoError::BodyTooLarge(body_len));
        }
        if b[20..24] != [0, 0, 0, 0] {
            return Err(ProtoError::Malformed("reserved header bytes are not zero"));
        }
        let payload_len = u64::from_le_bytes(b[24..32].try_into().unwrap());
        if payload_len != 0 && (!opcode.has_payload() || flags & ONE_SIDED_FLAGS != 0) {
            return Err(ProtoError::Malformed(
                "payload on an opcode that takes none",
            ));
        }
        if flags == ONE_SIDED_FLAGS
            || (flags & ONE_SIDED_FLAGS != 0
                && !matches!(opcode, Opcode::Put | Opcode::Get | Opcode::GetReply))
        {
            return Err(ProtoError::BadFlags(flags));
        }
        Ok(Header {
            opcode,
            flags,
            request_id,
            body_len,
            payload_len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let h = Header::new(Opcode::Put, 42, 100, 1 << 30);
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn rejects_foreign_bytes() {
        let mut b = Header::new(Opcode::Ping, 1, 0, 0).encode();
        b[0] = b'G';
        assert!(matches!(Header::decode(&b), Err(ProtoError::BadMagic(_))));
        let mut b = Header::new(Opcode::Ping, 1, 0, 0).encode();
        b[2] = 9;
        assert_eq!(Header::decode(&b), Err(ProtoError::BadVersion(9)));
        let b = Header::new(Opcode::Ping, 1, 0, 5).encode();
        assert!(
            Header::decode(&b).is_err(),
            "payload on PING must be refused"
        );
        let b = Header::new(Opcode::Get, 1, (MAX_BODY_LEN + 1) as usize, 0).encode();
        assert!(matches!(
            Header::decode(&b),
            Err(ProtoError::BodyTooLarge(_))
        ));
    }

    #[test]
    fn the_one_sided_flags_fit_put_and_get_only_and_forbid_a_payload() {
        for flag in [FLAG_RDMA, FLAG_SHM] {
            let mut h = Header::new(Opcode::Get, 3, 10, 0);
            h.flags = flag;
            assert_eq!(Header::decode(&h.encode()).unwrap(), h);
            h.opcode = Opcode::Exists;
            assert_eq!(Header::decode(&h.encode()), Err(ProtoError::BadFlags(flag)));
            let mut p = Header::new(Opcode::Put, 3, 10, 5);
            p.flags = flag;
            assert!(
                Header::decode(&p.encode()).is_err(),
                "values travel one-sidedly, not inline"
            );
        }
        let mut both = Header::new(Opcode::Put, 3, 10, 0);
        both.flags = FLAG_RDMA | FLAG_SHM;
        assert_eq!(
            Header::decode(&both.encode()),
            Err(ProtoError::BadFlags(FLAG_RDMA | FLAG_SHM))
        );
        let mut b = Header::new(Opcode::Put, 3, 10, 0);
        b.flags = 4;
        assert_eq!(Header::decode(&b.encode()), Err(ProtoError::BadFlags(4)));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), HEADER_LEN)) {
            let arr: [u8; HEADER_LEN] = bytes.try_into().unwrap();
            if let Ok(h) = Header::decode(&arr) {
                prop_assert_eq!(h.encode(), arr);
            }
        }
    }
}
