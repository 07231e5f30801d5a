//! The Lease pass (docs/exporter.md, "The Lease pass", "Lease assignment", "Lease
//! scheduling"): the assignment decided by `crate::exporter::decide::lease::assign` under the ledger,
//! confirmed on fresh reads where the caches cannot be trusted, the status write, the queue
//! position wake-ups, the spot preemption, then the metadata (ended label, ownerRef).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use jiff::Timestamp;
use kube::api::Patch;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource as _, ResourceExt};
use serde_json::{Map, json};
use tracing::info;

use crate::conditions;
use crate::exporter::apply::{gone_is_done, requeue};
use crate::exporter::context::{Caches, Context, Error};
use crate::exporter::crd::{Client, Exporter, ExporterAccessPolicy, Lease, LeaseStatus};
use crate::exporter::decide::lease::assign::{self, AssignInputs, QueueInputs};
use crate::exporter::decide::lease::expiry::is_active;
use crate::exporter::decide::lease::preempt::preempted_status;
use crate::exporter::decide::lease::status::LeaseOutcome;
use crate::exporter::decide::lease::{
    Assignment, ENDED_LABEL, ENDED_VALUE, PENDING, UNSATISFIABLE, access, queue, status,
};
use crate::exporter::lease::selector;
use crate::exporter::observe::readable;
use crate::runtime::controller::{ChangeMemory, Guarded};
use crate::runtime::meta::{controlled_by, controller_ref};
use crate::runtime::own_writes::STALE_RECHECK;
use crate::runtime::writer::status_merge_patch;

/// The Lease pass (docs/exporter.md, "The Lease pass"): decide, write status, count, then metadata.
pub async fn reconcile(lease: Arc<Lease>, ctx: Arc<Context>) -> Result<Action, Error> {
    gone_is_done(lease_pass(lease, ctx).await)
}

async fn lease_pass(lease: Arc<Lease>, ctx: Arc<Context>) -> Result<Action, Error> {
    let now = Timestamp::now();
    let ns = lease.namespace().unwrap_or_default();
    let name = lease.name_any();
    let rv = lease.resource_version().unwrap_or_default();
    if ctx.replaced.leases.is_stale(&ns, &name, &rv) {
        return Ok(Action::requeue(STALE_RECHECK));
    }
    // An empty cache would make every pinned exporter "not found" and end the lease.
    if !ctx.caches.synced.wait().await {
        return Ok(Action::await_change()); // shutting down
    }
    let pass = LeasePass {
        ctx: &ctx,
        lease: &lease,
        ns: &ns,
        name: &name,
        now,
    };
    let status = lease.status.clone().unwrap_or_default();
    // The waiting leases behind this one, whose shown position changes when it enters or
    // leaves the queue.
    let (assignment, wake) = if !status.ended && status.exporter_ref_name().is_none() {
        let (decision, wake) = pass.assignment().await?;
        (Some(decision), wake)
    } else {
        (None, Vec::new())
    };
    let out = status::build_status(&lease, assignment, now);
    // The version the metadata patch below replaces.
    let current_rv = pass.write_status(&out, &wake).await?;
    pass.write_metadata(&out, &current_rv).await?;
    Ok(requeue(&ctx.wakeups.leases, &ns, &name, out.requeue_after))
}

/// One Lease pass's subject and time, for its steps.
struct LeasePass<'a> {
    ctx: &'a Context,
    lease: &'a Lease,
    ns: &'a str,
    name: &'a str,
    now: Timestamp,
}

