//! The `oci` format (docs/vmexport.md, "OCI format"): the VM or template and its disks as one OCI
//! image layout archive, as KubeVirt 1.9 serves it behind its `OCIExport` gate (VEP 256).
//!
//! An image index (one manifest, the VM's architecture) whose manifest has the resource as its
//! config blob and each disk image as a zstd-compressed layer. A tar header holds a blob's size
//! and its digest (in its name) before the blob, so the archive is built in two passes without
//! scratch space: pass 1 (`Artifact::prepare`, at start) compresses every disk through SHA-256
//! and a counter; pass 2 (`Artifact::write_tar`, per download) compresses again, with the same
//! encoder settings and block sizes so the bytes are the same, and checks size and digest while
//! streaming: a disk that changed in between aborts the transfer instead of sending a blob that
//! does not match its name.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::Serialize;
use sha2::{Digest, Sha256};

use super::config::VolumeConfig;
use super::ready::image_file;
use crate::vmexport::naming;

pub const MEDIA_TYPE_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const MEDIA_TYPE_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const ARTIFACT_VM: &str = "application/vnd.kubevirt.virtualmachine.v1";
pub const CONFIG_VM: &str = "application/vnd.kubevirt.virtualmachine.config.v1+json";
pub const ARTIFACT_TEMPLATE: &str = "application/vnd.kubevirt.virtualmachinetemplate.v1";
pub const CONFIG_TEMPLATE: &str = "application/vnd.kubevirt.virtualmachinetemplate.config.v1+json";
pub const LAYER_RAW_ZSTD: &str = "application/vnd.kubevirt.disk.raw+zstd";
pub const ANN_DISK_NAME: &str = "io.kubevirt.disk.name";
pub const ANN_DISK_SIZE: &str = "io.kubevirt.disk.size";
pub const ANN_TITLE: &str = "org.opencontainers.image.title";
pub const ANN_CREATED: &str = "org.opencontainers.image.created";

/// zstd level 3, libzstd's default and the ratio of upstream's encoder default; one thread, so
/// the output depends only on the input and the block sizes.
const ZSTD_LEVEL: i32 = 3;
/// Input block size, the same on both passes.
const CHUNK: usize = 1024 * 1024;
const BLOCK: u64 = 512;

/// Which artifact: from the manifest ConfigMap's key the export server finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    VirtualMachine,
    VirtualMachineTemplate,
}

impl Kind {
    fn artifact_type(self) -> &'static str {
        match self {
            Kind::VirtualMachine => ARTIFACT_VM,
            Kind::VirtualMachineTemplate => ARTIFACT_TEMPLATE,
        }
    }
    fn config_media_type(self) -> &'static str {
        match self {
            Kind::VirtualMachine => CONFIG_VM,
            Kind::VirtualMachineTemplate => CONFIG_TEMPLATE,
        }
    }
}

/// A disk to export as a layer: its `io.kubevirt.disk.name` and the file (or device) to read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Disk {
    pub name: String,
    pub path: PathBuf,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType")]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Serialize)]
struct Platform<'a> {
    architecture: &'a str,
    os: &'a str,
}

#[derive(Serialize)]
struct IndexEntry<'a> {
    #[serde(rename = "mediaType")]
    media_type: &'a str,
    digest: &'a str,
    size: u64,
    platform: Platform<'a>,
}

#[derive(Serialize)]
struct Index<'a> {
    #[serde(rename = "schemaVersion")]
    schema_version: u32,
    #[serde(rename = "mediaType")]
    media_type: &'a str,
    #[serde(rename = "artifactType")]
    artifact_type: &'a str,
    manifests: Vec<IndexEntry<'a>>,
    annotations: BTreeMap<&'a str, String>,
}

#[derive(Serialize)]
struct Manifest<'a> {
    #[serde(rename = "schemaVersion")]
    schema_version: u32,
    #[serde(rename = "mediaType")]
    media_type: &'a str,
    #[serde(rename = "artifactType")]
    artifact_type: &'a str,
    config: &'a Descriptor,
    layers: Vec<&'a Descriptor>,
}

