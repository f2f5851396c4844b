//! The client and server over the RDMA transport, in-process on loopback with libfabric's tcp
//! provider (the real one-sided path: registration, descriptors, remote reads and writes,
//! completions). Needs libfabric1 (the repo's setup installs it).

use std::sync::Arc;
use std::time::Duration;

use memkv_client::{Buf, Client, ClientConfig, Status, TransportChoice, AUTO_PROVIDERS};
use memkv_server::rdma::RdmaConfig;
use memkv_server::{Server, ServerConfig};

fn rdma_cfg() -> RdmaConfig {
    RdmaConfig {
        provider: Some("tcp".into()),
        domains: vec!["lo".into()],
        ..RdmaConfig::default()
    }
}

fn server(memory: u64, rdma: bool) -> Server {
    Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory,
        lanes: 2,
        frame_timeout: Duration::from_secs(5),
        rdma: rdma.then(rdma_cfg),
        // Off: `auto` would take the same-host path to this in-process server, not RDMA.
        shm: None,
        ..ServerConfig::default()
    })
    .unwrap()
}

fn client(s: &Server, transport: TransportChoice) -> Arc<Client> {
    Client::new(ClientConfig {
        servers: vec![s.addr.to_string()],
        op_timeout: Duration::from_secs(10),
        transport,
        rdma_devices: vec!["lo".into()],
        rdma_provider: Some("tcp".into()),
        ..ClientConfig::default()
    })
    .unwrap()
}

fn value(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 31 + j * 7 + j / 251) as u8).collect()
}

#[test]
fn round_trips_of_every_size_in_batches_and_misses() {
    let s = server(256 << 20, true);
    let c = client(&s, TransportChoice::Rdma);
    // Empty, small, exactly one checksum chunk, one byte more, several chunks, and more than
    // one RDMA piece (4 MiB) ending mid-chunk.
    let sizes = [
        0,
        1,
        1000,
        256 << 10,
        (256 << 10) + 1,
        3 << 20,
        (9 << 20) + 77,
    ];
    let keys: Vec<Vec<u8>> = (0..sizes.len())
        .map(|i| format!("k{i}").into_bytes())
        .collect();
    let vals: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| value(i, n))
        .collect();
    let bufs: Vec<Buf> = vals.iter().map(|v| Buf::of(v)).collect();
    // SAFETY: `vals` outlive the blocking call.
    let st = unsafe { c.put(&keys, &bufs) };
    assert!(st.iter().all(|s| *s == Status::Ok), "{st:?}");
    assert_eq!(s.store.lane_stats().items, sizes.len() as u64);
    // One batch: every stored key, a missing key, and a key with the wrong length.
    let mut ks = keys.clone();
    ks.push(b"missing".to_vec());
    ks.push(keys[2].clone());
    let mut outs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xEE; n]).collect();
    outs.push(vec![0xEE; 10]);
    outs.push(vec![0xEE; 999]);
    let ob: Vec<Buf> = outs.iter_mut().map(|v| Buf::of_mut(v)).collect();
    // SAFETY: `outs` outlive the call and are not touched meanwhile.
    let st = unsafe { c.get(&ks, &ob) };
    let n = sizes.len();
    assert!(st[..n].iter().all(|s| *s == Status::Ok), "{st:?}");
    assert_eq!(st[n], Status::NotFound);
    assert_eq!(st[n + 1], Status::LengthMismatch);
    for i in 0..n {
        assert!(outs[i] == vals[i], "value {i} ({} bytes) differs", sizes[i]);
    }
    assert!(
        outs[n].iter().chain(&outs[n + 1]).all(|&b| b == 0xEE),
        "misses untouched"
    );
    // Many keys over several connections at once.
    let many: Vec<Vec<u8>> = (0..200).map(|i| format!("m{i}").into_bytes()).collect();
    let mv: Vec<Vec<u8>> = (0..200).map(|i| value(i, 5000 + i)).collect();
    let mb: Vec<Buf> = mv.iter().map(|v| Buf::of(v)).collect();
    // SAFETY: as above.
    assert!(unsafe { c.put(&many, &mb) }
        .iter()
        .all(|s| *s == Status::Ok));
    let mut mo: Vec<Vec<u8>> = (0..200).map(|i| vec![0; 5000 + i]).collect();
    let mob: Vec<Buf> = mo.iter_mut().map(|v| Buf::of_mut(v)).collect();
    // SAFETY: as above.
    assert!(unsafe { c.get(&many, &mob) }
        .iter()
        .all(|s| *s == Status::Ok));
    assert_eq!(mo, mv);
    let m = &s.store.metrics;
    assert_eq!(m.errors("rdma_remote"), 0);
    s.shutdown();
    s.wait();
}

