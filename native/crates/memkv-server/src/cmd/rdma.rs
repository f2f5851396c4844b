//! PUT and GET over RDMA (frames flagged `FLAG_RDMA`), and the RDMA_HELLO that sets a
//! connection's endpoint up. The key tables, statuses, checksums, pins, leases and limits are
//! those of the TCP commands; only the values move differently: the server reads a PUT's
//! values out of the client's memory into fresh reservations, and writes a GET's values from
//! the store into the client's memory, before it replies.
//!
//! Ordering rules that make the path safe:
//! - A PUT value is checksummed and committed only after all its reads completed; one whose
//!   read failed is dropped (REMOTE_ACCESS) and nothing of it is visible.
//! - Every chunk of a GET value is verified before any byte of it is written (a mismatch
//!   answers CORRUPT and writes nothing), and the reply is sent only after every write
//!   completed in the client's memory (writes are delivery-complete). After the reply the
//!   server never touches the client's memory for that request.
//! - A deadline miss or a broken endpoint closes the endpoint before the reservations and pins
//!   the operations named are released, and ends the connection without a reply.
//! - A failed remote operation may have torn down the provider's path to the client (the tcp
//!   provider does), so the connection closes after a reply that carries REMOTE_ACCESS; the
//!   client opens a new one for its next request.

use std::hash::Hasher;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use memkv_fabric::{Endpoint, Rma};
use memkv_proto::{self as proto, Header, Opcode, ProtoError, Status, CHECKSUM_CHUNK};

