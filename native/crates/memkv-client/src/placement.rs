//! Key placement: rendezvous (highest random weight) hashing over the configured server list.
//!
//! Every client computes the same owner from the same list with no coordination; adding a server
//! moves only the keys the new server wins (about 1/N), and removing one moves only its own keys.

use std::net::{Ipv4Addr, Ipv6Addr};

use twox_hash::XxHash3_64;

/// Validates one `host:port` (`[v6addr]:port` for IPv6) and returns its canonical spelling:
/// lower-case host names without a trailing dot, dotted-quad IPv4, compressed IPv6 in
/// brackets, a port without leading zeros. Placement hashes these names, so every process that
/// lists the same servers places keys alike however each spelled them. The Python config
/// validates addresses with this same function.
pub fn canonical_server(text: &str) -> Result<String, String> {
    let s = text.trim();
    if s.is_empty() {
        return Err("empty server address".into());
    }
    let (host, port_text) = if let Some(rest) = s.strip_prefix('[') {
        let Some((h, p)) = rest
            .split_once(']')
            .and_then(|(h, p)| Some((h, p.strip_prefix(':')?)))
        else {
            return Err(format!("server '{s}' must look like '[v6addr]:port'"));
        };
        let addr: Ipv6Addr = h
            .parse()
            .map_err(|_| format!("server '{s}': '{h}' is not an IPv6 address"))?;
        (format!("[{}]", compressed_v6(&addr)), p)
    } else {
        let colons = s.matches(':').count();
        if colons != 1 {
            let hint = if colons > 1 {
                " (write IPv6 addresses as '[addr]:port')"
            } else {
                ""
            };
            return Err(format!("server '{s}' must look like 'host:port'{hint}"));
        }
        let (h, p) = s.split_once(':').expect("one colon");
        let host = match h.parse::<Ipv4Addr>() {
            Ok(a) => a.to_string(),
            Err(_) if host_name_ok(h) => h.trim_end_matches('.').to_ascii_lowercase(),
            Err(_) => return Err(format!("server '{s}': '{h}' is not a valid host name")),
        };
        (host, p)
    };
    let port = (1..=5)
        .contains(&port_text.len())
        .then_some(port_text)
        .filter(|p| p.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|p| p.parse::<u32>().ok())
        .filter(|p| (1..=65535).contains(p))
        .ok_or_else(|| format!("server '{s}': port must be an integer in 1..65535"))?;
    Ok(format!("{host}:{port}"))
}

/// An RFC 1123 host name (labels of letters, digits and inner hyphens, at most 63 bytes each,
/// 253 in all, one optional trailing dot), with underscores allowed as resolvers accept them
/// and container runtimes hand them out; all-numeric names (a mistyped IPv4) are refused.
fn host_name_ok(h: &str) -> bool {
    let ok_end = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let label_ok = |l: &str| {
        let b = l.as_bytes();
        (1..=63).contains(&b.len())
            && ok_end(b[0])
            && ok_end(b[b.len() - 1])
            && b.iter().all(|&c| ok_end(c) || c == b'-')
    };
    (1..=253).contains(&h.len())
        && h.strip_suffix('.').unwrap_or(h).split('.').all(label_ok)
        && !h.bytes().all(|b| b.is_ascii_digit() || b == b'.')
}

/// RFC 5952 text of an IPv6 address, as Python's `ipaddress` writes it: lower-case hextets
/// without leading zeros, the longest run of two or more zero hextets (the first on a tie)
/// written `::`, and no dotted-quad tail (Rust's `Display` writes `::ffff:1.2.3.4`).
fn compressed_v6(a: &Ipv6Addr) -> String {
    let h = a.segments();
    let (mut best, mut run) = ((0usize, 0usize), (0usize, 0usize));
    for (i, &x) in h.iter().enumerate() {
        if x == 0 {
            run = if run.1 == 0 {
                (i, 1)
            } else {
                (run.0, run.1 + 1)
            };
            if run.1 > best.1 {
                best = run;
            }
        } else {
            run = (0, 0);
        }
    }
    let hex = |r: &[u16]| {
        r.iter()
            .map(|x| format!("{x:x}"))
            .collect::<Vec<_>>()
            .join(":")
    };
    if best.1 < 2 {
        return hex(&h);
    }
    format!("{}::{}", hex(&h[..best.0]), hex(&h[best.0 + best.1..]))
}

/// Index of the server in `servers` that owns `key`. Servers are identified by their address
/// string, so the order of the list does not matter.
pub fn rendezvous<S: AsRef<str>>(key: &[u8], servers: &[S]) -> usize {
    Placement::new(servers).owner(key)
}

