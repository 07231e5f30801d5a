//! Pure derivation of the Exporter status (docs/exporter.md: "The Exporter pass", "Online and
//! Registered", "Wake-ups", "Lease hooks: the record") and of its transition events ("Events").
//! The reconciler and every gRPC handler that writes status use [`derive_conditions`], so the
//! pass that follows a gRPC write has nothing to change. `TokenExpiring` is in
//! [`super::credential`], shared with the Client status.

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::conditions::{self, Desired};
use crate::exporter::auth::token::{Claims, TokenPolicy};
use crate::exporter::crd::{
    Exporter, ExporterStatus, ExporterStatusValue, HookPhase, LeaseHooks, LocalObjectReference,
};
use crate::exporter::decide::credential::{TOKEN_EXPIRING, expiry_thresholds, token_expiring};
use crate::exporter::decide::events::{EventSpec, NOTE_GRACEFUL};
use crate::exporter::decide::time::{go_time_string, next_delay};

pub const ONLINE: &str = "Online";
pub const REGISTERED: &str = "Registered";

pub const REASON_SEEN: &str = "Seen";
pub const REASON_OFFLINE: &str = "Offline";
pub const REASON_REGISTER: &str = "Register";
pub const REASON_UNREGISTER: &str = "Unregister";

/// Reconciler settings that shape the status.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusSettings {
    /// `--exporter-offline-threshold` (T), default 60 s.
    pub offline_threshold: SignedDuration,
    /// The advertised gRPC endpoint (`--exporter-grpc-endpoint`, `GRPC_ENDPOINT`, `localhost:8082`).
    pub endpoint: String,
    /// `--exporter-max-requeue`, default 24 h.
    pub max_requeue: SignedDuration,
}

impl Default for StatusSettings {
    fn default() -> Self {
        Self {
            offline_threshold: SignedDuration::from_secs(60),
            endpoint: "localhost:8082".into(),
            max_requeue: SignedDuration::from_hours(24),
        }
    }
}

/// The lease an exporter currently holds, as derived from the active Leases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLease {
    pub name: String,
    pub uid: Option<String>,
    pub client_name: String,
}

/// The result of one Exporter pass.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub status: ExporterStatus,
    /// When the next pass is due (None: watch-driven only).
    pub requeue_after: Option<std::time::Duration>,
    /// The record being replaced still owed afterLease: log a warning.
    pub replaced_owing_record: bool,
}

/// Builds the desired status from the observed Exporter plus derived inputs.
/// `token` is the claims of the token in the Secret after any re-mint in the same pass.
pub fn decide(
    exporter: &Exporter,
    token: Option<&Claims>,
    held: Option<&HeldLease>,
    settings: &StatusSettings,
    policy: &TokenPolicy,
    now: Timestamp,
) -> Decision {
    let name = exporter.metadata.name.clone().unwrap_or_default();
    let generation = exporter.metadata.generation;
    let mut status = exporter.status.clone().unwrap_or_default();

    status.credential = Some(LocalObjectReference::new(format!("{name}-exporter")));
    status.endpoint = Some(settings.endpoint.clone());
    status.lease_ref = held.map(|l| LocalObjectReference::new(&l.name));

    let mut replaced_owing_record = false;
    if let Some(lease) = held
        && status.records_lease_hooks == Some(true)
    {
        let same_lease = status
            .lease_hooks
            .as_ref()
            .is_some_and(|r| r.lease_uid.is_some() && r.lease_uid == lease.uid);
        if !same_lease {
            replaced_owing_record = status.lease_hooks.is_some() && owes_after_lease(&status);
            status.lease_hooks = Some(LeaseHooks {
                lease_ref: Some(LocalObjectReference::new(&lease.name)),
                lease_uid: lease.uid.clone(),
                client_name: Some(lease.client_name.clone()),
                before_lease: None,
                after_lease: None,
            });
        }
    }

    status.token_expires_at = token.map(|c| Time(c.expires_at()));
    let mut conditions = status.conditions.take().unwrap_or_default();
    derive_conditions(
        &mut status,
        &mut conditions,
        generation,
        settings.offline_threshold,
        now,
    );
    if let Some(claims) = token {
        conditions::set(
            &mut conditions,
            token_expiring(claims.expires_at(), now),
            generation,
            &conditions::time(now),
        );
    }
    status.conditions = Some(conditions);

    let requeue_after = next_wakeup(&status, token, settings, policy, now);
    Decision {
        status,
        requeue_after,
        replaced_owing_record,
    }
}