use crate::conn::{Conn, End};
use crate::lane::{Reservation, Value};
use crate::rdma::RdmaPeer;
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    pub(crate) fn rdma_hello(&mut self, h: &Header, body: &[u8]) -> Result<(), End> {
        let (prov, addr) = proto::decode_rdma_hello(body)?;
        let answer = match &self.ctx.rdma {
            None => Err("RDMA is off on this server (start it with --rdma)".to_string()),
            Some(sf) if sf.fab.hello_name != prov => Err(format!(
                "the server's libfabric provider is {:?}, the client's {prov:?}",
                sf.fab.hello_name
            )),
            Some(sf) => sf
                .endpoint_slot()
                .ok_or_else(|| {
                    format!(
                        "the server's RDMA connections are at their bound ({}, \
                         --max-rdma-connections)",
                        sf.max_endpoints()
                    )
                })
                .and_then(|slot| {
                    let ep = Endpoint::open(&sf.fab)
                        .map_err(|e| format!("cannot open an endpoint: {e}"))?;
                    Ok((ep, slot))
                })
                .and_then(|(mut ep, slot)| {
                    // The provider reads an address of its own format from what we hand it
                    // (a fixed length, or up to a NUL for shm's names): one it would read
                    // past is refused, never handed over.
                    let own = ep.name().map_err(|e| e.to_string())?;
                    sf.fab.peer_address_ok(own.len(), addr)?;
                    let peer = ep
                        .insert_peer(addr)
                        .map_err(|e| format!("cannot reach the client's endpoint: {e}"))?;
                    Ok(RdmaPeer {
                        ep,
                        peer,
                        _slot: slot,
                    })
                }),
        };
        let reply = match answer {
            Ok(p) => {
                self.rdma = Some(p);
                proto::encode_rdma_hello_reply(true, "")
            }
            Err(why) => {
                self.ctx.store.metrics.error("rdma_refused");
                proto::encode_rdma_hello_reply(false, &why)
            }
        };
        self.reply(h, &reply)
    }

    pub(crate) fn rdma_transfer(
        &mut self,
        h: &Header,
        body: &[u8],
        deadline: Instant,
    ) -> Result<(), End> {
        if self.rdma.is_none() {
            return Err(ProtoError::Malformed("an RDMA transfer before RDMA_HELLO").into());
        }
        let _share = self.key_share(body, 0, deadline)?;
        let items = proto::decode_descriptors(body)?;
        let total = items
            .iter()
            .try_fold(0u64, |a, (_, d)| a.checked_add(d.len))
            .ok_or(ProtoError::Malformed("descriptor lengths overflow"))?;
        // The same deadline rule as TCP: the frame allowance plus the bytes at the minimum rate.
        let deadline = deadline.max(self.io.timing.deadline(total));
        let failed = if h.opcode == Opcode::Put {
            self.put_rdma(h, &items, deadline)?
        } else {
            self.get_rdma(h, &items, deadline)?
        };
        if failed {
            self.ctx.store.metrics.error("rdma_remote");
            if let Some(dropped) = self.ctx.warn.allow() {
                tracing::warn!(peer = %self.io.transport().peer(), dropped_warnings = dropped,
                    "RDMA access to client memory failed (bad descriptor or client gone); \
                     closing the connection after its reply");
            }
            return Err(End::Closed);
        }
        Ok(())
    }

    /// Runs `ops` on this connection's endpoint; a deadline miss or endpoint failure ends the
    /// connection (the endpoint is closed by then).
    fn run_rma(&mut self, ops: &[Rma], groups: usize, deadline: Instant) -> Result<Vec<bool>, End> {
        let rd = self.rdma.as_mut().expect("checked by rdma_transfer");
        match rd.ep.run(rd.peer, ops, groups, deadline) {
            Ok(errs) => Ok(errs.into_iter().map(|e| e.is_none()).collect()),
            Err(e) if e.timed_out() => Err(End::Stalled {
                reply_started: false,
            }),
            Err(e) => Err(End::Io(std::io::Error::other(e.to_string()))),
        }
    }

    /// The operations moving `len` bytes between store memory at `local` and the client's
    /// `remote_addr`, split into pieces the provider takes.
    fn pieces(
        &self,
        write: bool,
        local: usize,
        d: &proto::Descriptor,
        group: usize,
        ops: &mut Vec<Rma>,
    ) -> Result<(), End> {
        let sf = self
            .ctx
            .rdma
            .as_ref()
            .expect("an endpoint implies a fabric");
        let len = d.len as usize;
        let desc = sf
            .desc(local, len)
            .ok_or_else(|| End::Io(std::io::Error::other("value outside registered memory")))?;
        let piece = sf.fab.max_msg;
        let mut off = 0;
        while off < len {
            let n = piece.min(len - off);
            ops.push(Rma {
                write,
                local: local + off,
                desc,
                len: n,
                remote_addr: d.addr.wrapping_add(off as u64),
                rkey: d.rkey,
                group,
            });
            off += n;
        }
        Ok(())
    }

    /// Returns whether a remote read failed.
    fn put_rdma(
        &mut self,
        h: &Header,
        items: &[(&[u8], proto::Descriptor)],
        deadline: Instant,
    ) -> Result<bool, End> {
        let store = &*self.ctx.store;
        let mut st = vec![Status::Ok; items.len()];
        let mut res: Vec<Option<Reservation>> = Vec::with_capacity(items.len());
        let mut ops = Vec::new();
        for (i, (key, d)) in items.iter().enumerate() {
            match store.reserve(key, d.len) {
                Ok(mut r) => {
                    let local = r.bytes_mut().as_mut_ptr() as usize;
                    self.pieces(false, local, d, i, &mut ops)?;
                    res.push(Some(r));
                }
                Err(s) => {
                    store.metrics.error(if s == Status::TooLarge {
                        "too_large"
                    } else {
                        "no_space"
                    });
                    st[i] = s;
                    res.push(None);
                }
            }
        }
        // On an error here the endpoint is closed before `res` drops the reservations.
        let ok = self.run_rma(&ops, items.len(), deadline)?;
        let mut failed = false;
        for (i, ((key, d), r)) in items.iter().zip(res).enumerate() {
            let Some(mut r) = r else { continue };
            if !ok[i] {
                st[i] = Status::RemoteAccess;
                failed = true;
                continue;
            }
            let sums: Vec<u64> = if d.len == 0 {
                vec![proto::checksum(&[])]
            } else {
                r.bytes_mut()
                    .chunks(CHECKSUM_CHUNK)
                    .map(|c| {
                        let mut hs = proto::checksum_hasher();
                        hs.write(c);
                        hs.finish()
                    })
                    .collect()
            };
            store.commit(key, r, sums);
            store.metrics.puts.fetch_add(1, Ordering::Relaxed);
            store.metrics.bytes_in.fetch_add(d.len, Ordering::Relaxed);
        }
        self.reply(h, &proto::encode_statuses(&st))?;
        Ok(failed)
    }

    /// Returns whether a remote write failed.
    fn get_rdma(
        &mut self,
        h: &Header,
        items: &[(&[u8], proto::Descriptor)],
        deadline: Instant,
    ) -> Result<bool, End> {
        let ctx = self.ctx;
        let store = &*ctx.store;
        let (mut st, vals) = self.lookup(items.iter().map(|(k, d)| (*k, d.len)));
        let chunks: u64 = vals.iter().map(|(_, _, v)| v.chunks() as u64).sum();
        let Some(_chunk_share) = self.take(chunks * super::get::PER_CHUNK, deadline) else {
            return Err(self.busy());
        };
        // Every chunk after the first (checked by the lookup) is verified before any write.
        let later: Vec<(Arc<Value>, usize)> = vals
            .iter()
            .flat_map(|(_, _, v)| (1..v.chunks()).map(|c| (v.value.clone(), c)))
            .collect();
        let mut checks = ctx.verifier.check(later);
        let mut ops = Vec::new();
        let mut sent = 0u64;
        for (i, key, v) in &vals {
            let intact = (1..v.chunks()).fold(true, |ok, _| checks.next_ok() && ok);
            if !intact {
                store.drop_corrupt(key, v);
                st[*i] = (Status::Corrupt, 0);
                continue;
            }
            let local = v.span.as_slice().as_ptr() as usize;
            self.pieces(true, local, &items[*i].1, *i, &mut ops)?;
            sent += v.span.len();
        }
        // On an error here the endpoint is closed before `vals` drops the pins.
        let ok = self.run_rma(&ops, items.len(), deadline)?;
        let mut failed = false;
        for (i, _, v) in &vals {
            if st[*i].0 == Status::Ok && !ok[*i] {
                st[*i] = (Status::RemoteAccess, 0);
                sent -= v.span.len();
                failed = true;
            }
        }
        store.metrics.bytes_out.fetch_add(sent, Ordering::Relaxed);
        self.reply(h, &proto::encode_status_lens(&st))?;
        drop(vals);
        Ok(failed)
    }
}

