//! TLS 1.3 for memkv's TCP links (the data connections and RDMA's control channel): the rustls
//! configurations of server and client, built from PEM files, on one crypto provider (`ring`:
//! docs/tls.md says why), and the identity a verified client certificate names.
//!
//! The server's certificate and key sit behind a resolver whose `Arc` is swapped by
//! `ServerTls::reload`: handshakes after it present the new certificate, connections already
//! open keep the keys they agreed on.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection};

pub use rustls;

mod read_ahead;
pub use read_ahead::{ReadAhead, READ_AHEAD};

/// The first byte of every TLS record that opens a connection (a handshake record holding the
/// ClientHello). memkv's own frames start with `b'M'` (`memkv_proto::MAGIC`), so one byte tells
/// a TLS client from a plaintext one.
pub const HANDSHAKE_RECORD: u8 = 0x16;

/// The ALPN protocol a memkv client offers, and a memkv server accepts, to say that it reads
/// the tenant a HELLO reply carries when the client's certificate named it
/// (docs/protocol.md, Tenants). A peer from before it offers or accepts none, and the
/// handshake then goes on without ALPN, so either side may be the older one.
pub const ALPN_HELLO_TENANT: &[u8] = b"memkv-hello-tenant";

/// A connection that failed for a reason of TLS itself (a failed handshake, a bad record, a
/// peer that speaks no TLS), carried inside an `io::Error` so transports can tell it apart.
#[derive(Debug)]
pub struct TlsError(pub String);

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TlsError {}

impl TlsError {
    /// `msg` as an `io::Error` (kind InvalidData) holding a `TlsError`.
    pub fn io(msg: String) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::InvalidData, TlsError(msg))
    }

    /// Whether `e` holds a `TlsError`.
    pub fn is(e: &std::io::Error) -> bool {
        e.get_ref().is_some_and(|i| i.is::<TlsError>())
    }
}

/// The provider every memkv TLS configuration uses, TLS 1.3 only, with its suites in the order
/// that is fastest on this CPU (client and server both offer them so: the server takes the
/// client's first that it shares).
fn provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = suites_by_speed(aes_in_hardware());
    Arc::new(p)
}

/// With AES instructions, AES-128-GCM first: it runs 10 AES rounds a block where AES-256 runs
/// 14, and on that hardware both beat ChaCha20-Poly1305. Without them, ChaCha20 first: software
/// AES is several times slower, and not constant-time.
fn suites_by_speed(aes: bool) -> Vec<rustls::SupportedCipherSuite> {
    use rustls::crypto::ring::cipher_suite as cs;
    let (aes128, aes256, chacha) = (
        cs::TLS13_AES_128_GCM_SHA256,
        cs::TLS13_AES_256_GCM_SHA384,
        cs::TLS13_CHACHA20_POLY1305_SHA256,
    );
    if aes {
        vec![aes128, aes256, chacha]
    } else {
        vec![chacha, aes128, aes256]
    }
}

#[cfg(target_arch = "x86_64")]
fn aes_in_hardware() -> bool {
    std::arch::is_x86_feature_detected!("aes") && std::arch::is_x86_feature_detected!("pclmulqdq")
}

#[cfg(target_arch = "aarch64")]
fn aes_in_hardware() -> bool {
    std::arch::is_aarch64_feature_detected!("aes")
        && std::arch::is_aarch64_feature_detected!("pmull")
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn aes_in_hardware() -> bool {
    false
}

/// Plaintext bytes one write may hand rustls to encrypt before its records go out (rustls
/// holds 64 KiB by default): sixteen full records a system call rather than four. Bounded, as
/// a connection whose peer reads slowly holds this much.
pub const SEND_BUFFER: usize = 256 << 10;

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{}: cannot read PEM certificates: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no PEM certificate in it", path.display()));
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| format!("{}: cannot read a PEM private key: {e}", path.display()))
}

fn roots(path: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for c in certs(path)? {
        roots
            .add(c)
            .map_err(|e| format!("{}: not a usable CA certificate: {e}", path.display()))?;
    }
    Ok(roots)
}

/// A certificate chain and its key, checked to belong together.
fn certified_key(cert: &Path, key_file: &Path) -> Result<Arc<CertifiedKey>, String> {
    let ck = CertifiedKey::from_der(certs(cert)?, key(key_file)?, &provider())
        .map_err(|e| format!("{} with key {}: {e}", cert.display(), key_file.display()))?;
    Ok(Arc::new(ck))
}

/// The server's PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTlsFiles {
    /// Certificate chain, leaf first.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// CA bundle client certificates must chain to (mutual TLS); None: no client certificate.
    pub client_ca: Option<PathBuf>,
}

/// Hands every handshake the certificate loaded last.
struct Reloadable {
    current: RwLock<Arc<CertifiedKey>>,
}

impl fmt::Debug for Reloadable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Reloadable")
    }
}

impl ResolvesServerCert for Reloadable {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().unwrap().clone())
    }
}

