//! The manager's API client drops the field sets of managedFields
//! (`metadata.managedFields[].fieldsV1`) from every JSON answer to a GET (lists, watch events,
//! single objects) before kube decodes it.
//!
//! Why: nothing in ucm reads them, yet each object carries one per writer, often a third of its
//! bytes and half of its decode time (nested maps of strings). At start-up the manager decodes
//! every object of every watched kind; dropping the field sets from the text is one pass over
//! the bytes, far cheaper than decoding them. The rest of each entry (manager, operation,
//! subresource, time) stays: the foreign-status trigger reads it.
//!
//! Only answers with `Content-Type: application/json` and a 2xx status are touched; anything
//! that does not parse as expected passes unchanged.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame};
use tower::{Layer, Service};

/// Field sets are dropped when a GET's answer comes back (see the module doc).
#[derive(Clone, Copy, Default)]
pub struct TrimLayer;

impl<S> Layer<S> for TrimLayer {
    type Service = Trim<S>;
    fn layer(&self, inner: S) -> Trim<S> {
        Trim(inner)
    }
}

#[derive(Clone)]
pub struct Trim<S>(S);

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    Pass,
    /// One JSON document: buffered whole, trimmed once.
    Whole,
    /// A watch: one JSON document per line.
    Lines,
}

impl<S, ReqB, B> Service<Request<ReqB>> for Trim<S>
where
    S: Service<Request<ReqB>, Response = Response<B>>,
    S::Future: Send + 'static,
    B: Body<Data = Bytes>,
{
    type Response = Response<TrimBody<B>>;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let mode = if req.method() != http::Method::GET {
            Mode::Pass
        } else if req
            .uri()
            .query()
            .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"))
        {
            Mode::Lines
        } else {
            Mode::Whole
        };
        let fut = self.0.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            let json = resp
                .headers()
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("application/json"));
            let mode = if json && resp.status().is_success() {
                mode
            } else {
                Mode::Pass
            };
            Ok(resp.map(|inner| TrimBody {
                inner: Box::pin(inner),
                mode,
                buf: Vec::new(),
                done: false,
            }))
        })
    }
}

pub struct TrimBody<B> {
    inner: Pin<Box<B>>,
    mode: Mode,
    buf: Vec<u8>,
    done: bool,
}

impl<B: Body<Data = Bytes>> Body for TrimBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        if this.mode == Mode::Pass {
            return this.inner.as_mut().poll_frame(cx);
        }
        loop {
            if this.mode == Mode::Lines
                && let Some(end) = memchr::memrchr(b'\n', &this.buf)
            {
                let lines: Vec<u8> = this.buf.drain(..=end).collect();
                return Poll::Ready(Some(Ok(Frame::data(trim_lines(lines)))));
            }
            if this.done {
                if this.buf.is_empty() {
                    return Poll::Ready(None);
                }
                let rest = std::mem::take(&mut this.buf);
                return Poll::Ready(Some(Ok(Frame::data(trim_or_keep(rest)))));
            }
            match ready!(this.inner.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) => {
                    // Trailers (none from the API server) are dropped.
                    if let Ok(data) = frame.into_data() {
                        this.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => this.done = true,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.mode == Mode::Pass && self.inner.is_end_stream()
    }
}

fn trim_or_keep(doc: Vec<u8>) -> Bytes {
    match trim(&doc) {
        Some(t) => Bytes::from(t),
        None => Bytes::from(doc),
    }
}

/// Complete lines (each ending in `\n`), each trimmed on its own.
fn trim_lines(lines: Vec<u8>) -> Bytes {
    if memchr::memmem::find(&lines, FIELDS_V1).is_none() {
        return Bytes::from(lines);
    }
    let mut out = Vec::with_capacity(lines.len());
    for line in lines.split_inclusive(|&b| b == b'\n') {
        let body = line.strip_suffix(b"\n").unwrap_or(line);
        match trim(body) {
            Some(t) => out.extend_from_slice(&t),
            None => out.extend_from_slice(body),
        }
        if line.ends_with(b"\n") {
            out.push(b'\n');
        }
    }
    Bytes::from(out)
}

const FIELDS_V1: &[u8] = b"\"fieldsV1\"";

/// Where a JSON object sits: the answer itself (a list, a watch event or one object), an object
/// of the API, its metadata, or one managedFields entry.
#[derive(Clone, Copy)]
enum Level {
    Doc,
    Obj,
    Meta,
    Entry,
}

/// What becomes of a member's value at `level` with `key`.
enum Then {
    Copy,
    Drop,
    Object(Level),
    Array(Level),
}

fn then(level: Level, key: &[u8]) -> Then {
    match (level, key) {
        (Level::Doc, b"items") => Then::Array(Level::Obj),
        (Level::Doc, b"object") => Then::Object(Level::Obj),
        (Level::Doc | Level::Obj, b"metadata") => Then::Object(Level::Meta),
        (Level::Meta, b"managedFields") => Then::Array(Level::Entry),
        (Level::Entry, b"fieldsV1") => Then::Drop,
        _ => Then::Copy,
    }
}

/// `doc` without the field sets of its objects' managedFields; `None` when it has none or is not
/// a JSON object (then it is used as it is).
pub fn trim(doc: &[u8]) -> Option<Vec<u8>> {
    memchr::memmem::find(doc, FIELDS_V1)?;
    let mut s = Scan {
        b: doc,
        i: 0,
        out: Vec::with_capacity(doc.len()),
    };
    s.ws();
    if s.peek()? != b'{' {
        return None;
    }
    s.object(Level::Doc)?;
    s.ws();
    (s.i == doc.len()).then_some(s.out)
}

struct Scan<'a> {
    b: &'a [u8],
    i: usize,
    out: Vec<u8>,
}