#[test]
fn a_server_without_rdma_fails_rdma_clients_and_serves_auto_ones_over_tcp() {
    let s = server(16 << 20, false);
    let strict = client(&s, TransportChoice::Rdma);
    let v = value(1, 4096);
    // SAFETY: `v` outlives the call.
    let st = unsafe { strict.put(&[b"a".to_vec()], &[Buf::of(&v)]) };
    assert_eq!(st, [Status::Unavailable]);
    let why = strict.health()[0].last_failure.clone().unwrap().reason;
    assert!(why.contains("RDMA is off"), "{why}");
    let auto = client(&s, TransportChoice::Auto);
    // SAFETY: as above.
    assert_eq!(
        unsafe { auto.put(&[b"a".to_vec()], &[Buf::of(&v)]) },
        [Status::Ok]
    );
    let mut out = vec![0u8; 4096];
    // SAFETY: `out` outlives the call.
    assert_eq!(
        unsafe { auto.get(&[b"a".to_vec()], &[Buf::of_mut(&mut out)]) },
        [Status::Ok]
    );
    assert_eq!(out, v);
    assert_eq!(s.store.metrics.errors("rdma_refused"), 2);
    s.shutdown();
    s.wait();
}

#[test]
fn an_unloadable_provider_is_an_error_for_rdma_and_tcp_for_auto() {
    let s = server(16 << 20, false);
    let cfg = |transport| ClientConfig {
        servers: vec![s.addr.to_string()],
        transport,
        rdma_provider: Some("no-such-provider".into()),
        ..ClientConfig::default()
    };
    let err = Client::new(cfg(TransportChoice::Rdma)).err().unwrap();
    assert!(err.starts_with("transport 'rdma': fi_getinfo"), "{err}");
    let auto = Client::new(cfg(TransportChoice::Auto)).unwrap();
    let v = value(2, 100);
    // SAFETY: `v` outlives the call.
    assert_eq!(
        unsafe { auto.put(&[b"b".to_vec()], &[Buf::of(&v)]) },
        [Status::Ok]
    );
    s.shutdown();
    s.wait();
}

#[test]
fn auto_never_picks_a_software_provider_unless_named() {
    let s = server(16 << 20, true);
    let unnamed = Client::new(ClientConfig {
        servers: vec![s.addr.to_string()],
        transport: TransportChoice::Auto,
        ..ClientConfig::default()
    })
    .unwrap();
    // Hosts without RDMA hardware (CI) get TCP; hosts with it, a hardware provider (libfabric
    // names it with its utility layer: `verbs;ofi_rxm`).
    let p = unnamed.rdma_provider();
    let core = |p: &str| p.split(';').next().unwrap_or_default().to_string();
    assert!(
        p.is_none_or(|p| AUTO_PROVIDERS.contains(&core(p).as_str())),
        "{p:?}"
    );
    let v = value(3, 5000);
    // SAFETY: `v` outlives the call.
    assert_eq!(
        unsafe { unnamed.put(&[b"u".to_vec()], &[Buf::of(&v)]) },
        [Status::Ok]
    );
    let named = client(&s, TransportChoice::Auto);
    assert_eq!(named.rdma_provider().map(core).as_deref(), Some("tcp"));
    s.shutdown();
    s.wait();
}

/// A client asked to reach GPU memory opens the tcp provider's host-only domain (tcp has no
/// FI_HMEM) and says so; host buffers pass the check and move as before.
#[test]
fn gpu_memory_is_asked_for_and_a_provider_without_it_still_moves_host_memory() {
    let s = server(16 << 20, true);
    let asked = Client::new(ClientConfig {
        servers: vec![s.addr.to_string()],
        transport: TransportChoice::Rdma,
        rdma_devices: vec!["lo".into()],
        rdma_provider: Some("tcp".into()),
        gpu_memory: true,
        ..ClientConfig::default()
    })
    .unwrap();
    let why = asked.gpu_memory().unwrap_err();
    assert!(
        why.contains("provider tcp offers no domain that registers GPU memory (FI_HMEM)"),
        "{why}"
    );
    let plain = client(&s, TransportChoice::Rdma);
    assert!(plain.gpu_memory().unwrap_err().contains("not asked"));
    let over_tcp = client(&s, TransportChoice::Tcp);
    assert!(over_tcp
        .gpu_memory()
        .unwrap_err()
        .contains("the TCP transport moves host memory only"));
    let v = value(5, 70_000);
    let mut out = vec![0u8; v.len()];
    for c in [&asked, &over_tcp] {
        c.check_buffers(&[Buf::of(&v), Buf::of_mut(&mut out)])
            .unwrap();
        // SAFETY: `v` and `out` outlive the calls.
        unsafe {
            c.register_memory(v.as_ptr() as usize, v.len()).unwrap();
            assert_eq!(c.put(&[b"g".to_vec()], &[Buf::of(&v)]), [Status::Ok]);
            assert_eq!(
                c.get(&[b"g".to_vec()], &[Buf::of_mut(&mut out)]),
                [Status::Ok]
            );
        }
        assert_eq!(out, v);
        c.unregister_memory(v.as_ptr() as usize);
        out.fill(0);
    }
    s.shutdown();
    s.wait();
}
