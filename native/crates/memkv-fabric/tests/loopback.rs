//! The one-sided path over a real libfabric provider on loopback (tcp, as CI runs it): remote
//! reads and writes between two endpoints, per-operation errors for bad descriptors, and no
//! access after a registration is revoked. Needs libfabric1 (the repo's setup installs it).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memkv_fabric::{Endpoint, Fabric, MrCache, Rma, WriteCompletion};

fn fabric() -> Arc<Fabric> {
    Fabric::open(Some("tcp"), &["lo".to_string()]).expect("libfabric tcp provider on lo")
}

/// The passive side: an endpoint whose memory the other one reads and writes, progressed by a
/// thread until the returned guard drops.
struct Passive {
    name: Vec<u8>,
    stop: Arc<AtomicBool>,
    t: Option<std::thread::JoinHandle<()>>,
}

impl Passive {
    fn start(fab: &Arc<Fabric>) -> Passive {
        let mut ep = Endpoint::open(fab).unwrap();
        let name = ep.name().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let t = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                ep.progress().unwrap();
                ep.wait(Duration::from_millis(5));
            }
        });
        Passive {
            name,
            stop,
            t: Some(t),
        }
    }
}

impl Drop for Passive {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.t.take().unwrap().join().unwrap();
    }
}

#[test]
fn reads_writes_and_refuses_bad_descriptors() {
    let fab = fabric();
    let passive = Passive::start(&fab);
    let cache = MrCache::new(fab.clone(), 8);
    let mut remote: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let rmr = unsafe { cache.get(remote.as_ptr() as usize, remote.len()) }.unwrap();
    let mut local = vec![0u8; remote.len()];
    let lmr = unsafe { fab.register(local.as_mut_ptr() as usize, local.len(), false) }.unwrap();
    // A failed remote operation may end the provider's connection to the peer (tcp does), so
    // each failure below is followed by a fresh endpoint, as the server does per connection.
    let open = || {
        let mut ep = Endpoint::open(&fab).unwrap();
        let peer = ep.insert_peer(&passive.name).unwrap();
        (ep, peer)
    };
    let (mut ep, peer) = open();
    let deadline = Instant::now() + Duration::from_secs(20);
    let op = |local: usize, remote_ptr: usize, len: usize, rkey: u64, group: usize| Rma {
        write: false,
        local,
        desc: lmr.desc(),
        len,
        remote_addr: rmr.remote_addr(remote_ptr),
        rkey,
        group,
    };
    let (l, r) = (local.as_mut_ptr() as usize, remote.as_ptr() as usize);
    // Read all of it in two pieces of one group.
    let half = remote.len() / 2;
    let ops = [
        op(l, r, half, rmr.key, 0),
        op(l + half, r + half, remote.len() - half, rmr.key, 0),
    ];
    let errs = ep.run(peer, &ops, 1, deadline).unwrap();
    assert!(errs[0].is_none(), "{:?}", errs[0]);
    assert_eq!(local, remote);
    // Write back changed bytes.
    local.iter_mut().for_each(|b| *b = b.wrapping_add(1));
    let w = [Rma {
        write: true,
        ..op(l, r, remote.len(), rmr.key, 0)
    }];
    let e = ep.run(peer, &w, 1, deadline).unwrap();
    assert!(e[0].is_none(), "{:?}", e[0]);
    assert_eq!(local, remote);
    // A wrong key fails its group and only its group.
    let bad = [op(l, r, 64, rmr.key, 0), op(l, r, 64, rmr.key ^ 0x5a5a, 1)];
    let errs = ep.run(peer, &bad, 2, deadline).unwrap();
    assert!(errs[1].is_some(), "a wrong key must fail");
    // Past the registration's end: refused, nothing written.
    let (mut ep, peer) = open();
    let before = remote.clone();
    let over = [Rma {
        write: true,
        ..op(l, r + remote.len() - 8, 64, rmr.key, 0)
    }];
    let errs = ep.run(peer, &over, 1, deadline).unwrap();
    assert!(errs[0].is_some(), "out-of-range address must fail");
    assert_eq!(remote, before);
    // Revoked: the key opens nothing any more.
    let (mut ep, peer) = open();
    cache.invalidate(r + 10, 1);
    assert!(cache.is_empty());
    local.fill(9);
    assert!(ep.run(peer, &w, 1, deadline).unwrap()[0].is_some());
    assert_eq!(remote, before, "no byte written after the revocation");
    remote[0] = 0;
    drop(passive);
}

#[test]
fn the_cache_is_bounded_and_reuses_covering_registrations() {
    let fab = fabric();
    let cache = MrCache::new(fab, 2);
    let bufs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 8192]).collect();
    let a = unsafe { cache.get(bufs[0].as_ptr() as usize, 8192) }.unwrap();
    let inner = unsafe { cache.get(bufs[0].as_ptr() as usize + 100, 50) }.unwrap();
    assert!(
        Arc::ptr_eq(&a, &inner),
        "a buffer inside a registration reuses it"
    );
    for b in &bufs[1..] {
        unsafe { cache.get(b.as_ptr() as usize, b.len()) }.unwrap();
    }
    assert_eq!(cache.len(), 2);
    assert!(
        !a.revoked(),
        "held by a transfer: evicted from the cache, not closed"
    );
}

