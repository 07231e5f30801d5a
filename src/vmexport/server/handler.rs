//! Request routing and responses of the export server (docs/vmexport.md, "Export server").

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Empty, Full, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use prometheus::IntCounterVec;

use super::auth::{self, AuthResult};
use super::config::{Config, VolumeConfig};
use super::dir::{self, Resolved};
use super::oci::{self, Oci};
use super::pgzip::{ParallelGzWriter, default_workers};
use super::range::{RangeReq, parse_range};
use super::ready::{Readiness, image_file, is_refused};
use super::tar::write_tar;
use crate::vmexport::api::{READINESS_PATH, TOKEN_HEADER};
use crate::vmexport::naming;

pub type Body = BoxBody<Bytes, io::Error>;

/// Read size for raw streaming: large blocks, since rustls has no sendfile path.
const RAW_CHUNK: usize = 1024 * 1024;

pub struct State {
    pub cfg: Config,
    pub ready: Readiness,
    /// The `oci` format's artifact, when `EXPORT_OCI_URI` is set.
    pub oci: Option<Arc<Oci>>,
    pub bytes_served: IntCounterVec,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Raw,
    Gzip,
    Archive,
    /// Exact dir URI without the trailing slash: redirect.
    DirRedirect,
    Dir,
    ManifestAll,
    ManifestSecret,
    Oci,
}

fn full(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).map_err(|e| match e {}).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn empty(status: StatusCode) -> Response<Body> {
    let mut r = Response::new(Empty::new().map_err(|e| match e {}).boxed());
    *r.status_mut() = status;
    r
}

/// A streaming body fed from a blocking thread. The producer returns an error to abort the
/// connection: the client then sees an incomplete transfer, never a short body that looks whole.
fn stream_body<F>(format: &'static str, counter: IntCounterVec, path: String, produce: F) -> Body
where
    F: FnOnce(&mut dyn FnMut(Vec<u8>) -> io::Result<()>) -> io::Result<()> + Send + 'static,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, io::Error>>(4);
    std::thread::spawn(move || {
        let started = Instant::now();
        let mut sent: u64 = 0;
        let c = counter.with_label_values(&[format]);
        let mut sink = |chunk: Vec<u8>| -> io::Result<()> {
            let n = chunk.len() as u64;
            tx.blocking_send(Ok(Frame::data(Bytes::from(chunk))))
                .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "client went away"))?;
            sent += n;
            c.inc_by(n);
            Ok(())
        };
        let res = produce(&mut sink);
        match res {
            Ok(()) => {
                tracing::info!(%path, format, bytes = sent, ms = started.elapsed().as_millis() as u64, "transfer complete");
            }
            Err(e) => {
                tracing::warn!(%path, format, bytes = sent, error = %e, "transfer aborted");
                let _ = tx.blocking_send(Err(e));
            }
        }
    });
    let stream = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
    StreamBody::new(stream).boxed()
}

fn route(cfg: &Config, path: &str) -> Option<(Route, Option<usize>, String)> {
    for (i, v) in cfg.volumes.iter().enumerate() {
        let eq = |u: &Option<String>| u.as_deref() == Some(path);
        if eq(&v.raw_uri) {
            return Some((Route::Raw, Some(i), String::new()));
        }
        if eq(&v.gzip_uri) {
            return Some((Route::Gzip, Some(i), String::new()));
        }
        if eq(&v.archive_uri) {
            return Some((Route::Archive, Some(i), String::new()));
        }
        if let Some(d) = &v.dir_uri {
            let base = d.trim_end_matches('/');
            if path == base {
                return Some((Route::DirRedirect, Some(i), String::new()));
            }
            if let Some(rest) = path.strip_prefix(&format!("{base}/")) {
                return Some((Route::Dir, Some(i), rest.to_string()));
            }
        }
    }
    // The OCI archive's URI has no /internal or /external prefix (upstream's links).
    if cfg.oci_uri.as_deref() == Some(path) {
        return Some((Route::Oci, None, String::new()));
    }
    for prefix in ["/internal", "/external"] {
        if let Some(rest) = path.strip_prefix(prefix) {
            if cfg.vm_def_uri.as_deref() == Some(rest) {
                return Some((Route::ManifestAll, None, prefix.to_string()));
            }
            if cfg.secret_def_uri.as_deref() == Some(rest) {
                return Some((Route::ManifestSecret, None, prefix.to_string()));
            }
        }
    }
    None
}

