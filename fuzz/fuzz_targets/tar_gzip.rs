//! Streaming of odd trees (src/vmexport/server/tar.rs) and parallel gzip
//! (src/vmexport/server/pgzip.rs). A tree is built on disk from the input: odd names (spaces,
//! UTF-8, 100+ byte paths, leading dashes), empty and nested directories, files with holes,
//! empty files, symlinks (also dangling) and a `lost+found`. Properties: the tar stream, read
//! back by an independent reader (the `tar` crate), holds exactly the tree, with identical
//! file contents (holes read back as zeros, apparent sizes kept), symlink targets and no
//! `lost+found`; the parallel gzip of any byte stream, written in any chunking, decompresses
//! to exactly that stream.
#![no_main]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use ucm::vmexport::server::pgzip::{BLOCK_SIZE, ParallelGzWriter};
use ucm::vmexport::server::tar::write_tar;

const NAMES: [&str; 9] = [
    "a",
    "with space",
    "ünïcödé",
    "-dash",
    "lost+found",
    "x.img",
    "dir",
    "e\u{301}",
    "n",
];

#[derive(Arbitrary, Debug)]
enum Node {
    File {
        name: u8,
        long: u8,
        data: Vec<u8>,
        hole_at: Option<u32>,
        tail: bool,
    },
    Dir {
        name: u8,
        long: u8,
        children: Vec<Node>,
    },
    Link {
        name: u8,
        target: String,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    tree: Vec<Node>,
    gz_data: Vec<u8>,
    repeat: u8,
    chunk: u16,
    workers: u8,
}

#[derive(Debug, PartialEq)]
enum Want {
    Dir,
    File(Vec<u8>),
    Link(String),
}

fn name(n: u8, long: u8) -> String {
    let base = NAMES[n as usize % NAMES.len()];
    if long > 200 {
        format!("{base}{}", "L".repeat(usize::from(long - 100)))
    } else {
        base.to_string()
    }
}

fn build(dir: &Path, rel: &str, nodes: &[Node], depth: usize, want: &mut BTreeMap<String, Want>) {
    for n in nodes.iter().take(6) {
        let (nm, kind) = match n {
            Node::File { name: a, long, .. } => (name(*a, *long), 0),
            Node::Dir { name: a, long, .. } => (name(*a, *long), 1),
            Node::Link { name: a, .. } => (name(*a, 0), 2),
        };
        let path = dir.join(&nm);
        if path.symlink_metadata().is_ok() {
            continue;
        }
        let key = format!("{rel}{nm}");
        let excluded = rel.is_empty() && nm == "lost+found";
        match n {
            Node::File {
                data,
                hole_at,
                tail,
                ..
            } => {
                let f = std::fs::File::create(&path).unwrap();
                let mut content = data.clone();
                if let Some(h) = hole_at {
                    // data, a hole, then (maybe) data again: a sparse file
                    let gap = u64::from(*h % (8 << 20));
                    f.write_all_at(data, 0).unwrap();
                    let end = data.len() as u64 + gap;
                    if *tail {
                        f.write_all_at(b"tail", end).unwrap();
                        content.resize(end as usize, 0);
                        content.extend_from_slice(b"tail");
                    } else {
                        f.set_len(end).unwrap();
                        content.resize(end as usize, 0);
                    }
                } else {
                    f.write_all_at(data, 0).unwrap();
                }
                if !excluded {
                    want.insert(key, Want::File(content));
                }
            }
            Node::Dir { children, .. } => {
                std::fs::create_dir(&path).unwrap();
                if !excluded {
                    want.insert(format!("{key}/"), Want::Dir);
                    if depth < 4 && kind == 1 {
                        build(&path, &format!("{key}/"), children, depth + 1, want);
                    }
                } else if depth < 4 {
                    // content below the excluded root lost+found must not show up either
                    build(
                        &path,
                        &format!("{key}/"),
                        children,
                        depth + 1,
                        &mut BTreeMap::new(),
                    );
                }
            }
            Node::Link { target, .. } => {
                let t: String = target.chars().filter(|c| *c != '\0').take(150).collect();
                let t = if t.is_empty() {
                    "nowhere".to_string()
                } else {
                    t
                };
                std::os::unix::fs::symlink(&t, &path).unwrap();
                if !excluded {
                    want.insert(key, Want::Link(t));
                }
            }
        }
    }
}

fn gzip(data: &[u8], chunk: usize, workers: usize) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut w = ParallelGzWriter::new(workers, |b: Vec<u8>| {
            out.extend_from_slice(&b);
            Ok(())
        });
        for c in data.chunks(chunk.max(1)) {
            w.write_all(c).unwrap();
        }
        w.finish().unwrap();
    }
    out
}

fn gunzip(gz: &[u8]) -> Vec<u8> {
    let mut plain = Vec::new();
    flate2::read::MultiGzDecoder::new(gz)
        .read_to_end(&mut plain)
        .expect("the gzip stream decodes");
    plain
}

fuzz_target!(|inp: Input| {
    // gzip of any bytes, across block boundaries (the input is repeated past BLOCK_SIZE now and then)
    let mut data = inp.gz_data.clone();
    if inp.repeat > 250 && !data.is_empty() {
        while data.len() < BLOCK_SIZE + BLOCK_SIZE / 2 {
            data.extend_from_slice(&inp.gz_data);
        }
    }
    let workers = 1 + usize::from(inp.workers % 3);
    let gz = gzip(&data, usize::from(inp.chunk), workers);
    assert_eq!(gz[..2], [0x1f, 0x8b]);
    assert_eq!(gunzip(&gz), data, "gzip round trip");

    // tar of an odd tree
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("vol");
    std::fs::create_dir(&root).unwrap();
    let mut want = BTreeMap::new();
    build(&root, "", &inp.tree, 0, &mut want);
    let mut tar_bytes = Vec::new();
    write_tar(&root, &mut tar_bytes).unwrap();
    assert_eq!(tar_bytes.len() % 512, 0);
    let mut got = BTreeMap::new();
    let mut archive = tar::Archive::new(tar_bytes.as_slice());
    for e in archive.entries().unwrap() {
        let mut e = e.expect("a readable tar entry");
        let path = e.path().unwrap().to_string_lossy().into_owned();
        let path = path.strip_prefix("./").unwrap_or(&path).to_string();
        let kind = e.header().entry_type();
        let w = if kind.is_dir() {
            Want::Dir
        } else if kind.is_symlink() {
            Want::Link(
                e.link_name()
                    .unwrap()
                    .unwrap()
                    .to_string_lossy()
                    .into_owned(),
            )
        } else {
            let mut v = Vec::new();
            e.read_to_end(&mut v).unwrap();
            assert_eq!(v.len() as u64, e.size(), "{path}: apparent size");
            Want::File(v)
        };
        let path = if kind.is_dir() && !path.ends_with('/') {
            format!("{path}/")
        } else {
            path
        };
        assert!(got.insert(path.clone(), w).is_none(), "{path} twice");
    }
    assert_eq!(
        got.len(),
        want.len(),
        "entries: {:?} vs {:?}",
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (k, v) in &want {
        assert_eq!(got.get(k), Some(v), "{k}");
    }
    // and the same stream through the parallel gzip
    assert_eq!(gunzip(&gzip(&tar_bytes, 4096, workers)), tar_bytes);
});
