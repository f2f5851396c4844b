//! TLS between client and server, in-process on loopback, with certificates made here: round
//! trips over TLS and mutual TLS, every refusal with the setting it names (and fast), the
//! certificate reload keeping open connections, and what TLS rules out (RDMA, the same-host
//! socket under mutual TLS without a key).

use std::sync::Arc;
use std::time::{Duration, Instant};

use memkv_client::{Client, ClientConfig, Status, TransportChoice};
use memkv_server::{Server, ServerConfig};
use memkv_tls::ephemeral::{Issued, Pki};
use memkv_tls::{ClientTlsFiles, ServerTlsFiles};

mod common;
use common::{get, put};

/// Well under the operation timeout of every client here (10 s): a refusal must come this fast.
const FAST: Duration = Duration::from_secs(2);

fn server(tls: Option<ServerTlsFiles>) -> Server {
    Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory: 64 << 20,
        lanes: 2,
        tls,
        ..ServerConfig::default()
    })
    .unwrap()
}

fn server_files(cert: &Issued, client_ca: Option<&Pki>) -> ServerTlsFiles {
    ServerTlsFiles {
        cert: cert.cert.clone(),
        key: cert.key.clone(),
        client_ca: client_ca.map(Pki::ca),
    }
}

fn client_files(ca: &Pki, client: Option<&Issued>) -> ClientTlsFiles {
    ClientTlsFiles {
        ca: ca.ca(),
        server_name: None,
        cert: client.map(|c| c.cert.clone()),
        key: client.map(|c| c.key.clone()),
    }
}

fn client(s: &Server, tls: Option<ClientTlsFiles>) -> Arc<Client> {
    Client::new(ClientConfig {
        servers: vec![s.addr.to_string()],
        connections_per_server: 1,
        op_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(10),
        tls,
        ..ClientConfig::default()
    })
    .unwrap()
}

fn round_trip(c: &Client) {
    for (i, len) in [1usize, 1000, 100_000, 5 << 20].into_iter().enumerate() {
        let val: Vec<u8> = (0..len).map(|j| (j * 7 + i) as u8).collect();
        let key = format!("k{i}");
        assert_eq!(put(c, key.as_bytes(), &val), Status::Ok);
        let (s, got) = get(c, key.as_bytes(), len);
        assert_eq!(s, Status::Ok);
        assert!(got == val, "value {i} came back different");
    }
}

/// A client's first PUT fails fast with AuthFailed (the server is fine, the settings do not fit
/// it), and the reason it keeps for the server holds every one of `needles`.
fn assert_refused(c: &Client, needles: &[&str]) {
    let t = Instant::now();
    assert_eq!(put(c, b"x", b"v"), Status::AuthFailed);
    let took = t.elapsed();
    let (_, r) = c.ping().pop().unwrap();
    let e = r.expect_err("the ping must fail");
    assert!(took < FAST, "took {took:?}: {e}");
    for n in needles {
        assert!(e.contains(n), "{n:?} not in {e:?}");
    }
}