/// The server side: makes one `ServerConnection` per accepted socket.
pub struct ServerTls {
    files: ServerTlsFiles,
    config: Arc<ServerConfig>,
    certs: Arc<Reloadable>,
}

impl ServerTls {
    pub fn new(files: &ServerTlsFiles) -> Result<ServerTls, String> {
        let certs = Arc::new(Reloadable {
            current: RwLock::new(certified_key(&files.cert, &files.key)?),
        });
        let builder = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?;
        let builder = match &files.client_ca {
            Some(ca) => {
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider())
                        .build()
                        .map_err(|e| format!("{}: {e}", ca.display()))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_cert_resolver(certs.clone());
        config.alpn_protocols = vec![ALPN_HELLO_TENANT.to_vec()];
        Ok(ServerTls {
            files: files.clone(),
            config: Arc::new(config),
            certs,
        })
    }

    /// Reads the certificate and key files again and uses them for every later handshake. On
    /// an error the certificate in use stays.
    pub fn reload(&self) -> Result<(), String> {
        let ck = certified_key(&self.files.cert, &self.files.key)?;
        *self.certs.current.write().unwrap() = ck;
        Ok(())
    }

    /// Whether clients must present a certificate (`client_ca` was given).
    pub fn mutual(&self) -> bool {
        self.files.client_ca.is_some()
    }

    pub fn connection(&self) -> Result<ServerConnection, rustls::Error> {
        let mut c = ServerConnection::new(self.config.clone())?;
        c.set_buffer_limit(Some(SEND_BUFFER));
        Ok(c)
    }
}

/// The client's PEM files and the name it verifies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientTlsFiles {
    /// CA bundle the server certificates must chain to.
    pub ca: PathBuf,
    /// Name every server's certificate must carry; None: the host part of each server address.
    pub server_name: Option<String>,
    /// Client certificate chain and key, for servers that ask for one (mutual TLS).
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// The client side: makes one `ClientConnection` per link.
pub struct ClientTls {
    config: Arc<ClientConfig>,
    server_name: Option<ServerName<'static>>,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

fn server_name(name: &str) -> Result<ServerName<'static>, String> {
    ServerName::try_from(name.to_string())
        .map_err(|e| format!("{name:?} is not a DNS name or IP address: {e}"))
}

impl ClientTls {
    pub fn new(files: &ClientTlsFiles) -> Result<ClientTls, String> {
        let builder = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots(&files.ca)?);
        let mut config = match (&files.cert, &files.key) {
            (Some(cert), Some(key_file)) => builder
                .with_client_auth_cert(certs(cert)?, key(key_file)?)
                .map_err(|e| format!("{} with key {}: {e}", cert.display(), key_file.display()))?,
            (None, None) => builder.with_no_client_auth(),
            _ => {
                return Err("a client certificate needs its key, and a key its certificate".into())
            }
        };
        config.alpn_protocols = vec![ALPN_HELLO_TENANT.to_vec()];
        Ok(ClientTls {
            config: Arc::new(config),
            server_name: files.server_name.as_deref().map(server_name).transpose()?,
        })
    }

    /// A connection to the server at `host` (verified against the configured server name, else
    /// `host` itself).
    pub fn connection(&self, host: &str) -> Result<ClientConnection, String> {
        let name = match &self.server_name {
            Some(n) => n.clone(),
            None => server_name(host.trim_start_matches('[').trim_end_matches(']'))?,
        };
        let mut c = ClientConnection::new(self.config.clone(), name).map_err(|e| e.to_string())?;
        c.set_buffer_limit(Some(SEND_BUFFER));
        Ok(c)
    }
}

/// Who a verified client certificate says the peer is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    /// The subject's distinguished name, as RFC 4514 writes it (`CN=engine-a, O=team-a`).
    pub subject: String,
    /// The DNS names of its subject alternative names.
    pub dns_names: Vec<String>,
    /// The URIs of its subject alternative names (SPIFFE IDs, for one).
    pub uris: Vec<String>,
}

impl PeerIdentity {
    /// The identity of a DER certificate; None when it cannot be parsed (rustls verified it, so
    /// that means an extension this parser does not know).
    pub fn from_der(cert: &[u8]) -> Option<PeerIdentity> {
        use x509_parser::extensions::GeneralName;
        let (_, c) = x509_parser::parse_x509_certificate(cert).ok()?;
        let (mut dns_names, mut uris) = (Vec::new(), Vec::new());
        if let Ok(Some(san)) = c.subject_alternative_name() {
            for n in &san.value.general_names {
                match n {
                    GeneralName::DNSName(d) => dns_names.push(d.to_string()),
                    GeneralName::URI(u) => uris.push(u.to_string()),
                    _ => {}
                }
            }
        }
        Some(PeerIdentity {
            subject: c.subject().to_string(),
            dns_names,
            uris,
        })
    }
}

#[cfg(any(test, feature = "ephemeral"))]
pub mod ephemeral;
#[cfg(any(test, feature = "ephemeral"))]
pub mod record_rate;
#[cfg(test)]
mod tests;
