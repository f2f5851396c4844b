//! Tenants: who a connection is (the auth key it proved, or the subject of its verified client
//! certificate under mutual TLS), which keys it may name (those starting with its prefix),
//! whether it may write, and how much memory its values may take (its quota, accounted in
//! `usage`). `file` reads them from `--tenants FILE`. A server without a tenants file has one
//! implicit tenant: the shared `--auth-key` (or none), no prefix, no quota, as before tenants.

pub mod file;
pub mod usage;

use std::fmt;

use memkv_proto::TenantInfo;

/// A tenant's place in its table (and in `usage::Usage`).
pub type TenantId = u16;

/// Most tenants one table holds (their ids are `TenantId`s).
pub const MAX_TENANTS: usize = 4096;

#[derive(Clone, PartialEq, Eq)]
pub struct Tenant {
    pub name: String,
    /// The 32-byte key of the HMAC-SHA256 challenge that names this tenant.
    pub auth_key: Option<Vec<u8>>,
    /// The subject of the client certificate that names this tenant under mutual TLS, as the
    /// TLS layer renders a verified certificate's subject (e.g. `CN=team-a, O=example`).
    pub cert_subject: Option<String>,
    /// Every key the tenant names must start with these bytes.
    pub prefix: Vec<u8>,
    /// Bytes its values may take, as the store charges them (arena footprint plus index
    /// charge); `u64::MAX` for the implicit tenant.
    pub quota: u64,
    /// PUT and DELETE answer FORBIDDEN.
    pub read_only: bool,
}

impl fmt::Debug for Tenant {
    /// Everything but the key, which must not reach a log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tenant")
            .field("name", &self.name)
            .field("auth_key", &self.auth_key.as_ref().map(|_| "<secret>"))
            .field("cert_subject", &self.cert_subject)
            .field("prefix", &String::from_utf8_lossy(&self.prefix))
            .field("quota", &self.quota)
            .field("read_only", &self.read_only)
            .finish()
    }
}

impl Tenant {
    /// Whether the tenant may name `key` at all (read it, probe it, lease it).
    pub fn may_name(&self, key: &[u8]) -> bool {
        key.starts_with(&self.prefix)
    }

    /// Whether the tenant may store or delete `key`.
    pub fn may_write(&self, key: &[u8]) -> bool {
        !self.read_only && self.may_name(key)
    }

    /// What the AUTH reply tells the client about its tenant.
    pub fn info(&self) -> TenantInfo {
        TenantInfo {
            name: self.name.clone(),
            prefix: self.prefix.clone(),
            read_only: self.read_only,
        }
    }
}

/// The tenants of a server, looked up by credential; ids index `list`.
#[derive(Clone, Debug)]
pub struct Tenants {
    list: Vec<Tenant>,
    /// From a tenants file (else the one implicit tenant).
    named: bool,
}

impl Tenants {
    /// The one tenant of a server without a tenants file: `auth_key` shared by every client
    /// (or none), no prefix, no quota.
    pub fn implicit(auth_key: Option<Vec<u8>>) -> Tenants {
        Tenants {
            list: vec![Tenant {
                name: "default".into(),
                auth_key,
                cert_subject: None,
                prefix: Vec::new(),
                quota: u64::MAX,
                read_only: false,
            }],
            named: false,
        }
    }

    /// The tenants of a tenants file, after `file::check` (which `file::load` runs).
    pub fn named(list: Vec<Tenant>) -> Result<Tenants, String> {
        file::check(&list)?;
        Ok(Tenants { list, named: true })
    }

    /// Whether the tenants came from a tenants file (stats and metrics then show each).
    pub fn is_named(&self) -> bool {
        self.named
    }

    /// Whether a connection must answer the auth challenge: always with a tenants file (a
    /// connection is nobody until a credential names its tenant), else when the shared key is
    /// set.
    pub fn auth_required(&self) -> bool {
        self.named || self.list[0].auth_key.is_some()
    }

    /// The tenant whose key answers `nonce` with `answer`. Every key is tried (each check in
    /// constant time), so the time taken does not tell which tenant, if any, matched.
    pub fn by_answer(&self, nonce: &[u8], answer: &[u8]) -> Option<TenantId> {
        let mut found = None;
        for (i, t) in self.list.iter().enumerate() {
            if let Some(key) = &t.auth_key {
                if memkv_proto::auth_verify(key, nonce, answer) && found.is_none() {
                    found = Some(i as TenantId);
                }
            }
        }
        found
    }

