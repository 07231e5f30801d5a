//! What every vmexport pass shares: the settings, the caches it observes (`Stores`), the writer,
//! the export CA, and the error type. Its own module so `apply`, `sources` and `run`
//! all depend on it and on nothing of each other's IO.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::Ingress;
use kube::api::ObjectMeta;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource};
use prometheus::IntCounter;

use super::certs::{self, Pem};
use super::objects::links::{external_from_ingresses, ingress_ca};
use super::objects::pod::PodSettings;
use super::optional::Optional;
use super::podcache::ClaimIndex;
use super::types::VirtualMachineExport;
use crate::runtime::own_writes::{OwnWrites, Replaced};
use crate::runtime::writer::kube_metric_label;
use crate::runtime::{ReconcileError, WriteError, Writer};

/// A failed step of a pass. Each variant names the step; the cause is its `source`, so
/// `error_chain` prints it once.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("write status")]
    WriteStatus(#[source] WriteError),
    #[error("delete export at TTL expiry")]
    DeleteExport(#[source] WriteError),
    #[error("delete pod {0}")]
    DeletePod(String, #[source] WriteError),
    #[error("read CA Secret {0}")]
    ReadCa(String, #[source] kube::Error),
    #[error("create CA Secret {0}")]
    CreateCa(String, #[source] WriteError),
    #[error("export CA: {0}")]
    Ca(String),
    /// A child could not be made; the status says which and why. Retried with the runtime's
    /// backoff, by the TTL expiry at the latest.
    #[error("a child could not be made (see the Ready condition)")]
    Reported { until: Duration },
}

impl ReconcileError for Error {
    fn metric_label(&self) -> &'static str {
        match self {
            Error::WriteStatus(e)
            | Error::DeleteExport(e)
            | Error::DeletePod(_, e)
            | Error::CreateCa(_, e) => e.metric_label(),
            Error::ReadCa(_, e) => kube_metric_label(e),
            Error::Ca(_) => "ca",
            // Never counted (see `reported`).
            Error::Reported { .. } => "reported",
        }
    }
    fn own_metric_labels() -> &'static [&'static str] {
        &["ca"]
    }
    fn is_conflict(&self) -> bool {
        match self {
            Error::WriteStatus(e) | Error::DeletePod(_, e) | Error::CreateCa(_, e) => {
                e.is_conflict()
            }
            _ => false,
        }
    }
    fn reported(&self) -> Option<Duration> {
        match self {
            Error::Reported { until } => Some(*until),
            _ => None,
        }
    }
}

// The manager's settings for this feature (docs/vmexport.md, "Settings").
#[derive(clap::Args, Debug, Clone)]
// clap names the group after the struct; the id keeps it apart from other features' flags.
#[group(id = "vmexport-settings")]
pub struct Args {
    /// Image that contains `ucm` on PATH, run by every export pod.
    #[arg(long = "export-server-image", default_value = concat!("ucm:", env!("CARGO_PKG_VERSION")), value_name = "IMAGE")]
    pub image: String,

    /// Pull policy of the export container.
    #[arg(long = "export-image-pull-policy", default_value = "IfNotPresent", value_parser = ["Always", "IfNotPresent", "Never"], value_name = "POLICY")]
    pub pull_policy: String,

    /// host[:port] of the external proxy; without it, status.links.external stays null.
    #[arg(long = "export-external-host", value_name = "HOST")]
    pub external_host: Option<String>,

    /// PEM file whose contents go into links.external.cert.
    #[arg(long = "export-external-ca-file", value_name = "PATH")]
    pub external_ca_file: Option<std::path::PathBuf>,

    /// The CA Secret, in the manager's namespace.
    #[arg(
        long = "export-ca-secret",
        default_value = "ucm-export-ca",
        value_name = "NAME"
    )]
    pub ca_secret: String,

    /// Validity of serving certificates.
    #[arg(long = "export-cert-duration", default_value = "24h", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub cert_duration: Duration,

    /// Renewal margin of serving certificates. Default: 20% of --export-cert-duration.
    #[arg(long = "export-cert-renew-before", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub cert_renew_before: Option<Duration>,

    /// After an export's TTL, how long its deletion waits for downloads in flight to finish
    /// (the export server takes no new request after the TTL and exits when the last one ends).
    #[arg(long = "export-ttl-transfer-wait", default_value = "24h", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub ttl_transfer_wait: Duration,

    /// Serve the `oci` format (KubeVirt 1.9's `OCIExport` gate, off there too): VM, snapshot and
    /// template exports get an `oci` manifest link to `/export.oci.tar` and the `OCIReady`
    /// condition; the export server computes the layers' digests before it reports ready.
    #[arg(long = "export-oci", value_parser = crate::runtime::cli::parse_go_bool, default_missing_value = "true", num_args = 0..=1, require_equals = true, action = clap::ArgAction::Set, default_value = "false", value_name = "BOOL")]
    pub oci: bool,

    /// CPU request of the export container.
    #[arg(
        long = "export-server-cpu-request",
        default_value = "100m",
        value_name = "QUANTITY"
    )]
    pub cpu_request: String,

    /// Memory request of the export container.
    #[arg(
        long = "export-server-memory-request",
        default_value = "200Mi",
        value_name = "QUANTITY"
    )]
    pub memory_request: String,

    /// CPU limit of the export container; raise it for faster gzip.
    #[arg(
        long = "export-server-cpu-limit",
        default_value = "1",
        value_name = "QUANTITY"
    )]
    pub cpu_limit: String,

    /// Memory limit of the export container.
    #[arg(
        long = "export-server-memory-limit",
        default_value = "1024Mi",
        value_name = "QUANTITY"
    )]
    pub memory_limit: String,

    /// Minimum TLS version of the export server, as a numeric TLS version ID (771 = TLS 1.2, 772 = TLS 1.3).
    #[arg(long = "export-tls-min-version", value_name = "ID")]
    pub tls_min_version: Option<u16>,

    /// TLS 1.2 cipher suites of the export server, as a JSON array of suite IDs.
    #[arg(long = "export-tls-cipher-suites", value_name = "JSON")]
    pub tls_cipher_suites: Option<String>,
}

