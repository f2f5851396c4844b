//! Control bodies: key tables in requests, status tables in replies. All little-endian.
//!
//! | frame          | body                                                            | payload            |
//! |----------------|-----------------------------------------------------------------|--------------------|
//! | HELLO          | (empty)                                                         |                    |
//! | HELLO reply    | auth_required u8, nonce [32], max_value_len u64                 |                    |
//! | AUTH           | hmac_sha256(key, nonce) [32]                                    |                    |
//! | AUTH reply     | (empty), or with `--tenants`: `TenantInfo`                       |                    |
//! | EXISTS         | lease_ms u32, count u32, count x (klen u16, key)                |                    |
//! | EXISTS reply   | count u32, count x (status u8, value_len u64)                   |                    |
//! | PUT            | count u32, count x (klen u16, key, value_len u64)               | values, in order   |
//! | PUT reply      | count u32, count x status u8                                    |                    |
//! | GET            | count u32, count x (klen u16, key, expected_len u64)            |                    |
//! | GET reply      | count u32, count x (status u8, value_len u64)                   | values with Ok     |
//! | DELETE         | count u32, count x (klen u16, key)                              |                    |
//! | DELETE reply   | count u32, count x status u8                                    |                    |
//! | STATS reply    | UTF-8 JSON object                                               |                    |
//! | ERROR          | code u16, UTF-8 message                                         |                    |

use crate::{ErrorCode, ProtoError, Status, MAX_BATCH, MAX_KEY_LEN, NONCE_LEN};

type Result<T> = std::result::Result<T, ProtoError>;

/// Growable little-endian writer.
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    pub fn with_capacity(n: usize) -> Writer {
        Writer(Vec::with_capacity(n))
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.0.extend_from_slice(v);
        self
    }
    /// A key: u16 length then bytes. Callers validate length with `key_ok` first.
    pub fn key(&mut self, k: &[u8]) -> &mut Self {
        self.u16(k.len() as u16).bytes(k)
    }
}

/// Bounds-checked little-endian reader. Every read fails cleanly on short input.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }
    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or(ProtoError::Malformed("length overflow"))?;
        let s = self
            .buf
            .get(self.pos..end)
            .ok_or(ProtoError::Malformed("body ends early"))?;
        self.pos = end;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn key(&mut self) -> Result<&'a [u8]> {
        let n = self.u16()? as usize;
        if n == 0 || n > MAX_KEY_LEN {
            return Err(ProtoError::Malformed("key length is 0 or over the maximum"));
        }
        self.take(n)
    }
    pub fn count(&mut self) -> Result<usize> {
        let n = self.u32()? as usize;
        if n > MAX_BATCH {
            return Err(ProtoError::BatchTooLarge(n));
        }
        Ok(n)
    }
    pub fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.pos..];
        self.pos = self.buf.len();
        s
    }
    pub fn finish(&self) -> Result<()> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(ProtoError::Malformed("trailing bytes after body"))
        }
    }
}

/// True when `k` can travel as a key.
pub fn key_ok(k: &[u8]) -> bool {
    !k.is_empty() && k.len() <= MAX_KEY_LEN
}

// ---- requests -------------------------------------------------------------------------------

/// `count u32, count x (klen u16, key)` after `head` bytes of room, written in one allocation.
fn key_table<K: AsRef<[u8]>>(head: usize, keys: &[K]) -> Writer {
    let table: usize = keys.iter().map(|k| 2 + k.as_ref().len()).sum();
    let mut w = Writer::with_capacity(head + 4 + table);
    w.0.resize(head, 0);
    w.u32(keys.len() as u32);
    for k in keys {
        w.key(k.as_ref());
    }
    w
}

pub fn encode_keys<K: AsRef<[u8]>>(keys: &[K]) -> Vec<u8> {
    key_table(0, keys).0
}

pub fn encode_exists<K: AsRef<[u8]>>(lease_ms: u32, keys: &[K]) -> Vec<u8> {
    let mut w = key_table(4, keys);
    w.0[..4].copy_from_slice(&lease_ms.to_le_bytes());
    w.0
}

