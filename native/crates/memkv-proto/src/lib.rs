//! The memkv wire protocol: a fixed 32-byte frame header, then a control body (key tables,
//! status tables), then an optional bulk payload (values, back to back). This crate encodes and
//! decodes bytes, plus one helper (`io`) that writes a frame's parts to any `Write`; it opens no
//! sockets. `docs/protocol.md` is the prose version.

pub mod body;
pub mod fd_passing;
pub mod header;
pub mod io;
pub mod rdma;
pub mod shm;

pub use body::*;
pub use header::*;
pub use rdma::*;
pub use shm::*;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Longest key accepted, in bytes. vLLM keys are ~100-200 bytes; 1 KiB leaves room for prefixes.
pub const MAX_KEY_LEN: usize = 1024;
/// Most keys in one batch frame.
pub const MAX_BATCH: usize = 65_536;
/// Largest control body (key and status tables, stats JSON). Values travel in the payload.
pub const MAX_BODY_LEN: u32 = 16 << 20;
/// Longest lease EXISTS grants (1 h); a longer `lease_ms` is cut to it. Clients cap it alike.
pub const MAX_LEASE_MS: u64 = 3_600_000;
/// Length of the auth challenge nonce and of the HMAC-SHA256 answer.
pub const NONCE_LEN: usize = 32;

/// Invokes the macro `$then` with the wire statuses, each `doc, Name = number, "NAME";`, in
/// brackets, followed by the rest of the arguments. The list exists only here: this crate builds
/// `Status` from it, and the client builds its per-key outcome (these statuses plus outcomes
/// only a client can produce) from it, so a status added here reaches the client's enum, number
/// and name with nothing else to keep in step.
#[macro_export]
macro_rules! with_wire_statuses {
    ($then:ident $(, $($rest:tt)*)?) => {
        $then! {
            [
                /// Found / stored / sent.
                Ok = 0, "OK";
                /// Not stored (never written, evicted, deleted, or dropped after a checksum
                /// mismatch).
                NotFound = 1, "NOT_FOUND";
                /// GET: the stored value's length differs from the caller's buffer; no byte was
                /// sent.
                LengthMismatch = 2, "LENGTH_MISMATCH";
                /// PUT: the value is larger than the server accepts; or a frame the server
                /// refused as too large (the client splits batches so that this does not happen
                /// with this build's server).
                TooLarge = 3, "TOO_LARGE";
                /// PUT: no room even after eviction (everything pinned or leased).
                NoSpace = 4, "NO_SPACE";
                /// Client side: the owning server is marked down after an earlier failure (the
                /// reason is in the client's `health()` and was logged when it went down), or
                /// the connection broke for another reason.
                Unavailable = 5, "UNAVAILABLE";
                /// GET: the stored bytes failed their checksum; the value was dropped.
                Corrupt = 6, "CORRUPT";
                /// The key is empty or longer than `MAX_KEY_LEN`.
                InvalidKey = 7, "INVALID_KEY";
                /// EXISTS with a lease: found, but the lane's leased-bytes bound is reached, so
                /// no lease.
                OkNoLease = 8, "OK_NO_LEASE";
                /// PUT or GET over RDMA: the server's read or write of the client's memory
                /// failed (a descriptor the client's registration does not cover, a revoked
                /// registration, or the client's endpoint gone). PUT: nothing stored. GET: the
                /// buffer may hold part of the value.
                RemoteAccess = 9, "REMOTE_ACCESS";
                /// The key lies outside the prefix of the connection's tenant, or the request
                /// writes (PUT, DELETE) for a read-only tenant: nothing was looked up, leased,
                /// stored or removed, so the answer says nothing about the key. Only servers
                /// started with `--tenants` send it; a client older than it reads the reply as
                /// a protocol error.
                Forbidden = 10, "FORBIDDEN";
                /// PUT: the tenant's memory quota is full and none of its own values can be
                /// evicted (all leased or being sent): nothing stored, no other tenant's value
                /// touched.
                OverQuota = 11, "OVER_QUOTA";
            ]
            $($($rest)*)?
        }
    };
}