impl Args {
    /// The export pod's settings, or why a present value is invalid.
    pub fn pod_settings(&self) -> Result<PodSettings, String> {
        if self.cert_duration.is_zero() {
            return Err(
                "invalid value for '--export-cert-duration': must be greater than 0".into(),
            );
        }
        let renew = self.cert_renew_before.unwrap_or(self.cert_duration / 5);
        if renew >= self.cert_duration {
            return Err("invalid value for '--export-cert-renew-before': must be less than --export-cert-duration".into());
        }
        if let Some(s) = &self.tls_cipher_suites
            && serde_json::from_str::<Vec<u16>>(s).is_err()
        {
            return Err(format!(
                "invalid value for '--export-tls-cipher-suites': {s:?} is not a JSON array of suite IDs"
            ));
        }
        Ok(PodSettings {
            image: self.image.clone(),
            pull_policy: self.pull_policy.clone(),
            cpu_request: self.cpu_request.clone(),
            memory_request: self.memory_request.clone(),
            cpu_limit: self.cpu_limit.clone(),
            memory_limit: self.memory_limit.clone(),
            tls_min_version: self.tls_min_version.map(|v| v.to_string()),
            tls_cipher_suites: self.tls_cipher_suites.clone(),
            cert_duration: self.cert_duration,
            cert_renew_before: renew,
            ttl_transfer_wait: self.ttl_transfer_wait,
        })
    }
}

/// Settings resolved at start (docs/vmexport.md, "Settings").
#[derive(Clone, Debug)]
pub struct Settings {
    pub pod: PodSettings,
    pub ca_secret: String,
    pub manager_namespace: String,
    pub external_host: Option<String>,
    pub external_ca: String,
    /// `--export-oci`: the `oci` format and the `OCIReady` condition (KubeVirt's `OCIExport`).
    pub oci: bool,
}