pub fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(data)))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `blobs/sha256/<hex>`.
pub fn blob_path(digest: &str) -> String {
    let (alg, enc) = digest.split_once(':').unwrap_or(("sha256", digest));
    format!("blobs/{alg}/{enc}")
}

/// A size as Kubernetes writes a binary-SI quantity (`resource.NewQuantity(n, BinarySI)`):
/// the largest power of 1024 that divides it (`10Gi`, `1536Mi`), plain bytes otherwise, and
/// below 1024 the decimal form (`1k` for 1000).
pub fn binary_si(n: u64) -> String {
    if n < 1024 {
        return if n == 1000 {
            "1k".into()
        } else {
            n.to_string()
        };
    }
    const SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    let (mut v, mut i) = (n, 0);
    while v % 1024 == 0 && i < SUFFIXES.len() - 1 {
        v /= 1024;
        i += 1;
    }
    format!("{v}{}", SUFFIXES[i])
}

/// The name upstream gives a disk (`io.kubevirt.disk.name`): its export pod's volume name, the
/// claim with `.` replaced by `-`, hashed when longer than 63 characters. ucm's pod volumes are
/// named otherwise (docs/vmexport.md, "Names", rule 3), so it is computed from the claim.
pub fn disk_name(claim: &str) -> String {
    let n = claim.replace('.', "-");
    if n.len() <= naming::MAX_NAME {
        n
    } else {
        naming::get_name("virt-export", &n, naming::MAX_NAME)
    }
}

/// The disks of the export pod's volumes, in index order: a device, or a directory's `disk.img`;
/// a directory without one (a filesystem claim, the backend-storage PVC) has no layer, as
/// upstream (its digest pass failed on it before, kubevirt#19084).
pub fn disks(volumes: &[VolumeConfig]) -> io::Result<Vec<Disk>> {
    let mut out = Vec::new();
    for v in volumes {
        let named = |e: io::Error| io::Error::new(e.kind(), format!("volume {}: {e}", v.name));
        let md = std::fs::metadata(&v.path).map_err(named)?;
        if md.is_dir() {
            match std::fs::symlink_metadata(v.path.join("disk.img")) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(named(e)),
                Ok(_) => {}
            }
        }
        out.push(Disk {
            name: disk_name(&v.name),
            path: image_file(v).map_err(named)?,
        });
    }
    Ok(out)
}

/// The config blob and the platform architecture of the artifact, from the manifest ConfigMap
/// the reconciler mounts (`virtualmachinetemplate-manifest` first, then
/// `virtualmachine-manifest`). `None` when neither is there.
pub fn config_from_manifest_dir(dir: &Path) -> Result<Option<(Kind, Vec<u8>, String)>, String> {
    let read = |k: &str| -> Result<Option<serde_json::Value>, String> {
        match std::fs::read(dir.join(k)) {
            Ok(b) if b.iter().all(u8::is_ascii_whitespace) => Ok(None),
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .map_err(|e| format!("{k} is not JSON: {e}")),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{k} cannot be read: {e}")),
        }
    };
    if let Some(t) = read(crate::vmexport::api::VM_TEMPLATE_MANIFEST_KEY)? {
        let (cfg, arch) = template_config(t);
        return Ok(Some((Kind::VirtualMachineTemplate, cfg, arch)));
    }
    if let Some(vm) = read("virtualmachine-manifest")? {
        let (cfg, arch) = vm_config(vm);
        return Ok(Some((Kind::VirtualMachine, cfg, arch)));
    }
    Ok(None)
}

