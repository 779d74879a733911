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

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
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

/// Reads a PEM file of at most [`MAX_PEM_BYTES`].
pub(crate) fn read_pem_file(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let f = std::fs::File::open(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    let mut bytes = Vec::new();
    f.take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{what} {}: {e}", path.display()))?;
    if bytes.len() as u64 > MAX_PEM_BYTES {
        return Err(format!(
            "{what} {}: over {MAX_PEM_BYTES} bytes, not a PEM file",
            path.display()
        ));
    }
    Ok(bytes)
}

/// The certificates of a PEM file (at least one).
pub(crate) fn read_certs(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = read_pem_file(path, what)?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{what} {}: not a PEM certificate file: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{what} {}: no PEM certificate (-----BEGIN CERTIFICATE-----) in it",
            path.display()
        ));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub(crate) fn read_key(path: &Path, what: &str) -> Result<PrivateKeyDer<'static>, String> {
    let bytes = read_pem_file(path, what)?;
    PrivateKeyDer::from_pem_slice(&bytes)
        .map_err(|e| format!("{what} {}: no PEM private key in it: {e}", path.display()))
}

/// A root store of the CA certificates in a PEM file.
pub(crate) fn read_roots(path: &Path, what: &str) -> Result<Arc<RootCertStore>, String> {
    let mut roots = RootCertStore::empty();
    for c in read_certs(path, what)? {
        roots.add(c).map_err(|e| {
            format!(
                "{what} {}: not a usable CA certificate: {e}",
                path.display()
            )
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
) -> Result<Arc<rustls::ServerConfig>, String> {
    let provider = provider();
    let cert_flag = format!("{flags}-cert");
    let key_flag = format!("{flags}-key");
    let chain = read_certs(cert, &cert_flag)?;
    let key_der = read_key(key, &key_flag)?;
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(VERSIONS)
        .map_err(|e| e.to_string())?;
    let builder = match client_ca {
        Some(ca) => {
            let ca_flag = format!("{flags}-client-ca");
            let roots = read_roots(ca, &ca_flag)?;
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider)
                    .build()
                    .map_err(|e| format!("{ca_flag} {}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key_der).map_err(|e| {
        format!(
            "{key_flag} {}: does not go with {cert_flag} {}: {e}",
            key.display(),
            cert.display()
        )
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
) -> Result<Arc<rustls::ClientConfig>, String> {
    let roots = read_roots(ca, "TLS CA file")?;
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let config = match cert_key {
        Some((cert, key)) => {
            let chain = read_certs(cert, "TLS client certificate")?;
            let k = read_key(key, "TLS client key")?;
            builder.with_client_auth_cert(chain, k).map_err(|e| {
                format!(
                    "TLS client key {}: does not go with the certificate {}: {e}",
                    key.display(),
                    cert.display()
                )
            })?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}
