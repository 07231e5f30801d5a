//! Lease hooks record transitions on ReportStatus (docs/exporter.md, "Lease hooks: transitions";
//! the tests' rows are its rows) and the optional hook metadata a recording exporter sends ("Lease
//! hooks: metadata"). Pure: the gRPC handler reads the Exporter, calls [`apply_report`] with the
//! stored `exporterStatus` as `prev`, then writes.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::exporter::crd::{
    ExporterStatus, ExporterStatusValue, HookOnFailure, HookPhase, HookState,
};

/// Request metadata: `<hook>=<Succeeded|Failed|Skipped>`, may repeat.
pub const HOOK_PHASE_MD: &str = "jumpstarter-lease-hook-phase";
/// Request metadata: `<hook>=<warn|endLease|exit>`, may repeat.
pub const HOOK_ON_FAILURE_MD: &str = "jumpstarter-lease-hook-on-failure";

pub const NO_BEFORE_LEASE: &str = "no beforeLease hook ran";
pub const NO_AFTER_LEASE: &str = "no afterLease hook ran";
const SKIPPED_BY_EXPORTER: &str = "skipped by the exporter";
/// Messages are capped at 1024 bytes.
const MESSAGE_LIMIT: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    BeforeLease = 0,
    AfterLease = 1,
}

impl Hook {
    fn parse(s: &str) -> Option<Hook> {
        match s {
            "beforeLease" => Some(Hook::BeforeLease),
            "afterLease" => Some(Hook::AfterLease),
            _ => None,
        }
    }
}

/// The explicit per-hook results and failure actions a declaring exporter sent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HookMetadata {
    pub before_phase: Option<HookPhase>,
    pub after_phase: Option<HookPhase>,
    pub before_on_failure: Option<HookOnFailure>,
    pub after_on_failure: Option<HookOnFailure>,
}

impl HookMetadata {
    fn phase(&self, hook: Hook) -> Option<HookPhase> {
        match hook {
            Hook::BeforeLease => self.before_phase,
            Hook::AfterLease => self.after_phase,
        }
    }
    fn on_failure(&self, hook: Hook) -> Option<HookOnFailure> {
        match hook {
            Hook::BeforeLease => self.before_on_failure,
            Hook::AfterLease => self.after_on_failure,
        }
    }
}

/// Parses the values of [`HOOK_PHASE_MD`] and [`HOOK_ON_FAILURE_MD`] (each may repeat, and a
/// proxy may have joined repeats with commas). Returns the valid entries and one line per
/// invalid or contradictory entry, which the caller logs and otherwise ignores.
pub fn parse_metadata<'a>(
    phases: impl IntoIterator<Item = &'a str>,
    on_failure: impl IntoIterator<Item = &'a str>,
) -> (HookMetadata, Vec<String>) {
    let mut errors = Vec::new();
    let (before_phase, after_phase) = per_hook(
        HOOK_PHASE_MD,
        phases,
        |p| match p {
            "Succeeded" => Some(HookPhase::Succeeded),
            "Failed" => Some(HookPhase::Failed),
            "Skipped" => Some(HookPhase::Skipped),
            _ => None,
        },
        &mut errors,
    );
    let (before_on_failure, after_on_failure) = per_hook(
        HOOK_ON_FAILURE_MD,
        on_failure,
        |a| match a {
            "warn" => Some(HookOnFailure::Warn),
            "endLease" => Some(HookOnFailure::EndLease),
            "exit" => Some(HookOnFailure::Exit),
            _ => None,
        },
        &mut errors,
    );
    let md = HookMetadata {
        before_phase,
        after_phase,
        before_on_failure,
        after_on_failure,
    };
    (md, errors)
}

