//! Events (`events.k8s.io/v1`) as kube's `Recorder` and client-go write them: one Event object
//! per occurrence, and an event that repeats within six minutes bumps the `series` of the first
//! instead of creating another.
//!
//! Why not kube's `Recorder`: to patch a series it keeps every Event it published for six minutes,
//! whole, with its key (about 2 KiB each), and scans them all on every publish. After a bulk of
//! 5,000 new Exporters that is 5,000 Events held for nothing (memory per cached Exporter:
//! docs/benchmarks.md, "Memory per object"). A repeat needs only the first Event's name, its count
//! and when it was last seen: this keeps those, under a hash of what makes two events the same.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;
use kube::{Api, Client};

/// How long a repeat still joins the first event's series (kube's and client-go's six minutes).
const SERIES_WINDOW: SignedDuration = SignedDuration::from_mins(6);

/// One event to publish.
pub struct Occurrence<'a> {
    pub type_: EventType,
    pub reason: &'a str,
    pub action: &'a str,
    pub note: &'a str,
}

/// Publishes events for one reporting controller (`ucm-<controller>`) and instance.
pub struct Publisher {
    client: Client,
    controller: String,
    instance: String,
    seen: Mutex<Seen>,
}

#[derive(Default)]
struct Seen {
    /// Hash of (type, reason, action, note, regarding) → the Event that occurrence went to.
    series: HashMap<u64, Series>,
    /// Entries older than the window are dropped at most once a minute.
    next_sweep: Option<Timestamp>,
}

#[derive(Clone, Copy)]
struct Series {
    /// The first Event's time in nanoseconds: its name is `<regarding name>.<this in hex>`, as
    /// kube and client-go name events.
    first_nanos: i128,
    count: i32,
    last: Timestamp,
}

/// What a publish sends.
#[derive(Debug, PartialEq)]
enum Publish {
    Create {
        name: String,
    },
    /// Bump the series of the Event `name` to `count`.
    Repeat {
        name: String,
        count: i32,
    },
}

impl Seen {
    /// Decides the request for an occurrence with `key` at `now` and records it.
    fn next(&mut self, key: u64, regarding: &str, now: Timestamp) -> Publish {
        if self.next_sweep.is_none_or(|at| at <= now) {
            self.series.retain(|_, s| s.last + SERIES_WINDOW > now);
            self.next_sweep = Some(now + SignedDuration::from_mins(1));
        }
        match self.series.get_mut(&key) {
            Some(s) if s.last + SERIES_WINDOW > now => {
                s.count += 1;
                s.last = now;
                Publish::Repeat {
                    name: event_name(regarding, s.first_nanos),
                    count: s.count,
                }
            }
            _ => Publish::Create {
                name: self.start(key, regarding, now),
            },
        }
    }

    /// A new series for `key` from `now` (a first occurrence, or its Event expired on the
    /// server); the name of the Event to create.
    fn start(&mut self, key: u64, regarding: &str, now: Timestamp) -> String {
        let first_nanos = now.as_nanosecond();
        let series = Series {
            first_nanos,
            count: 1,
            last: now,
        };
        self.series.insert(key, series);
        event_name(regarding, first_nanos)
    }
}

fn event_name(regarding: &str, nanos: i128) -> String {
    format!("{regarding}.{nanos:x}")
}

fn key(o: &Occurrence<'_>, r: &ObjectReference) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (o.type_ == EventType::Warning, o.reason, o.action, o.note).hash(&mut h);
    (&r.api_version, &r.kind, &r.namespace, &r.name, &r.uid).hash(&mut h);
    h.finish()
}

impl Publisher {
    pub fn new(client: Client, controller: String, instance: String) -> Self {
        Publisher {
            client,
            controller,
            instance,
            seen: Mutex::default(),
        }
    }

