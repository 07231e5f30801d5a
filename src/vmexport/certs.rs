//! The manager's export CA and per-export serving certificates (docs/vmexport.md, "Certificates").
//! ECDSA P-256 throughout; the CA's CN is upstream's `export.kubevirt.io`.

use crate::runtime::time::after;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256,
};
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

pub const CA_CN: &str = "export.kubevirt.io";
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// PEM certificate and key.
#[derive(Clone, Debug)]
pub struct Pem {
    pub cert: String,
    pub key: String,
}

fn odt(t: jiff::Timestamp) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp(t.as_second())
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}

pub fn new_ca(now: jiff::Timestamp) -> anyhow::Result<Pem> {
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_CN);
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p.not_before = odt(now);
    p.not_after = odt(after(now, CA_VALIDITY));
    let cert = p.self_signed(&key)?;
    Ok(Pem {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// The DNS names of the export Service (UPSTREAM).
pub fn service_sans(service: &str, ns: &str) -> Vec<String> {
    vec![
        service.to_string(),
        format!("{service}.{ns}"),
        format!("{service}.{ns}.svc"),
        format!("{service}.{ns}.svc.cluster.local"),
    ]
}

/// A serving certificate for the export Service, signed by `ca`, valid `duration` from `now`.
pub fn issue_serving(
    ca: &Pem,
    service: &str,
    ns: &str,
    now: jiff::Timestamp,
    duration: Duration,
) -> anyhow::Result<Pem> {
    let ca_key = KeyPair::from_pem(&ca.key)?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert, ca_key)?;
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let mut p = CertificateParams::new(service_sans(service, ns))?;
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        format!("{service}.{ns}.pod.cluster.local"),
    );
    p.distinguished_name = dn;
    p.is_ca = IsCa::ExplicitNoCa;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    // A minute of slack for clocks that run slightly behind the manager's.
    p.not_before = odt(now
        .checked_sub(jiff::SignedDuration::from_secs(60))
        .unwrap_or(now));
    p.not_after = odt(after(now, duration));
    let cert = p.signed_by(&key, &issuer)?;
    Ok(Pem {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// What the reissue rule needs to know about an existing serving certificate.
#[derive(Debug, PartialEq, Eq)]
pub struct CertInfo {
    pub not_after: jiff::Timestamp,
    pub dns_names: Vec<String>,
    pub signed_by_ca: bool,
}

fn first_der(pem: &str) -> anyhow::Result<Vec<u8>> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    Ok(CertificateDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| anyhow::anyhow!("invalid certificate PEM: {e}"))?
        .to_vec())
}

pub fn inspect(cert_pem: &str, ca_pem: &str) -> anyhow::Result<CertInfo> {
    let der = first_der(cert_pem)?;
    let ca_der = first_der(ca_pem)?;
    let (_, cert) = X509Certificate::from_der(&der)?;
    let (_, ca) = X509Certificate::from_der(&ca_der)?;
    let signed_by_ca = cert.verify_signature(Some(ca.public_key())).is_ok();
    let mut dns_names = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            if let GeneralName::DNSName(d) = n {
                dns_names.push((*d).to_string());
            }
        }
    }
    let not_after = jiff::Timestamp::from_second(cert.validity().not_after.timestamp())?;
    Ok(CertInfo {
        not_after,
        dns_names,
        signed_by_ca,
    })
}

/// Rule 3 of docs/vmexport.md, "Certificates": reissue when not signed by the current CA, SANs
/// differ from the Service, or `notAfter - renewBefore <= now + 1 min`.
pub fn needs_reissue(
    info: &CertInfo,
    service: &str,
    ns: &str,
    now: jiff::Timestamp,
    renew_before: Duration,
) -> bool {
    let mut want = service_sans(service, ns);
    let mut have = info.dns_names.clone();
    want.sort();
    have.sort();
    let renew = jiff::SignedDuration::try_from(renew_before).unwrap_or(jiff::SignedDuration::ZERO);
    let renew_at = info
        .not_after
        .checked_sub(renew)
        .unwrap_or(jiff::Timestamp::MIN);
    let soon = after(now, Duration::from_secs(60));
    !info.signed_by_ca || want != have || renew_at <= soon
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serving_cert_chain_sans_and_renewal() {
        let now: jiff::Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let ca = new_ca(now).unwrap();
        let day = Duration::from_secs(86400);
        let srv = issue_serving(&ca, "virt-export-e1", "ns1", now, day).unwrap();
        let info = inspect(&srv.cert, &ca.cert).unwrap();
        assert!(info.signed_by_ca);
        assert_eq!(info.not_after.to_string(), "2026-01-02T00:00:00Z");
        assert!(
            info.dns_names
                .contains(&"virt-export-e1.ns1.svc".to_string())
        );
        let renew = day / 5;
        assert!(!needs_reissue(&info, "virt-export-e1", "ns1", now, renew));
        // other service, other CA, or close to renewal: reissue
        assert!(needs_reissue(&info, "virt-export-e2", "ns1", now, renew));
        // renewal point: notAfter - 4h48m = 19:12; reissued from one minute before it
        let before: jiff::Timestamp = "2026-01-01T19:10:59Z".parse().unwrap();
        assert!(!needs_reissue(
            &info,
            "virt-export-e1",
            "ns1",
            before,
            renew
        ));
        let late: jiff::Timestamp = "2026-01-01T19:11:00Z".parse().unwrap();
        assert!(needs_reissue(&info, "virt-export-e1", "ns1", late, renew));
        let other_ca = new_ca(now).unwrap();
        assert!(!inspect(&srv.cert, &other_ca.cert).unwrap().signed_by_ca);
        // EKU serverAuth and the CA's CN
        let der = first_der(&srv.cert).unwrap();
        let (_, c) = X509Certificate::from_der(&der).unwrap();
        assert!(c.extended_key_usage().unwrap().unwrap().value.server_auth);
        assert!(c.issuer().to_string().contains("export.kubevirt.io"));
        assert!(
            c.subject()
                .to_string()
                .contains("virt-export-e1.ns1.pod.cluster.local")
        );
    }
}