/// The VM as upstream stores it: `kubevirt.io/v1` `VirtualMachine` without namespace, without
/// `dataVolumeTemplates`, each `dataVolume` volume a `persistentVolumeClaim` of that name (the
/// data is in the layers). Returns the JSON and `spec.template.spec.architecture`.
pub fn vm_config(mut vm: serde_json::Value) -> (Vec<u8>, String) {
    vm["apiVersion"] = "kubevirt.io/v1".into();
    vm["kind"] = "VirtualMachine".into();
    if let Some(m) = vm.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        m.remove("namespace");
    }
    if let Some(spec) = vm.get_mut("spec").and_then(|s| s.as_object_mut()) {
        spec.remove("dataVolumeTemplates");
    }
    if let Some(vols) = vm
        .pointer_mut("/spec/template/spec/volumes")
        .and_then(|v| v.as_array_mut())
    {
        for vol in vols {
            let Some(dv) = vol.get("dataVolume").and_then(|d| d.get("name")).cloned() else {
                continue;
            };
            let name = vol.get("name").cloned().unwrap_or_default();
            *vol = serde_json::json!({"name": name, "persistentVolumeClaim": {"claimName": dv}});
        }
    }
    let arch = vm
        .pointer("/spec/template/spec/architecture")
        .and_then(|a| a.as_str())
        .unwrap_or_default()
        .to_string();
    (serde_json::to_vec(&vm).unwrap_or_default(), arch)
}

/// The template as the manifest ConfigMap holds it (docs/vmexport.md, "The `all` manifest"),
/// typed; the architecture is its VM's, `${PARAM}`s resolved from the parameters' values (empty
/// when one does not resolve, as upstream).
pub fn template_config(mut t: serde_json::Value) -> (Vec<u8>, String) {
    if t.get("apiVersion")
        .and_then(|v| v.as_str())
        .is_none_or(str::is_empty)
    {
        t["apiVersion"] = "template.kubevirt.io/v1beta1".into();
    }
    t["kind"] = "VirtualMachineTemplate".into();
    let raw = t
        .pointer("/spec/virtualMachine/spec/template/spec/architecture")
        .and_then(|a| a.as_str())
        .unwrap_or_default();
    let mut arch = raw.to_string();
    for p in t
        .pointer("/spec/parameters")
        .and_then(|p| p.as_array())
        .into_iter()
        .flatten()
    {
        let (Some(n), Some(v)) = (
            p.get("name").and_then(|x| x.as_str()),
            p.get("value").and_then(|x| x.as_str()),
        ) else {
            continue;
        };
        if !v.is_empty() {
            arch = arch.replace(&format!("${{{n}}}"), v);
        }
    }
    if arch.contains("${") {
        arch.clear();
    }
    (serde_json::to_vec(&t).unwrap_or_default(), arch)
}

/// A writer that hashes and counts what passes through it.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
    n: u64,
    /// Pass 2: the size announced in the tar header; writing beyond it is an error.
    limit: Option<u64>,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Some(l) = self.limit
            && self.n + buf.len() as u64 > l
        {
            return Err(io::Error::other(
                "the disk changed since its digest was computed (the layer grew)",
            ));
        }
        let k = self.inner.write(buf)?;
        self.hash.update(&buf[..k]);
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Compresses `path` into `out` as the layer blob; returns the uncompressed size. Both passes go
/// through here: fixed level, one thread, `CHUNK`-sized reads (short only at the end).
fn compress(path: &Path, out: &mut impl Write) -> io::Result<u64> {
    let f = File::open(path)?;
    let mut enc = zstd::stream::write::Encoder::new(out, ZSTD_LEVEL)?;
    let mut buf = vec![0u8; CHUNK];
    let mut off = 0u64;
    loop {
        let mut filled = 0;
        while filled < CHUNK {
            let n = f.read_at(&mut buf[filled..], off + filled as u64)?;
            if n == 0 {
                break;
            }
            filled += n;
        }
        if filled == 0 {
            break;
        }
        enc.write_all(&buf[..filled])?;
        off += filled as u64;
        if filled < CHUNK {
            break;
        }
    }
    enc.finish()?;
    Ok(off)
}

/// Pass 1 for one disk: its layer descriptor.
pub fn layer_descriptor(d: &Disk) -> io::Result<Descriptor> {
    let mut h = Hashing {
        inner: io::sink(),
        hash: Sha256::new(),
        n: 0,
        limit: None,
    };
    let size = compress(&d.path, &mut h)?;
    Ok(Descriptor {
        media_type: LAYER_RAW_ZSTD.into(),
        digest: format!("sha256:{}", hex(&h.hash.finalize())),
        size: h.n,
        annotations: BTreeMap::from([
            (ANN_DISK_NAME.to_string(), d.name.clone()),
            (ANN_DISK_SIZE.to_string(), binary_si(size)),
            (ANN_TITLE.to_string(), format!("{}.raw.zst", d.name)),
        ]),
    })
}

