//! `ucm export-server` as a real process on real files, with curl, gzip and tar as clients
//! (docs/vmexport.md, "Export server"). Certificates come from the manager's issuing code, and curl
//! checks them against the CA and the Service name.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{pem_body, presented_cert};
use ucm::vmexport::certs;

use crate::common::free_port;

const SVC: &str = "virt-export-e1";
const NS: &str = "ns1";
const TOKEN: &str = "T0kenT0kenT0kenT0kenT0kenT0ken12";

struct Server {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    log: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn pattern(n: usize, seed: u32) -> Vec<u8> {
    let mut x = seed;
    (0..n)
        .map(|i| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            if i % 4 == 0 {
                (x >> 24) as u8
            } else {
                (i / 13) as u8
            }
        })
        .collect()
}

/// Fixture volumes: `disk` (kubevirt content: disk.img) and `files` (archive content).
fn fixtures(root: &Path) -> Vec<(String, String)> {
    let disk = root.join("export-volumes/v0-disk");
    fs::create_dir_all(&disk).unwrap();
    fs::write(disk.join("disk.img"), pattern(3 * 1024 * 1024 + 77, 1)).unwrap();
    let files = root.join("export-volumes/v1-files");
    fs::create_dir_all(files.join("nested/deeper")).unwrap();
    fs::create_dir_all(files.join("lost+found")).unwrap();
    fs::write(files.join("disk.img"), pattern(100_000, 2)).unwrap();
    fs::write(files.join("nested/deeper/a.txt"), b"hello nested\n").unwrap();
    fs::write(files.join("with space.txt"), b"space\n").unwrap();
    std::os::unix::fs::symlink("nested/deeper/a.txt", files.join("link-inside")).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", files.join("link-escape")).unwrap();
    // 1 GiB sparse file holding 1 MiB of data
    let f = fs::File::create(files.join("sparse.img")).unwrap();
    f.set_len(1 << 30).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&pattern(1 << 20, 3), 512 << 20).unwrap();
    let long = "l".repeat(120);
    fs::write(files.join(&long), b"long name\n").unwrap();
    [
        ("VOLUME0_EXPORT_PATH", disk.to_str().unwrap().to_string()),
        ("VOLUME0_EXPORT_RAW_URI", "/volumes/disk/disk.img".into()),
        (
            "VOLUME0_EXPORT_RAW_GZIP_URI",
            "/volumes/disk/disk.img.gz".into(),
        ),
        ("VOLUME1_EXPORT_PATH", files.to_str().unwrap().to_string()),
        (
            "VOLUME1_EXPORT_ARCHIVE_URI",
            "/volumes/files/disk.tar.gz".into(),
        ),
        ("VOLUME1_EXPORT_DIR_URI", "/volumes/files/dir/".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn start_with(extra: &[(&str, String)], volumes: Option<Vec<(String, String)>>) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let now = jiff::Timestamp::now();
    let ca = certs::new_ca(now).unwrap();
    let srv = certs::issue_serving(&ca, SVC, NS, now, Duration::from_secs(3600)).unwrap();
    fs::create_dir_all(root.join("cert")).unwrap();
    fs::create_dir_all(root.join("token")).unwrap();
    fs::write(root.join("ca.crt"), &ca.cert).unwrap();
    // The CA's key too, so a test can rotate the serving certificate.
    fs::write(root.join("ca.key"), &ca.key).unwrap();
    fs::write(root.join("cert/tls.crt"), &srv.cert).unwrap();
    fs::write(root.join("cert/tls.key"), &srv.key).unwrap();
    fs::write(root.join("token/token"), TOKEN).unwrap();
    let vols = volumes.unwrap_or_else(|| fixtures(root));
    // A LISTEN_ADDR in `extra` (applied after the default below) names the port.
    let port = extra
        .iter()
        .find(|(k, _)| *k == "LISTEN_ADDR")
        .map(|(_, v)| v.rsplit(':').next().unwrap().parse().unwrap())
        .unwrap_or_else(free_port);
    let log = root.join("server.log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ucm"));
    cmd.arg("export-server")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("LISTEN_ADDR", format!("127.0.0.1:{port}"))
        .env("CERT_FILE", root.join("cert/tls.crt"))
        .env("KEY_FILE", root.join("cert/tls.key"))
        .env("TOKEN_FILE", root.join("token/token"))
        .env("EXPORT_SECRET_DEF_URI", "/manifests/secret")
        .env("EXPORT_NAME", "e1")
        .env("MANIFEST_DATA_DIR", root.join("manifest_data"))
        .envs(vols)
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).unwrap());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let child = cmd.spawn().unwrap();
    let s = Server {
        child: Some(child),
        port,
        dir,
        log,
    };
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "server did not start: {}",
            fs::read_to_string(&s.log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    s
}