    /// The tenant a verified client certificate with this subject names (exact match: a
    /// subject is not a pattern).
    pub fn by_subject(&self, subject: &str) -> Option<TenantId> {
        self.list
            .iter()
            .position(|t| t.cert_subject.as_deref() == Some(subject))
            .map(|i| i as TenantId)
    }

    /// The tenant whose prefix `key` starts with: the owner of a value read back from the disk
    /// tier (prefixes never overlap, `file::check`, so there is at most one).
    pub fn owner_of(&self, key: &[u8]) -> Option<TenantId> {
        self.list
            .iter()
            .position(|t| t.may_name(key))
            .map(|i| i as TenantId)
    }

    pub fn get(&self, id: TenantId) -> &Tenant {
        &self.list[id as usize]
    }

    pub fn iter(&self) -> impl Iterator<Item = &Tenant> {
        self.list.iter()
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn tenant(name: &str, key: u8, prefix: &str) -> Tenant {
        Tenant {
            name: name.into(),
            auth_key: Some(vec![key; 32]),
            cert_subject: Some(format!("CN={name}")),
            prefix: prefix.as_bytes().to_vec(),
            quota: 1 << 20,
            read_only: false,
        }
    }

    #[test]
    fn a_credential_names_its_tenant_and_nothing_else() {
        let t = Tenants::named(vec![tenant("a", 1, "a/"), tenant("b", 2, "b/")]).unwrap();
        let nonce = [9u8; 32];
        assert_eq!(
            t.by_answer(&nonce, &memkv_proto::auth_mac(&[2; 32], &nonce)),
            Some(1)
        );
        assert_eq!(
            t.by_answer(&nonce, &memkv_proto::auth_mac(&[1; 32], &nonce)),
            Some(0)
        );
        assert_eq!(
            t.by_answer(&nonce, &memkv_proto::auth_mac(&[3; 32], &nonce)),
            None
        );
        assert_eq!(t.by_answer(&nonce, &[0; 5]), None);
        assert_eq!(t.by_subject("CN=b"), Some(1));
        assert_eq!(t.by_subject("CN=b,O=x"), None);
        assert_eq!(t.by_subject(""), None);
        assert!(t.auth_required());
    }

    #[test]
    fn a_key_is_owned_by_the_tenant_whose_prefix_it_starts_with() {
        let t = Tenants::named(vec![tenant("a", 1, "a/"), tenant("b", 2, "b/")]).unwrap();
        assert_eq!(t.owner_of(b"b/x"), Some(1));
        assert_eq!(t.owner_of(b"a/"), Some(0));
        assert_eq!(t.owner_of(b"c/x"), None);
        assert_eq!(Tenants::implicit(None).owner_of(b"c/x"), Some(0));
    }

    #[test]
    fn a_tenant_names_only_keys_under_its_prefix_and_a_reader_writes_none() {
        let mut a = tenant("a", 1, "team-a/");
        assert!(a.may_name(b"team-a/x") && a.may_write(b"team-a/x"));
        assert!(a.may_name(b"team-a/"), "the prefix itself is inside");
        for k in [&b"team-a"[..], b"team-b/x", b"", b"xteam-a/", b"team-A/x"] {
            assert!(!a.may_name(k) && !a.may_write(k), "{k:?}");
        }
        a.read_only = true;
        assert!(a.may_name(b"team-a/x") && !a.may_write(b"team-a/x"));
    }

    #[test]
    fn the_implicit_tenant_is_todays_server() {
        let open = Tenants::implicit(None);
        assert!(!open.auth_required() && !open.is_named());
        let d = open.get(0);
        assert!(d.may_write(b"anything") && d.quota == u64::MAX);
        let keyed = Tenants::implicit(Some(vec![7; 32]));
        assert!(keyed.auth_required());
        let nonce = [1u8; 32];
        assert_eq!(
            keyed.by_answer(&nonce, &memkv_proto::auth_mac(&[7; 32], &nonce)),
            Some(0)
        );
    }

    #[test]
    fn debug_output_never_shows_a_key() {
        let text = format!("{:?}", tenant("a", 0xab, "a/"));
        assert!(
            !text.contains("171") && !text.to_lowercase().contains("abab"),
            "{text}"
        );
        assert!(text.contains("<secret>"));
    }
}
