//! Mapped reads against an in-process server started with `share_values`: values read straight
//! out of the server's memory, pinned until released, mapped read-only, and a release that
//! tells whether the pins held.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use memkv_client::mapped::MapHook;
use memkv_client::{Buf, Client, ClientConfig, Status, TransportChoice};
use memkv_server::shm::ShmConfig;
use memkv_server::{Server, ServerConfig};

fn server(share_values: bool, memory: u64) -> Server {
    Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory,
        lanes: 2,
        frame_timeout: Duration::from_secs(5),
        shm: Some(ShmConfig {
            share_values,
            ..ShmConfig::default()
        }),
        ..ServerConfig::default()
    })
    .unwrap()
}

fn client(s: &Server) -> Arc<Client> {
    Client::new(ClientConfig {
        servers: vec![s.addr.to_string()],
        op_timeout: Duration::from_secs(5),
        transport: TransportChoice::Shm,
        ..ClientConfig::default()
    })
    .unwrap()
}

/// Records what the client maps and unmaps.
#[derive(Default)]
struct Hook {
    mapped: Mutex<Vec<(usize, usize)>>,
    unmapped: Mutex<Vec<(usize, usize)>>,
}

impl MapHook for Hook {
    fn mapped(&self, ptr: usize, len: usize) -> Result<(), String> {
        self.mapped.lock().unwrap().push((ptr, len));
        Ok(())
    }
    fn unmapping(&self, ptr: usize, len: usize) {
        self.unmapped.lock().unwrap().push((ptr, len));
    }
}

/// A server sharing its values and a client reading them in place, with its hook.
fn in_place(memory: u64) -> (Server, Arc<Client>, Arc<Hook>) {
    let s = server(true, memory);
    let c = client(&s);
    let hook = Arc::new(Hook::default());
    assert!(c
        .enable_mapped_reads(hook.clone())
        .iter()
        .all(|r| r.is_ok()));
    (s, c, hook)
}

fn put(c: &Client, key: &[u8], v: &[u8]) {
    let b = Buf {
        ptr: v.as_ptr() as usize,
        len: v.len(),
    };
    // SAFETY: `v` outlives the call.
    assert_eq!(unsafe { c.put(&[key.to_vec()], &[b]) }, [Status::Ok]);
}

fn value(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// The bytes at `addr` (inside a mapping the client holds while the ticket lives).
fn at(addr: usize, len: usize) -> Vec<u8> {
    // SAFETY: callers pass an address a live ticket keeps mapped.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec()
}

#[test]
fn values_are_read_in_place_and_held_through_overwrite_and_delete() {
    let (_s, c, hook) = in_place(64 << 20);
    assert_eq!(hook.mapped.lock().unwrap().len(), 2, "one mapping per lane");
    let keys: Vec<Vec<u8>> = (0..8u8).map(|i| vec![b'k', i]).collect();
    let vals: Vec<Vec<u8>> = (0..8u8).map(|i| value(i, 300_000 + i as usize)).collect();
    for (k, v) in keys.iter().zip(&vals) {
        put(&c, k, v);
    }
    let mut ks = keys.clone();
    ks.push(b"absent".to_vec());
    let mut lens: Vec<u64> = vals.iter().map(|v| v.len() as u64).collect();
    lens.push(10);
    let (got, ticket) = c.get_mapped_by(&ks, &lens, c.deadline());
    assert_ne!(ticket, 0);
    assert_eq!(got[8], (Status::NotFound, 0));
    for ((st, addr), v) in got[..8].iter().zip(&vals) {
        assert_eq!(*st, Status::Ok);
        assert_eq!(at(*addr, v.len()), *v);
    }
    // Overwritten and deleted under the pin: the pinned bytes stay what was read.
    put(&c, &keys[0], &value(99, vals[0].len()));
    assert_eq!(c.delete(&[keys[1].clone()]), [Status::Ok]);
    assert_eq!(at(got[0].1, vals[0].len()), vals[0]);
    assert_eq!(at(got[1].1, vals[1].len()), vals[1]);
    assert!(c.release_mapped(ticket), "the server held every value");
    assert!(!c.release_mapped(ticket), "a ticket is released once");
    // A wrong expected length is a mismatch, as for GET.
    let (got, _) = c.get_mapped_by(&keys[2..3], &[5], c.deadline());
    assert_eq!(got, [(Status::LengthMismatch, 0)]);
}

#[test]
fn pinned_values_survive_eviction_until_released() {
    let (_s, c, _) = in_place(16 << 20);
    let v = value(7, 1 << 20);
    put(&c, b"pinned", &v);
    let (got, ticket) = c.get_mapped_by(&[b"pinned".to_vec()], &[v.len() as u64], c.deadline());
    assert_eq!(got[0].0, Status::Ok);
    // Enough new values to evict everything unpinned several times over.
    for i in 0..64u32 {
        put(&c, format!("fill-{i}").as_bytes(), &value(i as u8, 1 << 20));
    }
    assert_eq!(at(got[0].1, v.len()), v);
    assert!(c.release_mapped(ticket));
}

#[test]
fn the_mapping_cannot_be_made_writable() {
    let (_s, _c, hook) = in_place(16 << 20);
    let (ptr, len) = hook.mapped.lock().unwrap()[0];
    // SAFETY: asking for write access to our own read-only mapping; it must be refused.
    let rc = unsafe {
        libc::mprotect(
            ptr as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
        )
    };
    assert_eq!(
        rc, -1,
        "a client must not be able to write the server's values"
    );
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EACCES)
    );
}

#[test]
fn a_release_after_the_connection_broke_says_the_pins_were_lost() {
    let (s, c, hook) = in_place(16 << 20);
    let v = value(3, 100_000);
    put(&c, b"k", &v);
    let (got, ticket) = c.get_mapped_by(&[b"k".to_vec()], &[v.len() as u64], c.deadline());
    assert_eq!(got[0].0, Status::Ok);
    s.shutdown();
    s.wait();
    assert!(!c.release_mapped(ticket), "the pins went with the server");
    assert_eq!(
        hook.unmapped.lock().unwrap().len(),
        2,
        "both lanes unmapped once nothing reads them"
    );
}

#[test]
fn a_server_that_does_not_share_says_how_to_and_reads_fail_unavailable() {
    let s = server(false, 16 << 20);
    let c = client(&s);
    let r = c.enable_mapped_reads(Arc::new(Hook::default()));
    let why = r[0].as_ref().unwrap_err();
    assert!(why.contains("--shm-share-values"), "{why}");
    let v = value(1, 1000);
    put(&c, b"k", &v);
    let (got, ticket) = c.get_mapped_by(&[b"k".to_vec()], &[1000], c.deadline());
    assert_eq!((got[0].0, ticket), (Status::Unavailable, 0));
}

#[test]
fn sharing_values_is_refused_with_several_tenants() {
    let a = "a".repeat(64);
    let b = "b".repeat(64);
    let (tenants, _) = memkv_server::tenants::file::parse(
        &format!(
            "tenants:\n  - {{name: a, auth_key: \"{a}\", prefix: \"a/\", quota: 4M}}\n  - {{name: b, auth_key: \"{b}\", prefix: \"b/\", quota: 4M}}\n"
        ),
        16 << 20,
    )
    .unwrap();
    let e = Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory: 16 << 20,
        tenants: Some(tenants),
        shm: Some(ShmConfig {
            share_values: true,
            ..ShmConfig::default()
        }),
        ..ServerConfig::default()
    })
    .err()
    .expect("refused");
    assert!(e.to_string().contains("--tenants"), "{e}");
}