/// Renders the offline threshold for condition and status messages: `1 minute` for 60 s (the
/// upstream text), `N minutes` for whole minutes, else `N seconds`.
pub fn human_threshold(threshold: SignedDuration) -> String {
    let secs = threshold.as_secs();
    if secs == 60 {
        "1 minute".to_string()
    } else if secs > 0 && secs % 60 == 0 && threshold.subsec_nanos() == 0 {
        format!("{} minutes", secs / 60)
    } else {
        format!("{secs} seconds")
    }
}

/// The message of an `exporterStatus` the controller derived (docs/exporter.md, "Exporters that
/// do not report a status").
pub const DERIVED_MESSAGE: &str =
    "The exporter does not report its status (Jumpstarter 0.7 or older); derived from its lease";

/// OURS (docs/exporter.md, "Exporters that do not report a status"): an online exporter with no
/// status of its own gets `Available`, or `LeaseReady` while it holds a lease, so the lab sees
/// it as a 0.8 exporter is seen. A report replaces the message, which ends the derivation.
fn derive_unreported(status: &mut ExporterStatus) {
    use ExporterStatusValue as S;
    if status.records_lease_hooks == Some(true) {
        return;
    }
    match status.exporter_status {
        None | Some(S::Unspecified) => {}
        Some(S::Available | S::LeaseReady) if is_derived(status) => {}
        _ => return,
    }
    status.exporter_status = Some(if status.lease_ref.is_some() {
        S::LeaseReady
    } else {
        S::Available
    });
    status.status_message = Some(DERIVED_MESSAGE.into());
}

/// Whether `exporterStatus` was derived by the controller rather than reported.
pub fn is_derived(status: &ExporterStatus) -> bool {
    status.status_message.as_deref() == Some(DERIVED_MESSAGE)
}

/// `Online` and `Registered` plus the `exporterStatus`/`statusMessage` rules of docs/exporter.md,
/// "Online and Registered". Shared with the gRPC handlers.
pub fn derive_conditions(
    status: &mut ExporterStatus,
    conditions: &mut Vec<Condition>,
    generation: Option<i64>,
    threshold: SignedDuration,
    now: Timestamp,
) {
    let t = human_threshold(threshold);
    let stamp = conditions::time(now);
    let online = match status.last_seen.as_ref().map(|t| t.0) {
        None => {
            status.status_message = Some("Never seen".into());
            Desired::new(ONLINE, false, REASON_SEEN, "Never seen")
        }
        Some(seen) if now.duration_since(seen) > threshold => {
            if status.exporter_status != Some(ExporterStatusValue::Offline) {
                status.exporter_status = Some(ExporterStatusValue::Offline);
                status.status_message =
                    Some(format!("Connection lost - last seen more than {t} ago"));
            }
            Desired::new(
                ONLINE,
                false,
                REASON_SEEN,
                format!("Last seen more than {t} ago"),
            )
        }
        Some(_) if status.exporter_status == Some(ExporterStatusValue::Offline) => Desired::new(
            ONLINE,
            false,
            REASON_OFFLINE,
            status.status_message.clone().unwrap_or_default(),
        ),
        Some(_) => Desired::new(
            ONLINE,
            true,
            REASON_SEEN,
            format!("Last seen less than {t} ago"),
        ),
    };
    if online.status == conditions::Status::True {
        derive_unreported(status);
    }
    conditions::set(conditions, online, generation, &stamp);
    let registered = if status.devices.is_some() {
        Desired::new(REGISTERED, true, REASON_REGISTER, "")
    } else {
        Desired::new(REGISTERED, false, REASON_UNREGISTER, "")
    };
    conditions::set(conditions, registered, generation, &stamp);
}

