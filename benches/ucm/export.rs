//! Phase `export` (docs/vmexport.md, "Performance goals", P1 and P2): one 2 GiB file without holes,
//! served by `ucm export-server` (HTTPS, raw and gzip) and by nginx from Debian (sendfile over
//! plain HTTP, and HTTPS with the same certificate), compressed by pigz; the same file, in the same
//! run, from the page cache. curl downloads to /dev/null (gzip streams are not decompressed).
//! Throughput is file bytes per second (for gzip: uncompressed bytes per second). The same raw
//! download also goes through `ucm export-proxy` (KubeVirt's external URL, the token checked
//! against an export and Secret on the phase's control plane) to the same server, and through a
//! reference TLS reverse proxy, nginx from Debian (`proxy_pass https://`, the same certificates:
//! the proxy's serving certificate and the export CA to verify the server). Then 50 concurrent
//! downloads (each a 1/50 range of the file) go straight to the server, through ucm's proxy and
//! through nginx's; each proxy's CPU time per GiB moved comes from /proc (issues 32 and 34).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ucm::vmexport::certs;
use ucm_testkit::free_port;

use crate::Ctx;
use crate::procs::{Proc, ucm_bin};
use crate::report::{Figure, median};

const PHASE: &str = "export";
const SVC: &str = "virt-export-bench";
const NS: &str = "bench";
const TOKEN: &str = "BenchT0kenBenchT0kenBenchT0ken12";

/// Deterministic disk-like content with no holes: each 64 KiB block is either pseudo-random
/// (incompressible) or text-like, and a quarter of the blocks are zero-filled ones, so gzip has
/// real work and a real ratio (about 2:1).
fn write_image(path: &Path, bytes: u64) {
    let mut f = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path).unwrap());
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut block = vec![0u8; 64 * 1024];
    let text = b"ucm bench: the quick brown fox jumps over the lazy dog 0123456789\n";
    let mut written = 0;
    let mut i = 0u64;
    while written < bytes {
        match i % 4 {
            0 | 1 => {
                for chunk in block.chunks_mut(8) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
                }
            }
            2 => {
                for (j, b) in block.iter_mut().enumerate() {
                    *b = text[(j + i as usize) % text.len()];
                }
            }
            _ => block.fill(0),
        }
        let n = (bytes - written).min(block.len() as u64) as usize;
        f.write_all(&block[..n]).unwrap();
        written += n as u64;
        i += 1;
    }
    f.flush().unwrap();
}

struct Nginx {
    child: std::process::Child,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        ucm_testkit::signal(self.child.id(), "QUIT");
        let _ = self.child.wait();
    }
}

fn nginx(dir: &Path, root: &Path, http: u16, https: u16, cert: &Path, key: &Path) -> Nginx {
    let conf = dir.join("nginx.conf");
    // SAFETY: geteuid takes no arguments, touches no memory and cannot fail.
    let user = if unsafe { libc::geteuid() } == 0 {
        "user root;"
    } else {
        ""
    };
    std::fs::write(
        &conf,
        format!(
            r#"{user}
worker_processes auto;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    client_body_temp_path {dir}/tmp;
    proxy_temp_path {dir}/tmp;
    fastcgi_temp_path {dir}/tmp;
    uwsgi_temp_path {dir}/tmp;
    scgi_temp_path {dir}/tmp;
    default_type application/octet-stream;
    server {{ listen 127.0.0.1:{http}; root {root}; }}
    server {{
        listen 127.0.0.1:{https} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        root {root};
    }}
}}
"#,
            dir = dir.display(),
            root = root.display(),
            cert = cert.display(),
            key = key.display(),
        ),
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
    let mut cmd = Command::new("nginx");
    crate::child::die_with_parent(&mut cmd);
    let child = cmd
        .arg("-c")
        .arg(&conf)
        .arg("-p")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("nginx.out")).unwrap())
        .spawn()
        .expect("nginx (Debian package nginx; hack/bench/bench.sh installs it)");
    wait_port(http);
    wait_port(https);
    Nginx { child }
}