/// The prepared artifact: every blob but the layers in memory, the layers' descriptors.
#[derive(Clone, Debug)]
pub struct Artifact {
    pub layout: Vec<u8>,
    pub index: Vec<u8>,
    pub manifest: Vec<u8>,
    pub manifest_digest: String,
    pub config: Vec<u8>,
    pub config_digest: String,
    pub layers: Vec<(Disk, Descriptor)>,
}

impl Artifact {
    /// Pass 1: reads and compresses every disk (in parallel, one thread each).
    pub fn prepare(
        kind: Kind,
        config: Vec<u8>,
        arch: &str,
        disks: Vec<Disk>,
        created: jiff::Timestamp,
    ) -> io::Result<Artifact> {
        let descs: Vec<io::Result<Descriptor>> = std::thread::scope(|s| {
            let hs: Vec<_> = disks
                .iter()
                .map(|d| s.spawn(move || layer_descriptor(d)))
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(io::Error::other("digest thread panicked")))
                })
                .collect()
        });
        let mut layers = Vec::new();
        for (d, r) in disks.into_iter().zip(descs) {
            let desc = r.map_err(|e| io::Error::new(e.kind(), format!("disk {}: {e}", d.name)))?;
            layers.push((d, desc));
        }
        Ok(Self::assemble(kind, config, arch, layers, created))
    }

    /// The manifest, index and layout around the given layers (pure).
    pub fn assemble(
        kind: Kind,
        config: Vec<u8>,
        arch: &str,
        layers: Vec<(Disk, Descriptor)>,
        created: jiff::Timestamp,
    ) -> Artifact {
        let config_desc = Descriptor {
            media_type: kind.config_media_type().into(),
            digest: sha256_digest(&config),
            size: config.len() as u64,
            annotations: BTreeMap::new(),
        };
        let manifest = serde_json::to_vec(&Manifest {
            schema_version: 2,
            media_type: MEDIA_TYPE_MANIFEST,
            artifact_type: kind.artifact_type(),
            config: &config_desc,
            layers: layers.iter().map(|(_, d)| d).collect(),
        })
        .unwrap_or_default();
        let manifest_digest = sha256_digest(&manifest);
        let arch = if arch.is_empty() { "amd64" } else { arch };
        let created = jiff::Timestamp::from_second(created.as_second())
            .unwrap_or(created)
            .to_string();
        let index = serde_json::to_vec(&Index {
            schema_version: 2,
            media_type: MEDIA_TYPE_INDEX,
            artifact_type: kind.artifact_type(),
            manifests: vec![IndexEntry {
                media_type: MEDIA_TYPE_MANIFEST,
                digest: &manifest_digest,
                size: manifest.len() as u64,
                platform: Platform {
                    architecture: arch,
                    os: "linux",
                },
            }],
            annotations: BTreeMap::from([(ANN_CREATED, created)]),
        })
        .unwrap_or_default();
        Artifact {
            layout: br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
            index,
            manifest,
            manifest_digest,
            config_digest: config_desc.digest,
            config,
            layers,
        }
    }

    /// The archive's size, the response's `Content-Length`: a 512-byte header per entry, data
    /// padded to 512 bytes, two zero blocks at the end.
    pub fn size(&self) -> u64 {
        let entry = |n: u64| BLOCK + n.div_ceil(BLOCK) * BLOCK;
        let small = [&self.layout, &self.index, &self.manifest, &self.config];
        small.iter().map(|b| entry(b.len() as u64)).sum::<u64>()
            + self.layers.iter().map(|(_, d)| entry(d.size)).sum::<u64>()
            + 2 * BLOCK
    }

    /// Pass 2: `oci-layout`, `index.json`, the manifest, config and layer blobs.
    pub fn write_tar(&self, out: &mut impl Write) -> io::Result<()> {
        let small = [
            ("oci-layout".to_string(), &self.layout),
            ("index.json".to_string(), &self.index),
            (blob_path(&self.manifest_digest), &self.manifest),
            (blob_path(&self.config_digest), &self.config),
        ];
        for (name, data) in small {
            out.write_all(&tar_header(&name, data.len() as u64))?;
            out.write_all(data)?;
            pad(out, data.len() as u64)?;
        }
        for (disk, desc) in &self.layers {
            out.write_all(&tar_header(&blob_path(&desc.digest), desc.size))?;
            let mut h = Hashing {
                inner: &mut *out,
                hash: Sha256::new(),
                n: 0,
                limit: Some(desc.size),
            };
            compress(&disk.path, &mut h)?;
            let digest = format!("sha256:{}", hex(&h.hash.finalize()));
            if h.n != desc.size || digest != desc.digest {
                return Err(io::Error::other(format!(
                    "disk {} changed since its digest was computed",
                    disk.name
                )));
            }
            pad(out, desc.size)?;
        }
        out.write_all(&[0u8; 2 * BLOCK as usize])
    }
}

