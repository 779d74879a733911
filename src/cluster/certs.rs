//! `ticket certs init DIR`: a cluster CA and one certificate per node, with
//! the names peer TLS checks ([`crate::cluster::tls`]), made with rcgen.
//!
//! Writes `ca.pem`, `ca-key.pem`, and `nodeN.pem`, `nodeN-key.pem` for
//! each node. Keys are created 0600, certificates 0644, every file with
//! `O_EXCL`: nothing that exists is overwritten (nor followed, if it is a
//! link), and when one of the files exists nothing is written at all.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

use crate::cluster::tls::node_name;

/// The most nodes one command makes certificates for.
pub const MAX_NODES: u64 = 1000;

/// Years a certificate made here is valid for.
const VALID_YEARS: i32 = 10;

/// What `ticket certs init` makes.
#[derive(Clone, Debug)]
pub struct InitOptions {
    /// Where the files go (created 0700 when missing).
    pub dir: PathBuf,
    /// The cluster name (`--cluster-name` of every node).
    pub cluster_name: String,
    /// Node ids 1..=nodes.
    pub nodes: u64,
}

/// Why `ticket certs init` wrote nothing (or, for [`CertsError::Io`],
/// stopped at a file).
#[derive(Debug)]
#[non_exhaustive]
pub enum CertsError {
    /// `--nodes` is 0 or over [`MAX_NODES`].
    Nodes,
    /// `--cluster-name` has characters a DNS name cannot hold.
    ClusterName(String),
    /// One of the files exists already: nothing is overwritten.
    Exists(PathBuf),
    /// rcgen could not make a key or a certificate.
    Generate(rcgen::Error),
    /// The directory is something else.
    NotADirectory(PathBuf),
    /// Creating the directory or writing a file failed.
    Io {
        /// The directory or file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
}

impl CertsError {
    /// An option is at fault (a usage error), not the disk or rcgen.
    #[must_use]
    pub fn is_usage(&self) -> bool {
        matches!(self, CertsError::Nodes | CertsError::ClusterName(_))
    }
}

impl std::fmt::Display for CertsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CertsError::Nodes => write!(f, "--nodes must be 1..={MAX_NODES}"),
            CertsError::ClusterName(name) => {
                write!(
                    f,
                    "--cluster-name {name:?}: letters, digits, '-' and '.' only"
                )
            }
            CertsError::Exists(p) => write!(
                f,
                "{} exists; refusing to overwrite anything (choose another directory, or \
                 remove the old files)",
                p.display()
            ),
            CertsError::Generate(e) => write!(f, "making a certificate: {e}"),
            CertsError::NotADirectory(p) => write!(f, "{}: not a directory", p.display()),
            CertsError::Io { path, source } => write!(f, "{}: {source}", path.display()),
        }
    }
}

impl std::error::Error for CertsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CertsError::Generate(e) => Some(e),
            CertsError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// The current year (UTC), from the clock.
fn this_year() -> i32 {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // Mean Gregorian year; the validity starts a year back anyway.
    1970 + i32::try_from(secs / 31_556_952).unwrap_or(0)
}

fn params(names: Vec<String>) -> Result<CertificateParams, CertsError> {
    let mut p = CertificateParams::new(names).map_err(CertsError::Generate)?;
    let year = this_year();
    p.not_before = rcgen::date_time_ymd(year - 1, 1, 1);
    p.not_after = rcgen::date_time_ymd(year + VALID_YEARS, 1, 1);
    Ok(p)
}

/// Makes the CA and the node certificates; returns the files written.
///
/// # Errors
/// A message naming the file or the option at fault; no file is written
/// when any of them exists already.
pub fn init(opts: &InitOptions) -> Result<Vec<PathBuf>, CertsError> {
    if opts.nodes == 0 || opts.nodes > MAX_NODES {
        return Err(CertsError::Nodes);
    }
    let name = &opts.cluster_name;
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
    {
        return Err(CertsError::ClusterName(name.clone()));
    }
    let mut files = vec![
        ("ca.pem".to_owned(), false),
        ("ca-key.pem".to_owned(), true),
    ];
    for id in 1..=opts.nodes {
        files.push((format!("node{id}.pem"), false));
        files.push((format!("node{id}-key.pem"), true));
    }
    for (f, _) in &files {
        let p = opts.dir.join(f);
        if p.symlink_metadata().is_ok() {
            return Err(CertsError::Exists(p));
        }
    }
    // Everything is made before anything is written.
    let gen = CertsError::Generate;
    let ca_key = KeyPair::generate().map_err(gen)?;
    let mut ca = params(Vec::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.distinguished_name
        .push(DnType::CommonName, format!("ticketd cluster CA for {name}"));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key_pem = ca_key.serialize_pem();
    let issuer = CertifiedIssuer::self_signed(ca, ca_key).map_err(gen)?;
    let mut out: Vec<(String, bool, String)> = vec![
        ("ca.pem".into(), false, issuer.pem()),
        ("ca-key.pem".into(), true, ca_key_pem),
    ];
    for id in 1..=opts.nodes {
        let dns = node_name(id, name);
        let mut p = params(vec![dns.clone()])?;
        p.distinguished_name.push(DnType::CommonName, dns);
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().map_err(gen)?;
        let cert = p.signed_by(&key, &issuer).map_err(gen)?;
        out.push((format!("node{id}.pem"), false, cert.pem()));
        out.push((format!("node{id}-key.pem"), true, key.serialize_pem()));
    }
    create_dir(&opts.dir)?;
    let mut written = Vec::new();
    for (f, secret, pem) in out {
        let p = opts.dir.join(f);
        write_new(&p, pem.as_bytes(), if secret { 0o600 } else { 0o644 })?;
        written.push(p);
    }
    Ok(written)
}

fn create_dir(dir: &Path) -> Result<(), CertsError> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) if dir.is_dir() => Ok(()),
        Ok(()) => Err(CertsError::NotADirectory(dir.to_owned())),
        Err(source) => Err(CertsError::Io {
            path: dir.to_owned(),
            source,
        }),
    }
}

fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), CertsError> {
    use std::os::unix::fs::PermissionsExt;
    let failed = |source| CertsError::Io {
        path: path.to_owned(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(failed)?;
    // Whatever the umask: exactly `mode`.
    f.set_permissions(std::fs::Permissions::from_mode(mode))
        .and_then(|()| f.write_all(bytes))
        .and_then(|()| f.sync_all())
        .map_err(failed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::tls::{PeerTls, TlsError, TlsFiles};
    use std::os::unix::fs::PermissionsExt;

    fn tmp(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("ticketd-certs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        p
    }

    #[test]
    fn init_makes_loadable_files_with_private_keys_and_never_overwrites() {
        let dir = tmp("init");
        let opts = InitOptions {
            dir: dir.clone(),
            cluster_name: "blue".into(),
            nodes: 2,
        };
        let files = init(&opts).unwrap();
        assert_eq!(files.len(), 6);
        for f in &files {
            let mode = std::fs::metadata(f).unwrap().permissions().mode() & 0o777;
            let key = f.to_string_lossy().ends_with("-key.pem");
            assert_eq!(mode, if key { 0o600 } else { 0o644 }, "{}", f.display());
        }
        let files2 = |id: u64| TlsFiles {
            cert: dir.join(format!("node{id}.pem")),
            key: dir.join(format!("node{id}-key.pem")),
            ca: dir.join("ca.pem"),
        };
        // Each node's files load for its own id and name, and only those.
        let t1 = PeerTls::load(&files2(1), 1, "blue").unwrap();
        assert!(PeerTls::load(&files2(1), 2, "blue").is_err());
        assert!(PeerTls::load(&files2(1), 1, "red").is_err());
        let cert2 = std::fs::read(dir.join("node2.pem")).unwrap();
        let der = rustls::pki_types::pem::PemObject::from_pem_slice(&cert2).unwrap();
        assert!(t1.names_node(&der, 2));
        assert!(!t1.names_node(&der, 1));
        // A second run refuses and changes nothing.
        let before = std::fs::read(dir.join("ca.pem")).unwrap();
        let e = init(&opts).unwrap_err();
        assert!(
            matches!(&e, CertsError::Exists(p) if p.starts_with(&dir)),
            "{e}"
        );
        assert!(e.to_string().contains("exists"), "{e}");
        assert_eq!(std::fs::read(dir.join("ca.pem")).unwrap(), before);
        // So does a run that would add a node next to existing files.
        let e = init(&InitOptions { nodes: 3, ..opts }).unwrap_err();
        assert!(e.to_string().contains("exists"), "{e}");
        assert!(!dir.join("node3.pem").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_options_are_clear_errors() {
        let dir = tmp("bad");
        for (name, nodes) in [
            ("ticketd", 0),
            ("ticketd", MAX_NODES + 1),
            ("a b", 3),
            ("", 3),
        ] {
            let e = init(&InitOptions {
                dir: dir.clone(),
                cluster_name: name.into(),
                nodes,
            })
            .unwrap_err();
            assert!(e.is_usage(), "{e:?}");
            let e = e.to_string();
            assert!(e.contains("--nodes") || e.contains("--cluster-name"), "{e}");
        }
        assert!(!dir.exists(), "nothing was made");
        let e = init(&InitOptions {
            dir: PathBuf::from("/proc/version/x"),
            cluster_name: "t".into(),
            nodes: 1,
        })
        .unwrap_err();
        assert!(!e.is_usage(), "{e:?}");
        assert!(std::error::Error::source(&e).is_some(), "{e:?}");
        assert!(e.to_string().contains("/proc/version"), "{e}");
    }

    #[test]
    fn bad_tls_files_are_errors_that_name_the_file() {
        let dir = tmp("badfiles");
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not pem").unwrap();
        let e = PeerTls::load(
            &TlsFiles {
                cert: junk.clone(),
                key: junk.clone(),
                ca: junk.clone(),
            },
            1,
            "t",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--peer-tls-cert") && e.contains("junk.pem"),
            "{e}"
        );
        let e = PeerTls::load(
            &TlsFiles {
                cert: dir.join("missing.pem"),
                key: junk.clone(),
                ca: junk,
            },
            1,
            "t",
        )
        .unwrap_err();
        assert!(
            matches!(&e, TlsError::Read { what, source, .. }
                if what == "--peer-tls-cert" && source.kind() == std::io::ErrorKind::NotFound),
            "{e:?}"
        );
        let e = e.to_string();
        assert!(e.contains("missing.pem"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