/// The `<hook>=<value>` entries of one metadata key, as (beforeLease, afterLease). Contradictory
/// repeats say nothing reliable about that hook, so they drop it.
fn per_hook<'a, T: Copy + PartialEq>(
    key: &str,
    values: impl IntoIterator<Item = &'a str>,
    value: impl Fn(&str) -> Option<T>,
    errors: &mut Vec<String>,
) -> (Option<T>, Option<T>) {
    let mut slots: [Option<T>; 2] = [None, None];
    let mut contradicted = [false; 2];
    let entries = values
        .into_iter()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|e| !e.is_empty());
    for entry in entries {
        let parsed = entry
            .split_once('=')
            .and_then(|(h, v)| Some((Hook::parse(h.trim())? as usize, value(v.trim())?)));
        let Some((i, v)) = parsed else {
            errors.push(format!("invalid {key} entry {entry:?}"));
            continue;
        };
        contradicted[i] |= slots[i].is_some_and(|old| old != v);
        slots[i] = Some(v);
    }
    for (i, hook) in ["beforeLease", "afterLease"].into_iter().enumerate() {
        if contradicted[i] {
            errors.push(format!("contradictory {key} values for {hook}"));
            slots[i] = None;
        }
    }
    (slots[0], slots[1])
}

/// One ReportStatus as the record sees it.
#[derive(Debug, Clone, Copy)]
pub struct Report<'a> {
    pub status: ExporterStatusValue,
    pub message: Option<&'a str>,
    pub metadata: &'a HookMetadata,
}

fn cap(msg: &str) -> String {
    let mut msg = msg.to_string();
    crate::runtime::text::cut_at_char_boundary(&mut msg, MESSAGE_LIMIT);
    msg
}

/// What the table decides for one hook.
#[derive(Debug, Clone, PartialEq)]
enum Step {
    Keep,
    /// Start (attempts 1) or restart (attempts + 1) the hook.
    Run,
    End(HookPhase, Option<String>),
}

/// Applies one report to `status.leaseHooks`. `status` is the Exporter status as read before the
/// report, so its `exporterStatus` is `prev`; the caller sets the reported
/// `exporterStatus` afterwards. Returns whether the record changed. Nothing happens unless the
/// exporter records its hooks and a record exists (docs/exporter.md, "Lease hooks: the record").
pub fn apply_report(status: &mut ExporterStatus, report: &Report<'_>, now: &Time) -> bool {
    if status.records_lease_hooks != Some(true) {
        return false;
    }
    let prev = status.exporter_status;
    let current_lease = status.lease_ref.as_ref().map(|r| r.name.clone());
    let Some(record) = status.lease_hooks.as_mut() else {
        return false;
    };
    let record_is_current = current_lease.is_some()
        && record.lease_ref.as_ref().map(|r| &r.name) == current_lease.as_ref();
    let before = record.before_lease.as_ref().map(|h| h.phase);
    let after = record.after_lease.as_ref().map(|h| h.phase);
    let msg = report.message.unwrap_or_default();
    let (mut before_step, mut after_step) =
        inferred(report.status, prev, before, after, record_is_current, msg);
    use HookPhase as P;

    // Explicit metadata overrides the inferred result for its hook.
    for (hook, step) in [
        (Hook::BeforeLease, &mut before_step),
        (Hook::AfterLease, &mut after_step),
    ] {
        if let Some(phase) = report.metadata.phase(hook) {
            let message = match phase {
                P::Failed => Some(msg.to_string()),
                P::Skipped if msg.is_empty() => Some(SKIPPED_BY_EXPORTER.into()),
                P::Skipped => Some(msg.to_string()),
                _ => None,
            };
            *step = Step::End(phase, message);
        }
    }

    let mut changed = false;
    for (hook, step) in [
        (Hook::BeforeLease, before_step),
        (Hook::AfterLease, after_step),
    ] {
        let slot = match hook {
            Hook::BeforeLease => &mut record.before_lease,
            Hook::AfterLease => &mut record.after_lease,
        };
        let old = slot.clone();
        *slot = stepped(old.as_ref(), step, now);
        if let (Some(action), Some(h)) = (report.metadata.on_failure(hook), slot.as_mut()) {
            h.on_failure = Some(action);
        }
        changed |= *slot != old;
    }
    changed
}

