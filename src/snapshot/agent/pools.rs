//! The agent's pool configuration file (`--pools`, docs/snapshot.md, "Backends and barrier"): pool
//! name → backend and its parameters. YAML or JSON:
//!
//! ```yaml
//! pools:
//!   default: {backend: loopfile, base: /var/lib/miroir/loop}
//!   thin:    {backend: lvmthin, volumeGroup: vg0}
//!   fast:    {backend: zfs, dataset: tank/miroir}
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use super::backend::{Backend, loopfile::Loopfile, lvmthin::LvmThin, zfs::Zfs};
use super::cmd::Runner;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "backend", rename_all = "lowercase", deny_unknown_fields)]
pub enum PoolConfig {
    Loopfile {
        base: PathBuf,
    },
    Lvmthin {
        #[serde(rename = "volumeGroup")]
        volume_group: String,
    },
    Zfs {
        dataset: String,
    },
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolsFile {
    #[serde(default)]
    pub pools: BTreeMap<String, PoolConfig>,
}

pub fn parse(text: &str) -> Result<PoolsFile, String> {
    crate::yaml::from_str(text)
}

pub fn load(path: &Path) -> Result<PoolsFile, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Builds one backend per pool.
pub fn build(
    file: &PoolsFile,
    backend_timeout: Duration,
    loopfile_full_copy: bool,
) -> BTreeMap<String, Arc<dyn Backend>> {
    file.pools
        .iter()
        .map(|(name, cfg)| {
            let b: Arc<dyn Backend> = match cfg {
                PoolConfig::Loopfile { base } => Arc::new(Loopfile::new(
                    name.clone(),
                    base.clone(),
                    loopfile_full_copy,
                    backend_timeout,
                )),
                PoolConfig::Lvmthin { volume_group } => Arc::new(LvmThin::new(
                    name.clone(),
                    volume_group.clone(),
                    Runner::new(backend_timeout),
                )),
                PoolConfig::Zfs { dataset } => Arc::new(Zfs::new(
                    name.clone(),
                    dataset.clone(),
                    Runner::new(backend_timeout),
                )),
            };
            (name.clone(), b)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::types::BackendKind;

    #[test]
    fn parses_every_backend() {
        let f = parse(
            "pools:\n  default: {backend: loopfile, base: /var/lib/miroir/loop}\n  thin: {backend: lvmthin, volumeGroup: vg0}\n  fast: {backend: zfs, dataset: tank/miroir}\n",
        )
        .unwrap();
        assert_eq!(
            f.pools["default"],
            PoolConfig::Loopfile {
                base: "/var/lib/miroir/loop".into()
            }
        );
        assert_eq!(
            f.pools["thin"],
            PoolConfig::Lvmthin {
                volume_group: "vg0".into()
            }
        );
        let built = build(&f, Duration::from_secs(1), false);
        assert_eq!(built["fast"].kind(), BackendKind::Zfs);
        assert_eq!(built["thin"].kind(), BackendKind::Lvmthin);
        assert_eq!(built["default"].kind(), BackendKind::Loopfile);
    }

    #[test]
    fn rejects_unknown_backends_and_fields() {
        assert!(parse("pools:\n  x: {backend: ceph}\n").is_err());
        assert!(parse("pools:\n  x: {backend: zfs, dataset: a, extra: 1}\n").is_err());
        assert_eq!(parse("{}").unwrap(), PoolsFile::default());
    }
}
