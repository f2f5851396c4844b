//! What happened to one key: the server's per-key status, or why the client has none.
//!
//! Numbers below 16 are the wire statuses (`memkv_proto::Status`), built here from the protocol
//! crate's own list (`memkv_proto::with_wire_statuses`) so that they cannot drift apart; 16 and
//! up are outcomes only the client can produce (the compiler refuses a number used twice). The gap
//! leaves room for new wire statuses.

use std::fmt;

macro_rules! client_status {
    (
        [$($(#[$wdoc:meta])* $wire:ident = $wnum:literal, $wname:literal;)*]
        $($(#[$cdoc:meta])* $own:ident = $cnum:literal, $cname:literal;)*
    ) => {
        /// Per-key outcome of a client operation.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum Status {
            $($(#[$wdoc])* $wire = $wnum,)*
            $($(#[$cdoc])* $own = $cnum,)*
        }

        impl Status {
            /// Every status, in numeric order.
            pub const ALL: &'static [Status] = &[$(Status::$wire,)* $(Status::$own,)*];

            /// The upper-case name used in logs, `health()` and the Python `Status` enum.
            pub fn name(self) -> &'static str {
                match self {
                    $(Status::$wire => $wname,)*
                    $(Status::$own => $cname,)*
                }
            }
        }

        impl From<memkv_proto::Status> for Status {
            fn from(s: memkv_proto::Status) -> Status {
                match s {
                    $(memkv_proto::Status::$wire => Status::$wire,)*
                }
            }
        }
    };
}

memkv_proto::with_wire_statuses!(
    client_status,
    /// The operation's deadline (`op_timeout`) passed before this key's answer arrived.
    Timeout = 16, "TIMEOUT";
    /// The server refused the TCP connection (nothing listens on the address).
    Refused = 17, "REFUSED";
    /// The server requires an auth key and ours is missing or wrong.
    AuthFailed = 18, "AUTH_FAILED";
    /// The server sent bytes that are not a valid reply (or reported our request malformed).
    ProtocolError = 19, "PROTOCOL_ERROR";
);

impl Status {
    /// True for statuses meaning "the value is there" (EXISTS) or "the bytes arrived" (GET/PUT).
    pub fn is_ok(self) -> bool {
        matches!(self, Status::Ok | Status::OkNoLease)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every wire status is a client status of the same number, and the client's own outcomes
    /// lie above the wire range.
    #[test]
    fn the_wire_statuses_are_the_clients_first_numbers() {
        let mut wire = 0;
        for v in 0..=255u8 {
            if let Some(w) = memkv_proto::Status::from_u8(v) {
                assert_eq!(Status::from(w) as u8, v);
                wire += 1;
            }
        }
        assert_eq!(wire, memkv_proto::Status::ALL.len());
        let nums: Vec<u8> = Status::ALL.iter().map(|s| *s as u8).collect();
        assert!(nums.windows(2).all(|p| p[0] < p[1]), "{nums:?}");
        assert!(nums[..wire].iter().copied().eq(0..wire as u8), "{nums:?}");
        assert!(nums[wire..].iter().all(|&n| n >= 16), "{nums:?}");
        assert_eq!(Status::ALL.len(), wire + 4);
        assert_eq!(Status::NotFound.name(), "NOT_FOUND");
        assert_eq!(Status::ProtocolError.to_string(), "PROTOCOL_ERROR");
    }
}
