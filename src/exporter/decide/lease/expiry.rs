//! When a Lease's time fields make it invalid, when it expires, and whether it is still active
//! (docs/exporter.md, "Lease time fields", "The Lease pass").

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::{Assignment, ENDED_LABEL, ENDED_VALUE};
use crate::exporter::crd::Lease;
use crate::godur;

/// The requested duration for policy limits: `spec.duration`, else `endTime − beginTime`.
pub(super) fn requested_duration(lease: &Lease) -> SignedDuration {
    if let Some(d) = lease
        .spec
        .duration
        .as_deref()
        .and_then(|d| godur::parse_signed(d).ok())
    {
        return d;
    }
    match (&lease.spec.begin_time, &lease.spec.end_time) {
        (Some(b), Some(e)) => e.0.duration_since(b.0),
        _ => SignedDuration::ZERO,
    }
}

/// `spec.duration`, parsed; `Err` is the InvalidDuration message. OURS: as on the gRPC path
/// (docs/exporter.md, "Lease time fields"), a duration must be positive.
pub(super) fn lease_duration(lease: &Lease) -> Option<Result<SignedDuration, String>> {
    let d = lease.spec.duration.as_deref()?;
    Some(match godur::parse_signed(d) {
        Err(e) => Err(format!("spec.duration: {e}")),
        Ok(v) if v <= SignedDuration::ZERO => Err(format!(
            "spec.duration: {d:?} is not positive; set a duration such as 1h"
        )),
        Ok(v) => Ok(v),
    })
}

/// OURS: a lease that would end before it begins can never be served.
pub(super) fn time_range_problem(lease: &Lease) -> Option<Assignment> {
    let (Some(b), Some(e)) = (&lease.spec.begin_time, &lease.spec.end_time) else {
        return None;
    };
    (b.0 >= e.0).then(|| Assignment::Invalid {
        reason: "InvalidTimeRange",
        message: format!(
            "spec.beginTime {} is not before spec.endTime {}; set an endTime after the beginTime",
            b.0, e.0
        ),
    })
}

/// The expiration instant of a started lease: `spec.endTime`, else `spec.beginTime + duration`,
/// else `status.beginTime + duration`; None when no field gives one (expires at once).
pub fn expiration(lease: &Lease, duration: Option<SignedDuration>) -> Option<Timestamp> {
    let begun = lease.status.as_ref().and_then(|s| s.begin_time.as_ref())?;
    if let Some(end) = &lease.spec.end_time {
        return Some(end.0);
    }
    let d = duration?;
    Some(match &lease.spec.begin_time {
        Some(b) => b.0 + d,
        None => begun.0 + d,
    })
}

/// Whether a Lease is active for the purpose of `leaseRef` and the leased filter.
pub fn is_active(lease: &Lease) -> bool {
    !is_ended_label(lease) && lease.status.as_ref().is_some_and(|s| !s.ended)
}

/// The lease carries the ended label (its status may not say so yet).
pub fn is_ended_label(lease: &Lease) -> bool {
    lease
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.get(ENDED_LABEL).map(String::as_str) == Some(ENDED_VALUE))
}

/// The lease an exporter holds (docs/exporter.md, "The Exporter pass", step 3): active, assigned to
/// it; with several (which should not happen), the earliest `status.beginTime`, then the lowest
/// name. The bool reports that several matched.
pub fn held_lease<'a>(exporter_name: &str, leases: &'a [Lease]) -> (Option<&'a Lease>, bool) {
    let mut held: Vec<&Lease> = leases
        .iter()
        .filter(|l| {
            is_active(l)
                && l.status.as_ref().and_then(|s| s.exporter_ref_name()) == Some(exporter_name)
        })
        .collect();
    held.sort_by(|a, b| {
        let begin = |l: &Lease| {
            l.status
                .as_ref()
                .and_then(|s| s.begin_time.clone())
                .map(|t: Time| t.0)
        };
        match (begin(a), begin(b)) {
            (Some(x), Some(y)) => x.cmp(&y),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => std::cmp::Ordering::Equal,
        }
        .then_with(|| a.metadata.name.cmp(&b.metadata.name))
    });
    (held.first().copied(), held.len() > 1)
}
