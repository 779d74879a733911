//! TLS configuration shared by the client port, the client and peer TLS:
//! PEM files read with a size bound, and rustls (ring provider)
//! configurations built from them with errors that name the flag and the
//! file.
//!
//! The server side of the client port (`--tls-cert`, `--tls-key`,
//! `--tls-client-ca`) is [`server_config`]; the client side
//! ([`crate::client::ClientBuilder::tls_ca`], `ticket --tls-ca`) is
//! [`client_config`]. Both speak TLS 1.3 and 1.2. Peer TLS between
//! cluster nodes (`crate::cluster::tls`) reads its files through the same
//! functions and speaks TLS 1.3 only.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::RootCertStore;

/// The largest PEM file read: certificates and keys are a few KiB.
const MAX_PEM_BYTES: u64 = 1 << 20;

/// The protocol versions of the client port and the client.
static VERSIONS: &[&rustls::SupportedProtocolVersion] =
    &[&rustls::version::TLS13, &rustls::version::TLS12];

/// The ring provider every configuration is built on.
pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Why a TLS configuration could not be built: which file (by the flag or
/// role that named it) and what was wrong with it.
#[derive(Debug)]
#[non_exhaustive]
pub enum TlsError {
    /// The file could not be opened or read.
    Read {
        /// The flag or role of the file, like `--tls-cert`.
        what: String,
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// The file is over 1 MiB: not a certificate or a key.
    TooLarge {
        /// The flag or role of the file.
        what: String,
        /// The file.
        path: PathBuf,
    },
    /// The file is not PEM of the kind expected.
    Pem {
        /// The flag or role of the file.
        what: String,
        /// The file.
        path: PathBuf,
        /// What it was expected to hold.
        expected: &'static str,
        /// What the PEM parser said.
        source: pem::Error,
    },
    /// The file holds no certificate.
    NoCertificate {
        /// The flag or role of the file.
        what: String,
        /// The file.
        path: PathBuf,
    },
    /// A certificate of a CA file cannot be a trust anchor.
    BadCa {
        /// The flag or role of the file.
        what: String,
        /// The file.
        path: PathBuf,
        /// What rustls said.
        source: rustls::Error,
    },
    /// The client certificate verifier refused the CA file.
    Verifier {
        /// The flag or role of the file.
        what: String,
        /// The file.
        path: PathBuf,
        /// What rustls said.
        source: rustls::server::VerifierBuilderError,
    },
    /// The private key does not go with the certificate.
    KeyMismatch {
        /// The flag or role of the key file.
        what: String,
        /// The key file.
        key: PathBuf,
        /// The flag or role of the certificate file.
        cert_what: String,
        /// The certificate file.
        cert: PathBuf,
        /// What rustls said (boxed: the other fields are large already).
        source: Box<rustls::Error>,
    },
    /// A peer certificate does not name the node it is for (cluster mode's
    /// `--peer-tls-cert`).
    NotNamed {
        /// The flag of the certificate file.
        what: String,
        /// The file.
        path: PathBuf,
        /// The DNS name it should hold, like `node1.ticketd`.
        name: String,
    },
    /// A name is not one a certificate can be checked against.
    ServerName {
        /// What the name is for, like `peer name for node 3`.
        what: String,
        /// What rustls said.
        source: rustls::pki_types::InvalidDnsNameError,
    },
    /// rustls refused the configuration or a session.
    Rustls(rustls::Error),
}

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TlsError::Read { what, path, source } => {
                write!(f, "{what} {}: {source}", path.display())
            }
            TlsError::TooLarge { what, path } => write!(
                f,
                "{what} {}: over {MAX_PEM_BYTES} bytes, not a PEM file",
                path.display()
            ),
            TlsError::Pem {
                what,
                path,
                expected,
                source,
            } => write!(f, "{what} {}: {expected}: {source}", path.display()),
            TlsError::NoCertificate { what, path } => write!(
                f,
                "{what} {}: no PEM certificate (-----BEGIN CERTIFICATE-----) in it",
                path.display()
            ),
            TlsError::BadCa { what, path, source } => write!(
                f,
                "{what} {}: not a usable CA certificate: {source}",
                path.display()
            ),
            TlsError::Verifier { what, path, source } => {
                write!(f, "{what} {}: {source}", path.display())
            }
            TlsError::KeyMismatch {
                what,
                key,
                cert_what,
                cert,
                source,
            } => write!(
                f,
                "{what} {}: does not go with {cert_what} {}: {source}",
                key.display(),
                cert.display()
            ),
            TlsError::NotNamed { what, path, name } => write!(
                f,
                "{what} {}: the certificate does not name {name} in its subjectAltName; make \
                 one with `ticket certs init`",
                path.display()
            ),
            TlsError::ServerName { what, source } => write!(f, "{what}: {source}"),
            TlsError::Rustls(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for TlsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TlsError::Read { source, .. } => Some(source),
            TlsError::Pem { source, .. } => Some(source),
            TlsError::BadCa { source, .. } => Some(source),
            TlsError::KeyMismatch { source, .. } => Some(&**source),
            TlsError::Verifier { source, .. } => Some(source),
            TlsError::ServerName { source, .. } => Some(source),
            TlsError::Rustls(e) => Some(e),
            TlsError::TooLarge { .. }
            | TlsError::NoCertificate { .. }
            | TlsError::NotNamed { .. } => None,
        }
    }
}

