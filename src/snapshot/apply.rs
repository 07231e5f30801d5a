//! Performing a decision (docs/snapshot.md, "Round writes" and "Conditions and events"): the one
//! fenced write a [`Decision`] names (status patch or finalizer list), then, only after it
//! landed, the metrics, event and log lines, and the requeue time.

use std::time::Duration;

use jiff::Timestamp;
use kube::{Resource, ResourceExt, runtime::controller::Action, runtime::events::EventType};
use tracing::{debug, info};

use super::context::{Context, Error};
use super::decide::{Decision, RoundResult, Step};
use super::round::{self, RoundView};
use super::status::desired_conditions;
use super::types::MiroirSnapshot;

fn to_patch(v: serde_json::Value) -> Result<json_patch::Patch, Error> {
    Ok(serde_json::from_value(v)?)
}

pub(super) async fn apply(
    snap: &MiroirSnapshot,
    d: Decision,
    ctx: &Context,
) -> Result<Action, Error> {
    let now = Timestamp::now();
    let name = snap.name_any();
    let uid = snap.uid().unwrap_or_default();
    let rv = snap.resource_version().unwrap_or_default();
    let r = RoundView::of(snap);
    let (conds, cond_changed) = desired_conditions(snap, &d, now);
    let patch = match &d.step {
        Step::Wait | Step::ReRead => {
            let initialised = snap
                .status
                .as_ref()
                .is_some_and(|s| s.io_suspended.is_some());
            if cond_changed && !initialised {
                // E.g. TeardownPending on a snapshot deleted before its first status write.
                Some(round::init_patch(&uid, &rv, snap.status.as_ref(), &conds))
            } else if cond_changed {
                Some(round::conditions_patch(
                    &uid,
                    r.io_suspended,
                    r.suspended_at,
                    &conds,
                ))
            } else {
                None
            }
        }
        Step::Unpublish => Some(round::unpublish_patch(&uid, &rv, &conds)),
        Step::SetFinalizers(f) => {
            let p = to_patch(round::finalizers_patch(&uid, &rv, f))?;
            ctx.writer
                .patch(&ctx.snapshots, &name, &kube::api::Patch::<()>::Json(p))
                .await
                .map_err(|e| {
                    if e.is_conflict() {
                        Error::Fenced
                    } else {
                        Error::Write(e)
                    }
                })?;
            debug!(snapshot = %name, "teardown finalizers added");
            return Ok(Action::await_change());
        }
        Step::Open { stamp, diskful } => Some(round::open_patch_of(snap, stamp, diskful, &conds)),
        Step::Publish {
            size_bytes,
            source_formatted,
            slots,
            ..
        } => Some(round::publish_patch(
            &uid,
            r.suspended_at,
            &rv,
            *size_bytes,
            *source_formatted,
            slots,
            &conds,
        )),
        Step::Void { stamp, diskful, .. } => Some(round::void_patch(
            &uid,
            r.suspended_at,
            &rv,
            stamp,
            diskful,
            &conds,
        )),
    };
    if let Some(p) = patch {
        let p = to_patch(p)?;
        ctx.writer
            .json_patch_status(&ctx.snapshots, &name, p)
            .await
            .map_err(|e| {
                if e.is_conflict() {
                    Error::Fenced
                } else {
                    Error::Write(e)
                }
            })?;
    }
    // Only after the write landed: metrics, events, logs.
    if let Some(result) = d.result {
        ctx.metrics
            .rounds_total
            .with_label_values(&[result.label()])
            .inc();
        if let Some(t) = r.suspended_at.and_then(round::parse_stamp) {
            ctx.metrics
                .round_open_seconds
                .with_label_values(&[result.label()])
                .observe(round::elapsed(t, now).as_secs_f64());
        }
        info!(snapshot = %name, volume = %snap.spec.volume_name, result = result.label(), "round closed");
    }
    if matches!(d.step, Step::Open { .. }) {
        info!(snapshot = %name, volume = %snap.spec.volume_name, "round opened");
    }
    if let Some(ev) = &d.event {
        let t = if ev.warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        let action = match (&d.step, d.result) {
            (Step::Unpublish, _) => "Unpublish",
            (_, Some(RoundResult::Success)) => "Publish",
            (_, Some(_)) => "Void",
            (_, None) => "Open",
        };
        ctx.writer
            .event(&snap.object_ref(&()), t, ev.reason, action, ev.note.clone())
            .await;
    }
    Ok(match d.requeue_at {
        Some(at) => Action::requeue(round::elapsed(now, at).max(Duration::from_millis(100))),
        None => Action::await_change(),
    })
}
