//! A real OpenID provider for the OIDC tests: Keycloak from Maven Central (fetched, verified and
//! pre-built once by `hack/jumpstarter/keycloak.sh`, cached in ~/.cache/ucm), started once per test process on
//! HTTPS with a certificate made here, so ucm's `certificateAuthority` is exercised. Each test makes
//! its own realm (issuer), clients and users through the admin REST API, so tests run in parallel.
//! A watchdog kills the server's process group when the test binary exits. Any failure panics
//! with Keycloak's log: a missing prerequisite fails loudly.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{free_port, repo_root, tail};

pub struct Keycloak {
    pub base: String,
    /// The PEM of the certificate Keycloak serves (its own CA).
    pub ca_pem: String,
    pub ca_file: PathBuf,
    admin_password: String,
    log: PathBuf,
    /// Seconds from spawn to the first answered discovery request.
    pub startup: Duration,
    _dir: PathBuf,
    /// Keycloak and its watchdog, held for the life of the process.
    _processes: [std::process::Child; 2],
}

static SHARED: OnceLock<Keycloak> = OnceLock::new();

/// The binary's Keycloak, started on first use (blocking: call from `spawn_blocking`).
pub fn shared() -> &'static Keycloak {
    SHARED.get_or_init(Keycloak::start)
}