/// Owes afterLease (docs/exporter.md, "Lease hooks: the assignment gate"): records its hooks, has a
/// record, and afterLease is unset or Running.
pub fn owes_after_lease(status: &ExporterStatus) -> bool {
    status.records_lease_hooks == Some(true)
        && status.lease_hooks.as_ref().is_some_and(|r| {
            r.after_lease
                .as_ref()
                .is_none_or(|h| h.phase == HookPhase::Running)
        })
}

/// docs/exporter.md, "Wake-ups": the earliest future instant among `lastSeen + T + 1 s` (while
/// Online), the renewal instant and the TokenExpiring thresholds, capped at `max_requeue`.
fn next_wakeup(
    status: &ExporterStatus,
    token: Option<&Claims>,
    settings: &StatusSettings,
    policy: &TokenPolicy,
    now: Timestamp,
) -> Option<std::time::Duration> {
    let mut instants: Vec<Timestamp> = Vec::new();
    let conds = status.conditions.as_deref().unwrap_or_default();
    if conditions::is_true(conds, ONLINE)
        && let Some(seen) = status.last_seen.as_ref()
    {
        instants.push(seen.0 + settings.offline_threshold + SignedDuration::from_secs(1));
    }
    if let Some(claims) = token {
        instants.extend(policy.renewal_at(claims));
        instants.extend(expiry_thresholds(claims.expires_at()));
    }
    next_delay(&instants, now, settings.max_requeue)
}

