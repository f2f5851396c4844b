use super::ephemeral::Pki;
use super::*;

fn server_files(pki: &Pki, client_ca: bool) -> ServerTlsFiles {
    let s = pki.server("server");
    ServerTlsFiles {
        cert: s.cert,
        key: s.key,
        client_ca: client_ca.then(|| pki.ca()),
    }
}

#[test]
fn a_client_certificate_names_its_subject_and_alternative_names() {
    let pki = Pki::new();
    let c = pki.issue(
        "c",
        "engine-a",
        &["engine-a.example", "spiffe://t/a"],
        false,
    );
    let der = CertificateDer::from_pem_file(&c.cert).unwrap();
    let id = PeerIdentity::from_der(&der).unwrap();
    assert_eq!(id.subject, "CN=engine-a, O=memkv tests");
    assert_eq!(id.dns_names, vec!["engine-a.example".to_string()]);
    assert_eq!(id.uris, vec!["spiffe://t/a".to_string()]);
}

#[test]
fn a_key_that_is_not_the_certificates_is_refused_and_reload_keeps_the_old_one() {
    let pki = Pki::new();
    let files = server_files(&pki, true);
    let tls = ServerTls::new(&files).unwrap();
    assert!(tls.mutual());
    let other = pki.server("other");
    std::fs::copy(&other.key, &files.key).unwrap();
    let e = tls.reload().unwrap_err();
    assert!(e.contains("server.pem"), "{e}");
    assert!(ServerTls::new(&files).is_err());
}

#[test]
fn missing_and_empty_files_are_named_in_the_error() {
    let pki = Pki::new();
    let mut files = server_files(&pki, false);
    files.cert = pki.dir().join("nope.pem");
    let e = ServerTls::new(&files).err().unwrap();
    assert!(e.contains("nope.pem"), "{e}");
    let empty = pki.dir().join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    let e = ClientTls::new(&ClientTlsFiles {
        ca: empty,
        server_name: None,
        cert: None,
        key: None,
    })
    .unwrap_err();
    assert!(e.contains("no PEM certificate"), "{e}");
}

#[test]
fn a_client_certificate_without_its_key_is_refused() {
    let pki = Pki::new();
    let c = pki.issue("c", "x", &[], false);
    let e = ClientTls::new(&ClientTlsFiles {
        ca: pki.ca(),
        server_name: None,
        cert: Some(c.cert),
        key: None,
    })
    .unwrap_err();
    assert!(e.contains("needs its key"), "{e}");
}

/// Moves the records each side has queued to the other until neither has any.
fn exchange(c: &mut ClientConnection, s: &mut ServerConnection) {
    loop {
        let mut wire = Vec::new();
        let n = c.write_tls(&mut wire).unwrap();
        if n > 0 {
            s.read_tls(&mut &wire[..]).unwrap();
            s.process_new_packets().unwrap();
        }
        let mut back = Vec::new();
        let m = s.write_tls(&mut back).unwrap();
        if m > 0 {
            c.read_tls(&mut &back[..]).unwrap();
            c.process_new_packets().unwrap();
        }
        if n == 0 && m == 0 {
            return;
        }
    }
}

#[test]
fn the_handshake_agrees_on_the_suite_fastest_on_this_cpu() {
    let pki = Pki::new();
    let server = ServerTls::new(&server_files(&pki, false)).unwrap();
    let client = ClientTls::new(&ClientTlsFiles {
        ca: pki.ca(),
        server_name: None,
        cert: None,
        key: None,
    })
    .unwrap();
    let (mut c, mut s) = (
        client.connection("localhost").unwrap(),
        server.connection().unwrap(),
    );
    exchange(&mut c, &mut s);
    assert!(!c.is_handshaking() && !s.is_handshaking());
    assert_eq!(s.alpn_protocol(), Some(ALPN_HELLO_TENANT));
    let want = suites_by_speed(aes_in_hardware())[0].suite();
    assert_eq!(s.negotiated_cipher_suite().unwrap().suite(), want);
    assert_eq!(c.negotiated_cipher_suite().unwrap().suite(), want);
}

#[test]
fn chacha20_comes_first_without_aes_instructions() {
    use rustls::CipherSuite as S;
    let order = |aes| -> Vec<S> { suites_by_speed(aes).iter().map(|s| s.suite()).collect() };
    assert_eq!(
        order(true),
        [
            S::TLS13_AES_128_GCM_SHA256,
            S::TLS13_AES_256_GCM_SHA384,
            S::TLS13_CHACHA20_POLY1305_SHA256
        ]
    );
    assert_eq!(order(false)[0], S::TLS13_CHACHA20_POLY1305_SHA256);
}