/// `curl` with Keycloak's CA; returns (HTTP status, body).
fn curl(ca: &Path, args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "30", "--cacert"])
        .arg(ca)
        .args(["-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl (needed by the OIDC e2e tests) is not installed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

impl Keycloak {
    fn start() -> Keycloak {
        let out = Command::new(repo_root().join("hack/jumpstarter/keycloak.sh"))
            .stderr(Stdio::inherit())
            .output()
            .expect("run hack/jumpstarter/keycloak.sh");
        assert!(out.status.success(), "hack/jumpstarter/keycloak.sh failed");
        let dist = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
        let java_home = std::fs::read_to_string(dist.join(".ucm-java-home")).unwrap();
        let dir = std::env::temp_dir().join(format!("ucm-keycloak-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();

        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params
            .subject_alt_names
            .push(rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap()));
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let (cert_file, key_file) = (dir.join("tls.crt"), dir.join("tls.key"));
        std::fs::write(&cert_file, cert.pem()).unwrap();
        std::fs::write(&key_file, key.serialize_pem()).unwrap();

        let (port, mgmt) = (free_port(), free_port());
        let admin_password = format!("admin-{:x}", rand::random::<u64>());
        let log = dir.join("keycloak.log");
        let logf = std::fs::File::create(&log).unwrap();
        let started = Instant::now();
        let child = {
            use std::os::unix::process::CommandExt;
            Command::new(dist.join("bin/kc.sh"))
                .args([
                    "start".to_string(),
                    "--optimized".into(),
                    format!("--https-port={port}"),
                    "--http-enabled=false".into(),
                    format!("--https-certificate-file={}", cert_file.display()),
                    format!("--https-certificate-key-file={}", key_file.display()),
                    "--hostname-strict=false".into(),
                    format!("--http-management-port={mgmt}"),
                ])
                .env("JAVA_HOME", java_home.trim())
                // Its transaction log in this run's directory, not the shared distribution's.
                .env(
                    "JAVA_OPTS_APPEND",
                    format!(
                        "-Dquarkus.transaction-manager.object-store.directory={}",
                        dir.join("transaction-logs").display()
                    ),
                )
                .env("KC_BOOTSTRAP_ADMIN_USERNAME", "admin")
                .env("KC_BOOTSTRAP_ADMIN_PASSWORD", &admin_password)
                .process_group(0)
                .stdin(Stdio::null())
                .stdout(logf.try_clone().unwrap())
                .stderr(logf)
                .spawn()
                .expect("start Keycloak")
        };
        // The group dies with this process (a static is never dropped). `kill -9 -PGID`: dash's
        // kill takes neither `--` nor `-s` before a negative pid.
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "while kill -0 {me} 2>/dev/null; do sleep 1; done; kill -9 -{pg} 2>/dev/null; sleep 1; rm -rf '{dir}'",
                me = std::process::id(),
                pg = child.id(),
                dir = dir.display()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the Keycloak watchdog");
        let base = format!("https://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(240);
        loop {
            let (code, _) = curl(
                &cert_file,
                &[&format!(
                    "{base}/realms/master/.well-known/openid-configuration"
                )],
            );
            if code == 200 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "Keycloak did not answer within 240 s:\n{}",
                tail(&log, 40)
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        let startup = started.elapsed();
        eprintln!("Keycloak up at {base} after {startup:?}");
        Keycloak {
            base,
            ca_pem: cert.pem(),
            ca_file: cert_file,
            admin_password,
            log,
            startup,
            _dir: dir,
            _processes: [child, watchdog],
        }
    }

    fn curl(&self, args: &[&str]) -> (u16, String) {
        curl(&self.ca_file, args)
    }

    fn admin_token(&self) -> String {
        let (code, body) = self.curl(&[
            "-d",
            "grant_type=password",
            "-d",
            "client_id=admin-cli",
            "-d",
            "username=admin",
            "--data-urlencode",
            &format!("password={}", self.admin_password),
            &format!("{}/realms/master/protocol/openid-connect/token", self.base),
        ]);
        assert_eq!(code, 200, "Keycloak admin login: {body}");
        serde_json::from_str::<Value>(&body).unwrap()["access_token"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// An admin REST call; panics unless the status is 2xx.
    fn admin(&self, method: &str, path: &str, body: Option<&Value>) -> String {
        let auth = format!("Authorization: Bearer {}", self.admin_token());
        let url = format!("{}/admin/realms{path}", self.base);
        let data = body.map(|b| b.to_string());
        let mut args = vec![
            "-X",
            method,
            "-H",
            &auth,
            "-H",
            "Content-Type: application/json",
        ];
        if let Some(d) = &data {
            args.extend(["--data-binary", d]);
        }
        args.push(&url);
        let (code, out) = self.curl(&args);
        assert!(
            (200..300).contains(&code),
            "Keycloak {method} {path}: HTTP {code} {out}\n{}",
            tail(&self.log, 20)
        );
        out
    }

    /// A realm with the public clients `jumpstarter-cli` (audience `jumpstarter-cli`, as the
    /// upstream docs set it up), `short-cli` (the same audience, 1 s access tokens) and
    /// `other-cli` (no audience mapper), and users `<name>` with password `pw-<name>`.
    pub fn realm(&self, realm: &str, users: &[&str]) -> Realm {
        let audience = json!([{
            "name": "audience", "protocol": "openid-connect",
            "protocolMapper": "oidc-audience-mapper",
            "config": {"included.client.audience": "jumpstarter-cli",
                       "access.token.claim": "true", "id.token.claim": "false"}
        }]);
        let client = |id: &str, lifespan: Option<&str>, mappers: &Value| {
            let mut c = json!({
                "clientId": id, "publicClient": true, "directAccessGrantsEnabled": true,
                "redirectUris": ["http://localhost/callback"], "protocolMappers": mappers,
            });
            if let Some(l) = lifespan {
                c["attributes"] = json!({"access.token.lifespan": l});
            }
            c
        };
        let users: Vec<Value> = users
            .iter()
            .map(|u| {
                json!({
                    "username": u, "enabled": true, "email": format!("{u}@example.com"),
                    "emailVerified": true, "firstName": u, "lastName": "Lab",
                    "realmRoles": ["offline_access"],
                    "credentials": [{"type": "password", "value": format!("pw-{u}"),
                                     "temporary": false}],
                })
            })
            .collect();
        self.admin(
            "POST",
            "",
            Some(&json!({
                "realm": realm, "enabled": true,
                "clients": [client("jumpstarter-cli", None, &audience),
                            client("short-cli", Some("1"), &audience),
                            client("other-cli", None, &json!([]))],
                "users": users,
            })),
        );
        Realm {
            name: realm.to_string(),
            issuer: format!("{}/realms/{realm}", self.base),
        }
    }

    /// A password grant; the access token.
    pub fn token(&self, realm: &Realm, client: &str, user: &str) -> String {
        let (code, body) = self.curl(&[
            "-d",
            "grant_type=password",
            "-d",
            &format!("client_id={client}"),
            "-d",
            &format!("username={user}"),
            "-d",
            &format!("password=pw-{user}"),
            "-d",
            "scope=openid profile",
            &format!("{}/protocol/openid-connect/token", realm.issuer),
        ]);
        assert_eq!(code, 200, "password grant for {user} via {client}: {body}");
        serde_json::from_str::<Value>(&body).unwrap()["access_token"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// Replaces the realm's signing key: a new RSA key provider with a higher priority, then the
    /// old providers removed, so new tokens carry a new `kid` and the old key leaves the JWKS.
    pub fn rotate_key(&self, realm: &Realm) {
        let id =
            serde_json::from_str::<Value>(&self.admin("GET", &format!("/{}", realm.name), None))
                .unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string();
        let path = format!("/{}/components", realm.name);
        let old: Vec<Value> = serde_json::from_str(&self.admin(
            "GET",
            &format!("{path}?type=org.keycloak.keys.KeyProvider"),
            None,
        ))
        .unwrap();
        self.admin(
            "POST",
            &path,
            Some(&json!({
                "name": "rotated-rsa", "providerId": "rsa-generated",
                "providerType": "org.keycloak.keys.KeyProvider", "parentId": id,
                "config": {"priority": ["500"], "keySize": ["2048"], "algorithm": ["RS256"]},
            })),
        );
        for c in old.iter().filter(|c| {
            c["providerId"]
                .as_str()
                .is_some_and(|p| p.starts_with("rsa"))
        }) {
            self.admin(
                "DELETE",
                &format!("{path}/{}", c["id"].as_str().unwrap()),
                None,
            );
        }
    }
}

pub struct Realm {
    pub name: String,
    pub issuer: String,
}

/// The `kid` of a JWT's header.
pub fn kid(token: &str) -> String {
    use base64::Engine;
    let h = token.split('.').next().unwrap();
    let v: Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(h)
            .unwrap(),
    )
    .unwrap();
    v["kid"].as_str().unwrap_or_default().to_string()
}