impl LeasePass<'_> {
    /// The assignment of a lease not ended and with no exporter, and the waiting leases behind
    /// it. It reads caches only: each is fed by a watch that also triggers this controller, so a
    /// change a pending lease waits for always brings a pass that sees it. What the caches cannot
    /// be trusted with is confirmed on fresh reads: an Unsatisfiable decision, and the assignment
    /// gate. A spot lease whose preemption is due is ended here.
    async fn assignment(&self) -> Result<(Assignment, Vec<String>), Error> {
        let (ctx, lease, ns) = (self.ctx, self.lease, self.ns);
        let exporters = Caches::in_namespace(&ctx.caches.exporters, ns);
        let exporter_refs = readable(&exporters);
        let policies = Caches::in_namespace(&ctx.caches.policies, ns);
        let policy_refs = readable(&policies);
        // An empty name is no Client; it is reported as not found.
        let client = if policies.is_empty() || lease.spec.client_ref.name.is_empty() {
            None
        } else {
            Caches::get(&ctx.caches.clients, ns, &lease.spec.client_ref.name)
        };
        let (mut decision, mut wake) = self.decide(
            &exporter_refs,
            &policy_refs,
            client.as_ref().and_then(|c| c.0.as_ref().ok()),
        );
        // Unsatisfiable ends the lease, so it is never decided on caches alone: an
        // Exporter, policy or Client created just before the Lease may not be in them yet.
        if matches!(decision, Assignment::Unsatisfiable { .. }) {
            (decision, wake) = self.decide_on_fresh_reads().await?;
        }
        if let Some(pending) = self.gate(&decision, &exporter_refs).await? {
            decision = pending;
        }
        if let Assignment::Queued {
            preempt: Some(p), ..
        } = &decision
            && p.due
        {
            preempt(ctx, ns, self.name, &p.lease, self.now).await?;
        }
        Ok((decision, wake))
    }

    /// Decides and reserves under the ledger's lock, from the inputs given. The queue
    /// (docs/exporter.md, "Lease scheduling") is built from the same snapshot: every waiting
    /// lease of the namespace, with the Clients that policies approve by.
    fn decide(
        &self,
        exporters: &[&Exporter],
        policies: &[&ExporterAccessPolicy],
        client: Option<&Client>,
    ) -> (Assignment, Vec<String>) {
        let (ctx, ns) = (self.ctx, self.ns);
        let clients = if policies.is_empty() {
            Vec::new()
        } else {
            Caches::in_namespace(&ctx.caches.clients, ns)
        };
        let by_name: HashMap<&str, &Client> = readable(&clients)
            .into_iter()
            .map(|c| (c.metadata.name.as_deref().unwrap_or_default(), c))
            .collect();
        let lookup = |n: &str| by_name.get(n).copied();
        let mut behind = Vec::new();
        let assignment = ctx.ledger.decide(
            ns,
            self.name,
            || Caches::in_namespace(&ctx.caches.leases, ns),
            |active| {
                let field = queue::waiting(exporters, active, policies, &lookup, self.now);
                let q = QueueInputs {
                    field: &field,
                    grace: ctx.settings.preemption_grace,
                };
                let d = assign::decide(&AssignInputs {
                    lease: self.lease,
                    exporters,
                    active_leases: active,
                    policies,
                    client,
                    now: self.now,
                    queue: Some(&q),
                });
                behind = d.behind;
                d.assignment
            },
        );
        (assignment, behind)
    }

    /// The decision again on fresh reads of the namespace's Exporters, policies and the Client
    /// (three requests, on failures only).
    async fn decide_on_fresh_reads(&self) -> Result<(Assignment, Vec<String>), Error> {
        let (ctx, lease, ns) = (self.ctx, self.lease, self.ns);
        let confirm = |e| Error::ConfirmUnsatisfiable(self.name.to_string(), e);
        let exporters = Api::<Exporter>::namespaced(ctx.client.clone(), ns)
            .list(&Default::default())
            .await
            .map_err(confirm)?
            .items;
        let policies = Api::<ExporterAccessPolicy>::namespaced(ctx.client.clone(), ns)
            .list(&Default::default())
            .await
            .map_err(confirm)?
            .items;
        let client = if policies.is_empty() || lease.spec.client_ref.name.is_empty() {
            None
        } else {
            Api::<Client>::namespaced(ctx.client.clone(), ns)
                .get_opt(&lease.spec.client_ref.name)
                .await
                .map_err(confirm)?
        };
        Ok(self.decide(
            &exporters.iter().collect::<Vec<_>>(),
            &policies.iter().collect::<Vec<_>>(),
            client.as_ref(),
        ))
    }

    /// docs/exporter.md, "Lease hooks: the assignment gate": the caches are not mutually
    /// consistent, so an exporter that records lease hooks is re-checked on a fresh read: its
    /// cache may predate the record of the lease it was handed last. Others gate on the
    /// exporterStatus they report, as upstream reads it from its cache; their assignment costs
    /// no read. Returns the Pending decision that replaces the assignment (its reservation
    /// released).
    async fn gate(
        &self,
        decision: &Assignment,
        cached: &[&Exporter],
    ) -> Result<Option<Assignment>, Error> {
        let Assignment::Assign { exporter, .. } = decision else {
            return Ok(None);
        };
        let records_hooks = cached.iter().any(|e| {
            e.metadata.name.as_deref() == Some(exporter.as_str())
                && e.status.as_ref().and_then(|s| s.records_lease_hooks) == Some(true)
        });
        if !records_hooks {
            return Ok(None);
        }
        let fresh = Api::<Exporter>::namespaced(self.ctx.client.clone(), self.ns)
            .get_opt(exporter)
            .await;
        let gated = match fresh {
            Ok(Some(fresh)) => access::gate_on_fresh(&fresh),
            Ok(None) => Some(Assignment::Pending {
                reason: "ExporterNotFound",
                message: format!("Exporter {exporter} was deleted"),
            }),
            Err(e) => {
                self.ctx.ledger.release(self.ns, self.name);
                return Err(Error::ReadExporter(exporter.clone(), e));
            }
        };
        if gated.is_some() {
            self.ctx.ledger.release(self.ns, self.name);
        }
        Ok(gated)
    }

    /// Writes the status when it changed, then counts and wakes what the change concerns.
    /// Returns the Lease's version after the write (the cached one when nothing was written).
    async fn write_status(&self, out: &LeaseOutcome, wake: &[String]) -> Result<String, Error> {
        let (ctx, lease, ns, name) = (self.ctx, self.lease, self.ns, self.name);
        let rv = lease.resource_version().unwrap_or_default();
        let Some(patch) = status_merge_patch(lease.status.as_ref(), &out.status) else {
            return Ok(rv);
        };
        let api: Api<Lease> = Api::namespaced(ctx.client.clone(), ns);
        let written = match ctx
            .writer
            .merge_status_fenced(&api, name, &rv, &patch)
            .await
        {
            Ok(written) => written,
            Err(e) => {
                // Not assigned after all: the exporter is free for the next decision.
                ctx.ledger.release(ns, name);
                return Err(e.into());
            }
        };
        let current_rv = written.resource_version().unwrap_or_default();
        ctx.replaced.leases.note(ns, name, &rv, &current_rv);
        self.count(out);
        // Coalesced position updates (docs/exporter.md, "Lease scheduling"): a lease that
        // leaves the queue (assigned or ended) or enters it ahead of others moves the leases
        // behind it, at most POSITION_CAP + 1 of them; each is woken within the settle time,
        // so a burst of changes costs each of them one pass and at most one write.
        let status = lease.status.clone().unwrap_or_default();
        let was_waiting = status.exporter_ref_name().is_none() && !status.ended;
        let left = was_waiting && (out.assigned.is_some() || out.status.ended);
        let entered = status.queue.is_none() && out.status.queue.is_some();
        if left || entered {
            for other in wake {
                ctx.wakeups.leases.wake_within(ns, other, POSITION_SETTLE);
            }
        }
        Ok(current_rv)
    }

    /// Acquisitions (success when an exporter was assigned, failure when the lease became
    /// Unsatisfiable) and the wait of an assigned lease.
    fn count(&self, out: &LeaseOutcome) {
        let metrics = &self.ctx.metrics;
        if let Some(exporter) = &out.assigned {
            info!(lease = %self.name, exporter = %exporter, "lease acquired");
            metrics.acquisitions.with_label_values(&["success"]).inc();
            metrics
                .lease_wait
                .with_label_values(&[self.ns])
                .observe(waited(self.lease, self.now));
        }
        let unsatisfiable = |s: Option<&LeaseStatus>| {
            conditions::is_true(
                s.and_then(|s| s.conditions.as_deref()).unwrap_or_default(),
                UNSATISFIABLE,
            )
        };
        if !unsatisfiable(self.lease.status.as_ref()) && unsatisfiable(Some(&out.status)) {
            metrics.acquisitions.with_label_values(&["failure"]).inc();
        }
    }

    /// Metadata: the ended label and the controller ownerRef to the assigned exporter, in one
    /// patch when either changed; `current_rv` is the version it replaces.
    async fn write_metadata(&self, out: &LeaseOutcome, current_rv: &str) -> Result<(), Error> {
        let (ctx, lease, ns, name) = (self.ctx, self.lease, self.ns, self.name);
        let mut labels = lease.labels().clone();
        if out.status.ended {
            labels.insert(ENDED_LABEL.into(), ENDED_VALUE.into());
        }
        let mut owners = lease.metadata.owner_references.clone().unwrap_or_default();
        // One lookup, not a scan of the namespace: most passes are of leases assigned already.
        if let Some(exporter_name) = out.status.exporter_ref_name()
            && let Some(exporter) = Caches::get(&ctx.caches.exporters, ns, exporter_name)
            && let Ok(exporter) = exporter.0.as_ref()
            && let Some(owner) = controller_ref(exporter)
            && !controlled_by(&lease.metadata, &owner.uid)
        {
            owners.retain(|r| r.controller != Some(true));
            owners.push(owner);
        }
        let labels_changed = &labels != lease.labels();
        let owners_changed =
            Some(&owners) != lease.metadata.owner_references.as_ref() && !owners.is_empty();
        if !labels_changed && !owners_changed {
            return Ok(());
        }
        let api: Api<Lease> = Api::namespaced(ctx.client.clone(), ns);
        let mut meta = Map::new();
        if labels_changed {
            meta.insert("labels".into(), json!({ ENDED_LABEL: ENDED_VALUE }));
        }
        if owners_changed {
            meta.insert("ownerReferences".into(), json!(owners));
        }
        let written = ctx
            .writer
            .patch(&api, name, &Patch::Merge(json!({ "metadata": meta })))
            .await?;
        let written_rv = written.resource_version().unwrap_or_default();
        ctx.replaced.leases.note(ns, name, current_rv, &written_rv);
        Ok(())
    }
}