/// nginx from Debian as a reference TLS reverse proxy in front of the export server on
/// `upstream`: the external path prefix stripped as ucm's proxy strips it, the server verified
/// with the export CA under its Service name, HTTP/1.1 upstream, responses buffered in memory
/// only (`proxy_max_temp_file_size 0`: never spooled to disk). Its own instance, so its CPU is
/// its own.
fn nginx_proxy(dir: &Path, port: u16, upstream: u16, cert: &Path, key: &Path, ca: &Path) -> Nginx {
    let dir = dir.join("nginx-proxy");
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
    let conf = dir.join("nginx.conf");
    // SAFETY: geteuid takes no arguments, touches no memory and cannot fail.
    let user = if unsafe { libc::geteuid() } == 0 {
        "user root;"
    } else {
        ""
    };
    std::fs::write(
        &conf,
        format!(
            r#"{user}
worker_processes auto;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {dir}/tmp;
    proxy_temp_path {dir}/tmp;
    fastcgi_temp_path {dir}/tmp;
    uwsgi_temp_path {dir}/tmp;
    scgi_temp_path {dir}/tmp;
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location {prefix}/ {{
            proxy_pass https://127.0.0.1:{upstream}/;
            proxy_http_version 1.1;
            proxy_set_header Host {SVC}.{NS}.svc;
            proxy_ssl_server_name on;
            proxy_ssl_name {SVC}.{NS}.svc;
            proxy_ssl_verify on;
            proxy_ssl_trusted_certificate {ca};
            proxy_buffering on;
            proxy_buffers 16 256k;
            proxy_busy_buffers_size 512k;
            proxy_max_temp_file_size 0;
            proxy_read_timeout 1h;
        }}
    }}
}}
"#,
            dir = dir.display(),
            cert = cert.display(),
            key = key.display(),
            ca = ca.display(),
            prefix = EXTERNAL_PREFIX,
        ),
    )
    .unwrap();
    let mut cmd = Command::new("nginx");
    crate::child::die_with_parent(&mut cmd);
    let child = cmd
        .arg("-c")
        .arg(&conf)
        .arg("-p")
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("nginx.out")).unwrap())
        .spawn()
        .expect("nginx (Debian package nginx; hack/bench/bench.sh installs it)");
    wait_port(port);
    Nginx { child }
}

/// The external path of the export `bench` (KubeVirt's proxy scheme).
const EXTERNAL_PREFIX: &str =
    "/api/export.kubevirt.io/v1/namespaces/bench/virtualmachineexports/bench";

/// CPU seconds of a process and its children that are alive (nginx's workers).
fn tree_cpu(pid: u32) -> f64 {
    let kids =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    crate::procs::cpu_secs(pid)
        + kids
            .split_whitespace()
            .filter_map(|k| k.parse::<u32>().ok())
            .map(crate::procs::cpu_secs)
            .sum::<f64>()
}