/// PUT and GET tables: each key with a length (value length, or the GET caller's buffer length).
pub fn encode_key_lens<K: AsRef<[u8]>>(keys: &[K], lens: &[u64]) -> Vec<u8> {
    assert_eq!(keys.len(), lens.len());
    let mut w =
        Writer::with_capacity(4 + keys.iter().map(|k| 10 + k.as_ref().len()).sum::<usize>());
    w.u32(keys.len() as u32);
    for (k, &n) in keys.iter().zip(lens) {
        w.key(k.as_ref()).u64(n);
    }
    w.0
}

pub fn decode_keys(body: &[u8]) -> Result<Vec<&[u8]>> {
    let mut r = Reader::new(body);
    let keys = read_keys(&mut r)?;
    r.finish()?;
    Ok(keys)
}

fn read_keys<'a>(r: &mut Reader<'a>) -> Result<Vec<&'a [u8]>> {
    let n = r.count()?;
    (0..n).map(|_| r.key()).collect()
}

pub fn decode_exists(body: &[u8]) -> Result<(u32, Vec<&[u8]>)> {
    let mut r = Reader::new(body);
    let lease_ms = r.u32()?;
    let keys = read_keys(&mut r)?;
    r.finish()?;
    Ok((lease_ms, keys))
}

pub fn decode_key_lens(body: &[u8]) -> Result<Vec<(&[u8], u64)>> {
    let mut r = Reader::new(body);
    let n = r.count()?;
    let v = (0..n)
        .map(|_| Ok((r.key()?, r.u64()?)))
        .collect::<Result<Vec<_>>>()?;
    r.finish()?;
    Ok(v)
}

// ---- replies --------------------------------------------------------------------------------

pub fn encode_statuses(st: &[Status]) -> Vec<u8> {
    let mut w = Writer::with_capacity(4 + st.len());
    w.u32(st.len() as u32);
    for s in st {
        w.u8(*s as u8);
    }
    w.0
}

fn read_status(r: &mut Reader<'_>) -> Result<Status> {
    Status::from_u8(r.u8()?).ok_or(ProtoError::Malformed("unknown status byte"))
}

fn check_count(r: &mut Reader<'_>, expected: usize) -> Result<()> {
    if r.count()? != expected {
        return Err(ProtoError::Malformed(
            "reply count differs from request count",
        ));
    }
    Ok(())
}

pub fn decode_statuses(body: &[u8], expected: usize) -> Result<Vec<Status>> {
    let mut r = Reader::new(body);
    check_count(&mut r, expected)?;
    let v = (0..expected)
        .map(|_| read_status(&mut r))
        .collect::<Result<Vec<_>>>()?;
    r.finish()?;
    Ok(v)
}

pub fn encode_status_lens(st: &[(Status, u64)]) -> Vec<u8> {
    let mut w = Writer::with_capacity(4 + 9 * st.len());
    w.u32(st.len() as u32);
    for (s, n) in st {
        w.u8(*s as u8).u64(*n);
    }
    w.0
}

pub fn decode_status_lens(body: &[u8], expected: usize) -> Result<Vec<(Status, u64)>> {
    let mut r = Reader::new(body);
    check_count(&mut r, expected)?;
    let v = (0..expected)
        .map(|_| Ok((read_status(&mut r)?, r.u64()?)))
        .collect::<Result<Vec<_>>>()?;
    r.finish()?;
    Ok(v)
}

/// The HELLO reply. `tenant` is a tail after `max_value_len`, sent only when the connection is
/// already authenticated by the tenant its verified client certificate names (mutual TLS) and
/// the client said in its TLS handshake that it reads it (`memkv_tls::ALPN_HELLO_TENANT`): such
/// a client sends no AUTH, so HELLO is the only reply that can tell it its tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloReply {
    pub auth_required: bool,
    pub nonce: [u8; NONCE_LEN],
    pub max_value_len: u64,
    pub tenant: Option<TenantInfo>,
}

impl HelloReply {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(1 + NONCE_LEN + 8);
        w.u8(self.auth_required as u8)
            .bytes(&self.nonce)
            .u64(self.max_value_len);
        let mut body = w.0;
        if let Some(t) = &self.tenant {
            body.extend_from_slice(&t.encode());
        }
        body
    }
    pub fn decode(body: &[u8]) -> Result<HelloReply> {
        let mut r = Reader::new(body);
        let auth_required = r.u8()? != 0;
        let nonce = r.take(NONCE_LEN)?.try_into().unwrap();
        let max_value_len = r.u64()?;
        let tenant = TenantInfo::decode(r.rest())?;
        Ok(HelloReply {
            auth_required,
            nonce,
            max_value_len,
            tenant,
        })
    }
}

