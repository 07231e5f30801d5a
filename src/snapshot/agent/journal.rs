//! The barrier journal (docs/snapshot.md, "Barrier journal"): one entry per barrier this agent
//! raised, written before the freeze (intent) and removed after resume and thaw. It lives on a
//! node-local tmpfs, so a reboot clears it together with the kernel state. Ownership rule: the
//! agent resumes or thaws only what its journal records.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    /// Volume, which is also the DRBD resource name.
    pub volume: String,
    pub snapshot: String,
    pub uid: String,
    /// The round, exactly as read from the object.
    pub suspended_at: String,
    /// The frozen mount point, if the volume is mounted on this node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mountpoint: Option<PathBuf>,
    /// When the raise started (RFC 3339); the deadline's monotonic leg after an agent restart.
    pub raised_at: String,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct File {
    #[serde(default)]
    entries: BTreeMap<String, Entry>,
}

/// The journal file, keyed by snapshot uid.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    entries: BTreeMap<String, Entry>,
}

impl Journal {
    /// Opens the journal; a missing file is an empty journal.
    pub fn open(path: impl Into<PathBuf>) -> io::Result<Self> {
        let path = path.into();
        let entries = match std::fs::read(&path) {
            Ok(b) => {
                serde_json::from_slice::<File>(&b)
                    .map_err(|e| {
                        io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("{}: {e}", path.display()),
                        )
                    })?
                    .entries
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(e),
        };
        Ok(Journal { path, entries })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn get(&self, uid: &str) -> Option<&Entry> {
        self.entries.get(uid)
    }

    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Records (or replaces) an entry, durably, before the caller acts on it.
    pub fn put(&mut self, e: Entry) -> io::Result<()> {
        self.entries.insert(e.uid.clone(), e);
        self.save()
    }

    pub fn remove(&mut self, uid: &str) -> io::Result<()> {
        if self.entries.remove(uid).is_some() {
            self.save()?;
        }
        Ok(())
    }

    fn save(&self) -> io::Result<()> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = self.path.with_extension("tmp");
        let body = serde_json::to_vec_pretty(&File {
            entries: self.entries.clone(),
        })?;
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&body)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(uid: &str) -> Entry {
        Entry {
            volume: "pvc-1".into(),
            snapshot: "snap-1".into(),
            uid: uid.into(),
            suspended_at: "2025-03-01T10:00:00Z".into(),
            mountpoint: Some("/mnt/x".into()),
            raised_at: "2025-03-01T10:00:00.5Z".into(),
        }
    }

    #[test]
    fn survives_reopen_and_removal() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/journal.json");
        let mut j = Journal::open(&p).unwrap();
        assert!(j.is_empty());
        j.put(entry("u1")).unwrap();
        j.put(entry("u2")).unwrap();
        let j2 = Journal::open(&p).unwrap();
        assert_eq!(j2.get("u1"), Some(&entry("u1")));
        assert_eq!(j2.entries().count(), 2);
        let mut j = j2;
        j.remove("u1").unwrap();
        j.remove("missing").unwrap();
        let j3 = Journal::open(&p).unwrap();
        assert_eq!(
            j3.entries().map(|e| e.uid.as_str()).collect::<Vec<_>>(),
            ["u2"]
        );
        assert!(!p.with_extension("tmp").exists());
    }

    #[test]
    fn corrupt_journal_is_an_error_not_an_empty_journal() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("journal.json");
        std::fs::write(&p, "{not json").unwrap();
        assert!(Journal::open(&p).is_err());
    }
}
