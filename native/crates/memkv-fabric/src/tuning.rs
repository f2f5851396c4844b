//! The memory an RDMA endpoint costs in libfabric's `ofi_rxm` layer (`tcp;ofi_rxm`,
//! `verbs;ofi_rxm`), cut to what memkv's endpoints use.
//!
//! memkv's endpoints only run RMA: the server reads and writes the client's registered memory,
//! and every message (requests, replies, statuses) goes over the TCP control connection. rxm
//! sizes its buffers for messaging instead: libfabric 1.17 gives each endpoint pools of 16-KiB
//! bounce buffers in chunks of 1,024, all zeroed at allocation (16.5 MiB per chunk), and over
//! tcp it preposts 4,096 of them to a shared receive context at `fi_enable`: about 85 MiB of
//! resident memory per endpoint, per connection in the server and in the client. RMA moves no
//! byte through those buffers: rxm hands `fi_read`/`fi_write` to the core provider with the
//! caller's registered memory and uses a transmit buffer only as the operation's context (read
//! in rxm_rma.c, 1.17 and 2.x); only `fi_inject_write` and messages copy through them, and memkv
//! uses neither.
//!
//! rxm reads its sizes from environment variables once, when libfabric initialises, and offers
//! no call to set them, so memkv sets the ones below where the user has not, makes libfabric
//! initialise, and removes them again (`apply`): the settings hold for this process's libfabric
//! and are not inherited by child processes. The per-endpoint receive queue is set on the
//! `fi_info` the endpoints are opened with instead (`RX_SIZE`), which touches nothing else.
//! Only rxm reads these names: efa, shm and the other providers are unaffected.

/// rxm's process-wide sizes memkv sets where the environment does not: (variable, value).
pub const RXM_TUNING: [Setting; 2] = [
    // Bounce-buffer bytes (default 16384): RMA copies nothing through them; rxm also makes it
    // the inject and eager-message limit, which memkv does not use.
    ("FI_OFI_RXM_BUFFER_SIZE", "256"),
    // Receive buffers preposted per endpoint (default 4096 over tcp, 128 elsewhere): RMA
    // consumes none.
    ("FI_OFI_RXM_MSG_RX_SIZE", "16"),
];

/// The variable of rxm's buffer size, and its default (libfabric 1.17 and 2.x).
const BUFFER_SIZE_VAR: &str = "FI_OFI_RXM_BUFFER_SIZE";
const RXM_DEFAULT_BUFFER_SIZE: &str = "16384";

/// The variable whose setting, when the user made one, keeps `RX_SIZE` off the endpoints.
pub const RX_SIZE_VAR: &str = "FI_OFI_RXM_RX_SIZE";

/// Entries of an rxm endpoint's receive queues (default 2048 per queue, each entry a few
/// hundred bytes): memkv posts no receive.
pub const RX_SIZE: usize = 16;

/// A variable memkv sets, and its value.
pub type Setting = (&'static str, &'static str);
/// A variable of `RXM_TUNING` the user set, and the user's value.
pub type UserSetting = (&'static str, String);

/// What memkv's tuning did in this process: the variables it set (and removed after libfabric
/// read them), those the user's settings kept, or why it did nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tuning {
    Applied {
        set: Vec<Setting>,
        users: Vec<UserSetting>,
    },
    Skipped(String),
}

impl Tuning {
    /// rxm's buffer size in this process, as its variable was (or would be) read: memkv's
    /// value, the user's, or rxm's default. Where memkv did not initialise libfabric it cannot
    /// know what was read, and takes the environment as it is now.
    pub fn rxm_buffer_size(&self) -> String {
        let from_env =
            || std::env::var(BUFFER_SIZE_VAR).unwrap_or_else(|_| RXM_DEFAULT_BUFFER_SIZE.into());
        match self {
            Tuning::Applied { set, users } => set
                .iter()
                .find(|(k, _)| *k == BUFFER_SIZE_VAR)
                .map(|(_, v)| v.to_string())
                .or_else(|| {
                    users
                        .iter()
                        .find(|(k, _)| *k == BUFFER_SIZE_VAR)
                        .map(|(_, v)| v.clone())
                })
                .unwrap_or_else(from_env),
            Tuning::Skipped(_) => from_env(),
        }
    }
}

impl std::fmt::Display for Tuning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tuning::Applied { set, users } => {
                let set: Vec<String> = set.iter().map(|(k, v)| format!("{k}={v}")).collect();
                write!(f, "memkv set {}", set.join(" "))?;
                if set.is_empty() {
                    write!(f, "nothing")?;
                }
                if !users.is_empty() {
                    let users: Vec<String> =
                        users.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    write!(f, "; the user's {}", users.join(" "))?;
                }
                Ok(())
            }
            Tuning::Skipped(why) => write!(f, "not tuned: {why}"),
        }
    }
}

/// The variables of `RXM_TUNING` to set: those `user` finds no value for in the environment (a
/// variable set to anything, even empty, is the user's and wins); and the user's values.
pub fn to_set(user: impl Fn(&str) -> Option<String>) -> (Vec<Setting>, Vec<UserSetting>) {
    let (mut set, mut users) = (Vec::new(), Vec::new());
    for &(k, v) in &RXM_TUNING {
        match user(k) {
            Some(u) => users.push((k, u)),
            None => set.push((k, v)),
        }
    }
    (set, users)
}

