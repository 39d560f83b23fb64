//! Pinning a BMC's self-signed certificate: a TLS server on 127.0.0.1 with an rcgen certificate whose name does
//! not match (as on real BMCs) answers a service root; the client connects with the right pin and refuses a wrong
//! one or a missing trust setting.

use std::sync::Arc;

use anyhow::{Context, Result};
use bcd_site::redfish::tls::fingerprint;
use bcd_site::redfish::{Bmc, BmcOptions, Credentials, RedfishError, TlsTrust};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Answers every request on every connection with a service root without SessionService, then closes.
async fn tls_bmc() -> Result<(String, CertificateDer<'static>)> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ck = rcgen::generate_simple_self_signed(vec!["bmc-factory-default.invalid".to_owned()])?;
    let cert = ck.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(vec![cert.clone()], key)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("https://{}", listener.local_addr()?);
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = vec![0u8; 8192];
                let mut seen = Vec::new();
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tls.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let body = r#"{"@odata.id":"/redfish/v1","RedfishVersion":"1.6.0","Systems":{"@odata.id":"/redfish/v1/Systems"}}"#;
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = tls.write_all(resp.as_bytes()).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    Ok((url, cert))
}

fn creds() -> Credentials {
    Credentials {
        username: "admin".into(),
        password: "secret".into(),
    }
}

#[tokio::test]
async fn pinned_certificate_is_accepted_and_others_refused() -> Result<()> {
    let (url, cert) = tls_bmc().await?;
    let pinned = BmcOptions {
        trust: Some(TlsTrust::PinnedSha256(fingerprint(&cert))),
        ..BmcOptions::default()
    };
    let bmc = Bmc::connect(&url, creds(), pinned).await?;
    assert_eq!(bmc.service_root().redfish_version.as_deref(), Some("1.6.0"));
    assert_eq!(bmc.basic_reason(), Some("the BMC has no SessionService"));

    let wrong = BmcOptions {
        trust: Some(TlsTrust::PinnedSha256([7; 32])),
        ..BmcOptions::default()
    };
    let t = std::time::Instant::now();
    let err = Bmc::connect(&url, creds(), wrong)
        .await
        .err()
        .context("wrong pin must fail")?;
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "a refused pin is not retried"
    );
    let text = err.to_string();
    assert!(matches!(err, RedfishError::Tls { .. }), "{text}");
    assert!(text.contains("does not match the pinned 0707"), "{text}");

    // The certificate as a root: its name (bmc-factory-default.invalid) does not match 127.0.0.1.
    let as_root = BmcOptions {
        trust: Some(TlsTrust::Roots(vec![cert])),
        ..BmcOptions::default()
    };
    assert!(Bmc::connect(&url, creds(), as_root).await.is_err());

    let none = Bmc::connect(&url, creds(), BmcOptions::default())
        .await
        .err()
        .context("no trust must fail")?;
    assert!(matches!(none, RedfishError::Tls { .. }), "{none}");
    Ok(())
}
