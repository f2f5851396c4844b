//! The tenants file (`memkv serve --tenants FILE`), YAML:
//!
//! ```yaml
//! tenants:
//!   - name: team-a                 # letters, digits, '.', '_', '-'; the `tenant` label
//!     auth_key: 64 hex characters  # and/or client_cert_subject: "CN=team-a" (mutual TLS)
//!     prefix: "team-a/"            # every key the tenant names starts with it
//!     quota: 8G                    # memory its values may take (binary units, as --memory)
//!     read_only: false             # optional
//! ```
//!
//! `check` refuses a table in which one tenant could reach another's values: duplicate names,
//! keys or subjects, and prefixes of which one starts the other (an empty prefix among two
//! tenants, equal prefixes, `a/` beside `a/b/`).

use std::collections::HashSet;
use std::path::Path;

use serde::Deserialize;

use super::{Tenant, Tenants, MAX_TENANTS};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDoc {
    tenants: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    auth_key: Option<String>,
    client_cert_subject: Option<String>,
    prefix: String,
    quota: String,
    #[serde(default)]
    read_only: bool,
}

/// Longest tenant name (it is a metrics label and a log field).
const MAX_NAME: usize = 64;

/// Reads and checks the tenants file at `path`. Returns the table and notes worth a log line
/// (quotas that add up to more than `memory`, a file others can read).
pub fn load(path: &Path, memory: u64) -> Result<(Tenants, Vec<String>), String> {
    let at = |e: String| format!("--tenants {}: {e}", path.display());
    let text = std::fs::read_to_string(path).map_err(|e| at(e.to_string()))?;
    let (tenants, mut notes) = parse(&text, memory).map_err(at)?;
    if readable_by_others(path) {
        notes.push(format!(
            "--tenants {}: the file holds auth keys and other users can read it (chmod 600)",
            path.display()
        ));
    }
    Ok((tenants, notes))
}

fn readable_by_others(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o044 != 0)
}

/// The table of a tenants file's text (see the module doc), checked.
pub fn parse(text: &str, memory: u64) -> Result<(Tenants, Vec<String>), String> {
    let doc: FileDoc = serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?;
    let list = doc
        .tenants
        .into_iter()
        .enumerate()
        .map(|(i, e)| tenant(e).map_err(|(name, why)| format!("tenant #{} ({name}): {why}", i + 1)))
        .collect::<Result<Vec<_>, _>>()?;
    let tenants = Tenants::named(list)?;
    let mut notes: Vec<String> = (tenants.iter())
        .filter(|t| t.auth_key.is_none())
        .map(|t| {
            format!(
                "tenant {} has no auth_key: only a verified client certificate (mutual TLS) \
                 names it",
                t.name
            )
        })
        .collect();
    let sum = tenants.iter().fold(0u64, |a, t| a.saturating_add(t.quota));
    if sum > memory {
        notes.push(format!(
            "the tenants' quotas add up to {sum} bytes, more than --memory ({memory}): a tenant \
             under its quota can then find the memory full, and its PUT evicts other tenants' \
             values as a server without tenants does (docs/security.md)"
        ));
    }
    Ok((tenants, notes))
}

fn tenant(e: Entry) -> Result<Tenant, (String, String)> {
    let fail = |why: String| (e.name.clone(), why);
    let auth_key = e
        .auth_key
        .as_deref()
        .map(crate::parse_auth_key)
        .transpose()
        .map_err(|why| fail(format!("auth_key: {why}")))?;
    let quota = crate::parse_size(&e.quota).map_err(|why| fail(format!("quota: {why}")))?;
    Ok(Tenant {
        name: e.name.clone(),
        auth_key,
        cert_subject: e.client_cert_subject.clone(),
        prefix: e.prefix.clone().into_bytes(),
        quota,
        read_only: e.read_only,
    })
}

