//! Throwaway certificates for TLS tests: a CA, a server certificate for 127.0.0.1 and
//! localhost, a client certificate (mutual TLS), and an unrelated CA that must be refused.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

/// PEM files written into a directory.
#[derive(Debug, Clone)]
pub struct TestCerts {
    /// The CA that signed the server and client certificates.
    pub ca: PathBuf,
    /// Server certificate (SAN 127.0.0.1, localhost) and key.
    pub server_cert: PathBuf,
    /// The server certificate's key.
    pub server_key: PathBuf,
    /// Client certificate signed by [`TestCerts::ca`] and its key.
    pub client_cert: PathBuf,
    /// The client certificate's key.
    pub client_key: PathBuf,
    /// A CA that signed nothing here: trusting only it must fail the handshake.
    pub other_ca: PathBuf,
}

fn ca(common_name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().expect("CA key")).expect("CA cert")
}

fn leaf(
    names: &[&str],
    issuer: &CertifiedIssuer<'static, KeyPair>,
    dir: &Path,
    stem: &str,
) -> (PathBuf, PathBuf) {
    let key = KeyPair::generate().expect("key");
    let mut params =
        CertificateParams::new(names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
            .expect("params");
    params.distinguished_name.push(DnType::CommonName, stem);
    let cert = params.signed_by(&key, issuer).expect("sign");
    let cert_path = dir.join(format!("{stem}.crt"));
    let key_path = dir.join(format!("{stem}.key"));
    std::fs::write(&cert_path, cert.pem()).expect("write cert");
    std::fs::write(&key_path, key.serialize_pem()).expect("write key");
    (cert_path, key_path)
}

impl TestCerts {
    /// Generate a fresh set into `dir`.
    ///
    /// # Panics
    /// When the files cannot be written.
    #[must_use]
    pub fn generate(dir: &Path) -> Self {
        let authority = ca("dlock test CA");
        let other = ca("unrelated CA");
        let ca_path = dir.join("ca.crt");
        let other_path = dir.join("other-ca.crt");
        std::fs::write(&ca_path, authority.pem()).expect("write CA");
        std::fs::write(&other_path, other.pem()).expect("write other CA");
        let (server_cert, server_key) =
            leaf(&["127.0.0.1", "localhost"], &authority, dir, "server");
        let (client_cert, client_key) = leaf(&["dlock-client"], &authority, dir, "client");
        TestCerts {
            ca: ca_path,
            server_cert,
            server_key,
            client_cert,
            client_key,
            other_ca: other_path,
        }
    }
}