/// Reads a PEM file of at most [`MAX_PEM_BYTES`].
pub(crate) fn read_pem_file(path: &Path, what: &str) -> Result<Vec<u8>, TlsError> {
    use std::io::Read;
    let failed = |source| TlsError::Read {
        what: what.to_owned(),
        path: path.to_owned(),
        source,
    };
    let f = std::fs::File::open(path).map_err(failed)?;
    let mut bytes = Vec::new();
    f.take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(failed)?;
    if bytes.len() as u64 > MAX_PEM_BYTES {
        return Err(TlsError::TooLarge {
            what: what.to_owned(),
            path: path.to_owned(),
        });
    }
    Ok(bytes)
}

/// The certificates of a PEM file (at least one).
pub(crate) fn read_certs(
    path: &Path,
    what: &str,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read_pem_file(path, what)?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<_, _>>()
        .map_err(|source| TlsError::Pem {
            what: what.to_owned(),
            path: path.to_owned(),
            expected: "not a PEM certificate file",
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            what: what.to_owned(),
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub(crate) fn read_key(path: &Path, what: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read_pem_file(path, what)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|source| TlsError::Pem {
        what: what.to_owned(),
        path: path.to_owned(),
        expected: "no PEM private key in it",
        source,
    })
}

/// A root store of the CA certificates in a PEM file.
pub(crate) fn read_roots(path: &Path, what: &str) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in read_certs(path, what)? {
        roots.add(c).map_err(|source| TlsError::BadCa {
            what: what.to_owned(),
            path: path.to_owned(),
            source,
        })?;
    }
    Ok(Arc::new(roots))
}

/// The rustls server configuration of the client port: TLS 1.3 and 1.2,
/// the certificate and key in `cert` and `key`, and a client certificate
/// required when `client_ca` is given. `flags` names the flags in errors (`--tls` for
/// `--tls-cert`/`--tls-key`/`--tls-client-ca`, `--admin-tls` for the admin
/// port's).
///
/// # Errors
/// A file is missing, unreadable, not PEM of the right kind, or the key
/// does not go with the certificate; the message names the flag and file.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
    flags: &str,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let provider = provider();
    let cert_flag = format!("{flags}-cert");
    let key_flag = format!("{flags}-key");
    let chain = read_certs(cert, &cert_flag)?;
    let key_der = read_key(key, &key_flag)?;
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(VERSIONS)
        .map_err(TlsError::Rustls)?;
    let builder = match client_ca {
        Some(ca) => {
            let ca_flag = format!("{flags}-client-ca");
            let roots = read_roots(ca, &ca_flag)?;
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider)
                    .build()
                    .map_err(|source| TlsError::Verifier {
                        what: ca_flag,
                        path: ca.to_owned(),
                        source,
                    })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config =
        builder
            .with_single_cert(chain, key_der)
            .map_err(|source| TlsError::KeyMismatch {
                what: key_flag,
                key: key.to_owned(),
                cert_what: cert_flag,
                cert: cert.to_owned(),
                source: Box::new(source),
            })?;
    // No resumption tickets: a lock client keeps its connections, and a
    // ticket is bytes and a key for nothing.
    config.send_tls13_tickets = 0;
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    Ok(Arc::new(config))
}

/// The rustls client configuration: TLS 1.3 and 1.2, servers trusted when
/// their certificate chains to `ca`, and a client certificate when
/// `cert_key` is given.
///
/// # Errors
/// A file is missing, unreadable, not PEM of the right kind, or the key
/// does not go with the certificate.
pub fn client_config(
    ca: &Path,
    cert_key: Option<(&Path, &Path)>,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let roots = read_roots(ca, "TLS CA file")?;
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .map_err(TlsError::Rustls)?
        .with_root_certificates(roots);
    let config = match cert_key {
        Some((cert, key)) => {
            let chain = read_certs(cert, "TLS client certificate")?;
            let k = read_key(key, "TLS client key")?;
            builder
                .with_client_auth_cert(chain, k)
                .map_err(|source| TlsError::KeyMismatch {
                    what: "TLS client key".to_owned(),
                    key: key.to_owned(),
                    cert_what: "the certificate".to_owned(),
                    cert: cert.to_owned(),
                    source: Box::new(source),
                })?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ticketd-tls-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn each_bad_file_is_named_with_its_flag_and_what_is_wrong() {
        let dir = tmp("errors");
        let missing = dir.join("missing.pem");
        let e = read_certs(&missing, "--tls-cert").unwrap_err();
        assert!(
            matches!(&e, TlsError::Read { what, path, source }
                if what == "--tls-cert" && *path == missing
                    && source.kind() == io::ErrorKind::NotFound),
            "{e:?}"
        );
        assert!(e.source().is_some());
        assert!(e.to_string().starts_with("--tls-cert "), "{e}");

        let big = dir.join("big.pem");
        std::fs::write(&big, vec![b'a'; MAX_PEM_BYTES as usize + 1]).unwrap();
        let e = read_key(&big, "--tls-key").unwrap_err();
        assert!(matches!(e, TlsError::TooLarge { .. }), "{e:?}");
        assert!(e.to_string().contains("not a PEM file"), "{e}");

        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not pem at all\n").unwrap();
        let e = read_certs(&junk, "--tls-cert").unwrap_err();
        assert!(matches!(e, TlsError::NoCertificate { .. }), "{e:?}");
        assert!(e.source().is_none());
        let e = read_key(&junk, "--tls-key").unwrap_err();
        assert!(
            matches!(&e, TlsError::Pem { what, .. } if what == "--tls-key"),
            "{e:?}"
        );
        assert!(e.to_string().contains("no PEM private key in it"), "{e}");

        let e = server_config(&junk, &junk, None, "--admin-tls").unwrap_err();
        assert!(e.to_string().starts_with("--admin-tls-cert "), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
