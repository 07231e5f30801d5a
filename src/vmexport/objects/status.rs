//! The export's own status, pure (docs/vmexport.md, "TTL", "Phases and conditions", "Pass
//! steps"): the TTL and its expiry, KubeVirt-style conditions, the phase the export pod gives, and
//! the initial status. The status write is in `status.rs`.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::godur;
use crate::vmexport::api::*;
use crate::vmexport::types::{Condition, VirtualMachineExportSpec, VirtualMachineExportStatus};

/// The lifetime to apply, and a warning text when the stored value does not parse (the CRD's
/// CEL rule normally prevents that; an object stored before the rule existed falls back to 2h).
pub fn ttl_duration(spec: &VirtualMachineExportSpec) -> (Duration, Option<String>) {
    match spec.ttl_duration.as_deref() {
        None => (DEFAULT_TTL, None),
        Some(s) => match godur::parse(s) {
            Ok(d) => (d, None),
            Err(e) => (
                DEFAULT_TTL,
                Some(format!(
                    "ttlDuration {s:?} is invalid ({e}); using the default {}",
                    godur::format(DEFAULT_TTL)
                )),
            ),
        },
    }
}

/// `creationTimestamp + ttlDuration`, whole seconds (metav1.Time precision).
pub fn ttl_expiration(created: jiff::Timestamp, ttl: Duration) -> jiff::Timestamp {
    let secs = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX / 2);
    let t = created
        .checked_add(jiff::SignedDuration::from_secs(secs))
        .unwrap_or(jiff::Timestamp::MAX);
    jiff::Timestamp::from_second(t.as_second()).unwrap_or(t)
}

/// `None` when expired (delete now), else the exact wait until expiry.
pub fn until_expiry(now: jiff::Timestamp, expiry: jiff::Timestamp) -> Option<Duration> {
    if now >= expiry {
        return None;
    }
    let d = expiry.duration_since(now);
    Some(Duration::try_from(d).unwrap_or(Duration::ZERO))
}

