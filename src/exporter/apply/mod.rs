//! The IO of the Exporter, Client and Lease passes (docs/exporter.md, "The Exporter pass",
//! "The Client pass", "The Lease pass", "Status writes"), one file per kind: read, call the
//! pure decisions (`crate::exporter::decide`, `crate::exporter::decide::lease::assign`), write only what
//! changed (a resourceVersion-fenced JSON merge patch of status), then emit events. The
//! credential Secret the Exporter and Client passes share is in [`credential`]. Here: what the
//! passes share.

pub mod client;
pub mod credential;
pub mod exporter;
pub mod lease;

use kube::Resource;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use crate::exporter::context::{Context, Error};
use crate::exporter::decide::events::EventSpec;
use crate::runtime::timers::Timers;

/// Publishes the events of one pass in order, off the pass's critical path: an event is a
/// courtesy, so the status write it accompanies need not wait for it.
pub(crate) async fn emit<K: Resource<DynamicType = ()>>(
    ctx: &Context,
    obj: &K,
    events: &[EventSpec],
) {
    if events.is_empty() {
        return;
    }
    let regarding = obj.object_ref(&());
    let writer = ctx.writer.clone();
    let events: Vec<(EventType, &'static str, &'static str, String)> = events
        .iter()
        .map(|e| {
            let t = if e.warning {
                EventType::Warning
            } else {
                EventType::Normal
            };
            (t, e.reason, e.action(), e.note.clone())
        })
        .collect();
    tokio::spawn(async move {
        for (t, reason, action, note) in events {
            writer.event(&regarding, t, reason, action, note).await;
        }
    });
}

/// A write answered 404: the object (or its Secret) was deleted meanwhile. Its deletion event
/// brings whatever pass is still needed, so this pass ends without an error.
pub(crate) fn gone_is_done(result: Result<Action, Error>) -> Result<Action, Error> {
    match result {
        Err(Error::Write(e)) if e.is_not_found() => Ok(Action::await_change()),
        other => other,
    }
}

/// Sets the object's next timed pass, replacing the one before ([`crate::exporter::context::Wakeups`]: compact, unlike
/// kube's scheduler, which keeps only the short-lived requeues: a stale pass's recheck, the
/// error backoff).
pub(crate) fn requeue<K>(
    timers: &Timers<K>,
    ns: &str,
    name: &str,
    after: Option<std::time::Duration>,
) -> Action {
    timers.set(ns, name, after);
    Action::await_change()
}

#[cfg(test)]
mod tests {
    use crate::runtime::writer::status_merge_patch;
    use serde_json::{Value, json};

    #[test]
    fn merge_patch_has_only_changes_and_nulls_for_removals() {
        let old = json!({"a": 1, "b": {"x": 1}, "gone": "y"});
        let new = json!({"a": 1, "b": {"x": 2}, "added": [1]});
        let p = status_merge_patch(Some(&old), &new).unwrap();
        assert_eq!(p, json!({"b": {"x": 2}, "added": [1], "gone": null}));
        // Nested removals are explicit too (a merge patch merges objects).
        let old = json!({"rec": {"lease": "l1", "after": {"phase": "Succeeded"}}, "list": [1, 2]});
        let new = json!({"rec": {"lease": "l2"}, "list": [1]});
        let p = status_merge_patch(Some(&old), &new).unwrap();
        assert_eq!(
            p,
            json!({"rec": {"lease": "l2", "after": null}, "list": [1]})
        );
        let mut applied = old.clone();
        json_patch::merge(&mut applied, &p);
        assert_eq!(applied, new);
        assert_eq!(status_merge_patch(Some(&new), &new), None);
        assert_eq!(
            status_merge_patch(None::<&Value>, &json!({"a": 1})),
            Some(json!({"a": 1}))
        );
    }
}