/// The caches a pass reads: nothing here sends a request.
#[derive(Clone)]
pub struct Stores {
    /// Slim Pods (podcache.rs) and their claim index; export Pods keep what the status reads.
    pub pods: Store<Pod>,
    pub claims: Arc<ClaimIndex>,
    pub pvcs: Store<PersistentVolumeClaim>,
    /// Services and Secrets labelled as export children, metadata only: a pass needs their
    /// presence and controller, never a Secret's data from the cache.
    pub services: Store<PartialObjectMeta<Service>>,
    pub secrets: Store<PartialObjectMeta<Secret>>,
    /// Ingresses in the manager's namespace: the one routing to `ucm export-proxy` gives the
    /// external host when `--export-external-host` is not set.
    pub ingresses: Store<Ingress>,
    pub optional: Arc<Optional>,
}

impl Stores {
    pub fn service(&self, ns: &str, name: &str) -> Option<ObjectMeta> {
        self.services
            .get(&ObjectRef::new(name).within(ns))
            .map(|s| s.metadata.clone())
    }

    pub fn secret(&self, ns: &str, name: &str) -> Option<ObjectMeta> {
        self.secrets
            .get(&ObjectRef::new(name).within(ns))
            .map(|s| s.metadata.clone())
    }

    pub fn pod(&self, ns: &str, name: &str) -> Option<Pod> {
        self.pods
            .get(&ObjectRef::new(name).within(ns))
            .map(|p| (*p).clone())
    }
}

/// Children this manager created that its caches may not show yet: the pass after a create
/// often runs before the child's watch event arrives (it is queued by an event of another
/// child of the same pass). Without this it would create again and get 409 AlreadyExists.
/// An entry lives until the cache shows the object or [`CREATED_TTL`] passes, so a child that
/// was deleted before the cache saw it is not believed for ever (docs/runtime.md, "Own writes").
pub struct Created {
    pub secrets: OwnWrites<ObjectMeta>,
    pub services: OwnWrites<ObjectMeta>,
    pub pods: OwnWrites<Pod>,
}

/// How long a created child counts as present without the cache showing it.
pub const CREATED_TTL: Duration = Duration::from_secs(30);

impl Default for Created {
    fn default() -> Self {
        Created {
            secrets: OwnWrites::with_ttl(CREATED_TTL),
            services: OwnWrites::with_ttl(CREATED_TTL),
            pods: OwnWrites::with_ttl(CREATED_TTL),
        }
    }
}

pub struct Context {
    pub writer: Writer,
    /// For reads; every write goes through `writer`.
    pub client: kube::Client,
    pub settings: Settings,
    pub stores: Stores,
    pub recent: Created,
    /// Exports whose cached version one of our status writes replaced (docs/vmexport.md, "Pass
    /// steps"): a pass on such a copy does not write status again.
    pub replaced: Replaced,
    ca: tokio::sync::Mutex<Option<Pem>>,
    pub ttl_deletions: IntCounter,
}

pub(super) fn object_ref(e: &VirtualMachineExport) -> ObjectReference {
    e.object_ref(&())
}

impl Context {
    pub fn new(
        writer: Writer,
        client: kube::Client,
        settings: Settings,
        stores: Stores,
        ttl_deletions: IntCounter,
    ) -> Self {
        Context {
            writer,
            client,
            settings,
            stores,
            recent: Created::default(),
            replaced: Default::default(),
            ca: tokio::sync::Mutex::new(None),
            ttl_deletions,
        }
    }