/// The server counts a refused handshake once its side of it ended, which can be after the
/// client has read the refusal: waits for the count, up to `FAST`.
fn assert_counts_a_tls_error(s: &Server) {
    let t = Instant::now();
    while s.store.metrics.errors("tls") == 0 {
        assert!(t.elapsed() < FAST, "the server counted no TLS error");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn values_round_trip_over_tls() {
    let pki = Pki::new();
    let s = server(Some(server_files(&pki.server("s"), None)));
    round_trip(&client(&s, Some(client_files(&pki, None))));
    assert_eq!(s.store.metrics.errors("tls"), 0);
}

#[test]
fn values_round_trip_over_mutual_tls() {
    let pki = Pki::new();
    let s = server(Some(server_files(&pki.server("s"), Some(&pki))));
    let me = pki.issue("engine", "engine-a", &[], false);
    round_trip(&client(&s, Some(client_files(&pki, Some(&me)))));
}

#[test]
fn a_client_without_a_certificate_is_told_to_set_one_under_mutual_tls() {
    let pki = Pki::new();
    let s = server(Some(server_files(&pki.server("s"), Some(&pki))));
    assert_refused(
        &client(&s, Some(client_files(&pki, None))),
        &["MEMKV_TLS_CERT"],
    );
    assert_counts_a_tls_error(&s);
}

#[test]
fn a_client_certificate_of_another_ca_is_refused() {
    let (pki, other) = (Pki::new(), Pki::new());
    let s = server(Some(server_files(&pki.server("s"), Some(&pki))));
    let stranger = other.issue("c", "engine-x", &[], false);
    let c = client(&s, Some(client_files(&pki, Some(&stranger))));
    assert_refused(&c, &["refused the client certificate"]);
}

#[test]
fn a_server_certificate_of_another_ca_names_tls_ca() {
    let (pki, other) = (Pki::new(), Pki::new());
    let s = server(Some(server_files(&pki.server("s"), None)));
    assert_refused(
        &client(&s, Some(client_files(&other, None))),
        &["MEMKV_TLS_CA"],
    );
}

#[test]
fn a_server_certificate_without_the_name_names_tls_server_name() {
    let pki = Pki::new();
    let s = server(Some(server_files(&pki.server("s"), None)));
    let mut files = client_files(&pki, None);
    files.server_name = Some("memkv.other.example".into());
    assert_refused(&client(&s, Some(files.clone())), &["MEMKV_TLS_SERVER_NAME"]);
    // The name the certificate carries passes.
    files.server_name = Some("localhost".into());
    assert!(client(&s, Some(files)).ping()[0].1.is_ok());
}

#[test]
fn an_expired_server_certificate_is_refused() {
    let pki = Pki::new();
    let old = pki.issue("old", "localhost", &["localhost", "127.0.0.1"], true);
    let s = server(Some(server_files(&old, None)));
    assert_refused(
        &client(&s, Some(client_files(&pki, None))),
        &["validity period"],
    );
}

#[test]
fn an_expired_client_certificate_is_refused() {
    let pki = Pki::new();
    let s = server(Some(server_files(&pki.server("s"), Some(&pki))));
    let old = pki.issue("old", "engine-a", &[], true);
    assert_refused(
        &client(&s, Some(client_files(&pki, Some(&old)))),
        &["refused the client certificate"],
    );
}

#[test]
fn a_plaintext_client_of_a_tls_server_is_told_to_configure_tls() {
    let pki = Pki::new();
    let s = server(Some(server_files(&pki.server("s"), None)));
    assert_refused(&client(&s, None), &["requires TLS", "MEMKV_TLS_CA"]);
    assert_counts_a_tls_error(&s);
}

#[test]
fn a_tls_client_of_a_plaintext_server_is_told_which_side_to_change() {
    let pki = Pki::new();
    let s = server(None);
    let c = client(&s, Some(client_files(&pki, None)));
    assert_refused(&c, &["speaks plaintext memkv", "--tls-cert"]);
    assert_counts_a_tls_error(&s);
}

#[test]
fn a_reload_keeps_open_connections_and_new_ones_see_the_new_certificate() {
    let (pki, next) = (Pki::new(), Pki::new());
    let files = server_files(&pki.server("s"), None);
    let s = server(Some(files.clone()));
    let open = client(&s, Some(client_files(&pki, None)));
    assert_eq!(put(&open, b"before", b"1"), Status::Ok);
    // The new certificate comes from another CA, so a client tells which one it was shown.
    let renewed = next.server("s");
    std::fs::copy(&renewed.cert, &files.cert).unwrap();
    std::fs::copy(&renewed.key, &files.key).unwrap();
    s.reload_tls().unwrap();
    // The pooled connection (one per server) goes on.
    assert_eq!(put(&open, b"after", b"2"), Status::Ok);
    assert_eq!(get(&open, b"before", 1), (Status::Ok, b"1".to_vec()));
    assert_eq!(
        s.store
            .metrics
            .connections_accepted
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_refused(
        &client(&s, Some(client_files(&pki, None))),
        &["MEMKV_TLS_CA"],
    );
    assert!(client(&s, Some(client_files(&next, None))).ping()[0]
        .1
        .is_ok());
}

#[test]
fn a_reload_of_a_broken_key_keeps_the_certificate_in_use() {
    let pki = Pki::new();
    let files = server_files(&pki.server("s"), None);
    let s = server(Some(files.clone()));
    std::fs::write(&files.key, "not a key").unwrap();
    let e = s.reload_tls().unwrap_err();
    assert!(e.contains("s.key"), "{e}");
    round_trip(&client(&s, Some(client_files(&pki, None))));
}

#[test]
fn tls_refuses_rdma_without_the_opt_in() {
    let pki = Pki::new();
    let e = Client::new(ClientConfig {
        transport: TransportChoice::Rdma,
        tls: Some(client_files(&pki, None)),
        ..ClientConfig::default()
    })
    .err()
    .unwrap();
    assert!(e.contains("MEMKV_TLS_ALLOW_RDMA"), "{e}");
    let e = Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory: 16 << 20,
        tls: Some(server_files(&pki.server("s"), None)),
        rdma: Some(memkv_server::rdma::RdmaConfig::default()),
        ..ServerConfig::default()
    })
    .err()
    .unwrap();
    assert!(e.to_string().contains("--tls-allow-rdma"), "{e}");
}

#[test]
fn auto_under_tls_stays_on_tls() {
    let pki = Pki::new();
    let s = server(Some(server_files(&pki.server("s"), None)));
    assert!(
        s.shm_socket.is_some(),
        "the same-host socket is on beside plain TLS"
    );
    let c = Client::new(ClientConfig {
        servers: vec![s.addr.to_string()],
        transport: TransportChoice::Auto,
        connections_per_server: 1,
        tls: Some(client_files(&pki, None)),
        ..ClientConfig::default()
    })
    .unwrap();
    round_trip(&c);
    // No same-host connection was made: the one connection accepted is the TLS one.
    assert_eq!(
        s.store
            .metrics
            .connections_accepted
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[test]
fn mutual_tls_without_an_auth_key_turns_the_same_host_socket_off() {
    let pki = Pki::new();
    let s = server(Some(server_files(&pki.server("s"), Some(&pki))));
    assert!(s.shm_socket.is_none());
}
