//! rustls's record layer alone, on one core and in memory: what TLS adds per byte to a stream
//! beside the socket's own work. `memkv bench --tls` prints it next to TLS and plaintext, and the
//! share of plaintext it leaves a TLS stream at best.
//!
//! Why it bounds that share: each end of a TLS stream does what a plaintext end does (the socket
//! copies, memkv's frames and checksums) plus its half of the record layer, on the same thread.
//! A plaintext stream of `P` GB/s whose ends each keep a core busy therefore becomes, over TLS,
//! at most `1 / (1/P + 1/R)` GB/s, where `R` is the slower half's rate here: a share of
//! `1 / (1 + P/R)`, and 80% needs `R >= 4 P`.
//!
//! `cipher_rate` times AES-128-GCM alone (ring, the provider's own code), in place on 16 KiB
//! records: the most a record layer that never copies could reach, and so the bound on any
//! TLS stream of this design, rustls's or one of memkv's own.

use std::io::{ErrorKind, Read, Write};
use std::time::{Duration, Instant};

use crate::ephemeral::Pki;
use crate::{ClientTls, ClientTlsFiles, ServerTls, ServerTlsFiles, SEND_BUFFER};

/// Both halves of the record layer, GB/s (1e9 B/s) of plaintext.
#[derive(Debug, Clone)]
pub struct RecordRate {
    /// The suite the handshake agreed on (the one memkv's links use on this CPU).
    pub suite: String,
    /// Plaintext into records: what a sender's rustls does per write (copy, encrypt).
    pub seal_gbps: f64,
    /// Records back into the reader's buffer: what a receiver's rustls does (decrypt, copies).
    pub open_gbps: f64,
}

impl RecordRate {
    /// The best share of a plaintext stream of `plain_gbps` (per stream) that a TLS stream can
    /// reach when each end adds this record layer on its own thread (the module's formula).
    pub fn best_share(&self, plain_gbps: f64) -> f64 {
        1.0 / (1.0 + plain_gbps / self.seal_gbps.min(self.open_gbps))
    }
}

fn other(e: impl std::fmt::Display) -> String {
    format!("record layer rate: {e}")
}

/// One write's worth of plaintext that is not all one byte.
fn plaintext() -> Vec<u8> {
    (0..SEND_BUFFER).map(|i| (i * 131 % 251) as u8).collect()
}

/// GB/s (1e9 B/s) of `bytes` moved in `d`.
fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9
}

/// AES-128-GCM alone on one core, sealing and opening 16 KiB records in place (GB/s of
/// plaintext): `(seal, open)` over `volume` bytes (at least one buffer).
pub fn cipher_rate(volume: usize) -> Result<(f64, f64), String> {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM};
    const RECORD: usize = 16 << 10;
    let key = LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &[7u8; 16]).map_err(other)?);
    let nonce = |seq: u64| {
        let mut n = [0u8; 12];
        n[4..].copy_from_slice(&seq.to_be_bytes());
        Nonce::assume_unique_for_key(n)
    };
    let mut buf = plaintext();
    let mut tags = Vec::with_capacity(SEND_BUFFER / RECORD);
    let (mut seal, mut open) = (Duration::ZERO, Duration::ZERO);
    let (mut moved, mut seq) = (0, 0u64);
    while moved == 0 || moved < volume {
        tags.clear();
        let t = Instant::now();
        for (i, rec) in buf.chunks_mut(RECORD).enumerate() {
            let tag = key
                .seal_in_place_separate_tag(nonce(seq + i as u64), Aad::from([0x17u8; 5]), rec)
                .map_err(other)?;
            tags.push(tag);
        }
        seal += t.elapsed();
        let t = Instant::now();
        for (i, rec) in buf.chunks_mut(RECORD).enumerate() {
            key.open_in_place_separate_tag(
                nonce(seq + i as u64),
                Aad::from([0x17u8; 5]),
                tags[i],
                rec,
                0..,
            )
            .map_err(|_| other("a record failed to open"))?;
        }
        open += t.elapsed();
        seq += tags.len() as u64;
        moved += buf.len();
    }
    Ok((gbps(moved, seal), gbps(moved, open)))
}

/// Moves `volume` bytes (at least one write) from a client connection to a server connection
/// of memkv's own configuration, through memory, in writes of `SEND_BUFFER` as the transports
/// hand rustls, and times each half.
pub fn record_layer_rate(volume: usize) -> Result<RecordRate, String> {
    let pki = Pki::new();
    let s = pki.server("server");
    let server = ServerTls::new(&ServerTlsFiles {
        cert: s.cert,
        key: s.key,
        client_ca: None,
    })?;
    let client = ClientTls::new(&ClientTlsFiles {
        ca: pki.ca(),
        server_name: None,
        cert: None,
        key: None,
    })?;
    let mut c = client.connection("localhost")?;
    let mut sv = server.connection().map_err(other)?;
    while c.is_handshaking() || sv.is_handshaking() {
        let mut wire = Vec::new();
        c.write_tls(&mut wire).map_err(other)?;
        sv.read_tls(&mut &wire[..]).map_err(other)?;
        sv.process_new_packets().map_err(other)?;
        wire.clear();
        sv.write_tls(&mut wire).map_err(other)?;
        c.read_tls(&mut &wire[..]).map_err(other)?;
        c.process_new_packets().map_err(other)?;
    }
    let suite = c
        .negotiated_cipher_suite()
        .map(|s| format!("{:?}", s.suite()))
        .unwrap_or_default();
    let plain = plaintext();
    let mut dest = vec![0u8; SEND_BUFFER];
    let mut wire = Vec::with_capacity(SEND_BUFFER + SEND_BUFFER / 64);
    let (mut seal, mut open) = (Duration::ZERO, Duration::ZERO);
    let mut moved = 0;
    while moved == 0 || moved < volume {
        wire.clear();
        let t = Instant::now();
        let mut put = 0;
        while put < plain.len() {
            put += c.writer().write(&plain[put..]).map_err(other)?;
            while c.wants_write() {
                c.write_tls(&mut wire).map_err(other)?;
            }
        }
        seal += t.elapsed();
        let t = Instant::now();
        let mut rd = &wire[..];
        let mut got = 0;
        while got < dest.len() {
            match sv.reader().read(&mut dest[got..]) {
                Ok(n) => got += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock && !rd.is_empty() => {
                    sv.read_tls(&mut rd).map_err(other)?;
                    sv.process_new_packets().map_err(other)?;
                }
                Err(e) => return Err(other(e)),
            }
        }
        open += t.elapsed();
        if dest != plain {
            return Err(other("the plaintext came back changed"));
        }
        moved += plain.len();
    }
    Ok(RecordRate {
        suite,
        seal_gbps: gbps(moved, seal),
        open_gbps: gbps(moved, open),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_layer_moves_the_bytes_and_bounds_the_share() {
        let r = record_layer_rate(4 << 20).unwrap();
        assert!(r.suite.starts_with("TLS13_"), "{}", r.suite);
        assert!(r.seal_gbps > 0.0 && r.open_gbps > 0.0);
        let slow = r.seal_gbps.min(r.open_gbps);
        // A plaintext stream as fast as the slower half leaves TLS half of it; 4x slower, 80%.
        assert!((r.best_share(slow) - 0.5).abs() < 1e-9);
        assert!((r.best_share(slow / 4.0) - 0.8).abs() < 1e-9);
    }

    #[test]
    fn the_cipher_alone_opens_what_it_sealed() {
        let (seal, open) = cipher_rate(1 << 20).unwrap();
        assert!(seal > 0.0 && open > 0.0);
    }
}