    /// The external host and the CA users should trust: `--export-external-host` with
    /// `--export-external-ca-file`, else the host of the Ingress that routes to the export proxy
    /// with the CA of its TLS Secret ("" without TLS), as KubeVirt finds its proxy's Ingress.
    pub(super) async fn external(&self) -> Option<(String, String)> {
        if let Some(h) = &self.settings.external_host {
            return Some((h.clone(), self.settings.external_ca.clone()));
        }
        let ings = self.stores.ingresses.state();
        let (host, secret) =
            external_from_ingresses(ings.iter().map(|i| i.as_ref()), super::proxy::SERVICE)?;
        let cert = match secret {
            Some(name) => {
                let api: Api<Secret> =
                    Api::namespaced(self.client.clone(), &self.settings.manager_namespace);
                match api.get_opt(&name).await {
                    Ok(Some(s)) => ingress_ca(&s),
                    Ok(None) => String::new(),
                    Err(e) => {
                        tracing::warn!(secret = %name, error = %e, "cannot read the proxy Ingress's TLS Secret");
                        String::new()
                    }
                }
            }
            None => String::new(),
        };
        Some((host, cert))
    }

    /// The CA: read; on NotFound create; on AlreadyExists (another leader won) read again. An
    /// existing CA is never overwritten (docs/vmexport.md, "Certificates"). Read once per process.
    pub(super) async fn ca(&self) -> Result<Pem, Error> {
        let mut guard = self.ca.lock().await;
        if let Some(p) = guard.as_ref() {
            return Ok(p.clone());
        }
        let name = &self.settings.ca_secret;
        let api: Api<Secret> =
            Api::namespaced(self.client.clone(), &self.settings.manager_namespace);
        let read = |s: &Secret| -> Result<Pem, Error> {
            let d = s.data.clone().unwrap_or_default();
            let get = |k: &str| {
                d.get(k)
                    .map(|b| String::from_utf8_lossy(&b.0).into_owned())
                    .ok_or_else(|| Error::Ca(format!("Secret {name} has no {k}")))
            };
            Ok(Pem {
                cert: get("tls.crt")?,
                key: get("tls.key")?,
            })
        };
        let read_err = |e| Error::ReadCa(name.clone(), e);
        let pem = match api.get_opt(name).await.map_err(read_err)? {
            Some(s) => read(&s)?,
            None => {
                let ca =
                    certs::new_ca(jiff::Timestamp::now()).map_err(|e| Error::Ca(e.to_string()))?;
                let secret = Secret {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        namespace: Some(self.settings.manager_namespace.clone()),
                        ..Default::default()
                    },
                    type_: Some("kubernetes.io/tls".into()),
                    data: Some(BTreeMap::from([
                        (
                            "tls.crt".to_string(),
                            k8s_openapi::ByteString(ca.cert.clone().into_bytes()),
                        ),
                        (
                            "tls.key".to_string(),
                            k8s_openapi::ByteString(ca.key.clone().into_bytes()),
                        ),
                    ])),
                    ..Default::default()
                };
                match self.writer.create(&api, &secret).await {
                    Ok(_) => ca,
                    Err(e) if e.is_already_exists() => {
                        read(&api.get(name).await.map_err(read_err)?)?
                    }
                    Err(e) => return Err(Error::CreateCa(name.clone(), e)),
                }
            }
        };
        // Validate once so an unusable CA is reported, not used.
        certs::issue_serving(
            &pem,
            "probe",
            "probe",
            jiff::Timestamp::now(),
            Duration::from_secs(60),
        )
        .map_err(|e| Error::Ca(format!("Secret {name} does not hold a usable CA: {e}")))?;
        *guard = Some(pem.clone());
        Ok(pem)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The step, then its cause, each once.
    #[test]
    fn errors_name_the_step_and_print_the_cause_once() {
        let e = Error::DeletePod("virt-export-a".into(), WriteError::NotLeader);
        assert_eq!(
            crate::runtime::controller::error_chain(&e),
            "delete pod virt-export-a: this replica is not the leader; the write was refused"
        );
        assert_eq!(e.metric_label(), "not_leader");
        let e = Error::WriteStatus(WriteError::NotLeader);
        assert_eq!(
            crate::runtime::controller::error_chain(&e),
            "write status: this replica is not the leader; the write was refused"
        );
        assert_eq!(
            Error::Reported {
                until: Duration::from_secs(3)
            }
            .reported(),
            Some(Duration::from_secs(3))
        );
        assert_eq!(e.reported(), None);
    }
}
