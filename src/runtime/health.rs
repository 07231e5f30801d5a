//! Readiness checks, as controller-runtime's `pkg/healthz`: named checks, `/readyz` fails when any
//! fails, `/readyz/<check>` for one, `?verbose` lists them. Leadership is never an input: a
//! standby is ready once its watches have synced, so rolling updates complete.

use std::{
    collections::BTreeMap,
    sync::{Arc, RwLock},
};

#[derive(Clone, Default)]
pub struct Health {
    checks: Arc<RwLock<BTreeMap<String, Result<(), String>>>>,
}

impl Health {
    pub fn new() -> Self {
        let h = Health::default();
        h.set("ping", Ok(()));
        h.set("shutdown", Ok(()));
        h
    }

    pub fn set(&self, name: &str, state: Result<(), String>) {
        self.checks
            .write()
            .expect("lock")
            .insert(name.to_string(), state);
    }

    pub fn remove(&self, name: &str) {
        self.checks.write().expect("lock").remove(name);
    }

    /// (all ok, report). The report lists every check like `[+]ping ok` / `[-]feature-x failed: why`.
    pub fn report(&self, only: Option<&str>) -> Option<(bool, String)> {
        let checks = self.checks.read().expect("lock");
        if let Some(name) = only {
            let state = checks.get(name)?;
            return Some(match state {
                Ok(()) => (true, "ok".to_string()),
                Err(e) => (false, format!("internal server error: {e}")),
            });
        }
        let mut ok = true;
        let mut text = String::new();
        for (name, state) in checks.iter() {
            match state {
                Ok(()) => text.push_str(&format!("[+]{name} ok\n")),
                Err(e) => {
                    ok = false;
                    text.push_str(&format!("[-]{name} failed: {e}\n"));
                }
            }
        }
        Some((ok, text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failing_check_fails_readiness_and_names_itself() {
        let h = Health::new();
        assert!(h.report(None).unwrap().0);
        h.set(
            "feature-snapshot",
            Err("CRD miroirsnapshots.miroir.home-operations.com is not installed".into()),
        );
        let (ok, text) = h.report(None).unwrap();
        assert!(!ok);
        assert!(text.contains("[-]feature-snapshot failed: CRD miroirsnapshots"));
        assert!(text.contains("[+]ping ok"));
        assert!(!h.report(Some("feature-snapshot")).unwrap().0);
        assert!(h.report(Some("ping")).unwrap().0);
        assert!(h.report(Some("nope")).is_none());
    }
}