/// The waiting Leases a policy change may satisfy: every pending Lease of its namespace (the
/// watch mapper of the Lease controller's policy trigger).
pub fn of_policy(
    leases: Store<Guarded<Lease>>,
) -> impl Fn(Guarded<ExporterAccessPolicy>) -> Vec<ObjectRef<Guarded<Lease>>> + Send + Sync + 'static
{
    move |policy| {
        let ns = policy.meta().namespace.clone().unwrap_or_default();
        pending_leases(&leases, &ns, |_| true)
    }
}

/// The waiting Leases a Client change may satisfy: its pending Leases.
pub fn of_client(
    leases: Store<Guarded<Lease>>,
) -> impl Fn(Guarded<Client>) -> Vec<ObjectRef<Guarded<Lease>>> + Send + Sync + 'static {
    move |client| {
        let ns = client.meta().namespace.clone().unwrap_or_default();
        let name = client.meta().name.clone().unwrap_or_default();
        pending_leases(&leases, &ns, |l| l.spec.client_ref.name == name)
    }
}

/// The waiting Leases an Exporter change may satisfy: those that select it. Only a change every
/// waiting Lease reads (or its deletion) wakes them all; one of who holds it wakes the Leases
/// near the head (docs/exporter.md, "Lease scheduling"). The mapper is a `Fn`: its memory of
/// each exporter's shared signature sits behind a lock only it takes.
pub fn of_exporter(
    leases: Store<Guarded<Lease>>,
) -> impl Fn(Guarded<Exporter>) -> Vec<ObjectRef<Guarded<Lease>>> + Send + Sync + 'static {
    let signatures = Mutex::new(ChangeMemory::default());
    move |exporter| {
        // An unreadable Exporter is no candidate; its own pass reports it.
        let Ok(exporter) = exporter.0 else {
            return Vec::new();
        };
        let ns = exporter.metadata.namespace.clone().unwrap_or_default();
        let name = exporter.metadata.name.clone().unwrap_or_default();
        let labels = exporter.metadata.labels.clone().unwrap_or_default();
        let everyone = exporter.metadata.deletion_timestamp.is_some()
            || signatures
                .lock()
                .expect("lock")
                .changed(&exporter.metadata, queue::shared_signature(&exporter));
        pending_leases(&leases, &ns, |lease| {
            (everyone || queue::near_head(lease))
                && (lease.spec.exporter_ref_name() == Some(name.as_str())
                    || selector::matches(&lease.spec.selector, &labels).unwrap_or(false))
        })
    }
}