pub async fn handle(state: Arc<State>, req: Request<hyper::body::Incoming>) -> Response<Body> {
    let started = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let mut resp = handle_inner(&state, req).await;
    // A HEAD response carries no body whatever the route answered (an error's text, say): an
    // HTTP/2 client takes one as a protocol error. Headers, Content-Length included, stay.
    if method == Method::HEAD {
        *resp.body_mut() = Empty::new().map_err(|e| match e {}).boxed();
    }
    // Access log: method, path without the query (it may hold the token), status.
    tracing::info!(%method, %path, status = resp.status().as_u16(), us = started.elapsed().as_micros() as u64, "request");
    resp
}

async fn handle_inner(state: &Arc<State>, req: Request<hyper::body::Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    if path == READINESS_PATH {
        let mut failures = {
            let st = Arc::clone(state);
            tokio::task::spawn_blocking(move || st.ready.failures())
                .await
                .unwrap_or_else(|_| vec!["readiness check failed".into()])
        };
        if let Some(o) = &state.oci {
            match &*o.status() {
                oci::Status::Ready(_) => {}
                oci::Status::Pending => failures.push("computing the OCI digests".into()),
                oci::Status::Failed(e) => {
                    failures.push(format!("the OCI digests cannot be computed: {e}"));
                }
            }
        }
        return if failures.is_empty() {
            full(StatusCode::OK, "OK")
        } else {
            full(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready:\n{}\n", failures.join("\n")),
            )
        };
    }
    let Some((route, vol, rest)) = route(&state.cfg, &path) else {
        return full(StatusCode::NOT_FOUND, "404 page not found\n");
    };

    let (query_token, _rest_query) = auth::take_query_token(req.uri().query());
    let header_token = req
        .headers()
        .get(TOKEN_HEADER)
        .map(|v| v.as_bytes().to_vec());
    let presented = header_token.or(query_token.map(String::into_bytes));
    let token_file = state.cfg.token_file.clone();
    let auth_res =
        tokio::task::spawn_blocking(move || auth::check(&token_file, presented.as_deref()))
            .await
            .unwrap_or(AuthResult::Error);
    match auth_res {
        AuthResult::Ok => {}
        AuthResult::Unauthorized => return full(StatusCode::UNAUTHORIZED, "unauthorized\n"),
        AuthResult::Error => {
            tracing::error!("the token file cannot be read");
            return full(StatusCode::INTERNAL_SERVER_ERROR, "internal error\n");
        }
    }

    let method = req.method().clone();
    let head = method == Method::HEAD;
    let range = req
        .headers()
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let st = Arc::clone(state);
    match route {
        Route::Raw => {
            if method != Method::GET && !head {
                return full(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
            }
            let v = &state.cfg.volumes[vol.unwrap_or(0)];
            match image_file(v) {
                Ok(p) => serve_file(&st, p, "raw", range.as_deref(), head, path),
                Err(e) => image_error(v, &e),
            }
        }
        Route::Gzip => {
            if method != Method::GET {
                return full(StatusCode::BAD_REQUEST, "only GET is supported\n");
            }
            let v = &state.cfg.volumes[vol.unwrap_or(0)];
            let f = match image_file(v).and_then(File::open) {
                Ok(f) => f,
                Err(e) => return image_error(v, &e),
            };
            let body = stream_body("gzip", st.bytes_served.clone(), path, move |sink| {
                gzip_file(&f, sink)
            });
            gz_response(body)
        }
        Route::Archive => {
            if method != Method::GET {
                return full(StatusCode::BAD_REQUEST, "only GET is supported\n");
            }
            let root = state.cfg.volumes[vol.unwrap_or(0)].path.clone();
            let body = stream_body("tar.gz", st.bytes_served.clone(), path, move |sink| {
                let mut gz = ParallelGzWriter::new(default_workers(), sink);
                write_tar(&root, &mut gz)?;
                gz.finish()
            });
            gz_response(body)
        }
        Route::DirRedirect => {
            let mut r = empty(StatusCode::MOVED_PERMANENTLY);
            let loc = match req.uri().query() {
                Some(q) => format!("{path}/?{q}"),
                None => format!("{path}/"),
            };
            if let Ok(v) = HeaderValue::from_str(&loc) {
                r.headers_mut().insert(header::LOCATION, v);
            }
            r
        }
        Route::Dir => {
            if method != Method::GET && !head {
                return full(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
            }
            let v = &state.cfg.volumes[vol.unwrap_or(0)];
            let rel = auth::percent_decode_path(&rest);
            let root = v.path.clone();
            let rel2 = rel.clone();
            let resolved = tokio::task::spawn_blocking(move || dir::resolve(&root, &rel2))
                .await
                .unwrap_or(Resolved::NotFound);
            match resolved {
                Resolved::NotFound => full(StatusCode::NOT_FOUND, "404 page not found\n"),
                Resolved::File(p) => {
                    if rest.ends_with('/') {
                        return full(StatusCode::NOT_FOUND, "404 page not found\n");
                    }
                    serve_file(&st, p, "dir", range.as_deref(), head, path)
                }
                Resolved::Dir(p) => {
                    if !path.ends_with('/') {
                        let mut r = empty(StatusCode::MOVED_PERMANENTLY);
                        if let Ok(v) = HeaderValue::from_str(&format!("{path}/")) {
                            r.headers_mut().insert(header::LOCATION, v);
                        }
                        return r;
                    }
                    let is_root = rel.trim_matches('/').is_empty();
                    match dir::listing(&p, is_root) {
                        Ok(html) => {
                            let n = html.len() as u64;
                            let mut r =
                                full(StatusCode::OK, if head { String::new() } else { html });
                            r.headers_mut().insert(
                                header::CONTENT_TYPE,
                                HeaderValue::from_static("text/html; charset=utf-8"),
                            );
                            if !head {
                                st.bytes_served.with_label_values(&["dir"]).inc_by(n);
                            }
                            r
                        }
                        Err(e) => volume_error(v, &e),
                    }
                }
            }
        }
        Route::Oci => {
            if method != Method::GET {
                let mut r = full(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
                r.headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static("GET"));
                return r;
            }
            let ready = state.oci.as_ref().and_then(|o| match &*o.status() {
                oci::Status::Ready(a) => Some(Arc::clone(a)),
                _ => None,
            });
            let Some(artifact) = ready else {
                return full(StatusCode::SERVICE_UNAVAILABLE, "OCI export not ready\n");
            };
            let size = artifact.size();
            let body = stream_body("oci", st.bytes_served.clone(), path, move |sink| {
                use std::io::Write;
                let mut w = oci::ChunkWriter::new(sink);
                artifact.write_tar(&mut w)?;
                w.flush()
            });
            let mut r = Response::new(body);
            let h = r.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/x-tar"),
            );
            h.insert(
                header::CONTENT_DISPOSITION,
                HeaderValue::from_static("attachment; filename=\"export.oci.tar\""),
            );
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(size));
            r
        }
        Route::ManifestSecret | Route::ManifestAll => {
            if method != Method::GET {
                return full(StatusCode::BAD_REQUEST, "only GET is supported\n");
            }
            let yaml = req
                .headers()
                .get(header::ACCEPT)
                .is_some_and(|v| v.as_bytes() == b"application/yaml");
            let external = rest == "/external";
            manifest(state, route == Route::ManifestAll, external, yaml)
        }
    }
}

