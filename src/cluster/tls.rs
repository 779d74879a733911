//! Peer TLS: mutual TLS 1.3 between cluster nodes (rustls, ring provider).
//!
//! Every node holds a certificate signed by the cluster CA whose
//! subjectAltName carries the DNS name `node<ID>.<cluster-name>`. A node
//! connecting to peer N checks that the server's certificate chains to the
//! CA and names `nodeN.<cluster-name>`; a node accepting a connection
//! requires a client certificate that chains to the CA, and once the hello
//! says which node is talking, checks that the certificate names that
//! node ([`PeerTls::names_node`]). docs/SECURITY.md has the threat model.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::ClientConfig;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::{ServerConfig, WebPkiClientVerifier};

/// The DNS name a node's certificate must carry.
#[must_use]
pub fn node_name(id: u64, cluster_name: &str) -> String {
    format!("node{id}.{cluster_name}")
}

/// The files peer TLS is made from (`--peer-tls-cert`, `--peer-tls-key`,
/// `--peer-tls-ca`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// This node's certificate (PEM; the chain up to, not including, the CA).
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The cluster CA's certificate(s) (PEM).
    pub ca: PathBuf,
}

/// Client and server configurations for one node.
#[derive(Clone)]
pub struct PeerTls {
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
    cluster_name: String,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTls")
            .field("cluster_name", &self.cluster_name)
            .finish_non_exhaustive()
    }
}

use crate::tls::{read_certs, read_key, read_roots};

/// Why peer TLS could not be set up from its files, or a TLS session with
/// a peer could not start: the crate's one TLS error, which names the flag
/// and the file.
pub use crate::tls::TlsError;

impl PeerTls {
    /// Loads the files and builds both configurations.
    ///
    /// # Errors
    /// A file is missing, unreadable or not what its flag needs; the
    /// error names the file and what is wrong with it.
    pub fn load(files: &TlsFiles, id: u64, cluster_name: &str) -> Result<PeerTls, TlsError> {
        let provider = crate::tls::provider();
        let chain = read_certs(&files.cert, "--peer-tls-cert")?;
        let key = read_key(&files.key, "--peer-tls-key")?;
        let roots = read_roots(&files.ca, "--peer-tls-ca")?;
        let ours = node_name(id, cluster_name);
        if !names(&chain[0], &ours) {
            return Err(TlsError::NotNamed {
                what: "--peer-tls-cert".to_owned(),
                path: files.cert.clone(),
                name: ours,
            });
        }
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|source| TlsError::Verifier {
                what: "--peer-tls-ca".to_owned(),
                path: files.ca.clone(),
                source,
            })?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(TlsError::Rustls)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|source| key_mismatch(files, source))?;
        // Peers never resume: no tickets to send or keep.
        server.send_tls13_tickets = 0;
        let client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(TlsError::Rustls)?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|source| key_mismatch(files, source))?;
        Ok(PeerTls {
            client: Arc::new(client),
            server: Arc::new(server),
            cluster_name: cluster_name.to_owned(),
        })
    }

    /// A client connection to peer `id` (which must prove it is
    /// `node<id>.<cluster-name>`).
    ///
    /// # Errors
    /// The name is no DNS name, or rustls refuses the session.
    pub fn client(&self, id: u64) -> Result<rustls::ClientConnection, TlsError> {
        let name = ServerName::try_from(node_name(id, &self.cluster_name)).map_err(|source| {
            TlsError::ServerName {
                what: format!("peer name for node {id}"),
                source,
            }
        })?;
        rustls::ClientConnection::new(self.client.clone(), name).map_err(TlsError::Rustls)
    }

    /// A server connection for a peer that connected to us.
    ///
    /// # Errors
    /// rustls refuses the session.
    pub fn server(&self) -> Result<rustls::ServerConnection, TlsError> {
        rustls::ServerConnection::new(self.server.clone()).map_err(TlsError::Rustls)
    }

    /// Whether `cert` (already verified to chain to the CA) names node `id`.
    #[must_use]
    pub fn names_node(&self, cert: &CertificateDer<'_>, id: u64) -> bool {
        names(cert, &node_name(id, &self.cluster_name))
    }
}

fn key_mismatch(files: &TlsFiles, source: rustls::Error) -> TlsError {
    TlsError::KeyMismatch {
        what: "--peer-tls-key".to_owned(),
        key: files.key.clone(),
        cert_what: "--peer-tls-cert".to_owned(),
        cert: files.cert.clone(),
        source: Box::new(source),
    }
}

fn names(cert: &CertificateDer<'_>, dns: &str) -> bool {
    let Ok(ee) = webpki::EndEntityCert::try_from(cert) else {
        return false;
    };
    let Ok(name) = ServerName::try_from(dns) else {
        return false;
    };
    ee.verify_is_valid_for_subject_name(&name).is_ok()
}