/// `n` concurrent curls, each downloading its 1/n range of the `bytes`-long file at `url`
/// (every byte once in all); returns the wall time. Each range must come back whole (206).
fn concurrent(url: &str, ca: &Path, hdr: &str, bytes: u64, n: u64) -> f64 {
    let authority = url.split("://").nth(1).unwrap().split('/').next().unwrap();
    let resolve = format!("{authority}:127.0.0.1");
    let chunk = bytes.div_ceil(n);
    let t0 = Instant::now();
    let kids: Vec<_> = (0..n)
        .map(|i| {
            let (a, b) = (i * chunk, ((i + 1) * chunk).min(bytes) - 1);
            let child = Command::new("curl")
                .args([
                    "-sS",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code} %{size_download}",
                ])
                .arg("--cacert")
                .arg(ca)
                .args(["--resolve", &resolve, "-H", hdr, "-r", &format!("{a}-{b}")])
                .arg(url)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("curl");
            (child, b - a + 1)
        })
        .collect();
    for (k, want) in kids {
        let out = k.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert_eq!(
            text,
            format!("206 {want}"),
            "curl {url}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    t0.elapsed().as_secs_f64()
}

fn wait_port(port: u16) {
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "nothing listens on {port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// curl to /dev/null; returns seconds and checks the status code and byte count.
fn curl(url: &str, ca: &Path, extra: &[&str], want_bytes: Option<u64>) -> f64 {
    // The URL's host:port, resolved to 127.0.0.1 (the certificates name Service hosts).
    let authority = url.split("://").nth(1).unwrap().split('/').next().unwrap();
    let resolve = format!("{authority}:127.0.0.1");
    let t0 = Instant::now();
    let out = Command::new("curl")
        .args([
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{size_download}",
            "--cacert",
        ])
        .arg(ca)
        .args(["--resolve", &resolve])
        .args(extra)
        .arg(url)
        .output()
        .expect("curl");
    let secs = t0.elapsed().as_secs_f64();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut it = text.split_whitespace();
    let (code, size) = (
        it.next().unwrap_or(""),
        it.next().and_then(|s| s.parse::<u64>().ok()).unwrap_or(0),
    );
    assert_eq!(
        code,
        "200",
        "curl {url}: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    if let Some(b) = want_bytes {
        assert_eq!(size, b, "curl {url}: short download");
    } else {
        assert!(size > 0, "curl {url}: empty");
    }
    secs
}

fn pigz(file: &Path) -> f64 {
    pigz_threads(file, 0)
}

/// pigz -6 with `threads` threads (0: pigz's default, one per CPU).
fn pigz_threads(file: &Path, threads: usize) -> f64 {
    let t0 = Instant::now();
    let mut cmd = Command::new("pigz");
    if threads > 0 {
        cmd.arg(format!("-p{threads}"));
    }
    let st = cmd
        .args(["-6", "-c"])
        .arg(file)
        .stdout(Stdio::null())
        .status()
        .expect("pigz (Debian package pigz; hack/bench/bench.sh installs it)");
    assert!(st.success());
    t0.elapsed().as_secs_f64()
}

/// `ucm export-server` serving `vol` on `port`, pinned to `cpus` (taskset) when given.
fn export_server(
    dir: &Path,
    vol: &Path,
    crt: &Path,
    key: &Path,
    tok: &Path,
    port: u16,
    cpus: Option<&str>,
) -> Proc {
    let mut cmd = match cpus {
        Some(c) => {
            let mut cmd = Command::new("taskset");
            cmd.args(["-c", c]).arg(ucm_bin());
            cmd
        }
        None => Command::new(ucm_bin()),
    };
    cmd.arg("export-server")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("LISTEN_ADDR", format!("127.0.0.1:{port}"))
        .env("CERT_FILE", crt)
        .env("KEY_FILE", key)
        .env("TOKEN_FILE", tok)
        .env("EXPORT_NAME", "bench")
        .env("MANIFEST_DATA_DIR", dir.join("manifest_data"))
        .env("VOLUME0_EXPORT_PATH", vol)
        .env("VOLUME0_EXPORT_RAW_URI", "/volumes/disk/disk.img")
        .env("VOLUME0_EXPORT_RAW_GZIP_URI", "/volumes/disk/disk.img.gz");
    let log = format!("export-server-{}.log", cpus.unwrap_or("all"));
    Proc::spawn(cmd, dir.join(log))
}

pub async fn run(ctx: &Ctx) -> Vec<Figure> {
    let bytes = ctx.export_bytes;
    let dir: PathBuf = ctx.work.join("export");
    let vol = dir.join("export-volumes/v0-disk");
    std::fs::create_dir_all(&vol).unwrap();
    let img = vol.join("disk.img");
    let t0 = Instant::now();
    write_image(&img, bytes);
    eprintln!(
        "  wrote {} MiB in {:.1}s",
        bytes >> 20,
        t0.elapsed().as_secs_f64()
    );

    let now = jiff::Timestamp::now();
    let ca = certs::new_ca(now).unwrap();
    let srv = certs::issue_serving(&ca, SVC, NS, now, Duration::from_secs(3600)).unwrap();
    let (ca_path, crt, key, tok) = (
        dir.join("ca.crt"),
        dir.join("tls.crt"),
        dir.join("tls.key"),
        dir.join("token"),
    );
    std::fs::write(&ca_path, &ca.cert).unwrap();
    std::fs::write(&crt, &srv.cert).unwrap();
    std::fs::write(&key, &srv.key).unwrap();
    std::fs::write(&tok, TOKEN).unwrap();

    let port = free_port();
    let server = export_server(&dir, &vol, &crt, &key, &tok, port, None);
    wait_port(port);
    let (http, https) = (free_port(), free_port());
    let web = nginx(&dir, &vol, http, https, &crt, &key);

    let hdr = format!("x-kubevirt-export-token: {TOKEN}");
    let ucm_url = |p: &str| format!("https://{SVC}.{NS}.svc:{port}{p}");
    // Warm the page cache and every server once.
    curl(
        &ucm_url("/volumes/disk/disk.img"),
        &ca_path,
        &["-H", &hdr],
        Some(bytes),
    );
    // Both proxies serve the same certificate, issued from the export CA for the proxy Service.
    let psrv = certs::issue_serving(
        &ca,
        ucm::vmexport::proxy::SERVICE,
        NS,
        now,
        Duration::from_secs(3600),
    )
    .unwrap();
    let (pcrt, pkey) = (dir.join("proxy.crt"), dir.join("proxy.key"));
    std::fs::write(&pcrt, &psrv.cert).unwrap();
    std::fs::write(&pkey, &psrv.key).unwrap();
    let (proxy, proxy_url) = export_proxy(ctx, &dir, &ca, port, &pcrt, &pkey).await;
    curl(&proxy_url, &ca_path, &["-H", &hdr], Some(bytes));
    let nport = free_port();
    let nproxy = nginx_proxy(&dir, nport, port, &pcrt, &pkey, &ca_path);
    let nproxy_url = format!(
        "https://{}.{NS}.svc:{nport}{EXTERNAL_PREFIX}/volumes/disk/disk.img",
        ucm::vmexport::proxy::SERVICE
    );
    curl(&nproxy_url, &ca_path, &["-H", &hdr], Some(bytes));
    let mut s: [Vec<f64>; 7] = Default::default();
    let mib = |secs: f64| bytes as f64 / f64::from(1 << 20) / secs;
    // A single raw download lasts about 2 s and swings by a fifth on 2 shared cores: the raw
    // downloads run in ROUNDS interleaved rounds a run (each of them once a round), the figures
    // their medians. gzip and pigz last about 18 s each and run once a run.
    const ROUNDS: usize = 5;
    for r in 0..ctx.runs {
        for k in 0..ROUNDS {
            s[0].push(mib(curl(
                &ucm_url("/volumes/disk/disk.img"),
                &ca_path,
                &["-H", &hdr],
                Some(bytes),
            )));
            s[1].push(mib(curl(
                &format!("http://{SVC}.{NS}.svc:{http}/disk.img"),
                &ca_path,
                &[],
                Some(bytes),
            )));
            s[2].push(mib(curl(
                &format!("https://{SVC}.{NS}.svc:{https}/disk.img"),
                &ca_path,
                &[],
                Some(bytes),
            )));
            s[5].push(mib(curl(&proxy_url, &ca_path, &["-H", &hdr], Some(bytes))));
            s[6].push(mib(curl(&nproxy_url, &ca_path, &["-H", &hdr], Some(bytes))));
            let i = r * ROUNDS + k;
            eprintln!(
                "  run {r} round {k}: ucm raw {:.0}, nginx http {:.0}, nginx https {:.0}, raw through ucm export-proxy {:.0}, through nginx proxy_pass {:.0} MiB/s",
                s[0][i], s[1][i], s[2][i], s[5][i], s[6][i]
            );
        }
        s[3].push(mib(curl(
            &ucm_url("/volumes/disk/disk.img.gz"),
            &ca_path,
            &["-H", &hdr],
            None,
        )));
        s[4].push(mib(pigz(&img)));
        eprintln!(
            "  run {r}: ucm gzip {:.0}, pigz {:.0} MiB/s",
            s[3][r], s[4][r]
        );
    }
    drop(web);
    // 50 concurrent downloads: aggregate MiB/s straight, through ucm's proxy, through nginx's;
    // CPU seconds per GiB of each proxy over its runs.
    const CONC: u64 = 50;
    let gib = bytes as f64 / f64::from(1 << 30);
    let mut c50: [Vec<f64>; 3] = Default::default();
    let mut cpu: [Vec<f64>; 2] = Default::default();
    let direct_url = ucm_url("/volumes/disk/disk.img");
    // One round takes about 3 s: ROUNDS interleaved rounds a run too.
    for r in 0..ctx.runs * ROUNDS {
        c50[0].push(mib(concurrent(&direct_url, &ca_path, &hdr, bytes, CONC)));
        let c0 = crate::procs::cpu_secs(proxy.pid());
        c50[1].push(mib(concurrent(&proxy_url, &ca_path, &hdr, bytes, CONC)));
        cpu[0].push((crate::procs::cpu_secs(proxy.pid()) - c0) / gib);
        let n0 = tree_cpu(nproxy.child.id());
        c50[2].push(mib(concurrent(&nproxy_url, &ca_path, &hdr, bytes, CONC)));
        cpu[1].push((tree_cpu(nproxy.child.id()) - n0) / gib);
        eprintln!(
            "  round {r}, {CONC} concurrent: direct {:.0}, ucm export-proxy {:.0} ({:.2} CPU s/GiB), nginx proxy_pass {:.0} ({:.2} CPU s/GiB) MiB/s",
            c50[0][r], c50[1][r], cpu[0][r], c50[2][r], cpu[1][r]
        );
    }
    drop(nproxy);
    drop(proxy);

    // The gzip stream must be valid and round-trip to the source (docs/vmexport.md, "Performance
    // goals", P2).
    let sha = |cmd: &str| {
        let out = Command::new("bash").args(["-c", cmd]).output().expect("sh");
        assert!(
            out.status.success(),
            "{cmd}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_string()
    };
    let source = sha(&format!("sha256sum '{}'", img.display()));
    let streamed = sha(&format!(
        "set -o pipefail; curl -sSf --cacert '{}' --resolve {SVC}.{NS}.svc:{port}:127.0.0.1 -H '{hdr}' '{}' | gzip -dc | sha256sum",
        ca_path.display(),
        ucm_url("/volumes/disk/disk.img.gz")
    ));
    assert_eq!(
        streamed, source,
        "the gzip download does not round-trip to the source file"
    );
    drop(server);

    // P2: gzip with the server pinned to one CPU, then to both; pigz with 1 and 2 threads.
    let mut scaling: [Vec<f64>; 4] = Default::default();
    for (k, cpus) in ["0", "0,1"].into_iter().enumerate() {
        let p = free_port();
        let pinned = export_server(&dir, &vol, &crt, &key, &tok, p, Some(cpus));
        wait_port(p);
        let url = format!("https://{SVC}.{NS}.svc:{p}/volumes/disk/disk.img.gz");
        for _ in 0..ctx.runs {
            scaling[k].push(mib(curl(&url, &ca_path, &["-H", &hdr], None)));
            scaling[2 + k].push(mib(pigz_threads(&img, k + 1)));
        }
        drop(pinned);
    }
    eprintln!(
        "  gzip, server on 1 / 2 CPUs: {:?} / {:?} MiB/s; pigz -p1 / -p2: {:?} / {:?}",
        scaling[0], scaling[1], scaling[2], scaling[3]
    );
    let _ = std::fs::remove_file(&img);
    let med = |v: &Vec<f64>| crate::report::median(v);
    let size = format!("{} GiB", bytes as f64 / (1u64 << 30) as f64);
    vec![
        Figure::new(PHASE, "export.raw_vs_sendfile", &format!("raw download of a {size} file: ucm export-server (HTTPS) vs nginx sendfile"), "MiB/s", s[0].clone())
            .reference(med(&s[1]), "nginx sendfile, plain HTTP, same file", true)
            .higher_is_better()
            .note("curl to /dev/null on the same 2 cores; TLS costs both the server and curl, sendfile over plain HTTP costs neither"),
        Figure::new(PHASE, "export.raw_vs_nginx_tls", &format!("raw download of a {size} file: ucm export-server (HTTPS) vs nginx HTTPS"), "MiB/s", s[0].clone())
            .reference(med(&s[2]), "nginx HTTPS (OpenSSL, no sendfile), same file and certificate", true)
            .higher_is_better(),
        Figure::new(PHASE, "export.proxy_vs_direct", &format!("raw download of a {size} file through ucm export-proxy (KubeVirt's external URL) vs directly from the export server"), "MiB/s", s[5].clone())
            .reference(med(&s[0]), "the same raw download straight from ucm export-server", true)
            .higher_is_better()
            .note("goal ≥ 90 % of direct (issue 18); the proxy terminates TLS and re-encrypts to the server, so the 2 cores carry two TLS hops plus curl; token checked against the export's Secret on the API server"),
        Figure::new(PHASE, "export.proxy_vs_nginx_proxy", &format!("raw download of a {size} file through ucm export-proxy vs through nginx proxy_pass https://"), "MiB/s", s[5].clone())
            .reference(med(&s[6]), "nginx from Debian as TLS reverse proxy, same certificates, same export server", true)
            .higher_is_better()
            .note("goal ≥ 1.0× (issue 32, goal 5); nginx checks no token, ucm's proxy reads the export and its token Secret from the API server per request"),
        Figure::new(PHASE, "export.proxy50_vs_direct", &format!("50 concurrent downloads (1/50 range of the {size} file each): aggregate through ucm export-proxy vs straight from the export server"), "MiB/s", c50[1].clone())
            .reference(med(&c50[0]), "the same 50 ranges straight from ucm export-server", true)
            .higher_is_better()
            .note("issue 34: admission default (--max-transfers 512) admits all 50"),
        Figure::new(PHASE, "export.proxy50_vs_nginx_proxy", "50 concurrent downloads: aggregate through ucm export-proxy vs through nginx proxy_pass https://", "MiB/s", c50[1].clone())
            .reference(med(&c50[2]), "nginx as TLS reverse proxy, same 50 ranges", true)
            .higher_is_better(),
        Figure::new(PHASE, "export.proxy_cpu_per_gib", "CPU seconds per GiB moved by the proxy process, 50 concurrent downloads: ucm export-proxy vs nginx proxy_pass https://", "CPU s/GiB", cpu[0].clone())
            .reference(med(&cpu[1]), "nginx master and workers, same runs", true)
            .note("from /proc utime+stime; both decrypt from the server and encrypt to the client"),
        Figure::new(PHASE, "export.gzip_vs_pigz", &format!("gzip download of a {size} file: ucm export-server (parallel gzip, HTTPS) vs pigz"), "MiB/s", s[3].clone())
            .reference(med(&s[4]), "pigz -6 to /dev/null, same file, 2 threads", true)
            .higher_is_better()
            .note("uncompressed bytes per second; both use level 6 on both cores, ucm also encrypts and curl decrypts; the stream was checked to gunzip to the source's sha256"),
        Figure::new(PHASE, "export.gzip_scaling", "gzip download: throughput with the server on 2 CPUs / on 1 CPU (taskset)", "×", ratio(&scaling[1], &scaling[0]))
            .reference(median(&ratio(&scaling[3], &scaling[2])), "pigz -p2 / pigz -p1 on the same file", true)
            .higher_is_better()
            .note(format!(
                "ucm goal: at least 1.7× (docs/vmexport.md, \"Performance goals\", P2); per-run ratios; server on 1 CPU median {:.0} MiB/s, on 2 CPUs {:.0} MiB/s; curl is not pinned and shares the 2 cores in the second case",
                median(&scaling[0]),
                median(&scaling[1])
            )),
    ]
}

/// `ucm export-proxy` in front of the export server on `upstream`: a Ready export `bench` whose
/// Service is SVC and whose token Secret holds TOKEN, and the export CA Secret, on the phase's
/// control plane; the proxy reads them with the manager's identity. Returns the proxy and the
/// external URL of the raw image.
async fn export_proxy(
    ctx: &Ctx,
    dir: &Path,
    ca: &certs::Pem,
    upstream: u16,
    cert: &Path,
    key: &Path,
) -> (Proc, String) {
    use k8s_openapi::api::core::v1::Secret;
    use kube::Api;
    use kube::api::{Patch, PatchParams, PostParams};
    use ucm::vmexport::VirtualMachineExport;
    let c = ctx.plane.admin.clone();
    crate::kube_util::create_namespace(&c, NS).await;
    let secrets: Api<Secret> = Api::namespaced(c.clone(), NS);
    for (name, data) in [
        (
            "ucm-export-ca",
            serde_json::json!({"tls.crt": ca.cert, "tls.key": ca.key}),
        ),
        ("bench-token", serde_json::json!({"token": TOKEN})),
    ] {
        let s: Secret = serde_json::from_value(
            serde_json::json!({"metadata": {"name": name}, "stringData": data}),
        )
        .unwrap();
        secrets.create(&PostParams::default(), &s).await.unwrap();
    }
    let exports: Api<VirtualMachineExport> = Api::namespaced(c.clone(), NS);
    let e: VirtualMachineExport = serde_json::from_value(serde_json::json!({
        "apiVersion": "export.kubevirt.io/v1", "kind": "VirtualMachineExport",
        "metadata": {"name": "bench"},
        "spec": {"source": {"kind": "PersistentVolumeClaim", "name": "disk"}, "tokenSecretRef": "bench-token"},
    }))
    .unwrap();
    exports.create(&PostParams::default(), &e).await.unwrap();
    exports
        .patch_status(
            "bench",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {
                "phase": "Ready", "serviceName": SVC, "tokenSecretRef": "bench-token"}})),
        )
        .await
        .unwrap();
    let port = free_port();
    let mut cmd = Command::new(ucm_bin());
    cmd.args([
        "export-proxy",
        &format!("--listen-address=127.0.0.1:{port}"),
        "--metrics-bind-address=0",
        &format!("--kubeconfig={}", ctx.plane.manager_kubeconfig.display()),
        &format!("--namespace={NS}"),
        &format!("--upstream-address=127.0.0.1:{upstream}"),
        &format!("--tls-cert-file={}", cert.display()),
        &format!("--tls-key-file={}", key.display()),
    ]);
    let p = Proc::spawn(cmd, dir.join("export-proxy.log"));
    wait_port(port);
    let url = format!(
        "https://{}.{NS}.svc:{port}{EXTERNAL_PREFIX}/volumes/disk/disk.img",
        ucm::vmexport::proxy::SERVICE
    );
    (p, url)
}

/// Per-run ratios `a[i] / b[i]`.
fn ratio(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x / y).collect()
}