#[cfg(test)]
mod tests {
    //! Hostile and broken RDMA requests against a live server on loopback (libfabric tcp), from
    //! a hand-made client: each gets a per-key status or an error frame, touches no memory it
    //! was not given, and leaves the server serving.

    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use memkv_fabric::{Endpoint, Fabric, Mr};
    use memkv_proto::{self as proto, Descriptor, Header, Opcode, Status, FLAG_RDMA, HEADER_LEN};

    use crate::rdma::RdmaConfig;
    use crate::{Server, ServerConfig};

    fn server() -> Server {
        server_with(Duration::from_secs(5))
    }

    fn server_with(frame_timeout: Duration) -> Server {
        Server::start(ServerConfig {
            listen: "127.0.0.1:0".into(),
            memory: 32 << 20,
            lanes: 1,
            frame_timeout,
            rdma: Some(RdmaConfig {
                provider: Some("tcp".into()),
                domains: vec!["lo".into()],
                ..RdmaConfig::default()
            }),
            ..ServerConfig::default()
        })
        .unwrap()
    }

    /// A client endpoint whose memory the server reads and writes, progressed by a thread.
    struct Peer {
        name: Vec<u8>,
        provider: String,
        mem: Vec<u8>,
        mr: Mr,
        stop: Arc<AtomicBool>,
        t: Option<std::thread::JoinHandle<()>>,
    }