/// Sets the variables `to_set` picks, runs `init` (which must make libfabric initialise: its
/// providers read their variables then, and only then), and removes them again. None when
/// `init` could not initialise libfabric (it returned false): nothing was applied.
///
/// Called once per process, before this process's first libfabric call (`Lib::load`). Setting
/// the environment races with C code reading it on other threads (glibc's `getenv` is not
/// synchronised with `setenv`); memkv does it once, at its first RDMA use, which in the server
/// is at start before it serves, and only for names nothing but rxm reads.
pub fn apply(init: impl FnOnce() -> bool) -> Option<Tuning> {
    let (set, users) = to_set(|k| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned()));
    for (k, v) in &set {
        std::env::set_var(k, v);
    }
    let initialised = init();
    for (k, _) in &set {
        std::env::remove_var(k);
    }
    initialised.then_some(Tuning::Applied { set, users })
}

/// How an endpoint of `provider` names it in RDMA_HELLO, so that two endpoints that cannot
/// reach each other are refused at once rather than stall in their first transfer: rxm accepts
/// a connection only between endpoints of one eager limit, which is its buffer size (1.17 and
/// 2.x: `Tuning::rxm_buffer_size`), and that size is this process's setting (memkv's, or the
/// user's `FI_OFI_RXM_BUFFER_SIZE`), which may differ from the peer's. rxm's default size goes
/// unnamed, as memkv named it before it set the size, so that such peers still meet. Other
/// providers are named as fi_getinfo names them.
pub fn hello_name(provider: &str, buffer_size: &str) -> String {
    if is_rxm(provider) && buffer_size != RXM_DEFAULT_BUFFER_SIZE {
        format!("{provider} with {buffer_size}-byte rxm buffers")
    } else {
        provider.to_string()
    }
}

fn is_rxm(provider: &str) -> bool {
    provider.split(';').any(|p| p == "ofi_rxm")
}

/// Whether an endpoint of `provider` (as fi_getinfo names it: `tcp;ofi_rxm`) gets `RX_SIZE`.
pub fn shrinks_rx(provider: &str, user_set: bool) -> bool {
    !user_set && is_rxm(provider)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_settings_win_and_the_rest_are_memkvs() {
        let (set, users) = to_set(|_| None);
        assert_eq!(
            set,
            [
                ("FI_OFI_RXM_BUFFER_SIZE", "256"),
                ("FI_OFI_RXM_MSG_RX_SIZE", "16")
            ]
        );
        assert!(users.is_empty());
        let t = Tuning::Applied { set, users };
        assert_eq!(t.rxm_buffer_size(), "256");
        let (set, users) = to_set(|k| (k == "FI_OFI_RXM_BUFFER_SIZE").then(|| "4096".into()));
        assert_eq!(set, [("FI_OFI_RXM_MSG_RX_SIZE", "16")]);
        assert_eq!(users, [("FI_OFI_RXM_BUFFER_SIZE", "4096".to_string())]);
        let t = Tuning::Applied { set, users };
        assert_eq!(t.rxm_buffer_size(), "4096");
        let (set, users) = to_set(|_| Some(String::new()));
        assert!(set.is_empty());
        assert_eq!(users.len(), RXM_TUNING.len());
    }

    #[test]
    fn only_rxm_endpoints_get_the_small_receive_queue() {
        assert!(shrinks_rx("tcp;ofi_rxm", false));
        assert!(shrinks_rx("verbs;ofi_rxm", false));
        assert!(!shrinks_rx("tcp;ofi_rxm", true));
        for p in ["efa", "shm", "sockets", "tcp", "verbs;ofi_rxd"] {
            assert!(!shrinks_rx(p, false), "{p}");
        }
    }

    #[test]
    fn rxm_endpoints_name_their_buffer_size_to_peers() {
        assert_eq!(
            hello_name("tcp;ofi_rxm", "256"),
            "tcp;ofi_rxm with 256-byte rxm buffers"
        );
        assert_eq!(
            hello_name("verbs;ofi_rxm", "4096"),
            "verbs;ofi_rxm with 4096-byte rxm buffers"
        );
        // rxm's default: the name a memkv that did not set the size sends.
        assert_eq!(hello_name("tcp;ofi_rxm", "16384"), "tcp;ofi_rxm");
        assert_eq!(hello_name("efa", "256"), "efa");
        assert_eq!(hello_name("shm", "256"), "shm");
    }

    #[test]
    fn the_log_line_says_what_was_set_and_kept() {
        let t = Tuning::Applied {
            set: vec![("FI_OFI_RXM_MSG_RX_SIZE", "16")],
            users: vec![("FI_OFI_RXM_BUFFER_SIZE", "4096".into())],
        };
        assert_eq!(
            t.to_string(),
            "memkv set FI_OFI_RXM_MSG_RX_SIZE=16; the user's FI_OFI_RXM_BUFFER_SIZE=4096"
        );
        let none = Tuning::Applied {
            set: vec![],
            users: vec![
                ("FI_OFI_RXM_BUFFER_SIZE", "16384".into()),
                ("FI_OFI_RXM_MSG_RX_SIZE", "4096".into()),
            ],
        };
        assert_eq!(
            none.to_string(),
            "memkv set nothing; the user's FI_OFI_RXM_BUFFER_SIZE=16384 FI_OFI_RXM_MSG_RX_SIZE=4096"
        );
    }
}