macro_rules! wire_status {
    ([$($(#[$doc:meta])* $name:ident = $num:literal, $text:literal;)*]) => {
        /// Per-key outcome carried in every batch reply.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum Status {
            $($(#[$doc])* $name = $num,)*
        }

        impl Status {
            /// Every wire status, in numeric order.
            pub const ALL: &'static [Status] = &[$(Status::$name),*];

            pub fn from_u8(v: u8) -> Option<Status> {
                match v {
                    $($num => Some(Status::$name),)*
                    _ => None,
                }
            }
        }
    };
}

with_wire_statuses!(wire_status);

impl Status {
    /// True for statuses meaning "the value is there" (EXISTS) or "the bytes arrived" (GET/PUT).
    pub fn is_ok(self) -> bool {
        matches!(self, Status::Ok | Status::OkNoLease)
    }
}

/// HMAC-SHA256(key, nonce): the answer to the server's auth challenge.
pub fn auth_mac(key: &[u8], nonce: &[u8]) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("hmac takes any key length");
    mac.update(nonce);
    mac.finalize().into_bytes().into()
}

/// Constant-time check of an auth answer.
pub fn auth_verify(key: &[u8], nonce: &[u8], answer: &[u8]) -> bool {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("hmac takes any key length");
    mac.update(nonce);
    mac.verify_slice(answer).is_ok()
}

/// Values are checksummed in chunks of this many bytes, so a server can verify a value chunk by
/// chunk just ahead of sending it (a checked chunk is still in cache when sent) and the first
/// byte of a reply waits for one small chunk's check, not the whole value's.
pub const CHECKSUM_CHUNK: usize = 256 << 10;

/// XXH3-64 (seed 0) of one chunk. twox-hash picks AVX2/SSE2/NEON at run time, so a wheel built
/// for baseline x86-64 still hashes at AVX2 speed (about 2x SSE2) where the CPU has it.
#[inline]
pub fn checksum(data: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(data)
}

/// Incremental `checksum`: the same value for the same bytes however they arrive split.
pub fn checksum_hasher() -> impl std::hash::Hasher {
    twox_hash::XxHash3_64::with_seed(0)
}

/// One checksum per `CHECKSUM_CHUNK` bytes of `data` (one for an empty value).
pub fn chunk_checksums(data: &[u8]) -> Vec<u64> {
    if data.is_empty() {
        return vec![checksum(data)];
    }
    data.chunks(CHECKSUM_CHUNK).map(checksum).collect()
}

/// Protocol violations. Each maps to an error frame code sent before the connection closes.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtoError {
    #[error("bad magic bytes {0:02x?} (not a memkv peer)")]
    BadMagic([u8; 2]),
    #[error("unsupported protocol version {0} (this side speaks {VERSION})")]
    BadVersion(u8),
    #[error("unknown opcode {0:#04x}")]
    BadOpcode(u8),
    #[error("unknown flags {0:#x}")]
    BadFlags(u32),
    #[error("control body of {0} bytes exceeds the limit of {MAX_BODY_LEN}")]
    BodyTooLarge(u32),
    #[error("malformed body: {0}")]
    Malformed(&'static str),
    #[error("batch of {0} keys exceeds the limit of {MAX_BATCH}")]
    BatchTooLarge(usize),
}

impl ProtoError {
    pub fn code(&self) -> ErrorCode {
        match self {
            ProtoError::BadMagic(_) => ErrorCode::BadMagic,
            ProtoError::BadVersion(_) => ErrorCode::BadVersion,
            ProtoError::BadOpcode(_) | ProtoError::BadFlags(_) => ErrorCode::BadOpcode,
            ProtoError::BodyTooLarge(_) | ProtoError::BatchTooLarge(_) => ErrorCode::TooLarge,
            ProtoError::Malformed(_) => ErrorCode::Malformed,
        }
    }
}

/// Codes carried by an `Opcode::Error` frame. The server closes the connection after sending one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum ErrorCode {
    BadMagic = 1,
    BadVersion = 2,
    BadOpcode = 3,
    Malformed = 4,
    TooLarge = 5,
    Unauthenticated = 6,
    AuthFailed = 7,
    ShuttingDown = 8,
    Internal = 9,
    /// A frame (request or reply) missed its deadline: the frame timeout plus its bytes at the
    /// server's minimum transfer rate; or a handshake that was not done in time.
    Stalled = 10,
    /// The server's buffer memory stayed taken by other requests until this one's deadline.
    Busy = 11,
}

impl ErrorCode {
    pub fn from_u16(v: u16) -> Option<ErrorCode> {
        use ErrorCode::*;
        Some(match v {
            1 => BadMagic,
            2 => BadVersion,
            3 => BadOpcode,
            4 => Malformed,
            5 => TooLarge,
            6 => Unauthenticated,
            7 => AuthFailed,
            8 => ShuttingDown,
            9 => Internal,
            10 => Stalled,
            11 => Busy,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Status;

    /// `from_u8` knows exactly the numbers of `ALL`, each its own status; docs/protocol.md's
    /// table lists these twelve.
    #[test]
    fn wire_status_numbers_round_trip() {
        let known: Vec<u8> = (0..=255u8)
            .filter(|&v| Status::from_u8(v).is_some())
            .collect();
        assert_eq!(known, (0..12).collect::<Vec<u8>>());
        for &s in Status::ALL {
            assert_eq!(Status::from_u8(s as u8), Some(s));
        }
        assert_eq!(Status::ALL.len(), known.len());
    }

    #[test]
    fn checksum_is_standard_xxh3_64() {
        // XXH3-64, seed 0, as computed by an independent implementation (xxhash-rust 0.8): the
        // protocol names this hash, so the SIMD path chosen at run time must agree bit for bit.
        assert_eq!(super::checksum(b""), 0x2D06_8005_38D3_94C2);
        let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(super::checksum(&big), 0x5D12_941F_4CF5_41C5);
        for piece in [1, 7, 4096, 65_537] {
            let mut h = super::checksum_hasher();
            big.chunks(piece)
                .for_each(|p| std::hash::Hasher::write(&mut h, p));
            assert_eq!(
                std::hash::Hasher::finish(&h),
                0x5D12_941F_4CF5_41C5,
                "split {piece}"
            );
        }
    }

    #[test]
    fn chunk_checksums_cover_every_byte() {
        const C: usize = super::CHECKSUM_CHUNK;
        let data: Vec<u8> = (0..(2 * C + C / 2) as u32)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let sums = super::chunk_checksums(&data);
        assert_eq!(sums.len(), 3);
        let mut other = data.clone();
        other[2 * C + 7] ^= 1;
        let o = super::chunk_checksums(&other);
        assert_eq!((o[0], o[1]), (sums[0], sums[1]));
        assert_ne!(o[2], sums[2]);
        assert_eq!(super::chunk_checksums(&[]).len(), 1);
    }
}