/// The pending leases of `ns` that `pick` selects, to wake on a change they may wait for.
fn pending_leases(
    store: &Store<Guarded<Lease>>,
    ns: &str,
    pick: impl Fn(&Lease) -> bool,
) -> Vec<ObjectRef<Guarded<Lease>>> {
    store
        .state()
        .iter()
        .filter_map(|g| g.0.as_ref().ok())
        .filter(|l| {
            l.metadata.namespace.as_deref() == Some(ns)
                && is_active(l)
                && conditions::is_true(
                    l.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_deref())
                        .unwrap_or_default(),
                    PENDING,
                )
                && pick(l)
        })
        .map(|l| {
            ObjectRef::<Guarded<Lease>>::new(l.metadata.name.as_deref().unwrap_or_default())
                .within(ns)
        })
        .collect()
}

/// How long position updates of the leases behind a queue change wait, to coalesce a burst.
const POSITION_SETTLE: std::time::Duration = std::time::Duration::from_secs(1);

/// Seconds from a lease's creation, or its beginTime when later, to `now`.
fn waited(lease: &Lease, now: Timestamp) -> f64 {
    let created = lease.metadata.creation_timestamp.as_ref().map(|t| t.0);
    let begin = lease.spec.begin_time.as_ref().map(|t| t.0);
    let from = created.max(begin).unwrap_or(now);
    from.duration_until(now).as_secs_f64().max(0.0)
}