    /// Creates the Event, or bumps the series of the same event seen within six minutes.
    pub async fn publish(
        &self,
        o: &Occurrence<'_>,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let key = key(o, regarding);
        let name = regarding.name.as_deref().unwrap_or(&self.controller);
        let namespace = regarding.namespace.as_deref().unwrap_or("default");
        let api: Api<Event> = Api::namespaced(self.client.clone(), namespace);
        let send = self.seen.lock().expect("lock").next(key, name, now);
        let create = match send {
            Publish::Create { name } => name,
            Publish::Repeat { name: first, count } => {
                let patch = serde_json::json!({"series": {
                    "count": count,
                    "lastObservedTime": MicroTime(now),
                }});
                match api
                    .patch(&first, &PatchParams::default(), &Patch::Merge(patch))
                    .await
                {
                    // The first Event expired on the server: a new one.
                    Err(e) if super::kube_errors::is_not_found(&e) => {
                        self.seen.lock().expect("lock").start(key, name, now)
                    }
                    other => return other.map(drop),
                }
            }
        };
        let event = self.event(o, regarding, create, now);
        api.create(&PostParams::default(), &event).await.map(drop)
    }

    fn event(
        &self,
        o: &Occurrence<'_>,
        regarding: &ObjectReference,
        name: String,
        now: Timestamp,
    ) -> Event {
        Event {
            metadata: ObjectMeta {
                name: Some(name),
                namespace: regarding.namespace.clone(),
                ..Default::default()
            },
            action: Some(o.action.to_string()),
            reason: Some(o.reason.to_string()),
            note: Some(o.note.to_string()),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(match o.type_ {
                EventType::Normal => "Normal".into(),
                EventType::Warning => "Warning".into(),
            }),
            series: None::<EventSeries>,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    #[test]
    fn a_repeat_within_six_minutes_bumps_the_first_events_series() {
        let mut seen = Seen::default();
        let Publish::Create { name } = seen.next(1, "e1", at(0)) else {
            panic!("the first occurrence creates")
        };
        assert_eq!(name, format!("e1.{:x}", at(0).as_nanosecond()));
        assert_eq!(
            seen.next(1, "e1", at(300)),
            Publish::Repeat {
                name: name.clone(),
                count: 2
            }
        );
        // The window runs from the last occurrence.
        assert_eq!(
            seen.next(1, "e1", at(600)),
            Publish::Repeat {
                name: name.clone(),
                count: 3
            }
        );
        // Another event (another key) is its own.
        assert!(matches!(
            seen.next(2, "e1", at(601)),
            Publish::Create { .. }
        ));
        // Six minutes of silence: a new Event.
        assert!(matches!(
            seen.next(1, "e1", at(960)),
            Publish::Create { .. }
        ));
    }

    #[test]
    fn old_series_are_swept_and_an_expired_one_starts_anew() {
        let mut seen = Seen::default();
        for k in 0..100 {
            seen.next(k, "x", at(0));
        }
        assert_eq!(seen.series.len(), 100);
        seen.next(1000, "x", at(361));
        assert_eq!(seen.series.len(), 1, "only the new one is kept");
        // Its Event expired on the server: the next repeat starts from one.
        let name = seen.start(1000, "x", at(362));
        assert_eq!(name, format!("x.{:x}", at(362).as_nanosecond()));
        assert_eq!(
            seen.next(1000, "x", at(363)),
            Publish::Repeat { name, count: 2 }
        );
    }

    #[test]
    fn the_key_is_what_makes_two_events_the_same() {
        let r = ObjectReference {
            kind: Some("Exporter".into()),
            namespace: Some("lab".into()),
            name: Some("e1".into()),
            uid: Some("u1".into()),
            ..Default::default()
        };
        let o = |note| Occurrence {
            type_: EventType::Normal,
            reason: "CredentialCreated",
            action: "Create",
            note,
        };
        assert_eq!(key(&o("a"), &r), key(&o("a"), &r));
        assert_ne!(key(&o("a"), &r), key(&o("b"), &r));
        let other = ObjectReference {
            uid: Some("u2".into()),
            ..r.clone()
        };
        assert_ne!(key(&o("a"), &r), key(&o("a"), &other));
    }
}