/// docs/exporter.md, "Events": events for the transitions between the persisted `old` and the
/// written `new` status.
pub fn transition_events(
    name: &str,
    old: Option<&ExporterStatus>,
    new: &ExporterStatus,
    threshold: SignedDuration,
    now: Timestamp,
) -> Vec<EventSpec> {
    let was = |t: &str| {
        old.is_some_and(|s| conditions::is_true(s.conditions.as_deref().unwrap_or_default(), t))
    };
    let is = |t: &str| conditions::is_true(new.conditions.as_deref().unwrap_or_default(), t);
    let mut events = Vec::new();
    match (was(REGISTERED), is(REGISTERED)) {
        (false, true) => events.push(EventSpec {
            warning: false,
            reason: "ExporterRegistered",
            note: format!(
                "Exporter registered its capabilities: deviceCount={}",
                new.devices.as_ref().map_or(0, Vec::len)
            ),
        }),
        (true, false) => events.push(EventSpec {
            warning: true,
            reason: "ExporterUnregistered",
            note: format!("Exporter lost its device registration: exporter={name}"),
        }),
        _ => {}
    }
    let last_seen = new.last_seen.as_ref().map(|t| t.0);
    match (was(ONLINE), is(ONLINE)) {
        (false, true) => events.push(EventSpec {
            warning: false,
            reason: "ExporterOnline",
            note: format!(
                "Exporter is online: exporter={name} lastSeen={}",
                go_time_string(last_seen)
            ),
        }),
        (true, false) => {
            let graceful = new.exporter_status == Some(ExporterStatusValue::Offline)
                && last_seen.is_some_and(|s| now.duration_since(s) <= threshold);
            let note = if graceful {
                format!(
                    "{NOTE_GRACEFUL}: exporter={name} message={}",
                    new.status_message.as_deref().unwrap_or_default()
                )
            } else {
                format!(
                    "Exporter went offline (connection lost): exporter={name} lastSeen={}",
                    go_time_string(last_seen)
                )
            };
            events.push(EventSpec {
                warning: true,
                reason: "ExporterOffline",
                note,
            });
        }
        _ => {}
    }
    if !was(TOKEN_EXPIRING) && is(TOKEN_EXPIRING) {
        let message = conditions::find(
            new.conditions.as_deref().unwrap_or_default(),
            TOKEN_EXPIRING,
        )
        .map(|c| c.message.clone())
        .unwrap_or_default();
        events.push(EventSpec {
            warning: true,
            reason: "TokenExpiringSoon",
            note: message,
        });
    }
    events
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exporter::auth::token::{AUDIENCE, ISSUER};
    use crate::exporter::crd::{Device, ExporterSpec, HookState};
    use crate::exporter::decide::credential::{DAY, REASON_WITHIN_7};
    use crate::exporter::decide::time::rfc3339;
    use kube::api::ObjectMeta;

    const NOW: i64 = 1_800_000_000;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    fn exporter(status: Option<ExporterStatus>) -> Exporter {
        Exporter {
            metadata: ObjectMeta {
                name: Some("e1".into()),
                namespace: Some("lab".into()),
                generation: Some(3),
                ..Default::default()
            },
            spec: ExporterSpec::default(),
            status,
        }
    }

    fn claims(exp: i64) -> Claims {
        Claims {
            iss: ISSUER.into(),
            aud: vec![AUDIENCE.into()],
            sub: "exporter:lab:e1:u".into(),
            iat: exp - 365 * DAY,
            exp,
            jti: None,
            holder: None,
        }
    }

    fn cond<'a>(s: &'a ExporterStatus, t: &str) -> &'a Condition {
        conditions::find(s.conditions.as_deref().unwrap(), t).unwrap()
    }

    fn run(status: ExporterStatus, settings: &StatusSettings) -> Decision {
        decide(
            &exporter(Some(status)),
            Some(&claims(NOW + 200 * DAY)),
            None,
            settings,
            &TokenPolicy::default(),
            ts(NOW),
        )
    }

    #[test]
    fn renders_threshold_like_upstream() {
        assert_eq!(human_threshold(SignedDuration::from_secs(60)), "1 minute");
        assert_eq!(human_threshold(SignedDuration::from_secs(120)), "2 minutes");
        assert_eq!(human_threshold(SignedDuration::from_secs(90)), "90 seconds");
        assert_eq!(human_threshold(SignedDuration::from_secs(30)), "30 seconds");
    }

    #[test]
    fn never_seen_keeps_exporter_status() {
        let d = run(
            ExporterStatus {
                exporter_status: Some(ExporterStatusValue::Available),
                ..Default::default()
            },
            &StatusSettings::default(),
        );
        let c = cond(&d.status, ONLINE);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str(), c.message.as_str()),
            ("False", "Seen", "Never seen")
        );
        assert_eq!(d.status.status_message.as_deref(), Some("Never seen"));
        assert_eq!(
            d.status.exporter_status,
            Some(ExporterStatusValue::Available)
        );
        assert_eq!(c.observed_generation, Some(3));
    }

    #[test]
    fn an_exporter_that_never_reports_gets_a_derived_status_that_follows_its_lease() {
        use ExporterStatusValue as S;
        const T: SignedDuration = SignedDuration::from_secs(60);
        // Seen, no status, no record: a 0.7 exporter. Available while free.
        let d = run(
            ExporterStatus {
                last_seen: Some(Time(ts(NOW - 5))),
                ..Default::default()
            },
            &StatusSettings::default(),
        );
        assert_eq!(d.status.exporter_status, Some(S::Available));
        assert!(is_derived(&d.status));
        assert_eq!(cond(&d.status, ONLINE).status, "True");
        // Leased: LeaseReady; free again: Available.
        let mut s = d.status.clone();
        let mut c = Vec::new();
        s.lease_ref = Some(LocalObjectReference::new("l1"));
        derive_conditions(&mut s, &mut c, Some(1), T, ts(NOW));
        assert_eq!(s.exporter_status, Some(S::LeaseReady));
        s.lease_ref = None;
        derive_conditions(&mut s, &mut c, Some(1), T, ts(NOW));
        assert_eq!(s.exporter_status, Some(S::Available));
        // Quiet past T: Offline as any exporter; its own Unregister's Offline is kept.
        let mut quiet = s.clone();
        quiet.last_seen = Some(Time(ts(NOW - 120)));
        derive_conditions(&mut quiet, &mut c, Some(1), T, ts(NOW));
        assert_eq!(quiet.exporter_status, Some(S::Offline));
        let mut bye = s.clone();
        bye.exporter_status = Some(S::Offline);
        bye.status_message = Some("Exporter unregistered".into());
        derive_conditions(&mut bye, &mut c, Some(1), T, ts(NOW));
        assert_eq!(bye.exporter_status, Some(S::Offline));
        // The reconnect clears Offline (the Status handler), and it is derived again.
        bye.exporter_status = None;
        bye.status_message = None;
        derive_conditions(&mut bye, &mut c, Some(1), T, ts(NOW));
        assert_eq!(bye.exporter_status, Some(S::Available));
        // A report (its own message) ends the derivation, even with the same value.
        let mut reported = s.clone();
        reported.status_message = Some("Exporter registered and available".into());
        reported.lease_ref = Some(LocalObjectReference::new("l1"));
        derive_conditions(&mut reported, &mut c, Some(1), T, ts(NOW));
        assert_eq!(reported.exporter_status, Some(S::Available));
    }

    #[test]
    fn a_reported_or_recorded_status_is_never_derived() {
        use ExporterStatusValue as S;
        let seen = Some(Time(ts(NOW - 5)));
        for st in [
            // Declares the lease-hooks record (registered as Unspecified).
            ExporterStatus {
                last_seen: seen.clone(),
                records_lease_hooks: Some(true),
                exporter_status: Some(S::Unspecified),
                ..Default::default()
            },
            // A reported value, for example taken over from upstream.
            ExporterStatus {
                last_seen: seen.clone(),
                exporter_status: Some(S::BeforeLeaseHook),
                status_message: Some("running".into()),
                ..Default::default()
            },
            // Never seen: nothing is known yet.
            ExporterStatus::default(),
        ] {
            let d = run(st.clone(), &StatusSettings::default());
            assert_eq!(d.status.exporter_status, st.exporter_status, "{st:?}");
        }
    }

    #[test]
    fn stale_marks_offline_with_threshold_text() {
        for (t, text) in [(60, "1 minute"), (90, "90 seconds"), (120, "2 minutes")] {
            let settings = StatusSettings {
                offline_threshold: SignedDuration::from_secs(t),
                ..Default::default()
            };
            let d = run(
                ExporterStatus {
                    last_seen: Some(Time(ts(NOW - t - 1))),
                    exporter_status: Some(ExporterStatusValue::Available),
                    ..Default::default()
                },
                &settings,
            );
            let c = cond(&d.status, ONLINE);
            assert_eq!(c.status, "False");
            assert_eq!(c.reason, "Seen");
            assert_eq!(c.message, format!("Last seen more than {text} ago"));
            assert_eq!(d.status.exporter_status, Some(ExporterStatusValue::Offline));
            assert_eq!(
                d.status.status_message.as_deref(),
                Some(format!("Connection lost - last seen more than {text} ago").as_str())
            );
        }
    }

    #[test]
    fn stale_and_already_offline_keeps_message() {
        let d = run(
            ExporterStatus {
                last_seen: Some(Time(ts(NOW - 600))),
                exporter_status: Some(ExporterStatusValue::Offline),
                status_message: Some("bye".into()),
                ..Default::default()
            },
            &StatusSettings::default(),
        );
        assert_eq!(d.status.status_message.as_deref(), Some("bye"));
    }

    #[test]
    fn recent_online_requeues_exactly_when_stale() {
        let d = run(
            ExporterStatus {
                last_seen: Some(Time(ts(NOW - 10))),
                exporter_status: Some(ExporterStatusValue::Available),
                ..Default::default()
            },
            &StatusSettings::default(),
        );
        let c = cond(&d.status, ONLINE);
        assert_eq!(
            (c.status.as_str(), c.message.as_str()),
            ("True", "Last seen less than 1 minute ago")
        );
        // lastSeen + T + 1 s = NOW − 10 + 61.
        assert_eq!(d.requeue_after, Some(std::time::Duration::from_secs(51)));
    }

    #[test]
    fn exactly_at_threshold_is_still_online() {
        let d = run(
            ExporterStatus {
                last_seen: Some(Time(ts(NOW - 60))),
                ..Default::default()
            },
            &StatusSettings::default(),
        );
        assert_eq!(cond(&d.status, ONLINE).status, "True");
        assert_eq!(d.requeue_after, Some(std::time::Duration::from_secs(1)));
    }

    #[test]
    fn recent_but_reported_offline_has_no_timer() {
        let d = run(
            ExporterStatus {
                last_seen: Some(Time(ts(NOW - 5))),
                exporter_status: Some(ExporterStatusValue::Offline),
                status_message: Some("Exporter unregistered".into()),
                ..Default::default()
            },
            &StatusSettings::default(),
        );
        let c = cond(&d.status, ONLINE);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str(), c.message.as_str()),
            ("False", "Offline", "Exporter unregistered")
        );
        // Only the token thresholds remain: exp − 30 d = NOW + 170 d, capped at 24 h.
        assert_eq!(
            d.requeue_after,
            Some(std::time::Duration::from_secs(DAY as u64))
        );
    }

    #[test]
    fn registered_follows_devices_presence() {
        let s = StatusSettings::default();
        let absent = run(ExporterStatus::default(), &s);
        let c = cond(&absent.status, REGISTERED);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str(), c.message.as_str()),
            ("False", "Unregister", "")
        );
        let empty = run(
            ExporterStatus {
                devices: Some(vec![]),
                ..Default::default()
            },
            &s,
        );
        assert_eq!(cond(&empty.status, REGISTERED).status, "True");
        assert_eq!(cond(&empty.status, REGISTERED).reason, "Register");
        let some = run(
            ExporterStatus {
                devices: Some(vec![Device::default()]),
                ..Default::default()
            },
            &s,
        );
        assert_eq!(cond(&some.status, REGISTERED).status, "True");
    }

    #[test]
    fn credential_endpoint_and_token_expiry() {
        let settings = StatusSettings {
            endpoint: "grpc.example:443".into(),
            ..Default::default()
        };
        let d = run(ExporterStatus::default(), &settings);
        assert_eq!(
            d.status.credential,
            Some(LocalObjectReference::new("e1-exporter"))
        );
        assert_eq!(d.status.endpoint.as_deref(), Some("grpc.example:443"));
        assert_eq!(d.status.token_expires_at, Some(Time(ts(NOW + 200 * DAY))));
        let c = cond(&d.status, TOKEN_EXPIRING);
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "Valid"));
        assert_eq!(
            c.message,
            format!(
                "Token expires on {} (200 days remaining)",
                rfc3339(ts(NOW + 200 * DAY))
            )
        );
    }

    #[test]
    fn requeue_is_the_next_token_instant() {
        let policy = TokenPolicy::default();
        let settings = StatusSettings::default();
        // exp in 40 days: next instant is exp − 30 d = renewal instant (10 days away), capped 24 h.
        let c = claims(NOW + 40 * DAY);
        let d = decide(&exporter(None), Some(&c), None, &settings, &policy, ts(NOW));
        assert_eq!(
            d.requeue_after,
            Some(std::time::Duration::from_secs(DAY as u64))
        );
        // With a large cap, the delay is exactly 10 days.
        let wide = StatusSettings {
            max_requeue: SignedDuration::from_hours(24 * 365),
            ..Default::default()
        };
        let d = decide(&exporter(None), Some(&c), None, &wide, &policy, ts(NOW));
        assert_eq!(
            d.requeue_after,
            Some(std::time::Duration::from_secs(10 * DAY as u64))
        );
        // Without renewal and with exp in 5 days, the next instant is exp itself.
        let c = claims(NOW + 5 * DAY);
        let d = decide(
            &exporter(None),
            Some(&c),
            None,
            &wide,
            &policy.without_renewal(),
            ts(NOW),
        );
        assert_eq!(
            d.requeue_after,
            Some(std::time::Duration::from_secs(5 * DAY as u64))
        );
        // Nothing due: no timer.
        assert_eq!(next_delay(&[ts(NOW - 1)], ts(NOW), wide.max_requeue), None);
    }

    #[test]
    fn lease_ref_and_record_creation() {
        let held = HeldLease {
            name: "l1".into(),
            uid: Some("uid-1".into()),
            client_name: "c1".into(),
        };
        let status = ExporterStatus {
            records_lease_hooks: Some(true),
            ..Default::default()
        };
        let d = decide(
            &exporter(Some(status)),
            None,
            Some(&held),
            &StatusSettings::default(),
            &TokenPolicy::default(),
            ts(NOW),
        );
        assert_eq!(d.status.lease_ref, Some(LocalObjectReference::new("l1")));
        let rec = d.status.lease_hooks.clone().unwrap();
        assert_eq!(rec.lease_ref, Some(LocalObjectReference::new("l1")));
        assert_eq!(rec.lease_uid.as_deref(), Some("uid-1"));
        assert_eq!(rec.client_name.as_deref(), Some("c1"));
        assert!(rec.before_lease.is_none() && rec.after_lease.is_none());
        assert!(!d.replaced_owing_record);

        // Same UID: the record (with progress) is kept.
        let mut progressed = d.status.clone();
        progressed.lease_hooks.as_mut().unwrap().before_lease = Some(HookState {
            phase: HookPhase::Succeeded,
            attempts: Some(1),
            last_transition_time: None,
            message: None,
            on_failure: None,
        });
        let d2 = decide(
            &exporter(Some(progressed.clone())),
            None,
            Some(&held),
            &StatusSettings::default(),
            &TokenPolicy::default(),
            ts(NOW),
        );
        assert_eq!(d2.status.lease_hooks, progressed.lease_hooks);

        // Reused name, new UID: reset; the old record owed afterLease, so it is flagged.
        let reused = HeldLease {
            uid: Some("uid-2".into()),
            ..held.clone()
        };
        let d3 = decide(
            &exporter(Some(progressed)),
            None,
            Some(&reused),
            &StatusSettings::default(),
            &TokenPolicy::default(),
            ts(NOW),
        );
        let rec = d3.status.lease_hooks.unwrap();
        assert_eq!(rec.lease_uid.as_deref(), Some("uid-2"));
        assert!(rec.before_lease.is_none());
        assert!(d3.replaced_owing_record);

        // Lease gone: leaseRef cleared, record kept ("Lease hooks: the record").
        let d4 = decide(
            &exporter(Some(d.status.clone())),
            None,
            None,
            &StatusSettings::default(),
            &TokenPolicy::default(),
            ts(NOW),
        );
        assert_eq!(d4.status.lease_ref, None);
        assert_eq!(d4.status.lease_hooks, d.status.lease_hooks);
    }

    #[test]
    fn non_recording_exporter_gets_no_record() {
        let held = HeldLease {
            name: "l1".into(),
            uid: Some("u".into()),
            client_name: "c".into(),
        };
        for records in [None, Some(false)] {
            let status = ExporterStatus {
                records_lease_hooks: records,
                ..Default::default()
            };
            let d = decide(
                &exporter(Some(status)),
                None,
                Some(&held),
                &StatusSettings::default(),
                &TokenPolicy::default(),
                ts(NOW),
            );
            assert!(d.status.lease_hooks.is_none());
        }
    }

    #[test]
    fn owes_after_lease_rule() {
        let mut s = ExporterStatus {
            records_lease_hooks: Some(true),
            lease_hooks: Some(LeaseHooks::default()),
            ..Default::default()
        };
        assert!(owes_after_lease(&s));
        let hook = |phase| HookState {
            phase,
            attempts: Some(1),
            last_transition_time: None,
            message: None,
            on_failure: None,
        };
        s.lease_hooks.as_mut().unwrap().after_lease = Some(hook(HookPhase::Running));
        assert!(owes_after_lease(&s));
        for done in [HookPhase::Succeeded, HookPhase::Failed, HookPhase::Skipped] {
            s.lease_hooks.as_mut().unwrap().after_lease = Some(hook(done));
            assert!(!owes_after_lease(&s));
        }
        s.lease_hooks.as_mut().unwrap().after_lease = None;
        s.records_lease_hooks = Some(false);
        assert!(!owes_after_lease(&s));
        s.records_lease_hooks = Some(true);
        s.lease_hooks = None;
        assert!(!owes_after_lease(&s));
    }

    #[test]
    fn second_pass_changes_nothing() {
        let status = ExporterStatus {
            last_seen: Some(Time(ts(NOW - 10))),
            devices: Some(vec![]),
            ..Default::default()
        };
        // The "N days remaining" text changes once a day (upstream wording), so both passes sit
        // within one day of the token's life.
        let token = claims(NOW + 200 * DAY + 3600);
        let first = decide(
            &exporter(Some(status)),
            Some(&token),
            None,
            &StatusSettings::default(),
            &TokenPolicy::default(),
            ts(NOW),
        );
        let second = decide(
            &exporter(Some(first.status.clone())),
            Some(&token),
            None,
            &StatusSettings::default(),
            &TokenPolicy::default(),
            ts(NOW + 3),
        );
        assert_eq!(first.status, second.status);
    }

    #[test]
    fn the_pass_that_mints_and_the_next_one_agree() {
        // Minted in this pass: iat is `now` truncated, so a full lifetime never reads as 365 days.
        let now = Timestamp::new(NOW, 250_000_000).unwrap();
        let minted = claims(NOW + 365 * DAY);
        let at = |t: Timestamp| {
            decide(
                &exporter(None),
                Some(&minted),
                None,
                &StatusSettings::default(),
                &TokenPolicy::default(),
                t,
            )
        };
        let first = at(now);
        let message = &cond(&first.status, TOKEN_EXPIRING).message;
        assert!(message.ends_with("(364 days remaining)"), "{message}");
        let second = decide(
            &exporter(Some(first.status.clone())),
            Some(&minted),
            None,
            &StatusSettings::default(),
            &TokenPolicy::default(),
            ts(NOW + 2),
        );
        assert_eq!(first.status, second.status);
        // A fraction of a second before exp is not yet expired.
        let d = token_expiring(ts(NOW), Timestamp::new(NOW - 1, 999_000_000).unwrap());
        assert_eq!(d.reason, REASON_WITHIN_7);
        assert!(d.message.ends_with("(0 days remaining)"));
    }

    #[test]
    fn events_on_transitions_only() {
        let threshold = SignedDuration::from_secs(60);
        let first = run(
            ExporterStatus {
                last_seen: Some(Time(ts(NOW - 10))),
                devices: Some(vec![Device::default(), Device::default()]),
                ..Default::default()
            },
            &StatusSettings::default(),
        )
        .status;
        let ev = transition_events("e1", None, &first, threshold, ts(NOW));
        let reasons: Vec<_> = ev.iter().map(|e| e.reason).collect();
        assert_eq!(reasons, ["ExporterRegistered", "ExporterOnline"]);
        assert_eq!(
            ev[0].note,
            "Exporter registered its capabilities: deviceCount=2"
        );
        assert_eq!(
            ev[1].note,
            format!(
                "Exporter is online: exporter=e1 lastSeen={}",
                go_time_string(Some(ts(NOW - 10)))
            )
        );
        assert!(transition_events("e1", Some(&first), &first, threshold, ts(NOW)).is_empty());

        // Connection lost.
        let mut stale = first.clone();
        stale.last_seen = Some(Time(ts(NOW - 100)));
        let stale = run(stale, &StatusSettings::default()).status;
        let ev = transition_events("e1", Some(&first), &stale, threshold, ts(NOW));
        assert_eq!(ev.len(), 1);
        assert!(ev[0].warning);
        assert!(
            ev[0]
                .note
                .starts_with("Exporter went offline (connection lost): exporter=e1 lastSeen=")
        );

        // Graceful shutdown.
        let mut bye = first.clone();
        bye.exporter_status = Some(ExporterStatusValue::Offline);
        bye.status_message = Some("Exporter unregistered".into());
        bye.devices = None;
        let bye = run(bye, &StatusSettings::default()).status;
        let ev = transition_events("e1", Some(&first), &bye, threshold, ts(NOW));
        let notes: Vec<_> = ev.iter().map(|e| e.note.as_str()).collect();
        assert_eq!(
            notes,
            [
                "Exporter lost its device registration: exporter=e1",
                "Exporter reported offline (graceful shutdown): exporter=e1 message=Exporter unregistered"
            ]
        );

        // TokenExpiringSoon only when it becomes True.
        let soon = decide(
            &exporter(Some(first.clone())),
            Some(&claims(NOW + 20 * DAY)),
            None,
            &StatusSettings::default(),
            &TokenPolicy::default().without_renewal(),
            ts(NOW),
        )
        .status;
        let ev = transition_events("e1", Some(&first), &soon, threshold, ts(NOW));
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].reason, "TokenExpiringSoon");
        assert!(ev[0].note.contains("(20 days remaining)"));
        assert!(transition_events("e1", Some(&soon), &soon, threshold, ts(NOW)).is_empty());
    }
}
