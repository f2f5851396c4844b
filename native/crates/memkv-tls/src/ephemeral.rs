//! Certificates made on the spot, for tests and the bench's in-process TLS server: a CA per
//! `Pki`, leaf certificates it signs (valid or already expired), written as PEM files into a
//! directory removed on drop. Certificates for real deployments come from the operator.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

/// A test CA and the directory its files are written to.
pub struct Pki {
    dir: PathBuf,
    ca: Certificate,
    ca_key: KeyPair,
}

/// A certificate and key written by `Pki::issue`.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Pki {
    /// A new CA whose certificate is `ca.pem` in a fresh directory.
    pub fn new() -> Pki {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "memkv-tls-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name
            .push(DnType::CommonName, "memkv test CA");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = p.self_signed(&ca_key).unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        Pki { dir, ca, ca_key }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// A leaf certificate for `cn` with subject alternative names `sans` (IP addresses where
    /// they parse as one, URIs where they hold `://`), usable by servers and clients, written as `NAME.pem` and
    /// `NAME.key`; `expired`: its validity ended in 2021.
    pub fn issue(&self, name: &str, cn: &str, sans: &[&str], expired: bool) -> Issued {
        let key = KeyPair::generate().unwrap();
        let (uris, names): (Vec<&str>, Vec<&str>) = sans.iter().partition(|s| s.contains("://"));
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut p = CertificateParams::new(names).unwrap();
        for u in uris {
            p.subject_alt_names
                .push(SanType::URI(u.try_into().unwrap()));
        }
        p.distinguished_name.push(DnType::CommonName, cn);
        p.distinguished_name
            .push(DnType::OrganizationName, "memkv tests");
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        if expired {
            p.not_before = rcgen::date_time_ymd(2020, 1, 1);
            p.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let cert = p.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        let out = Issued {
            cert: self.dir.join(format!("{name}.pem")),
            key: self.dir.join(format!("{name}.key")),
        };
        std::fs::write(&out.cert, cert.pem()).unwrap();
        std::fs::write(&out.key, key.serialize_pem()).unwrap();
        out
    }

    /// The usual server certificate: `localhost` and 127.0.0.1.
    pub fn server(&self, name: &str) -> Issued {
        self.issue(name, "localhost", &["localhost", "127.0.0.1"], false)
    }
}

impl Default for Pki {
    fn default() -> Self {
        Pki::new()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