impl Scan<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            self.i += 1;
        }
    }

    /// The end (one past the closing quote) of the string starting at `at`.
    fn string_end(&self, at: usize) -> Option<usize> {
        let mut j = at + 1;
        loop {
            let k = j + memchr::memchr2(b'"', b'\\', self.b.get(j..)?)?;
            if self.b[k] == b'\\' {
                j = k + 2;
            } else {
                return Some(k + 1);
            }
        }
    }

    /// The end of the value starting at `at`.
    fn value_end(&self, at: usize) -> Option<usize> {
        match *self.b.get(at)? {
            b'"' => self.string_end(at),
            b'{' | b'[' => {
                let mut depth = 0usize;
                let mut j = at;
                loop {
                    match *self.b.get(j)? {
                        b'"' => {
                            j = self.string_end(j)?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                return Some(j + 1);
                            }
                        }
                        _ => {}
                    }
                    j += 1;
                }
            }
            _ => {
                let mut j = at;
                while let Some(&c) = self.b.get(j) {
                    if matches!(c, b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t') {
                        break;
                    }
                    j += 1;
                }
                (j > at).then_some(j)
            }
        }
    }

    fn copy_value(&mut self) -> Option<()> {
        let end = self.value_end(self.i)?;
        self.out.extend_from_slice(&self.b[self.i..end]);
        self.i = end;
        Some(())
    }

    /// Copies the object at `self.i`, applying [`then`] to its members.
    fn object(&mut self, level: Level) -> Option<()> {
        self.i += 1; // '{'
        self.out.push(b'{');
        let mut first = true;
        loop {
            self.ws();
            match self.peek()? {
                b'}' => {
                    self.i += 1;
                    self.out.push(b'}');
                    return Some(());
                }
                b',' => {
                    self.i += 1;
                    self.ws();
                }
                _ => {}
            }
            if self.peek()? != b'"' {
                return None;
            }
            let key_start = self.i;
            let key_end = self.string_end(key_start)?;
            let key = &self.b[key_start + 1..key_end - 1];
            self.i = key_end;
            self.ws();
            if self.peek()? != b':' {
                return None;
            }
            self.i += 1;
            self.ws();
            let what = then(level, key);
            if let Then::Drop = what {
                self.i = self.value_end(self.i)?;
                continue;
            }
            if !first {
                self.out.push(b',');
            }
            first = false;
            self.out.extend_from_slice(&self.b[key_start..key_end]);
            self.out.push(b':');
            match (what, self.peek()?) {
                (Then::Object(l), b'{') => self.object(l)?,
                (Then::Array(l), b'[') => self.array(l)?,
                _ => self.copy_value()?,
            }
        }
    }

    /// Copies the array at `self.i`; its objects are at `level`.
    fn array(&mut self, level: Level) -> Option<()> {
        self.i += 1; // '['
        self.out.push(b'[');
        let mut first = true;
        loop {
            self.ws();
            match self.peek()? {
                b']' => {
                    self.i += 1;
                    self.out.push(b']');
                    return Some(());
                }
                b',' => {
                    self.i += 1;
                    self.ws();
                }
                _ => {}
            }
            if !first {
                self.out.push(b',');
            }
            first = false;
            if self.peek()? == b'{' {
                self.object(level)?;
            } else {
                self.copy_value()?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn entry(manager: &str, sub: Option<&str>) -> Value {
        let mut e = json!({
            "manager": manager, "operation": "Update", "apiVersion": "v1",
            "time": "2026-12-01T10:00:00Z", "fieldsType": "FieldsV1",
            "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:a\"}": {}}}, "f:spec": {"f:x": {}}}
        });
        if let Some(s) = sub {
            e["subresource"] = json!(s);
        }
        e
    }

    fn object(name: &str) -> Value {
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "labels": {"fieldsV1": "a label, not a field set"},
                         "managedFields": [entry("kubectl", None), entry("ucm", Some("status"))]},
            "data": {"fieldsV1": "{\"kept\": [1, 2]}", "n": "[\"]"}
        })
    }

    fn without_field_sets(mut v: Value) -> Value {
        for e in v["metadata"]["managedFields"].as_array_mut().unwrap() {
            e.as_object_mut().unwrap().remove("fieldsV1");
        }
        v
    }

    fn trimmed(doc: &Value) -> Value {
        let text = serde_json::to_vec_pretty(doc).unwrap();
        serde_json::from_slice(&trim(&text).expect("trimmed")).unwrap()
    }

    #[test]
    fn a_list_loses_only_the_field_sets() {
        let list = json!({"kind": "ConfigMapList", "metadata": {"resourceVersion": "5"},
                          "items": [object("a"), object("b")]});
        let want = json!({"kind": "ConfigMapList", "metadata": {"resourceVersion": "5"},
                          "items": [without_field_sets(object("a")), without_field_sets(object("b"))]});
        assert_eq!(trimmed(&list), want);
    }

    #[test]
    fn a_watch_event_and_a_single_object_lose_them_too() {
        let ev = json!({"type": "MODIFIED", "object": object("a")});
        assert_eq!(
            trimmed(&ev),
            json!({"type": "MODIFIED", "object": without_field_sets(object("a"))})
        );
        assert_eq!(trimmed(&object("a")), without_field_sets(object("a")));
    }

    #[test]
    fn watch_lines_are_trimmed_one_by_one_and_keep_their_newlines() {
        let a = json!({"type": "ADDED", "object": object("a")}).to_string();
        let b = json!({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "7"}}});
        let text = format!("{a}\n{b}\n");
        let out = trim_lines(text.into_bytes());
        let lines: Vec<Value> = std::str::from_utf8(&out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(
            lines,
            vec![
                json!({"type": "ADDED", "object": without_field_sets(object("a"))}),
                b
            ]
        );
        assert!(out.ends_with(b"\n"));
    }

    #[test]
    fn anything_else_is_left_alone() {
        assert_eq!(trim(br#"{"kind":"Status","code":404}"#), None);
        assert_eq!(trim(b"not json \"fieldsV1\""), None);
        assert_eq!(
            trim(br#"{"metadata":{"managedFields":[{"fieldsV1":{}"#),
            None
        );
        assert_eq!(trim(br#"["fieldsV1"]"#), None);
    }

    #[test]
    fn the_decoded_object_is_what_it_was_without_field_sets() {
        use k8s_openapi::api::core::v1::ConfigMap;
        let text = object("a").to_string();
        let cm: ConfigMap = serde_json::from_slice(&trim(text.as_bytes()).unwrap()).unwrap();
        let mf = cm.metadata.managed_fields.unwrap();
        assert_eq!(mf.len(), 2);
        assert!(mf.iter().all(|e| e.fields_v1.is_none()));
        assert_eq!(mf[1].subresource.as_deref(), Some("status"));
        assert_eq!(mf[1].manager.as_deref(), Some("ucm"));
        assert_eq!(cm.data.unwrap()["fieldsV1"], "{\"kept\": [1, 2]}");
    }

    /// The layer on a service that answers in chunks cut mid-line, as a watch arrives.
    #[tokio::test]
    async fn the_layer_trims_watch_streams_across_chunks_and_passes_other_answers() {
        use http_body_util::{BodyExt, StreamBody};
        let event = json!({"type": "ADDED", "object": object("a")}).to_string();
        let stream = format!("{event}\n{event}\n").into_bytes();
        let answer = move |req: Request<()>| {
            let stream = stream.clone();
            async move {
                let (content_type, chunks): (&str, Vec<Vec<u8>>) = if req.uri().path() == "/log" {
                    ("text/plain", vec![b"\"fieldsV1\" in a log\n".to_vec()])
                } else {
                    (
                        "application/json",
                        stream.chunks(7).map(<[u8]>::to_vec).collect(),
                    )
                };
                let frames = futures::stream::iter(
                    chunks
                        .into_iter()
                        .map(|c| Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(c)))),
                );
                Ok::<_, std::convert::Infallible>(
                    Response::builder()
                        .header("content-type", content_type)
                        .body(StreamBody::new(frames))
                        .unwrap(),
                )
            }
        };
        let mut svc = TrimLayer.layer(tower::service_fn(answer));
        let get = |uri: &str| Request::get(uri).body(()).unwrap();

        let resp = svc
            .call(get("/api/v1/configmaps?watch=true&resourceVersion=1"))
            .await
            .unwrap();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let want = json!({"type": "ADDED", "object": without_field_sets(object("a"))});
        let lines: Vec<Value> = std::str::from_utf8(&body)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines, vec![want.clone(), want]);

        let resp = svc.call(get("/log")).await.unwrap();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"\"fieldsV1\" in a log\n");
    }
}
