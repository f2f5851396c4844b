//! Key placement: rendezvous (highest random weight) hashing over the configured server list.
//!
//! Every client computes the same owner from the same list with no coordination; adding a server
//! moves only the keys the new server wins (about 1/N), and removing one moves only its own keys.

use twox_hash::XxHash3_64;

/// Index of the server in `servers` that owns `key`. Servers are identified by their address
/// string, so the order of the list does not matter.
pub fn rendezvous<S: AsRef<str>>(key: &[u8], servers: &[S]) -> usize {
    let mut best = (0u64, 0usize);
    for (i, s) in servers.iter().enumerate() {
        let score = XxHash3_64::oneshot_with_seed(XxHash3_64::oneshot(s.as_ref().as_bytes()), key);
        if i == 0 || score > best.0 {
            best = (score, i);
        }
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;

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
