//! What happened to one key: the server's per-key status, or why the client has none.
//!
//! Numbers 0..=9 are the wire statuses (`memkv_proto::Status`) with the same meaning and value;
//! 16 and up are outcomes only the client can produce. The gap leaves room for new wire statuses.

use std::fmt;

/// Per-key outcome of a client operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Status {
    Ok = 0,
    /// Not stored (never written, evicted, deleted, or dropped after a checksum mismatch).
    NotFound = 1,
    /// GET: the stored value's length differs from the caller's buffer; no byte was sent.
    LengthMismatch = 2,
    /// PUT: the value is larger than the server accepts; or a frame the server refused as too
    /// large (the client splits batches so that this does not happen with this build's server).
    TooLarge = 3,
    /// PUT: no room even after eviction (everything pinned or leased).
    NoSpace = 4,
    /// The owning server is marked down after an earlier failure (the reason is in `health()`
    /// and was logged when it went down), or the connection broke for another reason.
    Unavailable = 5,
    /// GET: the stored bytes failed their checksum; the value was dropped.
    Corrupt = 6,
    /// The key is empty or longer than `MAX_KEY_LEN`.
    InvalidKey = 7,
    /// EXISTS with a lease: found, but the lane's leased-bytes bound is reached, so no lease.
    OkNoLease = 8,
    /// PUT or GET over RDMA: the server's read or write of this key's buffer failed (its
    /// registration was revoked or does not cover it, or our endpoint went away). PUT: not
    /// stored. GET: the buffer may hold part of the value.
    RemoteAccess = 9,
    /// The operation's deadline (`op_timeout`) passed before this key's answer arrived.
    Timeout = 16,
    /// The server refused the TCP connection (nothing listens on the address).
    Refused = 17,
    /// The server requires an auth key and ours is missing or wrong.
    AuthFailed = 18,
    /// The server sent bytes that are not a valid reply (or reported our request malformed).
    ProtocolError = 19,
}

impl Status {
    /// Every status, in numeric order.
    pub const ALL: [Status; 14] = [
        Status::Ok,
        Status::NotFound,
        Status::LengthMismatch,
        Status::TooLarge,
        Status::NoSpace,
        Status::Unavailable,
        Status::Corrupt,
        Status::InvalidKey,
        Status::OkNoLease,
        Status::RemoteAccess,
        Status::Timeout,
        Status::Refused,
        Status::AuthFailed,
        Status::ProtocolError,
    ];

    /// True for statuses meaning "the value is there" (EXISTS) or "the bytes arrived" (GET/PUT).
    pub fn is_ok(self) -> bool {
        matches!(self, Status::Ok | Status::OkNoLease)
    }

    /// The upper-case name used in logs, `health()` and the Python `Status` enum.
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "OK",
            Status::NotFound => "NOT_FOUND",
            Status::LengthMismatch => "LENGTH_MISMATCH",
            Status::TooLarge => "TOO_LARGE",
            Status::NoSpace => "NO_SPACE",
            Status::Unavailable => "UNAVAILABLE",
            Status::Corrupt => "CORRUPT",
            Status::InvalidKey => "INVALID_KEY",
            Status::OkNoLease => "OK_NO_LEASE",
            Status::RemoteAccess => "REMOTE_ACCESS",
            Status::Timeout => "TIMEOUT",
            Status::Refused => "REFUSED",
            Status::AuthFailed => "AUTH_FAILED",
            Status::ProtocolError => "PROTOCOL_ERROR",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl From<memkv_proto::Status> for Status {
    fn from(s: memkv_proto::Status) -> Status {
        use memkv_proto::Status as W;
        match s {
            W::Ok => Status::Ok,
            W::NotFound => Status::NotFound,
            W::LengthMismatch => Status::LengthMismatch,
            W::TooLarge => Status::TooLarge,
            W::NoSpace => Status::NoSpace,
            W::Unavailable => Status::Unavailable,
            W::Corrupt => Status::Corrupt,
            W::InvalidKey => Status::InvalidKey,
            W::OkNoLease => Status::OkNoLease,
            W::RemoteAccess => Status::RemoteAccess,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_statuses_keep_their_numbers() {
        for v in 0..=255u8 {
            if let Some(w) = memkv_proto::Status::from_u8(v) {
                assert_eq!(Status::from(w) as u8, v);
            }
        }
        let nums: Vec<u8> = Status::ALL.iter().map(|s| *s as u8).collect();
        assert_eq!(nums, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 18, 19]);
    }
}