/// A refused `disk.img` is "not found" (nothing outside a volume exists for a client); other
/// errors are the volume's.
fn image_error(v: &VolumeConfig, e: &io::Error) -> Response<Body> {
    if is_refused(e) {
        tracing::warn!(volume = %v.name, error = %e, "refused to serve disk.img");
        return full(StatusCode::NOT_FOUND, "404 page not found\n");
    }
    volume_error(v, e)
}

fn volume_error(v: &VolumeConfig, e: &io::Error) -> Response<Body> {
    tracing::error!(volume = %v.name, error = %e, "cannot read export volume");
    full(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("volume {} cannot be read: {e}\n", v.name),
    )
}

fn gz_response(body: Body) -> Response<Body> {
    let mut r = Response::new(body);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/gzip"),
    );
    r
}

fn gzip_file(f: &File, sink: &mut dyn FnMut(Vec<u8>) -> io::Result<()>) -> io::Result<()> {
    use std::io::Write;
    let mut gz = ParallelGzWriter::new(default_workers(), sink);
    let mut buf = vec![0u8; RAW_CHUNK];
    let mut off = 0u64;
    loop {
        let n = f.read_at(&mut buf, off)?;
        if n == 0 {
            break;
        }
        gz.write_all(&buf[..n])?;
        off += n as u64;
    }
    gz.finish()
}

fn file_size(f: &File) -> io::Result<u64> {
    use std::io::Seek;
    // Seeking to the end also gives a block device's size (metadata says 0 there).
    let mut f2 = f.try_clone()?;
    f2.seek(io::SeekFrom::End(0))
}

