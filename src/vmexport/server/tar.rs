//! In-process GNU tar writer for `disk.tar.gz` (docs/vmexport.md, "Export server"): entries
//! `./<path>` for directories, regular files and symlinks, with mode, owner and mtime; `lost+found`
//! at the root excluded; files with holes (found with SEEK_DATA/SEEK_HOLE) written as GNU sparse
//! entries so holes are never read. Sizes beyond the octal range use GNU base-256 numbers.

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

const BLOCK: usize = 512;
/// Read size for file data: large blocks keep syscalls and per-call overhead low.
const READ_CHUNK: usize = 1024 * 1024;

/// Writes the tar stream of everything below `root` to `out`. Entries that vanish during the
/// walk are skipped; any other error aborts the stream (the response must then be cut).
pub fn write_tar(root: &Path, out: &mut impl Write) -> io::Result<()> {
    walk(root, root, out)?;
    out.write_all(&[0u8; BLOCK * 2])
}

fn walk(root: &Path, dir: &Path, out: &mut impl Write) -> io::Result<()> {
    let mut entries: Vec<_> = fs::read_dir(dir)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let path = e.path();
        if dir == root && e.file_name() == "lost+found" {
            continue;
        }
        let rel = path.strip_prefix(root).expect("walk stays below root");
        let name = format!("./{}", rel.to_string_lossy());
        let md = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
            Err(err) => return Err(err),
        };
        let ft = md.file_type();
        if ft.is_dir() {
            write_header(out, &format!("{name}/"), &md, b'5', 0, "", None)?;
            walk(root, &path, out)?;
        } else if ft.is_symlink() {
            let target = fs::read_link(&path)?;
            write_header(out, &name, &md, b'2', 0, &target.to_string_lossy(), None)?;
        } else if ft.is_file() {
            write_file(out, &path, &name, &md)?;
        }
        // Sockets, FIFOs and device nodes have no data to export; skipped.
    }
    Ok(())
}

/// Data regions `(offset, len)` of a file, or `None` if the file system cannot tell.
fn data_regions(f: &File, size: u64) -> Option<Vec<(u64, u64)>> {
    let fd = f.as_raw_fd();
    let mut regions = Vec::new();
    let mut off: i64 = 0;
    let size = i64::try_from(size).ok()?;
    while off < size {
        // SAFETY: lseek on a valid descriptor owned by `f`; it only moves the file offset.
        let data = unsafe { libc::lseek(fd, off, libc::SEEK_DATA) };
        if data < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENXIO) {
                break; // only a hole remains
            }
            return None;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return None;
        }
        let end = hole.min(size);
        if end > data {
            regions.push((data as u64, (end - data) as u64));
        }
        off = end.max(data + 1);
    }
    Some(regions)
}

fn write_file(out: &mut impl Write, path: &Path, name: &str, md: &fs::Metadata) -> io::Result<()> {
    let f = File::open(path)?;
    let size = md.len();
    let regions = data_regions(&f, size).unwrap_or_else(|| vec![(0, size)]);
    let stored: u64 = regions.iter().map(|r| r.1).sum();
    if stored < size {
        let mut map = regions.clone();
        // The real size is implied by the last entry, so a trailing hole needs a marker.
        if map.last().is_none_or(|&(o, l)| o + l < size) {
            map.push((size, 0));
        }
        write_header(out, name, md, b'S', stored, "", Some((&map, size)))?;
    } else {
        write_header(out, name, md, b'0', size, "", None)?;
    }
    let targets = if stored < size {
        regions
    } else {
        vec![(0, size)]
    };
    let mut buf = vec![0u8; READ_CHUNK];
    let mut written: u64 = 0;
    for (mut off, len) in targets {
        let end = off + len;
        while off < end {
            let want = ((end - off) as usize).min(READ_CHUNK);
            let n = f.read_at(&mut buf[..want], off)?;
            if n == 0 {
                // Shrunk while being archived: the header promised more; abort the stream.
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("{name} shrank while being archived"),
                ));
            }
            out.write_all(&buf[..n])?;
            off += n as u64;
            written += n as u64;
        }
    }
    pad(out, written)
}

fn pad(out: &mut impl Write, len: u64) -> io::Result<()> {
    let rem = (len % BLOCK as u64) as usize;
    if rem != 0 {
        out.write_all(&vec![0u8; BLOCK - rem])?;
    }
    Ok(())
}