    impl Peer {
        /// A client endpoint over `len` registered bytes, driven by its own thread. (A client
        /// that stops driving its endpoint is tested from Python with a stopped process: an
        /// endpoint in this process that nobody drives was sometimes served by the provider's
        /// own threads anyway.)
        fn new(len: usize) -> Peer {
            let fab = Fabric::open(Some("tcp"), &["lo".to_string()]).unwrap();
            let mut ep = Endpoint::open(&fab).unwrap();
            let name = ep.name().unwrap();
            let mem = vec![0xEEu8; len];
            // SAFETY: `mem` lives in the Peer, which drops the registration first.
            let mr = unsafe { fab.register(mem.as_ptr() as usize, len, true) }.unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let s = stop.clone();
            let t = std::thread::spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    let _ = ep.progress();
                    ep.wait(Duration::from_millis(2));
                }
            });
            Peer {
                name,
                provider: fab.hello_name.clone(),
                mem,
                mr,
                stop,
                t: Some(t),
            }
        }

        fn desc(&self, off: usize, len: usize) -> Descriptor {
            Descriptor {
                len: len as u64,
                addr: self.mr.remote_addr(self.mem.as_ptr() as usize + off),
                rkey: self.mr.key,
            }
        }
    }

    impl Drop for Peer {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
            self.t.take().unwrap().join().unwrap();
        }
    }

    fn call(s: &mut TcpStream, op: Opcode, flags: u32, body: &[u8]) -> Option<(Header, Vec<u8>)> {
        let mut h = Header::new(op, 1, body.len(), 0);
        h.flags = flags;
        s.write_all(&h.encode()).ok()?;
        s.write_all(body).ok()?;
        let mut hb = [0u8; HEADER_LEN];
        s.read_exact(&mut hb).ok()?;
        let h = Header::decode(&hb).unwrap();
        let mut b = vec![0u8; h.body_len as usize];
        s.read_exact(&mut b).ok()?;
        Some((h, b))
    }

    /// A connection that said HELLO and had its RDMA_HELLO (with `addr`) answered.
    fn connect(srv: &Server, provider: &str, addr: &[u8]) -> (TcpStream, bool, String) {
        let mut s = TcpStream::connect(srv.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        call(&mut s, Opcode::Hello, 0, &[]).unwrap();
        let (h, b) = call(
            &mut s,
            Opcode::RdmaHello,
            0,
            &proto::encode_rdma_hello(provider, addr),
        )
        .unwrap();
        assert_eq!(h.opcode, Opcode::RdmaHelloReply);
        let (ok, why) = proto::decode_rdma_hello_reply(&b).unwrap();
        (s, ok, why)
    }

    fn put(s: &mut TcpStream, key: &[u8], d: Descriptor) -> Option<Status> {
        let body = proto::encode_descriptors(&[key], &[d]);
        let (_, b) = call(s, Opcode::Put, FLAG_RDMA, &body)?;
        Some(proto::decode_statuses(&b, 1).unwrap()[0])
    }

    fn get(s: &mut TcpStream, key: &[u8], d: Descriptor) -> Option<Status> {
        let body = proto::encode_descriptors(&[key], &[d]);
        let (_, b) = call(s, Opcode::Get, FLAG_RDMA, &body)?;
        Some(proto::decode_status_lens(&b, 1).unwrap()[0].0)
    }

    /// The server closed the connection (after its last reply).
    fn closed(s: &mut TcpStream) -> bool {
        let mut b = [0u8; 1];
        matches!(s.read(&mut b), Ok(0) | Err(_))
    }

    #[test]
    fn bad_descriptors_fail_their_key_and_touch_nothing_else() {
        let srv = server();
        let mut peer = Peer::new(1 << 20);
        let val: Vec<u8> = (0..300_000u32).map(|i| (i % 249) as u8).collect();
        peer.mem[..val.len()].copy_from_slice(&val);
        let (mut s, ok, why) = connect(&srv, &peer.provider, &peer.name);
        assert!(ok, "{why}");
        assert_eq!(
            put(&mut s, b"good", peer.desc(0, val.len())),
            Some(Status::Ok)
        );
        // A wrong key: REMOTE_ACCESS, nothing stored, connection closed after the reply.
        let mut bad = peer.desc(0, 1000);
        bad.rkey ^= 0x77;
        assert_eq!(put(&mut s, b"bad", bad), Some(Status::RemoteAccess));
        assert!(closed(&mut s));
        assert!(srv.store.fetch_verified(b"bad").is_err(), "nothing stored");
        // An address past the registration: the write fails; the registered bytes are as
        // they were.
        let before = peer.mem.clone();
        let (mut s, _, _) = connect(&srv, &peer.provider, &peer.name);
        let past = peer.desc(peer.mem.len() - 8, val.len());
        assert_eq!(get(&mut s, b"good", past), Some(Status::RemoteAccess));
        assert!(closed(&mut s));
        assert_eq!(peer.mem, before);
        // A length that is not the stored one: LENGTH_MISMATCH, nothing written.
        let (mut s, _, _) = connect(&srv, &peer.provider, &peer.name);
        let off = 1 << 19;
        let wrong = peer.desc(off, val.len() - 1);
        assert_eq!(get(&mut s, b"good", wrong), Some(Status::LengthMismatch));
        assert_eq!(peer.mem, before);
        // The connection and the server still serve: the value comes back whole.
        assert_eq!(
            get(&mut s, b"good", peer.desc(off, val.len())),
            Some(Status::Ok)
        );
        assert_eq!(&peer.mem[off..off + val.len()], &val[..]);
        assert_eq!(srv.store.metrics.errors("rdma_remote"), 2);
        srv.shutdown();
        srv.wait();
    }

    #[test]
    fn broken_handshakes_are_refused_and_the_server_stays_up() {
        let srv = server();
        let peer = Peer::new(4096);
        // An address of the wrong length is never handed to the provider.
        let (_, ok, why) = connect(&srv, &peer.provider, &[1, 2, 3]);
        assert!(!ok && why.contains("3-byte"), "{why}");
        // Another provider's client.
        let (_, ok, why) = connect(&srv, "verbs;ofi_rxm", &peer.name);
        assert!(!ok && why.contains("provider"), "{why}");
        // The same provider with rxm buffers of another size (a client with another
        // FI_OFI_RXM_BUFFER_SIZE, or of a memkv that did not set it): rxm would refuse the
        // server's connection to it and every transfer would stall until its deadline.
        let (_, ok, why) = connect(&srv, "tcp;ofi_rxm", &peer.name);
        assert_eq!(
            (ok, why.as_str()),
            (
                false,
                "the server's libfabric provider is \"tcp;ofi_rxm with 256-byte rxm buffers\", \
                 the client's \"tcp;ofi_rxm\""
            )
        );
        // A well-formed address nobody listens at: accepted, but a transfer fails as a value.
        let nobody = vec![0u8; peer.name.len()];
        let (mut s, ok, _) = connect(&srv, &peer.provider, &nobody);
        if ok {
            let st = put(&mut s, b"x", peer.desc(0, 100));
            assert!(st.is_none() || st == Some(Status::RemoteAccess), "{st:?}");
        }
        // An RDMA transfer before RDMA_HELLO: an error frame, then the connection closes.
        let mut s = TcpStream::connect(srv.addr).unwrap();
        call(&mut s, Opcode::Hello, 0, &[]).unwrap();
        let body = proto::encode_descriptors(&[b"k".as_slice()], &[peer.desc(0, 10)]);
        let (h, b) = call(&mut s, Opcode::Put, FLAG_RDMA, &body).unwrap();
        assert_eq!(h.opcode, Opcode::Error);
        assert!(proto::decode_error(&b)
            .unwrap()
            .1
            .contains("before RDMA_HELLO"));
        // Still serving.
        let (mut s, ok, why) = connect(&srv, &peer.provider, &peer.name);
        assert!(ok, "{why}");
        assert_eq!(put(&mut s, b"y", peer.desc(0, 100)), Some(Status::Ok));
        srv.shutdown();
        srv.wait();
    }

    #[test]
    fn a_corrupt_value_answers_corrupt_and_writes_no_byte() {
        let srv = server();
        let mut peer = Peer::new(2 << 20);
        let len = 3 * proto::CHECKSUM_CHUNK + 5;
        for (i, b) in peer.mem[..len].iter_mut().enumerate() {
            *b = (i % 253) as u8;
        }
        let (mut s, ok, why) = connect(&srv, &peer.provider, &peer.name);
        assert!(ok, "{why}");
        assert_eq!(put(&mut s, b"v", peer.desc(0, len)), Some(Status::Ok));
        let v = srv.store.fetch_verified(b"v").ok().unwrap();
        v.span.corrupt_for_test(2 * proto::CHECKSUM_CHUNK + 7);
        drop(v);
        let off = 1 << 20;
        peer.mem[off..off + len].fill(0xEE);
        assert_eq!(
            get(&mut s, b"v", peer.desc(off, len)),
            Some(Status::Corrupt)
        );
        assert!(
            peer.mem[off..off + len].iter().all(|&b| b == 0xEE),
            "no byte written"
        );
        assert!(srv.store.fetch_verified(b"v").is_err(), "dropped");
        assert_eq!(srv.store.metrics.errors("corrupt"), 1);
        srv.shutdown();
        srv.wait();
    }
}