/// Ends the spot lease `victim`, preempted by `by` (docs/exporter.md, "Lease scheduling"): one
/// status write fenced by the cached version, so a lease that changed meanwhile is decided on
/// again. Its own pass then labels it ended, and its exporter comes free for the waiting lease.
async fn preempt(
    ctx: &Context,
    ns: &str,
    by: &str,
    victim: &str,
    now: Timestamp,
) -> Result<(), Error> {
    let Some(cached) = Caches::get(&ctx.caches.leases, ns, victim) else {
        return Ok(()); // gone or ended: nothing to preempt
    };
    let Ok(held) = cached.0.as_ref() else {
        return Ok(());
    };
    let rv = held.resource_version().unwrap_or_default();
    // Ended already, or by our own write the cache does not show yet.
    if held.status.as_ref().is_none_or(|s| s.ended) || ctx.replaced.leases.is_stale(ns, victim, &rv)
    {
        return Ok(());
    }
    let status = preempted_status(held, by, now);
    let Some(patch) = status_merge_patch(held.status.as_ref(), &status) else {
        return Ok(());
    };
    let api: Api<Lease> = Api::namespaced(ctx.client.clone(), ns);
    let written = ctx
        .writer
        .merge_status_fenced(&api, victim, &rv, &patch)
        .await?;
    let written_rv = written.resource_version().unwrap_or_default();
    ctx.replaced.leases.note(ns, victim, &rv, &written_rv);
    ctx.metrics.preemptions.with_label_values(&[ns]).inc();
    info!(lease = %victim, by = %by, "spot lease preempted");
    Ok(())
}