/// The tenant a connection's credential named, in the AUTH reply of a server started with
/// `--tenants` (a server without tenants answers AUTH with an empty body; clients older than
/// tenants ignore the body). Body: name_len u16, name (UTF-8), prefix_len u16, prefix,
/// flags u8 (bit 0: read-only). Every key the connection names must start with `prefix`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantInfo {
    pub name: String,
    pub prefix: Vec<u8>,
    pub read_only: bool,
}

impl TenantInfo {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(5 + self.name.len() + self.prefix.len());
        w.u16(self.name.len() as u16)
            .bytes(self.name.as_bytes())
            .u16(self.prefix.len() as u16)
            .bytes(&self.prefix)
            .u8(self.read_only as u8);
        w.0
    }

    /// None for an empty body (a server without tenants).
    pub fn decode(body: &[u8]) -> Result<Option<TenantInfo>> {
        if body.is_empty() {
            return Ok(None);
        }
        let mut r = Reader::new(body);
        let n = r.u16()? as usize;
        let name = std::str::from_utf8(r.take(n)?)
            .map_err(|_| ProtoError::Malformed("tenant name is not UTF-8"))?
            .to_string();
        let n = r.u16()? as usize;
        let prefix = r.take(n)?.to_vec();
        let read_only = r.u8()? & 1 != 0;
        r.finish()?;
        Ok(Some(TenantInfo {
            name,
            prefix,
            read_only,
        }))
    }
}

pub fn encode_error(code: ErrorCode, msg: &str) -> Vec<u8> {
    let mut w = Writer::with_capacity(2 + msg.len());
    w.u16(code as u16).bytes(msg.as_bytes());
    w.0
}