/// What the reported `status` does to each hook's record (before, after), from their phases,
/// the previous `exporterStatus` and whether the record is of the current lease.
fn inferred(
    status: ExporterStatusValue,
    prev: Option<ExporterStatusValue>,
    before: Option<HookPhase>,
    after: Option<HookPhase>,
    record_is_current: bool,
    msg: &str,
) -> (Step, Step) {
    use ExporterStatusValue as S;
    use HookPhase as P;

    let (mut before_step, mut after_step) = (Step::Keep, Step::Keep);
    match status {
        S::BeforeLeaseHook => {
            before_step = match before {
                None => Step::Run,
                Some(P::Running) if prev != Some(S::BeforeLeaseHook) => Step::Run,
                Some(P::Running) => Step::Keep,
                Some(_) if record_is_current => Step::Run,
                Some(_) => Step::Keep,
            }
        }
        S::LeaseReady => {
            before_step = match before {
                Some(P::Running) => Step::End(P::Succeeded, None),
                None => Step::End(P::Skipped, Some(NO_BEFORE_LEASE.into())),
                Some(_) => Step::Keep,
            }
        }
        S::BeforeLeaseHookFailed => {
            if matches!(before, None | Some(P::Running)) {
                before_step = Step::End(P::Failed, Some(msg.into()));
            }
        }
        S::AfterLeaseHook => {
            after_step = match after {
                None => Step::Run,
                Some(P::Running) if prev != Some(S::AfterLeaseHook) => Step::Run,
                Some(P::Running) => Step::Keep,
                Some(_) => Step::Run,
            };
            if after.is_none() && before.is_none() {
                before_step = Step::End(P::Skipped, Some(NO_BEFORE_LEASE.into()));
            }
        }
        S::Available => {
            after_step = match after {
                Some(P::Running) => Step::End(P::Succeeded, None),
                None if !record_is_current => Step::End(P::Skipped, Some(NO_AFTER_LEASE.into())),
                _ => Step::Keep,
            }
        }
        S::AfterLeaseHookFailed => {
            if matches!(after, None | Some(P::Running)) {
                after_step = Step::End(P::Failed, Some(msg.into()));
            }
        }
        S::Offline | S::Unspecified => {}
    }
    (before_step, after_step)
}

