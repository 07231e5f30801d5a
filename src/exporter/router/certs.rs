//! The router's TLS (docs/exporter.md, "The router"): a certificate that is reloaded in place. A
//! renewal rewrites the mounted `EXTERNAL_CERT_PEM`/`EXTERNAL_KEY_PEM` files; the next handshake
//! gets the new pair and every stream already carried keeps its connection (upstream restarts its
//! router on a renewal, which cuts every session).

use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::crypto::ring;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::exporter::tls::CertPair;

/// How often the certificate files are read again.
pub const RELOAD_EVERY: Duration = Duration::from_secs(10);
/// A TLS handshake that takes longer is dropped (it holds no stream yet).
const HANDSHAKE: Duration = Duration::from_secs(10);

/// The pair every new handshake gets; swapped in place by [`Reloading::reload`].
#[derive(Debug)]
pub struct Reloading {
    current: RwLock<(CertPair, Arc<CertifiedKey>)>,
}

fn certified(pair: &CertPair) -> Result<Arc<CertifiedKey>, String> {
    let certs = CertificateDer::pem_slice_iter(pair.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("router certificate: {e}"))?;
    if certs.is_empty() {
        return Err("router certificate: no certificate in the PEM".into());
    }
    let key = PrivateKeyDer::from_pem_slice(pair.key_pem.as_bytes())
        .map_err(|_| "router certificate: the key is not a PEM private key".to_string())?;
    let key = ring::sign::any_supported_type(&key)
        .map_err(|_| "router certificate: unsupported private key".to_string())?;
    let ck = CertifiedKey::new(certs, key);
    ck.keys_match()
        .map_err(|_| "router certificate: the key does not match the certificate".to_string())?;
    Ok(Arc::new(ck))
}

impl Reloading {
    pub fn new(pair: CertPair) -> Result<Arc<Self>, String> {
        let ck = certified(&pair)?;
        Ok(Arc::new(Reloading {
            current: RwLock::new((pair, ck)),
        }))
    }

    /// Serves `pair` from the next handshake on, when it differs from the current one and is
    /// valid. Whether it changed; an invalid pair is an error and the current one stays.
    pub fn reload(&self, pair: CertPair) -> Result<bool, String> {
        {
            let cur = self.current.read().expect("router certificate");
            if cur.0.cert_pem == pair.cert_pem && cur.0.key_pem == pair.key_pem {
                return Ok(false);
            }
        }
        let ck = certified(&pair)?;
        *self.current.write().expect("router certificate") = (pair, ck);
        Ok(true)
    }

    /// The rustls configuration: HTTP/2 only (gRPC), the certificate resolved per handshake.
    pub fn server_config(self: &Arc<Self>) -> Result<rustls::ServerConfig, String> {
        let mut cfg =
            rustls::ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|e| format!("router TLS: {e}"))?
                .with_no_client_auth()
                .with_cert_resolver(self.clone());
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(cfg)
    }

    /// Reads the pair again every [`RELOAD_EVERY`] with `read` (the environment's files) until
    /// `stop`; a read or parse failure is logged and the current pair kept.
    pub async fn watch(
        self: Arc<Self>,
        read: impl Fn() -> Result<Option<CertPair>, String>,
        stop: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(RELOAD_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            match read().and_then(|p| p.map(|p| self.reload(p)).transpose()) {
                Ok(Some(true)) => info!("router certificate reloaded: new handshakes get it"),
                Ok(_) => {}
                Err(e) => {
                    warn!(error = %e, "router certificate not reloaded; the current one stays");
                }
            }
        }
    }
}

impl ResolvesServerCert for Reloading {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().expect("router certificate").1.clone())
    }
}