fn pad(out: &mut impl Write, n: u64) -> io::Result<()> {
    let rem = (n % BLOCK) as usize;
    if rem != 0 {
        out.write_all(&[0u8; BLOCK as usize][..BLOCK as usize - rem])?;
    }
    Ok(())
}

/// A POSIX ustar header of a regular file, mode 0644, owner 0, mtime 0. A size beyond the 11
/// octal digits (8 GiB) is written as a GNU base-256 number, which GNU tar, bsdtar and Go read.
pub fn tar_header(name: &str, size: u64) -> [u8; 512] {
    let mut h = [0u8; 512];
    let nb = name.as_bytes();
    h[..nb.len().min(100)].copy_from_slice(&nb[..nb.len().min(100)]);
    h[100..108].copy_from_slice(b"0000644\0");
    h[108..116].copy_from_slice(b"0000000\0");
    h[116..124].copy_from_slice(b"0000000\0");
    if size < 8 << 30 {
        h[124..136].copy_from_slice(format!("{size:011o}\0").as_bytes());
    } else {
        h[124] = 0x80;
        h[128..136].copy_from_slice(&size.to_be_bytes());
    }
    h[136..148].copy_from_slice(b"00000000000\0");
    h[156] = b'0';
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    h
}

/// Buffers writes into chunks for a streaming response body.
pub struct ChunkWriter<'a> {
    sink: &'a mut dyn FnMut(Vec<u8>) -> io::Result<()>,
    buf: Vec<u8>,
}

impl<'a> ChunkWriter<'a> {
    pub fn new(sink: &'a mut dyn FnMut(Vec<u8>) -> io::Result<()>) -> Self {
        ChunkWriter {
            sink,
            buf: Vec::with_capacity(CHUNK),
        }
    }
}

impl Write for ChunkWriter<'_> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(b);
        if self.buf.len() >= CHUNK {
            self.flush()?;
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
            (self.sink)(chunk)?;
        }
        Ok(())
    }
}

/// The artifact of this server, prepared in the background at start.
#[derive(Debug)]
pub enum Status {
    Pending,
    Ready(std::sync::Arc<Artifact>),
    /// Why pass 1 failed (names the disk, never a path); retried every `RETRY`.
    Failed(String),
}

/// A failed pass 1 (a disk that cannot be read yet) is retried this often, so a fixed volume
/// becomes ready without a restart, as the volume checks do.
pub const RETRY: std::time::Duration = std::time::Duration::from_secs(30);

pub struct Oci {
    status: std::sync::Mutex<Status>,
}