fn start() -> Server {
    start_with(&[], None)
}

impl Server {
    fn root(&self) -> &Path {
        self.dir.path()
    }
    fn url(&self, path: &str) -> String {
        format!("https://{SVC}.{NS}.svc:{}{path}", self.port)
    }
    fn curl(&self, args: &[&str]) -> Output {
        let resolve = format!("{SVC}.{NS}.svc:{}:127.0.0.1", self.port);
        let ca = self.root().join("ca.crt");
        Command::new("curl")
            .args([
                "-sS",
                "--cacert",
                ca.to_str().unwrap(),
                "--resolve",
                &resolve,
            ])
            .args(args)
            .output()
            .unwrap()
    }
    /// Status code of a request.
    fn status(&self, args: &[&str]) -> u16 {
        let mut a = vec!["-o", "/dev/null", "-w", "%{http_code}"];
        a.extend_from_slice(args);
        let out = self.curl(&a);
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(0)
    }
    fn get(&self, path: &str) -> Vec<u8> {
        let out = self.curl(&[
            "-f",
            "-H",
            &format!("x-kubevirt-export-token: {TOKEN}"),
            &self.url(path),
        ]);
        assert!(
            out.status.success(),
            "GET {path}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }
    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
    fn metrics_line(&self, metrics_port: u16, format: &str) -> u64 {
        let out = Command::new("curl")
            .args(["-sS", &format!("http://127.0.0.1:{metrics_port}/metrics")])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let key = format!("ucm_export_server_bytes_served_total{{format=\"{format}\"}}");
        text.lines()
            .find_map(|l| l.strip_prefix(&key).map(|v| v.trim().parse().unwrap()))
            .unwrap_or_else(|| panic!("no {key} in {text}"))
    }
}

fn hdr() -> String {
    format!("x-kubevirt-export-token: {TOKEN}")
}

fn run(cmd: &str, args: &[&str], stdin: &[u8]) -> Output {
    let mut c = Command::new(cmd)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd} is required for this test: {e}"));
    // Feed stdin from a thread: the tools write output while reading, and a full stdout pipe
    // would otherwise deadlock both sides.
    let mut pipe = c.stdin.take().unwrap();
    let data = stdin.to_vec();
    let feeder = std::thread::spawn(move || {
        let _ = pipe.write_all(&data);
    });
    let out = c.wait_with_output().unwrap();
    feeder.join().unwrap();
    out
}

#[test]
fn s1_token_header_query_rotation_and_no_token_in_logs() {
    let s = start();
    let img = s.url("/volumes/disk/disk.img");
    assert_eq!(s.status(&["-H", &hdr(), &img]), 200);
    assert_eq!(
        s.status(&[&format!("{img}?x-kubevirt-export-token={TOKEN}")]),
        200
    );
    assert_eq!(s.status(&[&img]), 401, "missing token");
    assert_eq!(
        s.status(&["-H", "x-kubevirt-export-token: wrong", &img]),
        401
    );
    assert_eq!(s.status(&["-H", "x-kubevirt-export-token: ", &img]), 401);
    // rotation without restart
    let tf = s.root().join("token/token");
    fs::write(&tf, "NewTokenNewTokenNewTokenNewToken").unwrap();
    assert_eq!(s.status(&["-H", &hdr(), &img]), 401, "old token refused");
    assert_eq!(
        s.status(&[
            "-H",
            "x-kubevirt-export-token: NewTokenNewTokenNewTokenNewToken",
            &img
        ]),
        200
    );
    // empty token file rejects everything
    fs::write(&tf, "").unwrap();
    assert_eq!(s.status(&["-H", "x-kubevirt-export-token: ", &img]), 401);
    // unreadable token file: 500
    fs::remove_file(&tf).unwrap();
    assert_eq!(s.status(&["-H", &hdr(), &img]), 500);
    // unknown path: 404 without auth
    assert_eq!(s.status(&[&s.url("/nope")]), 404);
    let log = s.log_text();
    assert!(
        log.contains("/volumes/disk/disk.img"),
        "access log missing: {log}"
    );
    assert!(
        !log.contains(TOKEN) && !log.contains("NewTokenNewToken"),
        "token leaked into the log"
    );
}

#[test]
fn s2_raw_full_head_ranges_resume() {
    let s = start();
    let want = fs::read(s.root().join("export-volumes/v0-disk/disk.img")).unwrap();
    assert_eq!(s.get("/volumes/disk/disk.img"), want);
    let url = s.url("/volumes/disk/disk.img");
    // HEAD reports the length
    let out = s.curl(&["-I", "-H", &hdr(), &url]);
    let head = String::from_utf8_lossy(&out.stdout).to_lowercase();
    assert!(
        head.contains(&format!("content-length: {}", want.len())),
        "{head}"
    );
    assert!(head.contains("accept-ranges: bytes"), "{head}");
    // ranges
    let n = want.len();
    for (range, slice) in [
        ("0-1023", &want[..1024]),
        ("-512", &want[n - 512..]),
        ("1000000-", &want[1_000_000..]),
    ] {
        assert_eq!(s.status(&["-H", &hdr(), "-r", range, &url]), 206);
        let out = s.curl(&["-H", &hdr(), "-r", range, &url]);
        assert_eq!(out.stdout, slice, "range {range}");
    }
    let out = s.curl(&[
        "-D",
        "-",
        "-o",
        "/dev/null",
        "-H",
        &hdr(),
        "-r",
        &format!("{}-", n + 10),
        &url,
    ]);
    let h = String::from_utf8_lossy(&out.stdout).to_lowercase();
    assert!(
        h.starts_with("http/1.1 416") || h.starts_with("http/2 416"),
        "{h}"
    );
    assert!(h.contains(&format!("content-range: bytes */{n}")), "{h}");
    // resume: a partial file completed with -C -
    let part = s.root().join("partial.img");
    fs::write(&part, &want[..123_457]).unwrap();
    let out = s.curl(&[
        "-f",
        "-C",
        "-",
        "-H",
        &hdr(),
        "-o",
        part.to_str().unwrap(),
        &url,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(fs::read(&part).unwrap(), want);
    // other methods
    assert_eq!(s.status(&["-X", "POST", "-H", &hdr(), &url]), 405);
}

#[test]
fn s3_gzip_valid_round_trip_one_and_two_cpus() {
    let s = start();
    let want = fs::read(s.root().join("export-volumes/v0-disk/disk.img")).unwrap();
    let z = s.get("/volumes/disk/disk.img.gz");
    let t = run("gzip", &["-t"], &z);
    assert!(
        t.status.success(),
        "gzip -t: {}",
        String::from_utf8_lossy(&t.stderr)
    );
    let d = run("gzip", &["-dc"], &z);
    assert_eq!(d.stdout, want);
    let out = s.curl(&[
        "-D",
        "-",
        "-o",
        "/dev/null",
        "-H",
        &hdr(),
        &s.url("/volumes/disk/disk.img.gz"),
    ]);
    let h = String::from_utf8_lossy(&out.stdout).to_lowercase();
    assert!(!h.contains("content-length"), "{h}");
    assert!(h.contains("content-type: application/gzip"), "{h}");
    assert_eq!(
        s.status(&[
            "-X",
            "POST",
            "-H",
            &hdr(),
            &s.url("/volumes/disk/disk.img.gz")
        ]),
        400
    );
    drop(s);

    // pinned to one CPU: the worker count follows the affinity mask
    let mut s1 = start();
    let pid = s1.child.as_ref().unwrap().id().to_string();
    let ok = Command::new("taskset")
        .args(["-a", "-p", "-c", "0", &pid])
        .output()
        .unwrap();
    assert!(ok.status.success());
    let z1 = s1.get("/volumes/disk/disk.img.gz");
    assert_eq!(
        run("gzip", &["-dc"], &z1).stdout,
        fs::read(s1.root().join("export-volumes/v0-disk/disk.img")).unwrap()
    );
    s1.child.take().map(|mut c| c.kill());
}

#[test]
fn s4_dir_listing_files_symlinks() {
    let s = start();
    let listing = String::from_utf8(s.get("/volumes/files/dir/")).unwrap();
    assert!(listing.contains("nested/"), "{listing}");
    assert!(listing.contains("disk.img"), "{listing}");
    assert!(!listing.contains("lost+found"), "{listing}");
    // redirect to add the slash
    let out = s.curl(&[
        "-D",
        "-",
        "-o",
        "/dev/null",
        "-H",
        &hdr(),
        &s.url("/volumes/files/dir"),
    ]);
    let h = String::from_utf8_lossy(&out.stdout).to_lowercase();
    assert!(
        h.contains("301") && h.contains("location: /volumes/files/dir/"),
        "{h}"
    );
    assert_eq!(
        s.get("/volumes/files/dir/nested/deeper/a.txt"),
        b"hello nested\n"
    );
    assert_eq!(s.get("/volumes/files/dir/with%20space.txt"), b"space\n");
    assert_eq!(s.get("/volumes/files/dir/link-inside"), b"hello nested\n");
    assert_eq!(
        s.status(&["-H", &hdr(), &s.url("/volumes/files/dir/link-escape")]),
        404
    );
    assert_eq!(
        s.status(&["-H", &hdr(), &s.url("/volumes/files/dir/lost+found/")]),
        404
    );
    assert_eq!(
        s.status(&[
            "-H",
            &hdr(),
            &s.url("/volumes/files/dir/../../cert/tls.key")
        ]),
        404
    );
    let out = s.curl(&[
        "-H",
        &hdr(),
        "-r",
        "10-19",
        &s.url("/volumes/files/dir/disk.img"),
    ]);
    assert_eq!(out.stdout, &pattern(100_000, 2)[10..20]);
}

#[test]
fn s5_tar_gz_gnu_and_bsdtar_sparse() {
    let s = start();
    let z = s.get("/volumes/files/disk.tar.gz");
    assert!(run("gzip", &["-t"], &z).status.success());
    let list = run("tar", &["-tzf", "-"], &z);
    assert!(
        list.status.success(),
        "{}",
        String::from_utf8_lossy(&list.stderr)
    );
    let names = String::from_utf8(list.stdout).unwrap();
    for want in [
        "./disk.img",
        "./nested/deeper/a.txt",
        "./sparse.img",
        "./link-inside",
    ] {
        assert!(
            names.lines().any(|l| l == want),
            "{want} missing in {names}"
        );
    }
    assert!(!names.contains("lost+found"), "{names}");
    assert!(names.contains(&"l".repeat(120)), "long name missing");
    let src = s.root().join("export-volumes/v1-files");
    for tool in ["tar", "bsdtar"] {
        let out = s.root().join(format!("x-{tool}"));
        fs::create_dir_all(&out).unwrap();
        let x = run(tool, &["-xzf", "-", "-C", out.to_str().unwrap()], &z);
        assert!(
            x.status.success(),
            "{tool}: {}",
            String::from_utf8_lossy(&x.stderr)
        );
        for f in [
            "disk.img",
            "nested/deeper/a.txt",
            "sparse.img",
            "with space.txt",
        ] {
            assert_eq!(
                fs::read(out.join(f)).unwrap(),
                fs::read(src.join(f)).unwrap(),
                "{tool}: {f}"
            );
        }
        assert_eq!(
            fs::metadata(out.join("sparse.img")).unwrap().len(),
            1 << 30,
            "{tool}: apparent size"
        );
        assert_eq!(
            fs::read_link(out.join("link-inside")).unwrap(),
            PathBuf::from("nested/deeper/a.txt")
        );
    }
    // holes are not stored: the uncompressed tar stays small
    let raw = run("gzip", &["-dc"], &z).stdout;
    assert!(
        raw.len() < 2 << 20,
        "uncompressed tar is {} bytes",
        raw.len()
    );
}

#[test]
fn s6_unreadable_volume_reported_then_recovers() {
    use std::os::unix::fs::PermissionsExt;
    // As root the permission bits do not stop reads, so make the image missing instead.
    let dir = tempfile::tempdir().unwrap();
    let vol = dir.path().join("vol");
    fs::create_dir_all(&vol).unwrap();
    let vols = vec![
        (
            "VOLUME0_EXPORT_PATH".to_string(),
            vol.to_str().unwrap().to_string(),
        ),
        (
            "VOLUME0_EXPORT_RAW_URI".to_string(),
            "/volumes/broken/disk.img".to_string(),
        ),
    ];
    let s = start_with(&[], Some(vols));
    let out = s.curl(&["-w", "%{http_code}", &s.url("/exportready")]);
    let body = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        body.ends_with("503") && body.contains("volume broken"),
        "{body}"
    );
    assert!(
        !body.contains(vol.to_str().unwrap()),
        "paths must not leak: {body}"
    );
    assert!(s.log_text().contains("volume broken"), "error not logged");
    fs::write(vol.join("disk.img"), b"data").unwrap();
    fs::set_permissions(vol.join("disk.img"), fs::Permissions::from_mode(0o644)).unwrap();
    let t0 = Instant::now();
    loop {
        if s.status(&[&s.url("/exportready")]) == 200 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(7), "still not ready");
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(s.curl(&[&s.url("/exportready")]).stdout, b"OK");
}

#[test]
fn s7_secret_manifest_json_yaml_and_external_404() {
    let s = start();
    let list: serde_json::Value =
        serde_json::from_slice(&s.get("/internal/manifests/secret")).unwrap();
    // KubeVirt answers with a `List` of one Secret.
    assert_eq!(
        (&list["apiVersion"], &list["kind"]),
        (&"v1".into(), &"List".into())
    );
    assert_eq!(list["items"].as_array().unwrap().len(), 1, "{list}");
    let j = &list["items"][0];
    assert_eq!(j["kind"], "Secret");
    assert_eq!(j["metadata"]["name"], "header-secret-e1");
    assert_eq!(
        j["stringData"]["token"],
        format!("x-kubevirt-export-token:{TOKEN}")
    );
    let out = s.curl(&[
        "-f",
        "-H",
        &hdr(),
        "-H",
        "Accept: application/yaml",
        &s.url("/internal/manifests/secret"),
    ]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.ends_with("\n---\n"),
        "every document is terminated: {text}"
    );
    let docs: Vec<&str> = text
        .split("---\n")
        .filter(|d| !d.trim().is_empty())
        .collect();
    assert_eq!(docs.len(), 1, "{text}");
    let y: serde_json::Value = serde_saphyr::from_str(docs[0]).unwrap();
    assert_eq!(&y, j);
    assert_eq!(
        s.status(&["-H", &hdr(), &s.url("/external/manifests/secret")]),
        404
    );
    assert_eq!(
        s.status(&["-H", &hdr(), &s.url("/internal/manifests/all")]),
        404,
        "no all manifest for PVC sources"
    );
    assert_eq!(
        s.status(&[
            "-X",
            "POST",
            "-H",
            &hdr(),
            &s.url("/internal/manifests/secret")
        ]),
        400
    );
}

#[test]
fn s8_exits_zero_at_deadline() {
    let deadline = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(3);
    let mut s = start_with(&[("DEADLINE", deadline.to_string())], None);
    let mut child = s.child.take().unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "did not exit at DEADLINE"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "{status:?}");
    let late = jiff::Timestamp::now().duration_since(deadline);
    assert!(
        late < jiff::SignedDuration::from_secs(2),
        "exited {late:?} after the deadline"
    );
}

#[test]
fn s9_tls_verification_and_http2() {
    let s = start();
    // wrong name: verification fails
    let out = Command::new("curl")
        .args([
            "-sS",
            "-o",
            "/dev/null",
            "--cacert",
            s.root().join("ca.crt").to_str().unwrap(),
            "--resolve",
            &format!("other.svc:{}:127.0.0.1", s.port),
            &format!("https://other.svc:{}/exportready", s.port),
        ])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a certificate for another name was accepted"
    );
    // TLS 1.1 refused
    assert_eq!(s.status(&["--tls-max", "1.1", &s.url("/exportready")]), 0);
    // HTTP/2
    let out = s.curl(&[
        "--http2",
        "-o",
        "/dev/null",
        "-w",
        "%{http_version}",
        "-H",
        &hdr(),
        &s.url("/volumes/disk/disk.img"),
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "2");
    // HEAD over HTTP/2 gets headers only, on an error (only GET is offered) as on a file.
    for (path, want) in [
        ("/volumes/disk/disk.img.gz", "400"),
        ("/volumes/disk/disk.img", "200"),
        ("/nope", "404"),
    ] {
        let out = s.curl(&[
            "--http2",
            "-I",
            "-o",
            "/dev/null",
            "-w",
            "%{http_version} %{http_code}",
            "-H",
            &hdr(),
            &s.url(path),
        ]);
        assert!(
            out.status.success(),
            "HEAD {path}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("2 {want}"),
            "HEAD {path}"
        );
    }
}

#[test]
fn s10_bytes_served_metric_matches_downloads() {
    let mp = free_port();
    let s = start_with(&[("METRICS_ADDR", format!("127.0.0.1:{mp}"))], None);
    let raw = s.get("/volumes/disk/disk.img").len() as u64;
    let gz = s.get("/volumes/disk/disk.img.gz").len() as u64;
    let tgz = s.get("/volumes/files/disk.tar.gz").len() as u64;
    let f = s.get("/volumes/files/dir/nested/deeper/a.txt").len() as u64;
    // the stream thread counts a frame right after handing it over; allow it to finish
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(s.metrics_line(mp, "raw"), raw);
    assert_eq!(s.metrics_line(mp, "gzip"), gz);
    assert_eq!(s.metrics_line(mp, "tar.gz"), tgz);
    assert_eq!(s.metrics_line(mp, "dir"), f);
}

#[test]
fn s11_truncated_file_is_an_incomplete_transfer() {
    // Large enough that the server's read-ahead (a few MiB) cannot hold it all.
    let dir = tempfile::tempdir().unwrap();
    let vol = dir.path().join("big");
    fs::create_dir_all(&vol).unwrap();
    let img = vol.join("disk.img");
    fs::write(&img, pattern(64 << 20, 9)).unwrap();
    let vols = vec![
        (
            "VOLUME0_EXPORT_PATH".to_string(),
            vol.to_str().unwrap().to_string(),
        ),
        (
            "VOLUME0_EXPORT_RAW_URI".to_string(),
            "/volumes/big/disk.img".to_string(),
        ),
    ];
    let s = start_with(&[], Some(vols));
    let child = Command::new("curl")
        .args([
            "-sS",
            "-o",
            "/dev/null",
            "--limit-rate",
            "1M",
            "--cacert",
            s.root().join("ca.crt").to_str().unwrap(),
            "--resolve",
            &format!("{SVC}.{NS}.svc:{}:127.0.0.1", s.port),
            "-H",
            &hdr(),
            &s.url("/volumes/big/disk.img"),
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(1_500_000)
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        !out.status.success(),
        "curl reported success for a truncated body"
    );
    assert!(
        s.log_text().contains("transfer aborted"),
        "{}",
        s.log_text()
    );
}

#[test]
fn s7_all_manifest_from_manifest_data() {
    let s0 = tempfile::tempdir().unwrap();
    let md = s0.path().join("manifest_data");
    fs::create_dir_all(&md).unwrap();
    let host = format!("https://{SVC}.{NS}.svc");
    fs::write(md.join("internal_host"), &host).unwrap();
    fs::write(md.join("internal_ca_cm"), "CA-PEM").unwrap();
    fs::write(md.join("export-name"), "e1").unwrap();
    fs::write(
        md.join("virtualmachine-manifest"),
        serde_json::json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "vm1"},
            "spec": {"dataVolumeTemplates": [{"metadata": {"name": "disk"}, "spec": {"sourceRef": {"kind": "DataSource", "name": "x"}, "storage": {}}}],
                "template": {"spec": {"volumes": [{"name": "r", "dataVolume": {"name": "disk"}}, {"name": "f", "persistentVolumeClaim": {"claimName": "files"}}]}}}})
            .to_string(),
    )
    .unwrap();
    fs::write(
        md.join("dv-files"),
        serde_json::json!({"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume", "metadata": {"name": "files"}, "spec": {"storage": {}}}).to_string(),
    )
    .unwrap();
    let s = start_with(
        &[
            ("EXPORT_VM_DEF_URI", "/manifests/all".to_string()),
            ("MANIFEST_DATA_DIR", md.to_str().unwrap().to_string()),
        ],
        None,
    );
    let list: serde_json::Value =
        serde_json::from_slice(&s.get("/internal/manifests/all")).unwrap();
    assert_eq!(list["kind"], "List");
    let items = list["items"].as_array().unwrap();
    let kinds: Vec<_> = items.iter().map(|i| i["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["ConfigMap", "VirtualMachine", "DataVolume"]);
    assert_eq!(items[0]["metadata"]["name"], "export-ca-cm-e1");
    let tpl = &items[1]["spec"]["dataVolumeTemplates"][0]["spec"];
    assert_eq!(
        tpl["source"]["http"]["url"],
        format!("{host}/volumes/disk/disk.img.gz")
    );
    assert_eq!(
        tpl["source"]["http"]["secretExtraHeaders"][0],
        "header-secret-e1"
    );
    assert_eq!(tpl["source"]["http"]["certConfigMap"], "export-ca-cm-e1");
    assert!(tpl.get("sourceRef").is_none());
    // `files` is a directory volume: no gzip disk, so no URL (a disk.img.gz link would 404).
    assert_eq!(items[2]["spec"]["source"]["http"]["url"], "");
    assert_eq!(
        items[2]["spec"]["source"]["http"]["secretExtraHeaders"][0],
        "header-secret-e1"
    );
    // YAML documents
    let out = s.curl(&[
        "-f",
        "-H",
        &hdr(),
        "-H",
        "Accept: application/yaml",
        &s.url("/internal/manifests/all"),
    ]);
    let text = String::from_utf8(out.stdout).unwrap();
    // Every document ends with `---`, as virt-exportserver writes them.
    assert_eq!(text.matches("\n---\n").count(), 3, "{text}");
    assert!(text.ends_with("\n---\n"), "{text}");
    // no external host configured
    assert_eq!(
        s.status(&["-H", &hdr(), &s.url("/external/manifests/all")]),
        404
    );
    assert_eq!(s.status(&[&s.url("/internal/manifests/all")]), 401);
}

/// Detaches the loop device when the test ends, pass or fail.
struct Loop(String);

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

#[test]
fn s12_block_device_raw_and_gzip() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("backing.img");
    let data = pattern(8 << 20, 12);
    fs::write(&img, &data).unwrap();
    let out = Command::new("losetup")
        .args(["-f", "--show", "-r", img.to_str().unwrap()])
        .output();
    let dev = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        other => {
            // A host that refuses loop devices may opt out explicitly; never silently.
            let why = format!("{other:?}");
            if std::env::var("UCM_E2E_NO_LOOP_DEVICES").is_ok() {
                println!("EXCLUDED: s12_block_device_raw_and_gzip (loop devices refused: {why})");
                return;
            }
            panic!(
                "loop devices are needed for S12 (set UCM_E2E_NO_LOOP_DEVICES=1 to exclude it by name): {why}"
            );
        }
    };
    let _guard = Loop(dev.clone());
    let vols = vec![
        ("VOLUME0_EXPORT_PATH".to_string(), dev.clone()),
        (
            "VOLUME0_EXPORT_RAW_URI".to_string(),
            "/volumes/blk/disk.img".to_string(),
        ),
        (
            "VOLUME0_EXPORT_RAW_GZIP_URI".to_string(),
            "/volumes/blk/disk.img.gz".to_string(),
        ),
    ];
    let s = start_with(&[], Some(vols));
    assert_eq!(s.curl(&[&s.url("/exportready")]).stdout, b"OK");
    // the size of a block device comes from seeking to its end
    let out = s.curl(&["-I", "-H", &hdr(), &s.url("/volumes/blk/disk.img")]);
    let head = String::from_utf8_lossy(&out.stdout).to_lowercase();
    assert!(
        head.contains(&format!("content-length: {}", data.len())),
        "{head}"
    );
    assert_eq!(s.get("/volumes/blk/disk.img"), data);
    let z = s.get("/volumes/blk/disk.img.gz");
    assert_eq!(run("gzip", &["-dc"], &z).stdout, data);
    let r = s.curl(&[
        "-H",
        &hdr(),
        "-r",
        "4096-8191",
        &s.url("/volumes/blk/disk.img"),
    ]);
    assert_eq!(r.stdout, &data[4096..8192]);
}

