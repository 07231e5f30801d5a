//! The bench driver's children (the control plane, ucm's processes, the reference servers): none
//! outlives a bench run.

use std::process::Command;

/// The child gets SIGTERM when the bench driver dies, even without running its destructors
/// (Ctrl-C, a kill): no manager, agent or server outlives a bench run.
pub fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe and touches only the calling (child) process.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
}