/// A hook's state after `step`: a new attempt, or the end in a phase (its transition time kept
/// when the phase does not change).
fn stepped(old: Option<&HookState>, step: Step, now: &Time) -> Option<HookState> {
    use HookPhase as P;
    match step {
        Step::Keep => old.cloned(),
        Step::Run => {
            let attempts = old.and_then(|h| h.attempts).unwrap_or(0) + 1;
            Some(HookState {
                attempts: Some(attempts),
                last_transition_time: Some(now.clone()),
                message: None,
                on_failure: old.and_then(|h| h.on_failure),
                phase: P::Running,
            })
        }
        Step::End(phase, message) => {
            let attempts = old.and_then(|h| h.attempts);
            let attempts = match phase {
                P::Failed | P::Succeeded => Some(attempts.unwrap_or(0).max(1)),
                _ => attempts,
            };
            let same_phase = old.is_some_and(|h| h.phase == phase);
            Some(HookState {
                attempts,
                last_transition_time: if same_phase {
                    old.and_then(|h| h.last_transition_time.clone())
                } else {
                    Some(now.clone())
                },
                message: message.map(|m| cap(&m)),
                on_failure: old.and_then(|h| h.on_failure),
                phase,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exporter::crd::{LeaseHooks, LocalObjectReference};
    use ExporterStatusValue as S;
    use HookPhase as P;

    fn t(s: i64) -> Time {
        Time(jiff::Timestamp::from_second(s).unwrap())
    }

    fn hook(phase: P, attempts: i64) -> HookState {
        HookState {
            attempts: Some(attempts),
            last_transition_time: Some(t(100)),
            message: None,
            on_failure: None,
            phase,
        }
    }

    /// A recording exporter whose record belongs to lease `l1`; `current` is `leaseRef`.
    fn status(
        prev: Option<S>,
        current: Option<&str>,
        before: Option<HookState>,
        after: Option<HookState>,
    ) -> ExporterStatus {
        ExporterStatus {
            records_lease_hooks: Some(true),
            exporter_status: prev,
            lease_ref: current.map(LocalObjectReference::new),
            lease_hooks: Some(LeaseHooks {
                lease_ref: Some(LocalObjectReference::new("l1")),
                lease_uid: Some("u1".into()),
                client_name: Some("c1".into()),
                before_lease: before,
                after_lease: after,
            }),
            ..Default::default()
        }
    }

    fn report(s: &mut ExporterStatus, status: S, message: &str, md: &HookMetadata) -> bool {
        apply_report(
            s,
            &Report {
                status,
                message: Some(message),
                metadata: md,
            },
            &t(200),
        )
    }

    fn run(s: &mut ExporterStatus, status: S, message: &str) -> bool {
        report(s, status, message, &HookMetadata::default())
    }

    fn before(s: &ExporterStatus) -> Option<&HookState> {
        s.lease_hooks.as_ref().unwrap().before_lease.as_ref()
    }

    fn after(s: &ExporterStatus) -> Option<&HookState> {
        s.lease_hooks.as_ref().unwrap().after_lease.as_ref()
    }

    fn summary(h: Option<&HookState>) -> Option<(P, Option<i64>, Option<&str>)> {
        h.map(|h| (h.phase, h.attempts, h.message.as_deref()))
    }

    #[test]
    fn before_lease_rows() {
        // Row 1: start.
        let mut s = status(Some(S::Available), Some("l1"), None, None);
        assert!(run(&mut s, S::BeforeLeaseHook, "Running beforeLease hook"));
        assert_eq!(summary(before(&s)), Some((P::Running, Some(1), None)));
        assert_eq!(before(&s).unwrap().last_transition_time, Some(t(200)));
        assert!(after(&s).is_none());

        // Row 2: Running, prev ≠ BeforeLeaseHook (restarted): attempts + 1, new time.
        let mut s = status(
            Some(S::Unspecified),
            Some("l1"),
            Some(hook(P::Running, 1)),
            None,
        );
        assert!(run(&mut s, S::BeforeLeaseHook, ""));
        assert_eq!(summary(before(&s)), Some((P::Running, Some(2), None)));
        assert_eq!(before(&s).unwrap().last_transition_time, Some(t(200)));

        // Row 3: duplicate report: nothing changes.
        let mut s = status(
            Some(S::BeforeLeaseHook),
            Some("l1"),
            Some(hook(P::Running, 1)),
            None,
        );
        let old = s.clone();
        assert!(!run(&mut s, S::BeforeLeaseHook, ""));
        assert_eq!(s, old);

        // Row 4: terminal and the record's lease is current: re-run.
        for done in [P::Succeeded, P::Failed, P::Skipped] {
            let mut s = status(Some(S::LeaseReady), Some("l1"), Some(hook(done, 1)), None);
            assert!(run(&mut s, S::BeforeLeaseHook, ""));
            assert_eq!(summary(before(&s)), Some((P::Running, Some(2), None)));
        }
        // ... but not once the lease is no longer current (a late report).
        for current in [None, Some("l2")] {
            let mut s = status(
                Some(S::Available),
                current,
                Some(hook(P::Succeeded, 1)),
                None,
            );
            assert!(!run(&mut s, S::BeforeLeaseHook, ""));
        }

        // Row 5: LEASE_READY ends a Running hook as Succeeded.
        let mut s = status(
            Some(S::BeforeLeaseHook),
            Some("l1"),
            Some(hook(P::Running, 2)),
            None,
        );
        assert!(run(&mut s, S::LeaseReady, "Ready for commands"));
        assert_eq!(summary(before(&s)), Some((P::Succeeded, Some(2), None)));
        assert_eq!(before(&s).unwrap().last_transition_time, Some(t(200)));

        // Row 6: LEASE_READY without a beforeLease start: Skipped.
        let mut s = status(Some(S::Available), Some("l1"), None, None);
        assert!(run(&mut s, S::LeaseReady, "Ready for commands"));
        assert_eq!(
            summary(before(&s)),
            Some((P::Skipped, None, Some(NO_BEFORE_LEASE)))
        );
        // A second LEASE_READY on a terminal hook changes nothing (#241).
        let old = s.clone();
        assert!(!run(&mut s, S::LeaseReady, "again"));
        assert_eq!(s, old);

        // Row 7: BEFORE_LEASE_HOOK_FAILED from unset or Running: Failed, attempts ≥ 1.
        let mut s = status(Some(S::Available), Some("l1"), None, None);
        assert!(run(&mut s, S::BeforeLeaseHookFailed, "exit code 3"));
        assert_eq!(
            summary(before(&s)),
            Some((P::Failed, Some(1), Some("exit code 3")))
        );
        let mut s = status(
            Some(S::BeforeLeaseHook),
            Some("l1"),
            Some(hook(P::Running, 2)),
            None,
        );
        assert!(run(&mut s, S::BeforeLeaseHookFailed, "boom"));
        assert_eq!(
            summary(before(&s)),
            Some((P::Failed, Some(2), Some("boom")))
        );
        // ... but not from Succeeded (out of order).
        let mut s = status(
            Some(S::LeaseReady),
            Some("l1"),
            Some(hook(P::Succeeded, 1)),
            None,
        );
        assert!(!run(&mut s, S::BeforeLeaseHookFailed, "late"));
    }

    #[test]
    fn after_lease_rows() {
        // Row 8: start; an unset beforeLease becomes Skipped.
        let mut s = status(Some(S::Available), None, None, None);
        assert!(run(&mut s, S::AfterLeaseHook, "Running afterLease hooks"));
        assert_eq!(summary(after(&s)), Some((P::Running, Some(1), None)));
        assert_eq!(
            summary(before(&s)),
            Some((P::Skipped, None, Some(NO_BEFORE_LEASE)))
        );
        // A finished beforeLease is left alone.
        let mut s = status(Some(S::LeaseReady), None, Some(hook(P::Succeeded, 1)), None);
        assert!(run(&mut s, S::AfterLeaseHook, ""));
        assert_eq!(summary(before(&s)), Some((P::Succeeded, Some(1), None)));
        assert_eq!(before(&s).unwrap().last_transition_time, Some(t(100)));

        // Row 9: restart.
        let mut s = status(
            Some(S::Unspecified),
            None,
            Some(hook(P::Succeeded, 1)),
            Some(hook(P::Running, 1)),
        );
        assert!(run(&mut s, S::AfterLeaseHook, ""));
        assert_eq!(summary(after(&s)), Some((P::Running, Some(2), None)));

        // Row 10: duplicate.
        let mut s = status(
            Some(S::AfterLeaseHook),
            None,
            Some(hook(P::Succeeded, 1)),
            Some(hook(P::Running, 1)),
        );
        assert!(!run(&mut s, S::AfterLeaseHook, ""));

        // Row 11: re-run of a finished afterLease.
        for done in [P::Succeeded, P::Failed, P::Skipped] {
            let mut s = status(
                Some(S::Available),
                None,
                Some(hook(P::Succeeded, 1)),
                Some(hook(done, 1)),
            );
            assert!(run(&mut s, S::AfterLeaseHook, ""));
            assert_eq!(summary(after(&s)), Some((P::Running, Some(2), None)));
        }

        // Row 12: AVAILABLE ends a Running afterLease.
        let mut s = status(
            Some(S::AfterLeaseHook),
            None,
            Some(hook(P::Succeeded, 1)),
            Some(hook(P::Running, 1)),
        );
        assert!(run(&mut s, S::Available, "Available for new lease"));
        assert_eq!(summary(after(&s)), Some((P::Succeeded, Some(1), None)));

        // Row 13: AVAILABLE without an afterLease start, lease no longer current: Skipped.
        for current in [None, Some("l2")] {
            let mut s = status(
                Some(S::LeaseReady),
                current,
                Some(hook(P::Succeeded, 1)),
                None,
            );
            assert!(run(&mut s, S::Available, "Available for new lease"));
            assert_eq!(
                summary(after(&s)),
                Some((P::Skipped, None, Some(NO_AFTER_LEASE)))
            );
        }
        // ... but while the lease is current, AVAILABLE (e.g. right after Register) says nothing.
        let mut s = status(Some(S::Unspecified), Some("l1"), None, None);
        assert!(!run(
            &mut s,
            S::Available,
            "Exporter registered and available"
        ));

        // Row 14: AFTER_LEASE_HOOK_FAILED from unset or Running.
        let mut s = status(
            Some(S::AfterLeaseHook),
            None,
            Some(hook(P::Succeeded, 1)),
            Some(hook(P::Running, 1)),
        );
        assert!(run(&mut s, S::AfterLeaseHookFailed, "cleanup failed"));
        assert_eq!(
            summary(after(&s)),
            Some((P::Failed, Some(1), Some("cleanup failed")))
        );
        let mut s = status(Some(S::LeaseReady), None, Some(hook(P::Succeeded, 1)), None);
        assert!(run(&mut s, S::AfterLeaseHookFailed, "x"));
        assert_eq!(summary(after(&s)), Some((P::Failed, Some(1), Some("x"))));
    }

    #[test]
    fn other_reports_and_preconditions_change_nothing() {
        for st in [S::Offline, S::Unspecified] {
            let mut s = status(
                Some(S::BeforeLeaseHook),
                Some("l1"),
                Some(hook(P::Running, 1)),
                None,
            );
            let old = s.clone();
            assert!(!run(&mut s, st, "shutting down"));
            assert_eq!(s, old, "a hook cut off by a restart stays Running");
        }
        // Not recording: no record is touched (and none created).
        let mut s = status(Some(S::Available), Some("l1"), None, None);
        s.records_lease_hooks = Some(false);
        let old = s.clone();
        assert!(!run(&mut s, S::BeforeLeaseHook, ""));
        assert_eq!(s, old);
        // Recording but no record yet.
        let mut s = ExporterStatus {
            records_lease_hooks: Some(true),
            ..Default::default()
        };
        assert!(!run(&mut s, S::BeforeLeaseHook, ""));
        assert!(s.lease_hooks.is_none());
    }

    #[test]
    fn full_lease_sequence_as_the_real_exporter_reports_it() {
        // Register (declaring) → Available → leased → hooks → lease ends → Available.
        let mut s = status(Some(S::Unspecified), Some("l1"), None, None);
        let step = |s: &mut ExporterStatus, st: S, current: Option<&str>| {
            s.lease_ref = current.map(LocalObjectReference::new);
            run(s, st, "");
            s.exporter_status = Some(st);
        };
        step(&mut s, S::Available, Some("l1"));
        step(&mut s, S::BeforeLeaseHook, Some("l1"));
        step(&mut s, S::LeaseReady, Some("l1"));
        step(&mut s, S::AfterLeaseHook, None);
        step(&mut s, S::Available, None);
        assert_eq!(summary(before(&s)), Some((P::Succeeded, Some(1), None)));
        assert_eq!(summary(after(&s)), Some((P::Succeeded, Some(1), None)));
    }

    #[test]
    fn explicit_metadata_overrides_inference() {
        // A `warn` failure: LEASE_READY with beforeLease=Failed.
        let (md, errors) = parse_metadata(["beforeLease=Failed"], ["beforeLease=warn"]);
        assert!(errors.is_empty());
        let mut s = status(
            Some(S::BeforeLeaseHook),
            Some("l1"),
            Some(hook(P::Running, 1)),
            None,
        );
        assert!(report(&mut s, S::LeaseReady, "hook warning: exit 1", &md));
        let b = before(&s).unwrap();
        assert_eq!(
            (b.phase, b.attempts, b.message.as_deref(), b.on_failure),
            (
                P::Failed,
                Some(1),
                Some("hook warning: exit 1"),
                Some(HookOnFailure::Warn)
            )
        );

        // afterLease skipped after an endLease failure: AVAILABLE with afterLease=Skipped, even
        // while the lease is still current.
        let (md, _) = parse_metadata(["afterLease=Skipped"], []);
        let mut s = status(
            Some(S::BeforeLeaseHookFailed),
            Some("l1"),
            Some(hook(P::Failed, 1)),
            None,
        );
        assert!(report(&mut s, S::Available, "", &md));
        assert_eq!(
            summary(after(&s)),
            Some((P::Skipped, None, Some(SKIPPED_BY_EXPORTER)))
        );

        // onFailure alone is stored on an existing hook and kept by later transitions.
        let (md, _) = parse_metadata([], ["beforeLease=endLease"]);
        let mut s = status(Some(S::Available), Some("l1"), None, None);
        assert!(report(&mut s, S::BeforeLeaseHook, "", &md));
        assert_eq!(
            before(&s).unwrap().on_failure,
            Some(HookOnFailure::EndLease)
        );
        s.exporter_status = Some(S::BeforeLeaseHook);
        assert!(run(&mut s, S::BeforeLeaseHookFailed, "exit 3"));
        assert_eq!(
            before(&s).unwrap().on_failure,
            Some(HookOnFailure::EndLease)
        );
        // onFailure for a hook that has no state yet has nowhere to go.
        let (md, _) = parse_metadata([], ["afterLease=exit"]);
        assert!(!report(&mut s, S::BeforeLeaseHookFailed, "exit 3", &md));
        assert!(after(&s).is_none());
    }

    #[test]
    fn long_messages_are_capped() {
        let long = "é".repeat(1000);
        let mut s = status(Some(S::Available), Some("l1"), None, None);
        assert!(run(&mut s, S::BeforeLeaseHookFailed, &long));
        let m = before(&s).unwrap().message.clone().unwrap();
        assert!(m.len() <= 1024 && m.len() >= 1022);
        assert!(long.starts_with(&m));
    }

    #[test]
    fn metadata_parsing() {
        let (md, errors) = parse_metadata(
            ["beforeLease=Succeeded, afterLease=Skipped"],
            ["afterLease=exit"],
        );
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(
            md,
            HookMetadata {
                before_phase: Some(P::Succeeded),
                after_phase: Some(P::Skipped),
                before_on_failure: None,
                after_on_failure: Some(HookOnFailure::Exit),
            }
        );
        // Running is not an explicit result; unknown hooks and actions are invalid.
        let (md, errors) = parse_metadata(
            ["beforeLease=Running", "during=Failed", "afterLease"],
            ["beforeLease=abort"],
        );
        assert_eq!(md, HookMetadata::default());
        assert_eq!(errors.len(), 4);
        // Repeats that agree are fine; contradictions drop that hook only.
        let (md, errors) = parse_metadata(
            [
                "afterLease=Failed",
                "afterLease=Failed",
                "beforeLease=Failed",
                "beforeLease=Skipped",
            ],
            [],
        );
        assert_eq!(md.after_phase, Some(P::Failed));
        assert_eq!(md.before_phase, None);
        assert_eq!(errors.len(), 1);
    }
}