fn serve_file(
    state: &Arc<State>,
    p: PathBuf,
    format: &'static str,
    range: Option<&str>,
    head: bool,
    path: String,
) -> Response<Body> {
    let f = match File::open(&p) {
        Ok(f) => f,
        Err(e) => return file_error(state, &p, &e),
    };
    let size = match file_size(&f) {
        Ok(s) => s,
        Err(e) => return file_error(state, &p, &e),
    };
    let (status, start, len) = match parse_range(range, size) {
        RangeReq::Full => (StatusCode::OK, 0, size),
        RangeReq::Partial(a, b) => (StatusCode::PARTIAL_CONTENT, a, b - a + 1),
        RangeReq::Unsatisfiable => {
            let mut r = empty(StatusCode::RANGE_NOT_SATISFIABLE);
            if let Ok(v) = HeaderValue::from_str(&format!("bytes */{size}")) {
                r.headers_mut().insert(header::CONTENT_RANGE, v);
            }
            return r;
        }
    };
    let body = if head || len == 0 {
        Empty::new().map_err(|e| match e {}).boxed()
    } else {
        stream_body(format, state.bytes_served.clone(), path, move |sink| {
            let mut off = start;
            let end = start + len;
            while off < end {
                let want = ((end - off) as usize).min(RAW_CHUNK);
                let mut buf = vec![0u8; want];
                let mut filled = 0;
                while filled < want {
                    let n = f.read_at(&mut buf[filled..], off + filled as u64)?;
                    if n == 0 {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "file is shorter than the announced length",
                        ));
                    }
                    filled += n;
                }
                off += want as u64;
                sink(buf)?;
            }
            Ok(())
        })
    };
    let mut r = Response::new(body);
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    if status == StatusCode::PARTIAL_CONTENT
        && let Ok(v) = HeaderValue::from_str(&format!("bytes {}-{}/{size}", start, start + len - 1))
    {
        h.insert(header::CONTENT_RANGE, v);
    }
    r
}

fn file_error(state: &Arc<State>, p: &Path, e: &io::Error) -> Response<Body> {
    let name = state
        .cfg
        .volumes
        .iter()
        .find(|v| p.starts_with(&v.path))
        .map(|v| v.name.clone())
        .unwrap_or_default();
    tracing::error!(volume = %name, error = %e, "cannot read export volume");
    full(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("volume {name} cannot be read: {e}\n"),
    )
}

fn manifest(state: &Arc<State>, all: bool, external: bool, yaml: bool) -> Response<Body> {
    let dir = &state.cfg.manifest_data_dir;
    let read = |k: &str| {
        std::fs::read_to_string(dir.join(k))
            .ok()
            .filter(|s| !s.trim().is_empty())
    };
    if external && read("external_host").is_none() {
        return full(StatusCode::NOT_FOUND, "no external host is configured\n");
    }
    let Some(name) = state
        .cfg
        .export_name
        .clone()
        .or_else(|| read("export-name"))
    else {
        return full(StatusCode::NOT_FOUND, "404 page not found\n");
    };
    if all {
        // The `all` manifest needs the manifest ConfigMap rendered by the reconciler.
        let gzip_uris = state
            .cfg
            .volumes
            .iter()
            .filter_map(|v| Some((v.name.clone(), v.gzip_uri.clone()?)))
            .collect();
        return match super::manifest::all_manifest(dir, &name, external, &gzip_uris) {
            Ok(items) => render_items(items, yaml),
            Err(e) => {
                tracing::error!(error = %e, "cannot build the VM manifest");
                full(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "cannot build the manifest\n",
                )
            }
        };
    }
    let token = match std::fs::read_to_string(&state.cfg.token_file) {
        Ok(t) => t.trim().to_string(),
        Err(_) => return full(StatusCode::INTERNAL_SERVER_ERROR, "internal error\n"),
    };
    let secret = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": naming::header_secret_name(&name)},
        "stringData": {"token": format!("{TOKEN_HEADER}:{token}")},
    });
    render_items(vec![secret], yaml)
}

/// Both manifests as KubeVirt's server writes them: JSON is a `v1` `List` (the secret one too);
/// YAML ends every document with `---`, so the `all` and secret bodies that virtctl prints back
/// to back stay separate documents.
fn render_items(items: Vec<serde_json::Value>, yaml: bool) -> Response<Body> {
    if yaml {
        let mut out = String::new();
        for it in &items {
            out.push_str(&serde_saphyr::to_string(it).unwrap_or_default());
            out.push_str("---\n");
        }
        let mut r = full(StatusCode::OK, out);
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/yaml"),
        );
        r
    } else {
        let body = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
        let mut r = full(StatusCode::OK, body.to_string());
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r
    }
}