/// `rendezvous` over one server list, with each server's hash computed once instead of once per
/// key, and no hashing at all for a single server.
pub struct Placement {
    seeds: Vec<u64>,
}

impl Placement {
    pub fn new<S: AsRef<str>>(servers: &[S]) -> Placement {
        let seeds = servers
            .iter()
            .map(|s| XxHash3_64::oneshot(s.as_ref().as_bytes()))
            .collect();
        Placement { seeds }
    }

    /// Index of the server that owns `key`.
    pub fn owner(&self, key: &[u8]) -> usize {
        if self.seeds.len() == 1 {
            return 0;
        }
        let mut best = (0u64, 0usize);
        for (i, &seed) in self.seeds.iter().enumerate() {
            let score = XxHash3_64::oneshot_with_seed(seed, key);
            if i == 0 || score > best.0 {
                best = (score, i);
            }
        }
        best.1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_spellings() {
        for (text, canon) in [
            ("127.0.0.1:7390", "127.0.0.1:7390"),
            ("LocalHost:65535", "localhost:65535"),
            ("host.example.:80", "host.example:80"),
            ("[0:0:0:0:0:0:0:1]:07390", "[::1]:7390"),
            ("[FE80::1]:9", "[fe80::1]:9"),
            ("[::]:1", "[::]:1"),
            ("[1:0:0:2:0:0:0:3]:1", "[1:0:0:2::3]:1"),
            ("[1:0:0:2:0:0:3:4]:1", "[1::2:0:0:3:4]:1"),
            ("[1:2:3:4:5:6:7:0]:1", "[1:2:3:4:5:6:7:0]:1"),
            ("[::ffff:1.2.3.4]:1", "[::ffff:102:304]:1"),
            ("  a-b.c:12  ", "a-b.c:12"),
            ("memkv_server_1:7390", "memkv_server_1:7390"),
        ] {
            assert_eq!(canonical_server(text).as_deref(), Ok(canon), "{text}");
        }
        for bad in [
            "",
            "host",
            "host:",
            ":80",
            "host:0",
            "host:65536",
            "host:+80",
            "host:123456",
            "::1:80",
            "[::1]",
            "[::1]80",
            "[::1:80",
            "[zz::1]:80",
            "[127.0.0.1]:80",
            "a b:80",
            "-host:80",
            "host-:80",
            "1.2.3:80",
            "256.1.1.1:80",
            "01.2.3.4:80",
            "a..b:80",
            "http://h:80",
            "h:80/x",
        ] {
            assert!(canonical_server(bad).is_err(), "{bad:?} accepted");
        }
    }

    /// Clients of different versions share servers, so placement must never change: these
    /// owners are what every earlier version computed.
    #[test]
    fn owners_are_those_of_earlier_versions() {
        let s = [
            "10.0.0.1:7390",
            "10.0.0.2:7390",
            "10.0.0.3:7390",
            "[::1]:7390",
            "host-a:1",
        ];
        let owners = |n: usize| -> Vec<usize> {
            let p = Placement::new(&s[..n]);
            (0..24)
                .map(|i| p.owner(format!("key/{i}").as_bytes()))
                .collect()
        };
        assert_eq!(
            owners(5),
            [1, 1, 3, 4, 0, 0, 0, 2, 1, 3, 1, 1, 2, 0, 2, 1, 0, 3, 4, 1, 1, 1, 4, 1]
        );
        assert_eq!(
            owners(2),
            [1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1]
        );
        assert_eq!(owners(1), [0; 24]);
        assert_eq!(rendezvous(b"key/3", &s), 4);
    }

    #[test]
    fn stable_balanced_and_minimal_movement() {
        let three = ["10.0.0.1:7390", "10.0.0.2:7390", "10.0.0.3:7390"];
        let four = [
            "10.0.0.1:7390",
            "10.0.0.2:7390",
            "10.0.0.3:7390",
            "10.0.0.4:7390",
        ];
        let n = 30_000;
        let mut counts = [0usize; 3];
        let mut moved = 0;
        for i in 0..n {
            let k = format!("model/abc/{i:08}.bin");
            let a = rendezvous(k.as_bytes(), &three);
            counts[a] += 1;
            let b = rendezvous(k.as_bytes(), &four);
            if b != a {
                assert_eq!(b, 3, "a key may only move to the new server");
                moved += 1;
            }
        }
        for c in counts {
            assert!(
                (c as f64 - n as f64 / 3.0).abs() < n as f64 * 0.03,
                "{counts:?}"
            );
        }
        assert!(
            (moved as f64 - n as f64 / 4.0).abs() < n as f64 * 0.03,
            "moved {moved}"
        );
    }
}