/// Refuses a table whose tenants are not told apart by their credentials, or in which one
/// tenant may name another's keys.
pub fn check(list: &[Tenant]) -> Result<(), String> {
    if list.is_empty() {
        return Err("no tenants: list at least one under `tenants:`".into());
    }
    if list.len() > MAX_TENANTS {
        return Err(format!("{} tenants; at most {MAX_TENANTS}", list.len()));
    }
    let (mut names, mut keys, mut subjects) = (HashSet::new(), HashSet::new(), HashSet::new());
    for (i, t) in list.iter().enumerate() {
        let fail = |why: &str| Err(format!("tenant #{} ({}): {why}", i + 1, t.name));
        let name_ok = !t.name.is_empty()
            && t.name.len() <= MAX_NAME
            && t.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !name_ok {
            return fail("name must be 1 to 64 letters, digits, '.', '_' or '-'");
        }
        if !names.insert(&t.name) {
            return fail("a second tenant of this name");
        }
        if t.auth_key.is_none() && t.cert_subject.is_none() {
            return fail("no credential: give auth_key, client_cert_subject or both");
        }
        if let Some(k) = &t.auth_key {
            if !keys.insert(k) {
                return fail("its auth_key is another tenant's: a key must name one tenant");
            }
        }
        if let Some(s) = &t.cert_subject {
            if s.trim().is_empty() {
                return fail("client_cert_subject is empty");
            }
            if !subjects.insert(s) {
                return fail("its client_cert_subject is another tenant's");
            }
        }
        if t.prefix.len() >= memkv_proto::MAX_KEY_LEN {
            return fail("prefix leaves no room for a key (keys are at most 1024 bytes)");
        }
        if t.quota == 0 {
            return fail("quota is 0: such a tenant could store nothing");
        }
    }
    for (i, a) in list.iter().enumerate() {
        for b in &list[i + 1..] {
            if a.prefix.starts_with(&b.prefix) || b.prefix.starts_with(&a.prefix) {
                return Err(format!(
                    "tenants {} (prefix {:?}) and {} (prefix {:?}) overlap: one prefix starts \
                     the other, so one tenant could read and overwrite the other's values; give \
                     each a prefix that is not the start of another's (e.g. \"{}/\", \"{}/\")",
                    a.name,
                    String::from_utf8_lossy(&a.prefix),
                    b.name,
                    String::from_utf8_lossy(&b.prefix),
                    a.name,
                    b.name,
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> String {
        format!("{b:02x}").repeat(32)
    }

    fn doc(entries: &[(&str, &str, &str)]) -> String {
        let mut s = String::from("tenants:\n");
        for (i, (name, prefix, quota)) in entries.iter().enumerate() {
            s += &format!(
                "  - name: {name}\n    auth_key: \"{}\"\n    prefix: \"{prefix}\"\n    quota: {quota}\n",
                key(i as u8 + 1)
            );
        }
        s
    }

    #[test]
    fn a_good_file_gives_its_tenants_in_order() {
        let text = doc(&[("a", "a/", "1M"), ("b", "b/", "2M")])
            + "  - name: reader\n    client_cert_subject: CN=reader\n    prefix: r/\n    \
               quota: 1K\n    read_only: true\n";
        let (t, notes) = parse(&text, 1 << 30).unwrap();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("tenant reader has no auth_key"),
            "{notes:?}"
        );
        assert_eq!(t.len(), 3);
        assert_eq!(t.get(1).quota, 2 << 20);
        assert_eq!(t.get(1).prefix, b"b/");
        assert_eq!(t.get(0).auth_key.as_deref(), Some(&[1u8; 32][..]));
        let r = t.get(2);
        assert!(r.read_only && r.auth_key.is_none());
        assert_eq!(r.cert_subject.as_deref(), Some("CN=reader"));
        assert_eq!(t.by_subject("CN=reader"), Some(2));
    }

    #[test]
    fn quotas_above_the_memory_are_allowed_and_noted() {
        let (_, notes) = parse(&doc(&[("a", "a/", "1G"), ("b", "b/", "1G")]), 1 << 30).unwrap();
        assert_eq!(notes.len(), 1);
        assert!(notes[0].contains("more than --memory"), "{notes:?}");
    }

    fn refused(text: &str) -> String {
        match parse(text, 1 << 30) {
            Ok(_) => panic!("accepted:\n{text}"),
            Err(e) => e,
        }
    }

    #[test]
    fn tenants_that_could_reach_each_other_are_refused_with_both_names() {
        for (p, q) in [
            ("a/", "a/"),
            ("a/", "a/b/"),
            ("", "b/"),
            ("team", "team-b/"),
        ] {
            let e = refused(&doc(&[("one", p, "1M"), ("two", q, "1M")]));
            assert!(
                e.contains("one") && e.contains("two") && e.contains("overlap"),
                "{e}"
            );
        }
        let e = refused(&doc(&[("one", "a/", "1M"), ("one", "b/", "1M")]));
        assert!(e.contains("second tenant of this name"), "{e}");
        let same_key = format!(
            "tenants:\n  - {{name: a, auth_key: \"{k}\", prefix: a/, quota: 1M}}\n  \
             - {{name: b, auth_key: \"{k}\", prefix: b/, quota: 1M}}\n",
            k = key(5)
        );
        let e = refused(&same_key);
        assert!(
            e.contains("tenant #2 (b)") && e.contains("another tenant's"),
            "{e}"
        );
    }

    #[test]
    fn bad_fields_are_refused_naming_the_tenant_and_the_field() {
        let k = key(1);
        for (entry, says) in [
            (
                "{name: a, prefix: a/, quota: 1M}".to_string(),
                "no credential",
            ),
            (
                "{name: a, auth_key: abc, prefix: a/, quota: 1M}".to_string(),
                "auth_key",
            ),
            (
                format!("{{name: a, auth_key: \"{k}\", prefix: a/, quota: 1X}}"),
                "quota",
            ),
            (
                format!("{{name: a, auth_key: \"{k}\", prefix: a/, quota: 0}}"),
                "quota is 0",
            ),
            (
                format!("{{name: 'a b', auth_key: \"{k}\", prefix: a/, quota: 1M}}"),
                "name",
            ),
            (
                format!("{{name: a, auth_key: \"{k}\", prefix: a/, quota: 1M, quotas: 2}}"),
                "quotas",
            ),
            (
                format!("{{name: a, auth_key: \"{k}\", quota: 1M}}"),
                "prefix",
            ),
        ] {
            let e = refused(&format!("tenants:\n  - {entry}\n"));
            assert!(e.contains(says), "{entry}: {e}");
        }
        assert!(refused("tenants: []\n").contains("no tenants"));
        assert!(refused("tenant:\n  - name: a\n").contains("tenant"));
    }
}