#[test]
fn s13_default_listen_address_is_dual_stack() {
    // The pod leaves LISTEN_ADDR unset: `:8443`, every address of both families, as in Go.
    let port = free_port();
    let s = start_with(&[("LISTEN_ADDR", format!(":{port}"))], None);
    let want = fs::read(s.root().join("export-volumes/v0-disk/disk.img")).unwrap();
    assert_eq!(s.get("/volumes/disk/disk.img"), want, "over IPv4");
    let ca = s.root().join("ca.crt");
    let out = Command::new("curl")
        .args([
            "-sSf",
            "--cacert",
            ca.to_str().unwrap(),
            "--resolve",
            &format!("{SVC}.{NS}.svc:{port}:[::1]"),
            "-H",
            &hdr(),
            &s.url("/volumes/disk/disk.img"),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "over IPv6: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, want, "over IPv6");
    assert!(
        s.log_text().contains(&format!("[::]:{port}")),
        "{}",
        s.log_text()
    );
}

/// Issue 34: nothing ucm does cuts a download in flight. One slow download (about 10 s) spans a
/// certificate rotation (the files swapped as the kubelet updates a Secret volume), the
/// server's DEADLINE (the TTL) and many idle timeouts (about 13 s); it completes byte-exact, new handshakes
/// get the new certificate, an idle connection is closed, no connection is accepted after the
/// DEADLINE, and the server exits 0 once the download is done.
#[test]
fn s14_download_spans_cert_rotation_deadline_and_idle_timeouts() {
    let dir = tempfile::tempdir().unwrap();
    let vol = dir.path().join("big");
    fs::create_dir_all(&vol).unwrap();
    let img = vol.join("disk.img");
    let content = pattern(64 << 20, 14);
    fs::write(&img, &content).unwrap();
    let vols = vec![
        (
            "VOLUME0_EXPORT_PATH".to_string(),
            vol.to_str().unwrap().to_string(),
        ),
        (
            "VOLUME0_EXPORT_RAW_URI".to_string(),
            "/volumes/big/disk.img".to_string(),
        ),
    ];
    let deadline = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(8);
    let mut s = start_with(
        &[
            ("DEADLINE", deadline.to_string()),
            ("DRAIN_SECONDS", "120".to_string()),
            ("IDLE_TIMEOUT_SECONDS", "2".to_string()),
        ],
        Some(vols),
    );
    let old_cert = pem_body(&fs::read_to_string(s.root().join("cert/tls.crt")).unwrap());
    assert_eq!(presented_cert(s.port, &format!("{SVC}.{NS}.svc")), old_cert);

    let got = s.root().join("got.img");
    let download = Command::new("curl")
        .args([
            "-sS",
            "-f",
            "--http1.1",
            "--limit-rate",
            "5M",
            "-o",
            got.to_str().unwrap(),
            "--cacert",
            s.root().join("ca.crt").to_str().unwrap(),
            "--resolve",
            &format!("{SVC}.{NS}.svc:{}:127.0.0.1", s.port),
            "-H",
            &hdr(),
            &s.url("/volumes/big/disk.img"),
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // An idle connection (a handshake, then nothing) is closed after IDLE_TIMEOUT_SECONDS.
    let t_idle = Instant::now();
    let mut idle = Command::new("openssl")
        .args([
            "s_client",
            "-quiet",
            "-connect",
            &format!("127.0.0.1:{}", s.port),
            "-servername",
            &format!("{SVC}.{NS}.svc"),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();

    // Rotate: a new certificate from the same CA, each file replaced atomically (the kubelet
    // swaps a Secret volume's files at once; a reader may still see one new and one old file).
    std::thread::sleep(Duration::from_millis(500));
    let ca_pem = fs::read_to_string(s.root().join("ca.crt")).unwrap();
    let ca_key = fs::read_to_string(s.root().join("ca.key")).unwrap();
    let ca = certs::Pem {
        cert: ca_pem,
        key: ca_key,
    };
    let new = certs::issue_serving(
        &ca,
        SVC,
        NS,
        jiff::Timestamp::now(),
        Duration::from_secs(7200),
    )
    .unwrap();
    for (f, body) in [("tls.crt", &new.cert), ("tls.key", &new.key)] {
        let tmp = s.root().join(format!("cert/.{f}.new"));
        fs::write(&tmp, body).unwrap();
        fs::rename(&tmp, s.root().join("cert").join(f)).unwrap();
    }
    let new_cert = pem_body(&new.cert);
    assert_ne!(new_cert, old_cert);
    let t_rot = Instant::now();
    while presented_cert(s.port, &format!("{SVC}.{NS}.svc")) != new_cert {
        assert!(
            t_rot.elapsed() < Duration::from_secs(5),
            "new handshakes still get the old certificate: {}",
            s.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    let idle_status = loop {
        if let Some(st) = idle.try_wait().unwrap() {
            break st;
        }
        assert!(
            t_idle.elapsed() < Duration::from_secs(10),
            "an idle connection stayed open"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = idle_status;
    assert!(t_idle.elapsed() >= Duration::from_secs(2));

    // After the DEADLINE no new connection is accepted, while the download goes on.
    while jiff::Timestamp::now() < deadline + jiff::SignedDuration::from_millis(500) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        s.status(&[&s.url("/exportready")]),
        0,
        "served after DEADLINE"
    );
    let mut child = s.child.take().unwrap();
    assert!(
        child.try_wait().unwrap().is_none(),
        "the server exited while a download was in flight"
    );

    let out = download.wait_with_output().unwrap();
    let done = Instant::now();
    assert!(
        out.status.success(),
        "the download was cut: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.log_text()
    );
    assert!(
        jiff::Timestamp::now() > deadline + jiff::SignedDuration::from_secs(2),
        "the download did not outlast the DEADLINE; the test proves nothing"
    );
    let body = fs::read(&got).unwrap();
    assert!(body == content, "the download differs from the volume");

    // The last download done, the server exits 0 (the Pod becomes Succeeded).
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            done.elapsed() < Duration::from_secs(5),
            "the server did not exit after its last download"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "{status:?}");
    assert!(
        s.log_text().contains("serving certificate reloaded"),
        "{}",
        s.log_text()
    );
}