/// Returns the code (None if unknown to this version) and the message.
pub fn decode_error(body: &[u8]) -> Result<(Option<ErrorCode>, String)> {
    let mut r = Reader::new(body);
    let code = ErrorCode::from_u16(r.u16()?);
    Ok((code, String::from_utf8_lossy(r.rest()).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    #[test]
    fn key_lens_round_trip() {
        let keys: Vec<&[u8]> = vec![b"a", b"model/abc/0001.bin"];
        let body = encode_key_lens(&keys, &[1, 1 << 40]);
        let got = decode_key_lens(&body).unwrap();
        assert_eq!(
            got,
            vec![(&b"a"[..], 1), (&b"model/abc/0001.bin"[..], 1 << 40)]
        );
    }

    #[test]
    fn exists_round_trip() {
        let body = encode_exists(5000, &[b"x".as_slice(), b"yy"]);
        assert_eq!(body, b"\x88\x13\0\0\x02\0\0\0\x01\0x\x02\0yy");
        assert_eq!(
            decode_exists(&body).unwrap(),
            (5000, vec![&b"x"[..], &b"yy"[..]])
        );
        let none: [&[u8]; 0] = [];
        assert_eq!(encode_exists(7, &none), [7, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            decode_exists(&encode_exists(7, &none)).unwrap(),
            (7, vec![])
        );
    }

    #[test]
    fn statuses_round_trip_and_count_check() {
        let st = [Status::Ok, Status::NotFound, Status::Corrupt];
        assert_eq!(decode_statuses(&encode_statuses(&st), 3).unwrap(), st);
        assert!(decode_statuses(&encode_statuses(&st), 2).is_err());
        let sl = [(Status::Ok, 7), (Status::LengthMismatch, 9)];
        assert_eq!(decode_status_lens(&encode_status_lens(&sl), 2).unwrap(), sl);
    }

    #[test]
    fn rejects_bad_keys_and_trailing_bytes() {
        let mut body = encode_keys(&[b"k".as_slice()]);
        body.push(0);
        assert!(decode_keys(&body).is_err());
        let mut w = Writer::default();
        w.u32(1).u16(0);
        assert!(decode_keys(&w.0).is_err(), "empty key must be refused");
        let mut w = Writer::default();
        w.u32(1)
            .u16((MAX_KEY_LEN + 1) as u16)
            .bytes(&vec![b'a'; MAX_KEY_LEN + 1]);
        assert!(decode_keys(&w.0).is_err(), "oversize key must be refused");
        let mut w = Writer::default();
        w.u32(u32::MAX);
        assert!(matches!(
            decode_keys(&w.0),
            Err(ProtoError::BatchTooLarge(_))
        ));
    }

    #[test]
    fn hello_and_error_round_trip() {
        let mut h = HelloReply {
            auth_required: true,
            nonce: [7; NONCE_LEN],
            max_value_len: 99,
            tenant: None,
        };
        let plain = h.encode();
        assert_eq!(plain.len(), 1 + NONCE_LEN + 8, "as before tenants");
        assert_eq!(HelloReply::decode(&plain).unwrap(), h);
        let t = TenantInfo {
            name: "team-a".into(),
            prefix: b"a/".to_vec(),
            read_only: true,
        };
        h.tenant = Some(t.clone());
        assert_eq!(HelloReply::decode(&h.encode()).unwrap(), h);
        assert!(HelloReply::decode(&[&plain[..], &[1]].concat()).is_err());
        assert_eq!(TenantInfo::decode(&t.encode()).unwrap(), Some(t));
        assert_eq!(TenantInfo::decode(&[]).unwrap(), None);
        assert!(TenantInfo::decode(&[1, 0]).is_err());
        let e = encode_error(ErrorCode::AuthFailed, "wrong key");
        assert_eq!(
            decode_error(&e).unwrap(),
            (Some(ErrorCode::AuthFailed), "wrong key".into())
        );
    }

    /// Arbitrary bytes never panic any decoder, and whatever decodes re-encodes to the input.
    fn check_decoders(body: &[u8]) -> std::result::Result<(), TestCaseError> {
        if let Ok(keys) = decode_keys(body) {
            prop_assert_eq!(&encode_keys(&keys)[..], body);
        }
        if let Ok(kl) = decode_key_lens(body) {
            let (k, l): (Vec<&[u8]>, Vec<u64>) = kl.into_iter().unzip();
            prop_assert_eq!(&encode_key_lens(&k, &l)[..], body);
        }
        let _ = decode_exists(body);
        let _ = decode_statuses(body, 3);
        let _ = decode_status_lens(body, 2);
        let _ = HelloReply::decode(body);
        let _ = TenantInfo::decode(body);
        let _ = decode_error(body);
        Ok(())
    }

    /// Time-bounded campaign (MEMKV_FUZZ_SECS, default 10 s) over header and body decoders.
    #[test]
    #[ignore = "time-bounded campaign; run with --include-ignored and MEMKV_FUZZ_SECS"]
    fn fuzz_campaign_decoders() {
        use proptest::test_runner::{RngAlgorithm, TestRng, TestRunner};
        let secs: u64 = std::env::var("MEMKV_FUZZ_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(10);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        let mut round = 0u64;
        while std::time::Instant::now() < deadline {
            let mut seed = [0u8; 32];
            seed[..8].copy_from_slice(&round.to_le_bytes());
            let cfg = ProptestConfig {
                cases: 4096,
                failure_persistence: None,
                ..ProptestConfig::default()
            };
            let mut runner =
                TestRunner::new_with_rng(cfg, TestRng::from_seed(RngAlgorithm::ChaCha, &seed));
            runner
                .run(&proptest::collection::vec(any::<u8>(), 0..2048), |b| {
                    if b.len() >= crate::HEADER_LEN {
                        let _ = crate::Header::decode(b[..crate::HEADER_LEN].try_into().unwrap());
                    }
                    check_decoders(&b)
                })
                .unwrap();
            round += 1;
        }
        eprintln!("decoder fuzz campaign: {} inputs in {secs} s", round * 4096);
    }

    proptest! {
        #[test]
        fn decoders_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            check_decoders(&body)?;
        }

        #[test]
        fn key_tables_round_trip(keys in proptest::collection::vec(
            proptest::collection::vec(any::<u8>(), 1..64), 0..32)) {
            let body = encode_keys(&keys);
            prop_assert_eq!(decode_keys(&body).unwrap(),
                keys.iter().map(|k| k.as_slice()).collect::<Vec<_>>());
        }
    }
}
