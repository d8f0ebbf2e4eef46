//! `rediss://`: TLS to a single Redis, with the server verified against the system's
//! roots or `ca_file=PATH`, and an optional client certificate (`cert_file=PATH`,
//! `key_file=PATH`) for servers that require one (`tls-auth-clients yes`).

use redis::{ClientTlsConfig, TlsCertificates};

use crate::error::Result;
use crate::url::ConnectUrl;

/// The TLS files a `rediss://` URL names (paths only; read at connect time).
#[derive(Debug)]
pub(crate) struct TlsFiles {
    ca: Option<String>,
    client: Option<(String, String)>,
}

impl TlsFiles {
    /// Take the TLS parameters out of `url`: `Some` for `rediss://`, `None` otherwise
    /// (where any TLS parameter is an error rather than silently plain text).
    pub(crate) fn take(url: &mut ConnectUrl) -> Result<Option<Self>> {
        let ca = url.take_param("ca_file");
        let cert = url.take_param("cert_file");
        let key = url.take_param("key_file");
        if url.scheme() != "rediss" {
            if ca.is_some() || cert.is_some() || key.is_some() {
                return Err(url.invalid("ca_file, cert_file and key_file need TLS: use rediss://"));
            }
            return Ok(None);
        }
        let client = match (cert, key) {
            (None, None) => None,
            (Some(c), Some(k)) => Some((c, k)),
            _ => {
                return Err(url.invalid("cert_file and key_file go together (mutual TLS)"));
            }
        };
        Ok(Some(TlsFiles { ca, client }))
    }

    /// Read the files into what the driver takes.
    pub(crate) fn load(&self, url: &ConnectUrl) -> Result<TlsCertificates> {
        install_crypto_provider();
        let read = |param: &str, path: &str| {
            std::fs::read(path)
                .map_err(|e| url.invalid(&format!("cannot read {param} {path:?}: {}", e.kind())))
        };
        let root_cert = self.ca.as_deref().map(|p| read("ca_file", p)).transpose()?;
        let client_tls = match &self.client {
            None => None,
            Some((cert, key)) => Some(ClientTlsConfig {
                client_cert: read("cert_file", cert)?,
                client_key: read("key_file", key)?,
            }),
        };
        Ok(TlsCertificates {
            client_tls,
            root_cert,
        })
    }
}

/// rustls needs one process-wide crypto provider; dlock builds only `ring`. An
/// application that installed its own first keeps it.
fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
