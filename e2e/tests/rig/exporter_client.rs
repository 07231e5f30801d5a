//! A Jumpstarter exporter's side of the controller protocol, over the stubs generated from the
//! jumpstarter-protocol 0.9.0 descriptors: Register (optionally declaring that it records lease
//! hooks), ReportStatus and the Status stream, with upstream's bearer token and metadata.
//! "Killing" the exporter is dropping this value: its channel and streams close.

use std::time::{Duration, Instant};

use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Request, Status, Streaming};
use ucm::exporter::crd::LeaseHooks;
use ucm::exporter::proto::jumpstarter::v1 as pb;

pub use pb::ExporterStatus as Report;

pub struct ExporterClient {
    client: pb::controller_service_client::ControllerServiceClient<Channel>,
    ns: String,
    name: String,
    token: String,
}

impl ExporterClient {
    /// Connects to the leader's gRPC port (TLS with the stored certificate's CA), retrying
    /// until `timeout`: the listener starts only once a replica leads.
    pub async fn connect(
        port: u16,
        ca: &[u8],
        ns: &str,
        name: &str,
        token: &str,
        timeout: Duration,
    ) -> ExporterClient {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .domain_name("localhost");
        let endpoint = Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect_timeout(Duration::from_secs(2));
        let start = Instant::now();
        loop {
            match endpoint.connect().await {
                Ok(ch) => {
                    return ExporterClient {
                        client: pb::controller_service_client::ControllerServiceClient::new(ch),
                        ns: ns.into(),
                        name: name.into(),
                        token: token.into(),
                    };
                }
                Err(e) if start.elapsed() > timeout => {
                    panic!("exporter {name}: cannot reach the gRPC server on port {port}: {e}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    fn req<T>(&self, body: T) -> Request<T> {
        let mut r = Request::new(body);
        let md = r.metadata_mut();
        md.insert(
            "authorization",
            format!("Bearer {}", self.token).parse().unwrap(),
        );
        md.insert("jumpstarter-namespace", self.ns.parse().unwrap());
        md.insert("jumpstarter-kind", "Exporter".parse().unwrap());
        md.insert("jumpstarter-name", self.name.parse().unwrap());
        r.set_timeout(Duration::from_secs(20));
        r
    }

    /// Register; with `declare`, as an exporter that records lease hooks (docs/exporter.md, "Lease
    /// hooks: the record"). Returns the uid and the lease-hooks record from the response headers.
    pub async fn register(
        &mut self,
        declare: bool,
    ) -> Result<(String, Option<LeaseHooks>), Status> {
        let mut r = self.req(pb::RegisterRequest {
            labels: [("jumpstarter.dev/board".to_string(), "rpi".to_string())].into(),
            reports: vec![pb::DriverInstanceReport {
                uuid: "d1".into(),
                ..Default::default()
            }],
        });
        if declare {
            r.metadata_mut()
                .insert("jumpstarter-records-lease-hooks", "v1".parse().unwrap());
        }
        let resp = self.client.register(r).await?;
        let record = resp
            .metadata()
            .get_bin("jumpstarter-lease-hooks-bin")
            .and_then(|v| v.to_bytes().ok())
            .and_then(|b| serde_json::from_slice(&b).ok());
        Ok((resp.into_inner().uuid, record))
    }

    pub async fn report(&mut self, status: Report, message: &str) -> Result<(), Status> {
        let r = self.req(pb::ReportStatusRequest {
            status: status as i32,
            message: Some(message.into()),
            release_lease: None,
        });
        self.client.report_status(r).await.map(|_| ())
    }

    /// Opens the Status stream (heartbeats and lease notifications while it stays open).
    pub async fn status(&mut self) -> Result<Streaming<pb::StatusResponse>, Status> {
        let mut r = self.req(pb::StatusRequest {});
        // A stream lives as long as the exporter: no deadline.
        r.metadata_mut().remove("grpc-timeout");
        self.client.status(r).await.map(|r| r.into_inner())
    }
}

/// Reads the Status stream until a response satisfies `check`.
pub async fn next_status<F: Fn(&pb::StatusResponse) -> bool>(
    stream: &mut Streaming<pb::StatusResponse>,
    what: &str,
    timeout: Duration,
    check: F,
) -> pb::StatusResponse {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match tokio::time::timeout_at(deadline, stream.message()).await {
            Ok(Ok(Some(r))) if check(&r) => return r,
            Ok(Ok(Some(_))) => continue,
            Ok(other) => panic!("Status stream ended while waiting for {what}: {other:?}"),
            Err(_) => panic!("no Status response {what} within {timeout:?}"),
        }
    }
}