impl Oci {
    pub fn status(&self) -> std::sync::MutexGuard<'_, Status> {
        self.status.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts pass 1 on its own thread; `/exportready` waits for it, as upstream's readiness does.
    pub fn start(volumes: Vec<VolumeConfig>, manifest_dir: PathBuf) -> std::sync::Arc<Oci> {
        let oci = std::sync::Arc::new(Oci {
            status: std::sync::Mutex::new(Status::Pending),
        });
        let o = std::sync::Arc::clone(&oci);
        let created = jiff::Timestamp::now();
        std::thread::spawn(move || {
            loop {
                let started = std::time::Instant::now();
                match Self::pass1(&volumes, &manifest_dir, created) {
                    Ok(a) => {
                        tracing::info!(
                            layers = a.layers.len(),
                            bytes = a.size(),
                            ms = started.elapsed().as_millis() as u64,
                            "OCI digests computed"
                        );
                        *o.status() = Status::Ready(std::sync::Arc::new(a));
                        return;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "OCI digest pass failed; retrying in 30 s");
                        *o.status() = Status::Failed(e);
                        std::thread::sleep(RETRY);
                    }
                }
            }
        });
        oci
    }

    fn pass1(
        volumes: &[VolumeConfig],
        manifest_dir: &Path,
        created: jiff::Timestamp,
    ) -> Result<Artifact, String> {
        let (kind, config, arch) = config_from_manifest_dir(manifest_dir)?
            .ok_or("the manifest data holds no VirtualMachine or VirtualMachineTemplate")?;
        let disks = disks(volumes).map_err(|e| e.to_string())?;
        Artifact::prepare(kind, config, &arch, disks, created).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(dir: &Path, name: &str, data: &[u8]) -> Disk {
        let p = dir.join(format!("{name}.img"));
        std::fs::write(&p, data).unwrap();
        Disk {
            name: name.into(),
            path: p,
        }
    }

    fn pattern(n: usize, seed: u32) -> Vec<u8> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(seed) >> 5) % 251) as u8)
            .collect()
    }

    /// The entries of a tar stream (name, data), checking every header's checksum.
    fn untar(b: &[u8]) -> Vec<(String, Vec<u8>)> {
        let mut out = Vec::new();
        let mut off = 0;
        loop {
            let h = &b[off..off + 512];
            if h.iter().all(|&x| x == 0) {
                assert!(b[off + 512..].iter().all(|&x| x == 0));
                assert_eq!(b.len(), off + 1024, "two zero blocks end the archive");
                return out;
            }
            let sum: u32 = h
                .iter()
                .enumerate()
                .map(|(i, &x)| {
                    if (148..156).contains(&i) {
                        32
                    } else {
                        u32::from(x)
                    }
                })
                .sum();
            let stored =
                u32::from_str_radix(std::str::from_utf8(&h[148..154]).unwrap(), 8).unwrap();
            assert_eq!(sum, stored, "header checksum");
            assert_eq!(&h[257..265], b"ustar\x0000");
            let name =
                String::from_utf8(h[..100].iter().copied().take_while(|&c| c != 0).collect())
                    .unwrap();
            let size = u64::from_str_radix(std::str::from_utf8(&h[124..135]).unwrap(), 8).unwrap()
                as usize;
            off += 512;
            out.push((name, b[off..off + size].to_vec()));
            off += size.div_ceil(512) * 512;
        }
    }

    #[test]
    fn quantities_as_kubernetes_writes_them() {
        assert_eq!(binary_si(0), "0");
        assert_eq!(binary_si(512), "512");
        assert_eq!(binary_si(1000), "1k");
        assert_eq!(binary_si(1024), "1Ki");
        assert_eq!(binary_si(1536), "1536");
        assert_eq!(binary_si(10 << 30), "10Gi");
        assert_eq!(binary_si(1536 << 20), "1536Mi");
        assert_eq!(binary_si(200_000), "200000");
    }

    #[test]
    fn disk_names_follow_upstream_pod_volume_names() {
        assert_eq!(disk_name("rootdisk"), "rootdisk");
        assert_eq!(disk_name("my.disk"), "my-disk");
        let long = "a".repeat(70);
        let n = disk_name(&long);
        assert_eq!(n, naming::get_name("virt-export", &long, 63));
        assert!(n.len() <= 63);
    }

    #[test]
    fn vm_config_strips_what_the_layers_replace() {
        let vm = serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "vm1", "namespace": "ns", "labels": {"a": "b"}},
            "spec": {
                "dataVolumeTemplates": [{"metadata": {"name": "dv1"}}],
                "template": {"spec": {"architecture": "arm64", "volumes": [
                    {"name": "root", "dataVolume": {"name": "dv1"}},
                    {"name": "data", "persistentVolumeClaim": {"claimName": "pvc1"}},
                    {"name": "ci", "cloudInitNoCloud": {"userData": "x"}},
                ]}},
            },
        });
        let (b, arch) = vm_config(vm);
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(arch, "arm64");
        assert_eq!(
            v["metadata"],
            serde_json::json!({"name": "vm1", "labels": {"a": "b"}})
        );
        assert!(v["spec"].get("dataVolumeTemplates").is_none());
        assert_eq!(
            v["spec"]["template"]["spec"]["volumes"],
            serde_json::json!([
                {"name": "root", "persistentVolumeClaim": {"claimName": "dv1"}},
                {"name": "data", "persistentVolumeClaim": {"claimName": "pvc1"}},
                {"name": "ci", "cloudInitNoCloud": {"userData": "x"}},
            ])
        );
    }

    #[test]
    fn template_architecture_resolves_parameters() {
        let t = |arch: &str| {
            serde_json::json!({
                "apiVersion": "template.kubevirt.io/v1beta1",
                "metadata": {"name": "t"},
                "spec": {
                    "parameters": [{"name": "ARCH", "value": "s390x"}, {"name": "EMPTY"}],
                    "virtualMachine": {"spec": {"template": {"spec": {"architecture": arch}}}},
                },
            })
        };
        assert_eq!(template_config(t("${ARCH}")).1, "s390x");
        assert_eq!(
            template_config(t("${EMPTY}")).1,
            "",
            "unresolved: upstream's default"
        );
        let (b, _) = template_config(t("amd64"));
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["kind"], "VirtualMachineTemplate");
        assert_eq!(v["apiVersion"], "template.kubevirt.io/v1beta1");
    }

    #[test]
    fn layout_manifest_and_index() {
        let tmp = tempfile::tempdir().unwrap();
        let a = pattern(3 * CHUNK + 123, 7);
        let b = vec![0u8; 4096];
        let disks = vec![
            disk(tmp.path(), "rootdisk", &a),
            disk(tmp.path(), "data-1", &b),
        ];
        let created: jiff::Timestamp = "2026-04-09T12:00:00.75Z".parse().unwrap();
        let art = Artifact::prepare(
            Kind::VirtualMachine,
            br#"{"kind":"VirtualMachine"}"#.to_vec(),
            "",
            disks,
            created,
        )
        .unwrap();

        let mut tar = Vec::new();
        art.write_tar(&mut tar).unwrap();
        assert_eq!(
            tar.len() as u64,
            art.size(),
            "Content-Length is the archive's size"
        );
        let entries = untar(&tar);
        let names: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names[..2], ["oci-layout", "index.json"]);
        // every blob is named by its content's digest
        for (n, data) in &entries[2..] {
            assert_eq!(n, &blob_path(&sha256_digest(data)), "{n}");
        }
        let file = |n: &str| &entries.iter().find(|(x, _)| x == n).unwrap().1;
        assert_eq!(file("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#);

        let index: serde_json::Value = serde_json::from_slice(file("index.json")).unwrap();
        assert_eq!(index["schemaVersion"], 2);
        assert_eq!(index["mediaType"], MEDIA_TYPE_INDEX);
        assert_eq!(index["artifactType"], ARTIFACT_VM);
        assert_eq!(
            index["annotations"],
            serde_json::json!({ANN_CREATED: "2026-04-09T12:00:00Z"})
        );
        let m0 = &index["manifests"][0];
        assert_eq!(m0["mediaType"], MEDIA_TYPE_MANIFEST);
        assert_eq!(
            m0["platform"],
            serde_json::json!({"architecture": "amd64", "os": "linux"})
        );
        let mbytes = file(&blob_path(m0["digest"].as_str().unwrap()));
        assert_eq!(m0["size"], mbytes.len());

        let manifest: serde_json::Value = serde_json::from_slice(mbytes).unwrap();
        assert_eq!(manifest["schemaVersion"], 2);
        assert_eq!(manifest["mediaType"], MEDIA_TYPE_MANIFEST);
        assert_eq!(manifest["artifactType"], ARTIFACT_VM);
        assert!(
            manifest.get("annotations").is_none(),
            "the manifest carries none"
        );
        assert_eq!(manifest["config"]["mediaType"], CONFIG_VM);
        assert_eq!(
            file(&blob_path(manifest["config"]["digest"].as_str().unwrap())),
            br#"{"kind":"VirtualMachine"}"#
        );
        let layers = manifest["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 2);
        for (l, (name, src, size)) in layers
            .iter()
            .zip([("rootdisk", &a, "3145851"), ("data-1", &b, "4Ki")])
        {
            assert_eq!(l["mediaType"], LAYER_RAW_ZSTD);
            assert_eq!(
                l["annotations"],
                serde_json::json!({
                    ANN_DISK_NAME: name, ANN_DISK_SIZE: size,
                    ANN_TITLE: format!("{name}.raw.zst"),
                })
            );
            let blob = file(&blob_path(l["digest"].as_str().unwrap()));
            assert_eq!(l["size"], blob.len());
            assert_eq!(&zstd::stream::decode_all(&blob[..]).unwrap(), src, "{name}");
        }
    }

    #[test]
    fn a_disk_changed_between_the_passes_aborts_the_archive() {
        let tmp = tempfile::tempdir().unwrap();
        let d = disk(tmp.path(), "rootdisk", &pattern(100_000, 3));
        let art = Artifact::prepare(
            Kind::VirtualMachine,
            b"{}".to_vec(),
            "",
            vec![d.clone()],
            jiff::Timestamp::UNIX_EPOCH,
        )
        .unwrap();
        std::fs::write(&d.path, pattern(100_000, 5)).unwrap();
        let mut out = Vec::new();
        let e = art.write_tar(&mut out).unwrap_err();
        assert!(e.to_string().contains("changed"), "{e}");
        assert!(
            (out.len() as u64) < art.size(),
            "never the announced length"
        );
    }

    #[test]
    fn template_artifact_and_large_sizes() {
        let art = Artifact::assemble(
            Kind::VirtualMachineTemplate,
            b"{}".to_vec(),
            "arm64",
            Vec::new(),
            jiff::Timestamp::UNIX_EPOCH,
        );
        let index: serde_json::Value = serde_json::from_slice(&art.index).unwrap();
        assert_eq!(index["artifactType"], ARTIFACT_TEMPLATE);
        assert_eq!(index["manifests"][0]["platform"]["architecture"], "arm64");
        let manifest: serde_json::Value = serde_json::from_slice(&art.manifest).unwrap();
        assert_eq!(manifest["config"]["mediaType"], CONFIG_TEMPLATE);
        assert_eq!(manifest["layers"], serde_json::json!([]));
        // beyond 8 GiB: base-256, still one header
        let h = tar_header("x", 9 << 30);
        assert_eq!(h[124], 0x80);
        assert_eq!(u64::from_be_bytes(h[128..136].try_into().unwrap()), 9 << 30);
    }

    #[test]
    fn disks_skip_volumes_without_an_image() {
        let tmp = tempfile::tempdir().unwrap();
        let img = tmp.path().join("v0");
        let files = tmp.path().join("v1");
        std::fs::create_dir_all(&img).unwrap();
        std::fs::create_dir_all(&files).unwrap();
        std::fs::write(img.join("disk.img"), b"x").unwrap();
        std::fs::write(files.join("a.txt"), b"x").unwrap();
        let vol = |i, path: &Path, name: &str| VolumeConfig {
            index: i,
            path: path.to_path_buf(),
            name: name.into(),
            raw_uri: None,
            gzip_uri: None,
            archive_uri: None,
            dir_uri: None,
        };
        let got = disks(&[vol(0, &img, "root.disk"), vol(1, &files, "files")]).unwrap();
        assert_eq!(
            got,
            [Disk {
                name: "root-disk".into(),
                path: img.join("disk.img").canonicalize().unwrap()
            }]
        );
    }
}