/// GPU memory on a domain that cannot register it is refused before libfabric sees the pointer
/// (a provider taking it for host memory would copy from it on the CPU and crash); host memory
/// registers as before, and the domain says why GPU memory is out of its reach. The tcp
/// provider has no FI_HMEM, so asking for it falls back to its host-only domain.
#[test]
fn gpu_memory_is_refused_where_the_domain_cannot_register_it() {
    use memkv_fabric::Memory;

    let asked = Fabric::open_for(Some("tcp"), &["lo".to_string()], true).unwrap();
    let why = asked.device_memory().unwrap_err();
    assert!(why.contains("FI_HMEM") && why.contains("tcp"), "{why}");
    let plain = fabric();
    assert!(plain.device_memory().unwrap_err().contains("not asked"));

    let buf = vec![1u8; 8192];
    let ptr = buf.as_ptr() as usize;
    for fab in [&asked, &plain] {
        let e = unsafe { fab.register_memory(ptr, buf.len(), true, Memory::Cuda(0)) }
            .err()
            .expect("GPU memory refused");
        let msg = e.to_string();
        assert!(msg.contains("GPU memory (CUDA device 0)"), "{msg}");
        assert!(msg.contains(&format!("{ptr:#x}")), "{msg}");
        let mr = unsafe { fab.register_memory(ptr, buf.len(), true, Memory::Host) }.unwrap();
        assert_eq!(mr.mem, Memory::Host);
    }

    // No CUDA driver in this process: every buffer is host memory, registrations say so.
    let cache = MrCache::new(asked.clone(), 4);
    unsafe { cache.pin(ptr, 4096) }.unwrap();
    assert_eq!(cache.memory_of(ptr + 8, 16), Memory::Host);
    let mr = unsafe { cache.get(ptr + 4096, 4096) }.unwrap();
    assert_eq!(mr.mem, Memory::Host);
    assert_eq!(memkv_fabric::memory::locate(ptr), Memory::Host);
}

/// shm lists FI_HMEM in every build, with or without CUDA: the domain registers GPU memory only
/// where libfabric is built with CUDA and its CUDA support started (Debian's and Ubuntu's
/// libfabric 1.17 are built without).
#[test]
fn fi_hmem_alone_does_not_make_a_domain_reach_cuda_memory() {
    let fab = Fabric::open_for(Some("shm"), &[], true).expect("libfabric shm provider");
    assert_eq!(fab.provider, "shm");
    match fab.device_memory() {
        Ok(how) => assert!(how.contains("(FI_HMEM, CUDA)"), "{how}"),
        Err(why) => assert!(
            why.contains("offers FI_HMEM but this libfabric is built without CUDA support")
                || why.contains("offers FI_HMEM but libfabric's CUDA support did not start"),
            "{why}"
        ),
    }
}

/// A peer's endpoint address is handed to the provider only when it cannot read past it: of
/// the provider's one size (tcp), or a NUL-terminated name of any length up to 256 bytes (shm,
/// whose names carry a process id, so a server and its clients differ in length).
#[test]
fn peer_addresses_are_checked_by_the_providers_format() {
    let tcp = fabric();
    let own = Endpoint::open(&tcp).unwrap().name().unwrap();
    assert!(tcp.peer_address_ok(own.len(), &own).is_ok());
    let e = tcp.peer_address_ok(own.len(), &own[1..]).unwrap_err();
    assert!(e.contains("endpoint address; this provider's are"), "{e}");
    let shm = Fabric::open(Some("shm"), &[]).expect("libfabric shm provider");
    let own = Endpoint::open(&shm).unwrap().name().unwrap();
    assert!(
        own.contains(&0),
        "shm names are NUL-terminated strings: {own:?}"
    );
    let mut longer = own[..own.len() - 1].to_vec();
    longer.extend_from_slice(b"7\0");
    for ok in [&own[..], &longer[..]] {
        assert!(shm.peer_address_ok(own.len(), ok).is_ok());
    }
    for bad in [&own[..own.len() - 1], &[b'x'; 300][..]] {
        assert!(shm.peer_address_ok(own.len(), bad).is_err());
    }
}

#[test]
fn writes_fenced_by_a_read_move_the_same_bytes() {
    // tcp delivers before it completes; the fallback is chosen here by hand.
    assert_eq!(fabric().write_completion, WriteCompletion::Delivery);
    let fab = Fabric::open_with_read_fence(Some("tcp"), &["lo".to_string()]).unwrap();
    assert_eq!(fab.write_completion, WriteCompletion::ReadFence);
    let passive = Passive::start(&fab);
    let cache = MrCache::new(fab.clone(), 8);
    let remote = vec![0u8; 1 << 20];
    let rmr = unsafe { cache.get(remote.as_ptr() as usize, remote.len()) }.unwrap();
    let local: Vec<u8> = (0..remote.len() as u32).map(|i| (i % 241) as u8).collect();
    let lmr = unsafe { fab.register(local.as_ptr() as usize, local.len(), false) }.unwrap();
    let mut ep = Endpoint::open(&fab).unwrap();
    let peer = ep.insert_peer(&passive.name).unwrap();
    let (l, r) = (local.as_ptr() as usize, remote.as_ptr() as usize);
    let w = |off: usize, len: usize, group: usize| Rma {
        write: true,
        local: l + off,
        desc: lmr.desc(),
        len,
        remote_addr: rmr.remote_addr(r + off),
        rkey: rmr.key,
        group,
    };
    // Group 0 in two pieces, group 1 in one; the bytes between stay untouched.
    let ops = [w(0, 1000, 0), w(1000, 500_000, 0), w(600_000, 448_576, 1)];
    let errs = ep
        .run(peer, &ops, 2, Instant::now() + Duration::from_secs(20))
        .unwrap();
    assert!(errs.iter().all(Option::is_none), "{errs:?}");
    assert_eq!(remote[..501_000], local[..501_000]);
    assert_eq!(remote[600_000..], local[600_000..]);
    assert!(remote[501_000..600_000].iter().all(|&b| b == 0));
    drop(passive);
}