pub fn condition(type_: &str, status: bool, reason: &str, message: impl Into<String>) -> Condition {
    Condition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: Some(reason.into()),
        message: Some(message.into()),
        last_probe_time: None,
        last_transition_time: None,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodState {
    Pending,
    Ready,
    Succeeded,
    /// Running but not ready, Failed or Unknown.
    NotReady,
}

pub fn pod_state(pod: &Pod) -> PodState {
    let status = pod.status.as_ref();
    match status.and_then(|s| s.phase.as_deref()) {
        Some("Pending") | None => PodState::Pending,
        Some("Succeeded") => PodState::Succeeded,
        Some("Running") => {
            let statuses = status.and_then(|s| s.container_statuses.as_ref());
            match statuses {
                Some(cs) if !cs.is_empty() && cs.iter().all(|c| c.ready) => PodState::Ready,
                _ => PodState::NotReady,
            }
        }
        _ => PodState::NotReady,
    }
}

/// Phase and Ready condition from the export pod.
pub fn phase_from_pod(state: PodState, pod_name: &str) -> (&'static str, Condition) {
    match state {
        PodState::Pending => (
            PHASE_PENDING,
            condition(COND_READY, false, REASON_POD_PENDING, ""),
        ),
        PodState::Ready => (
            PHASE_READY,
            condition(COND_READY, true, REASON_POD_READY, ""),
        ),
        PodState::Succeeded => (
            PHASE_TERMINATED,
            condition(COND_READY, false, REASON_POD_COMPLETED, ""),
        ),
        PodState::NotReady => (
            PHASE_PENDING,
            condition(
                COND_READY,
                false,
                REASON_UNKNOWN,
                format!(
                    "export server pod {pod_name} is not ready; see its log and its {READINESS_PATH} endpoint"
                ),
            ),
        ),
    }
}

/// The initial status of a new export ("Pass steps", step 2).
pub fn initial_status(ttl_expiry: jiff::Timestamp, now: &Time) -> VirtualMachineExportStatus {
    let mut conds = Vec::new();
    crate::conditions::set_kubevirt_condition(
        &mut conds,
        condition(COND_READY, false, REASON_INITIALIZING, ""),
        now,
    );
    VirtualMachineExportStatus {
        phase: Some(PHASE_PENDING.into()),
        conditions: Some(conds),
        ttl_expiration_time: Some(Time(ttl_expiry)),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conditions::{remove_kubevirt, set_kubevirt_condition};
    use crate::vmexport::fixtures::{export, user_pod};
    use k8s_openapi::api::core::v1::ContainerStatus;

    fn now() -> Time {
        Time("2026-01-01T00:00:00Z".parse().unwrap())
    }

    #[test]
    fn ttl_default_invalid_and_expiry() {
        let mut spec = export("e").spec;
        assert_eq!(ttl_duration(&spec), (DEFAULT_TTL, None));
        spec.ttl_duration = Some("90m".into());
        assert_eq!(ttl_duration(&spec).0, Duration::from_secs(5400));
        spec.ttl_duration = Some("banana".into());
        let (d, warn) = ttl_duration(&spec);
        assert_eq!(d, DEFAULT_TTL);
        assert!(warn.unwrap().contains("banana"));

        let created: jiff::Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let exp = ttl_expiration(created, Duration::from_secs(10));
        assert_eq!(exp.to_string(), "2026-01-01T00:00:10Z");
        let t: jiff::Timestamp = "2026-01-01T00:00:04Z".parse().unwrap();
        assert_eq!(until_expiry(t, exp), Some(Duration::from_secs(6)));
        assert_eq!(until_expiry(exp, exp), None);
        assert_eq!(
            until_expiry("2026-01-02T00:00:00Z".parse().unwrap(), exp),
            None
        );
    }

    #[test]
    fn condition_transition_time_moves_only_on_change() {
        let t0 = now();
        let t1 = Time("2026-01-01T00:05:00Z".parse().unwrap());
        let mut conds = Vec::new();
        assert!(set_kubevirt_condition(
            &mut conds,
            condition(COND_PVC_READY, false, REASON_PVC_PENDING, ""),
            &t0
        ));
        assert!(set_kubevirt_condition(
            &mut conds,
            condition(COND_READY, false, REASON_INITIALIZING, ""),
            &t0
        ));
        assert_eq!(conds[0].type_, COND_READY, "Ready comes first");
        // same content: no change, time kept
        assert!(!set_kubevirt_condition(
            &mut conds,
            condition(COND_READY, false, REASON_INITIALIZING, ""),
            &t1
        ));
        assert_eq!(conds[0].last_transition_time, Some(t0.clone()));
        // message change alone moves the time (KubeVirt mode)
        assert!(set_kubevirt_condition(
            &mut conds,
            condition(COND_READY, false, REASON_INITIALIZING, "m"),
            &t1
        ));
        assert_eq!(conds[0].last_transition_time, Some(t1.clone()));
        assert!(conds.iter().all(|c| c.last_probe_time.is_none()));
        assert!(remove_kubevirt(&mut conds, COND_PVC_READY));
        assert_eq!(conds.len(), 1);
    }

    #[test]
    fn pod_states_map_to_phases() {
        let mut p = user_pod("d", "Pending", None);
        assert_eq!(phase_from_pod(pod_state(&p), "p").0, PHASE_PENDING);
        p.status.as_mut().unwrap().phase = Some("Running".into());
        p.status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
            ready: false,
            ..Default::default()
        }]);
        let (phase, c) = phase_from_pod(pod_state(&p), "p");
        assert_eq!(
            (phase, c.reason.as_deref()),
            (PHASE_PENDING, Some(REASON_UNKNOWN))
        );
        assert!(c.message.unwrap().contains("/exportready"));
        p.status
            .as_mut()
            .unwrap()
            .container_statuses
            .as_mut()
            .unwrap()[0]
            .ready = true;
        let (phase, c) = phase_from_pod(pod_state(&p), "p");
        assert_eq!(
            (phase, c.status.as_str(), c.reason.as_deref()),
            (PHASE_READY, "True", Some(REASON_POD_READY))
        );
        p.status.as_mut().unwrap().phase = Some("Succeeded".into());
        assert_eq!(phase_from_pod(pod_state(&p), "p").0, PHASE_TERMINATED);
        p.status.as_mut().unwrap().phase = Some("Failed".into());
        assert_eq!(
            phase_from_pod(pod_state(&p), "p").1.reason.as_deref(),
            Some(REASON_UNKNOWN)
        );
    }

    #[test]
    fn initial_status_is_pending_initializing() {
        let st = initial_status("2026-01-01T02:00:00Z".parse().unwrap(), &now());
        assert_eq!(st.phase.as_deref(), Some(PHASE_PENDING));
        let c = &st.conditions.as_ref().unwrap()[0];
        assert_eq!(
            (c.type_.as_str(), c.reason.as_deref()),
            ("Ready", Some(REASON_INITIALIZING))
        );
        assert_eq!(
            st.ttl_expiration_time.unwrap().0.to_string(),
            "2026-01-01T02:00:00Z"
        );
        assert!(st.links.is_none());
    }
}