/// Writes a numeric field: octal with a trailing NUL when it fits, else GNU base-256.
fn num(field: &mut [u8], v: u64) {
    let digits = field.len() - 1;
    if digits >= 22 || v < (1u64 << (3 * digits)) {
        let s = format!("{v:0digits$o}");
        field[..digits].copy_from_slice(s.as_bytes());
        field[digits] = 0;
    } else {
        field.fill(0);
        let bytes = v.to_be_bytes();
        let n = field.len();
        field[n - 8..].copy_from_slice(&bytes);
        field[0] = 0x80;
    }
}

fn long_entry(out: &mut impl Write, kind: u8, value: &str) -> io::Result<()> {
    let data = format!("{value}\0");
    let mut h = [0u8; BLOCK];
    h[..13].copy_from_slice(b"././@LongLink");
    num(&mut h[100..108], 0o644);
    num(&mut h[108..116], 0);
    num(&mut h[116..124], 0);
    num(&mut h[124..136], data.len() as u64);
    num(&mut h[136..148], 0);
    h[156] = kind;
    finish_header(&mut h);
    out.write_all(&h)?;
    out.write_all(data.as_bytes())?;
    pad(out, data.len() as u64)
}

fn finish_header(h: &mut [u8; BLOCK]) {
    h[257..263].copy_from_slice(b"ustar ");
    h[263..265].copy_from_slice(b" \0");
    h[148..156].fill(b' ');
    let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
    let s = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(s.as_bytes());
}

fn write_header(
    out: &mut impl Write,
    name: &str,
    md: &fs::Metadata,
    kind: u8,
    size: u64,
    link: &str,
    sparse: Option<(&[(u64, u64)], u64)>,
) -> io::Result<()> {
    if name.len() > 100 {
        long_entry(out, b'L', name)?;
    }
    if link.len() > 100 {
        long_entry(out, b'K', link)?;
    }
    let mut h = [0u8; BLOCK];
    let n = name.len().min(100);
    h[..n].copy_from_slice(&name.as_bytes()[..n]);
    num(&mut h[100..108], u64::from(md.mode() & 0o7777));
    num(&mut h[108..116], u64::from(md.uid()));
    num(&mut h[116..124], u64::from(md.gid()));
    num(&mut h[124..136], size);
    num(&mut h[136..148], md.mtime().max(0) as u64);
    h[156] = kind;
    let l = link.len().min(100);
    h[157..157 + l].copy_from_slice(&link.as_bytes()[..l]);
    let mut rest: &[(u64, u64)] = &[];
    if let Some((map, real)) = sparse {
        let first = map.len().min(4);
        for (i, &(o, len)) in map[..first].iter().enumerate() {
            let at = 386 + i * 24;
            num(&mut h[at..at + 12], o);
            num(&mut h[at + 12..at + 24], len);
        }
        rest = &map[first..];
        h[482] = u8::from(!rest.is_empty());
        num(&mut h[483..495], real);
    }
    finish_header(&mut h);
    out.write_all(&h)?;
    // Extension blocks of 21 sparse entries each.
    while !rest.is_empty() {
        let mut ext = [0u8; BLOCK];
        let take = rest.len().min(21);
        for (i, &(o, len)) in rest[..take].iter().enumerate() {
            let at = i * 24;
            num(&mut ext[at..at + 12], o);
            num(&mut ext[at + 12..at + 24], len);
        }
        rest = &rest[take..];
        ext[504] = u8::from(!rest.is_empty());
        out.write_all(&ext)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numeric_fields_octal_and_base256() {
        let mut f = [0u8; 12];
        num(&mut f, 0o777);
        assert_eq!(&f, b"00000000777\0");
        num(&mut f, 8 << 30); // 8 GiB does not fit 11 octal digits
        assert_eq!(f[0], 0x80);
        assert_eq!(u64::from_be_bytes(f[4..12].try_into().unwrap()), 8 << 30);
    }

    #[test]
    fn header_checksum_is_valid() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("a"), b"hello").unwrap();
        let mut out = Vec::new();
        write_tar(dir.path(), &mut out).unwrap();
        let h = &out[..512];
        let stored = u64::from_str_radix(
            std::str::from_utf8(&h[148..154])
                .unwrap()
                .trim_matches(char::from(0)),
            8,
        )
        .unwrap();
        let mut copy = h.to_vec();
        copy[148..156].fill(b' ');
        assert_eq!(stored, copy.iter().map(|&b| u64::from(b)).sum::<u64>());
        assert_eq!(&h[..3], b"./a");
        assert_eq!(&out[512..517], b"hello");
        assert_eq!(out.len(), 512 * 4);
    }
}