/// TLS connections accepted on `listener`, each handshake on its own task so a slow peer delays
/// no other, until `stop`.
pub fn incoming(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    stop: CancellationToken,
) -> ReceiverStream<std::io::Result<TlsStream<TcpStream>>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                _ = stop.cancelled() => return,
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        debug!(error = %e, "router accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            // Frames are forwarded as they come: Nagle's algorithm would hold a small write
            // (a keystroke, an HTTP/2 WINDOW_UPDATE) until the peer's delayed ACK, up to 40 ms,
            // and stall a bulk stream on its flow-control window.
            if let Err(e) = tcp.set_nodelay(true) {
                debug!(%peer, error = %e, "router: TCP_NODELAY not set");
            }
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => {
                        let _ = tx.send(Ok(tls)).await;
                    }
                    Ok(Err(e)) => debug!(%peer, error = %e, "router TLS handshake failed"),
                    Err(_) => debug!(%peer, "router TLS handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(host: &str) -> CertPair {
        crate::exporter::tls::self_signed(&format!("{host}:8083")).unwrap()
    }

    /// The certificate a TLS client is served by `addr`.
    async fn served(addr: std::net::SocketAddr) -> Vec<u8> {
        #[derive(Debug)]
        struct Any;
        impl rustls::client::danger::ServerCertVerifier for Any {
            fn verify_server_cert(
                &self,
                _: &CertificateDer<'_>,
                _: &[CertificateDer<'_>],
                _: &rustls::pki_types::ServerName<'_>,
                _: &[u8],
                _: rustls::pki_types::UnixTime,
            ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
                Ok(rustls::client::danger::ServerCertVerified::assertion())
            }
            fn verify_tls12_signature(
                &self,
                _: &[u8],
                _: &CertificateDer<'_>,
                _: &rustls::DigitallySignedStruct,
            ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error>
            {
                Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
            }
            fn verify_tls13_signature(
                &self,
                _: &[u8],
                _: &CertificateDer<'_>,
                _: &rustls::DigitallySignedStruct,
            ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error>
            {
                Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
            }
            fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
                ring::default_provider()
                    .signature_verification_algorithms
                    .supported_schemes()
            }
        }
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Any))
            .with_no_client_auth();
        let tcp = TcpStream::connect(addr).await.unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect("router.test".try_into().unwrap(), tcp)
            .await
            .unwrap();
        tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
    }

    fn der(p: &CertPair) -> Vec<u8> {
        CertificateDer::from_pem_slice(p.cert_pem.as_bytes())
            .unwrap()
            .to_vec()
    }

    /// A new pair is served from the next handshake on; a connection made before keeps going;
    /// a broken pair is refused and the current one stays.
    #[tokio::test]
    async fn a_renewed_certificate_serves_new_handshakes_without_a_restart() {
        use futures::StreamExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (old, new) = (pair("old.test"), pair("new.test"));
        let certs = Reloading::new(old.clone()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = TlsAcceptor::from(Arc::new(certs.server_config().unwrap()));
        let mut conns = incoming(listener, acceptor, CancellationToken::new());
        // An echo server on the accepted connections.
        tokio::spawn(async move {
            while let Some(Ok(mut c)) = conns.next().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 64];
                    while let Ok(n @ 1..) = c.read(&mut b).await {
                        if c.write_all(&b[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        assert_eq!(served(addr).await, der(&old));

        let before = {
            // rustls' client config for a long-lived connection made before the renewal
            let tcp = TcpStream::connect(addr).await.unwrap();
            let cfg =
                rustls::ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
                    .with_safe_default_protocol_versions()
                    .unwrap()
                    .with_root_certificates({
                        let mut r = rustls::RootCertStore::empty();
                        r.add(CertificateDer::from(der(&old))).unwrap();
                        r
                    })
                    .with_no_client_auth();
            tokio_rustls::TlsConnector::from(Arc::new(cfg))
                .connect("old.test".try_into().unwrap(), tcp)
                .await
                .unwrap()
        };
        assert!(certs.reload(new.clone()).unwrap(), "a new pair is a change");
        assert!(
            !certs.reload(new.clone()).unwrap(),
            "the same pair is no change"
        );
        assert_eq!(served(addr).await, der(&new));
        let mut before = before;
        before.write_all(b"still here").await.unwrap();
        let mut b = [0u8; 10];
        before.read_exact(&mut b).await.unwrap();
        assert_eq!(
            &b, b"still here",
            "the connection made before the renewal goes on"
        );

        let broken = CertPair {
            cert_pem: new.cert_pem.clone(),
            key_pem: old.key_pem.clone(),
        };
        assert!(
            certs.reload(broken).is_err(),
            "a key of another certificate"
        );
        assert_eq!(served(addr).await, der(&new));
    }
}
