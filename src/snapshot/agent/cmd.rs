//! Bounded external commands. Every DRBD, LVM and ZFS call goes through here, so each one is
//! killed at its timeout (#222/#226) and looked up through `PATH` (tests put fake scripts first).

use std::ffi::OsString;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

/// Runs commands with one timeout and an optional `PATH` override.
#[derive(Clone, Debug)]
pub struct Runner {
    pub timeout: Duration,
    /// `PATH` for the child and for looking the program up; None inherits the agent's.
    pub path: Option<OsString>,
}

/// A finished command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// stderr, else stdout, trimmed and bounded: what goes into an error or event.
    pub fn text(&self) -> String {
        let t = if self.stderr.trim().is_empty() {
            self.stdout.trim()
        } else {
            self.stderr.trim()
        };
        bounded(t, 1024)
    }
}

/// Cuts `s` to at most `max` characters with a marker.
pub fn bounded(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let mut out: String = s.chars().take(max).collect();
        out.push_str(" […]");
        out
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CmdError {
    #[error("{program}: could not start: {reason}")]
    Spawn { program: String, reason: String },
    #[error("{program}: killed after {}s timeout", timeout.as_secs_f32())]
    Timeout { program: String, timeout: Duration },
    #[error("{program} failed (exit {code:?}): {text}")]
    Failed {
        program: String,
        code: Option<i32>,
        text: String,
    },
}

impl Runner {
    pub fn new(timeout: Duration) -> Self {
        Runner {
            timeout,
            path: None,
        }
    }

    /// Runs `argv`, returning its output whatever the exit code; errors only on spawn failure
    /// or timeout.
    pub async fn output(&self, argv: &[String]) -> Result<Output, CmdError> {
        let program = argv.first().cloned().unwrap_or_default();
        let mut cmd = Command::new(&program);
        cmd.args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(p) = &self.path {
            cmd.env("PATH", p);
        }
        let child = cmd.spawn().map_err(|e| CmdError::Spawn {
            program: program.clone(),
            reason: e.to_string(),
        })?;
        // Dropping the future on timeout drops the child, which kills it (kill_on_drop).
        match tokio::time::timeout(self.timeout, child.wait_with_output()).await {
            Err(_) => Err(CmdError::Timeout {
                program,
                timeout: self.timeout,
            }),
            Ok(Err(e)) => Err(CmdError::Spawn {
                program,
                reason: e.to_string(),
            }),
            Ok(Ok(o)) => Ok(Output {
                code: o.status.code(),
                stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
            }),
        }
    }

    /// Runs `argv` and requires exit 0.
    pub async fn run(&self, argv: &[String]) -> Result<Output, CmdError> {
        let out = self.output(argv).await?;
        if out.success() {
            Ok(out)
        } else {
            Err(CmdError::Failed {
                program: argv.first().cloned().unwrap_or_default(),
                code: out.code,
                text: out.text(),
            })
        }
    }
}

/// Builds an argv from string-ish parts.
pub fn argv<I, S>(parts: I) -> Vec<String>
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    parts.into_iter().map(Into::into).collect()
}

#[cfg(test)]
pub mod testing {
    //! Fake commands for tests: shell scripts first on `PATH` that record their arguments.

    use std::os::unix::fs::PermissionsExt;
    use std::path::{Path, PathBuf};

    use super::Runner;

    pub struct FakeBin {
        pub dir: tempfile::TempDir,
    }

    impl Default for FakeBin {
        fn default() -> Self {
            Self::new()
        }
    }

    impl FakeBin {
        pub fn new() -> Self {
            FakeBin {
                dir: tempfile::tempdir().unwrap(),
            }
        }

        pub fn log(&self) -> PathBuf {
            self.dir.path().join("calls.log")
        }

        /// Installs `name` as a script that appends "name args…" to the call log, then runs
        /// `body` (shell).
        pub fn script(&self, name: &str, body: &str) -> &Self {
            let p = self.dir.path().join(name);
            let log = self.log();
            let text = format!(
                "#!/bin/sh\necho \"{name} $*\" >> '{}'\n{body}\n",
                log.display()
            );
            std::fs::write(&p, text).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
            self
        }

        pub fn calls(&self) -> Vec<String> {
            std::fs::read_to_string(self.log())
                .unwrap_or_default()
                .lines()
                .map(str::to_string)
                .collect()
        }

        pub fn runner(&self, timeout: std::time::Duration) -> Runner {
            Runner {
                timeout,
                path: Some(path_with(self.dir.path())),
            }
        }
    }

    fn path_with(dir: &Path) -> std::ffi::OsString {
        let mut p = dir.as_os_str().to_owned();
        p.push(":/usr/bin:/bin");
        p
    }
}

#[cfg(test)]
mod tests {
    use super::testing::FakeBin;
    use super::*;

    #[tokio::test]
    async fn runs_through_path_and_captures_output() {
        let bin = FakeBin::new();
        bin.script("tool", "echo out; echo err >&2; exit 3");
        let r = bin.runner(Duration::from_secs(5));
        let out = r.output(&argv(["tool", "a", "b c"])).await.unwrap();
        assert_eq!(out.code, Some(3));
        assert_eq!(out.stdout, "out\n");
        assert_eq!(out.text(), "err");
        assert_eq!(bin.calls(), vec!["tool a b c"]);
        let err = r.run(&argv(["tool"])).await.unwrap_err();
        assert_eq!(
            err,
            CmdError::Failed {
                program: "tool".into(),
                code: Some(3),
                text: "err".into()
            }
        );
    }

    #[tokio::test]
    async fn hanging_command_is_killed_at_the_timeout() {
        let bin = FakeBin::new();
        let pidfile = bin.dir.path().join("pid");
        bin.script(
            "hang",
            &format!("echo $$ > '{}'; exec sleep 30", pidfile.display()),
        );
        let r = bin.runner(Duration::from_millis(300));
        let start = std::time::Instant::now();
        let err = r.run(&argv(["hang"])).await.unwrap_err();
        assert!(matches!(err, CmdError::Timeout { .. }), "{err}");
        assert!(start.elapsed() < Duration::from_secs(5));
        // The child is gone: kill -0 fails once it has been reaped.
        let pid: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let mut gone = false;
        for _ in 0..50 {
            // SAFETY: kill with signal 0 only checks for existence.
            if unsafe { libc::kill(pid, 0) } != 0 {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(gone, "hanging command {pid} still alive");
    }

    #[tokio::test]
    async fn missing_program_is_a_spawn_error() {
        let r = Runner::new(Duration::from_secs(1));
        let err = r
            .run(&argv(["/nonexistent/ucm-no-such-tool"]))
            .await
            .unwrap_err();
        assert!(matches!(err, CmdError::Spawn { .. }));
    }

    #[test]
    fn bounded_text() {
        assert_eq!(bounded("abc", 5), "abc");
        assert_eq!(bounded("abcdef", 3), "abc […]");
    }
}
