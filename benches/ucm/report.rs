//! Figures and the two result files. A figure is a list of samples (one per run) summarised as
//! median, min and max, next to a reference value and the ratio median/reference. Rendering is
//! pure; `write` merges with the files of an earlier run so `UCM_BENCH_ONLY=<phase>` refreshes
//! only that phase's rows.

use std::path::Path;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Reference {
    pub value: f64,
    /// What the reference is and where it comes from (measured in this run, or a stated figure).
    pub what: String,
    /// True when the reference was measured in the same run, false for a published/computed one.
    pub measured: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Figure {
    /// Stable key, e.g. `bulk.exporters.objects_per_s`.
    pub id: String,
    /// The `UCM_BENCH_ONLY` phase that measures it.
    pub phase: String,
    pub title: String,
    pub unit: String,
    pub samples: Vec<f64>,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub reference: Option<Reference>,
    /// median / reference.value.
    pub ratio: Option<f64>,
    /// "higher" or "lower": which direction is better for ucm.
    pub better: String,
    pub note: String,
    pub rerun: String,
    pub measured_at: String,
}

pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// Nearest-rank percentile (p in 0..=1).
pub fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    let rank = (p * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

pub fn rerun_command(phase: &str) -> String {
    if phase == "storage" {
        return "make storage-lab".into();
    }
    format!("UCM_BENCH_ONLY={phase} make bench")
}

impl Figure {
    pub fn new(phase: &str, id: &str, title: &str, unit: &str, samples: Vec<f64>) -> Figure {
        let min = samples.iter().copied().fold(f64::INFINITY, f64::min);
        let max = samples.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Figure {
            id: id.into(),
            phase: phase.into(),
            title: title.into(),
            unit: unit.into(),
            median: median(&samples),
            min,
            max,
            samples,
            reference: None,
            ratio: None,
            better: "lower".into(),
            note: String::new(),
            rerun: rerun_command(phase),
            measured_at: jiff::Timestamp::now()
                .round(jiff::Unit::Second)
                .unwrap_or_else(|_| jiff::Timestamp::now())
                .to_string(),
        }
    }

    pub fn reference(mut self, value: f64, what: &str, measured: bool) -> Figure {
        self.ratio = (value != 0.0 && value.is_finite()).then(|| self.median / value);
        self.reference = Some(Reference {
            value,
            what: what.into(),
            measured,
        });
        self
    }

    pub fn higher_is_better(mut self) -> Figure {
        self.better = "higher".into();
        self
    }

    pub fn note(mut self, n: impl Into<String>) -> Figure {
        self.note = n.into();
        self
    }
}

/// Three significant digits, no exponent for the ranges this bench produces.
pub fn fmt(v: f64) -> String {
    if !v.is_finite() {
        return "–".into();
    }
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a >= 0.01 {
        format!("{v:.3}")
    } else {
        format!("{v:.2e}")
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Results {
    /// Run metadata: date, machine, commit, wall time, settings.
    pub meta: serde_json::Map<String, serde_json::Value>,
    pub figures: Vec<Figure>,
}

impl Results {
    /// Replaces every figure of the phases in `fresh` (a partial rerun keeps the others, and
    /// adds its metadata, whose keys name its phases); a run that replaces every figure replaces
    /// the metadata too. An earlier rerun's keys stay until then, beside a later rerun's.
    pub fn merge(mut self, fresh: Results) -> Results {
        let phases: Vec<&str> = fresh.figures.iter().map(|f| f.phase.as_str()).collect();
        self.figures.retain(|f| !phases.contains(&f.phase.as_str()));
        if self.figures.is_empty() {
            self.meta.clear();
        }
        self.figures.extend(fresh.figures.iter().cloned());
        for (k, v) in fresh.meta {
            self.meta.insert(k, v);
        }
        self
    }
}

pub const PHASE_TITLES: &[(&str, &str)] = &[
    ("bulk", "Bulk reconcile, memory, idle cost and start-up"),
    (
        "scale",
        "Snapshots and exports at the API server's limit (minimal-writes references)",
    ),
    (
        "leases",
        "Exporter feature at issue 17's load (Exporters, Clients, Leases)",
    ),
    (
        "peer",
        "Exporter feature against the Go controller v0.9.0, same run (Go, ucm, ucm, Go)",
    ),
    (
        "churn",
        "Lease churn and exporter reports at 10,000 Exporters against the Go controller v0.9.0, same run",
    ),
    (
        "queue",
        "Lease scheduler: 2,000 Leases, three priorities, 50 exporters",
    ),
    ("grpc", "Simulated exporters holding Status streams"),
    ("barrier", "Snapshot barrier"),
    ("storage", "Snapshot pause on real storage (storage lab)"),
    ("failover", "Leader failover (default lease settings)"),
    ("export", "Export server throughput"),
    (
        "objects",
        "Time to objects (a VirtualMachineExport's children)",
    ),
];

/// A paragraph under a phase's title, where its table needs one.
pub const PHASE_INTROS: &[(&str, &str)] = &[
    (
        "storage",
        "Issue 52: written by `make storage-lab` (hack/storage-lab), not by this driver. Two QEMU \
         guests under software emulation (Debian's 6.1 cloud kernel, DRBD 9.3.3, LVM thin, ext4 \
         on the Primary), each running the shipped agent against the host's control plane; a \
         writer appends fdatasync'ed records every 20 ms. Each of ucm's rounds is followed by \
         the bare sequence, run by the lab's script in the same guests, one command per step \
         from the host (freeze and suspend-io on the Primary, then suspend-io on the peer, \
         lvcreate on both at once, resume-io on the peer, resume-io and thaw on the Primary): \
         the reference is that physical limit. The bare peer suspends after the Primary and \
         resumes before it, ucm's legs raise at once, hence the peer's longer pause under ucm. \
         Emulation makes every command slow (lvcreate alone takes seconds) and the host was \
         shared, so the ratio, not the absolute figure, is what carries over to a real node; \
         with 21 rounds the p99 is the worst round.",
    ),
    (
        "scale",
        "Issue 32: each feature against the physical limit of this control plane, a bare client \
         doing only the writes the feature must make per object, in their causal order, at the \
         same concurrency. A snapshot round must write the teardown finalizers (so a cut is \
         never orphaned), open the round, each diskful agent's Suspended and Done (the \
         protocol's consensus is in these slots), and publish: 10 requests with the create. An \
         export must make its Service, token and certificate Secrets and Pod, the kubelet \
         reports the Pod, and one status makes it Ready: 7. What ucm adds: for a snapshot, the \
         round grant (the per-volume exclusion) and two Normal events; for an export, the \
         Pending status a user sees before the Pod is ready. Time per object at the larger N \
         against the smaller shows whether a feature costs O(N) per object.",
    ),
    (
        "leases",
        "Issue 17's load: 5,000 Exporters in one namespace, 500 Clients, every tenth Exporter \
         online, then 50 and 500 Leases. The reference column is a bare client doing the same \
         minimal writes in the same run where it measures the figure, else issue 17's goal; the \
         Go controller v0.9.0 at the same load, in the same run, is the `peer` phase. The manager \
         runs with the shipped defaults: every feature, `--leader-elect`, the default worker \
         count.",
    ),
    (
        "queue",
        "The lease scheduler (README, \"How leases are scheduled\"; docs/exporter.md, \"Lease \
         scheduling\"): 5,000 Exporters, 500 online, 2,000 Leases competing for the 50 online \
         Exporters of one label at three ExporterAccessPolicy priorities, each Lease released as \
         soon as it is assigned. The scheduling decision reads caches only; the figures are its \
         passes, their cost, and the status writes of waiting Leases per change of what they \
         show. The phase fails unless every Lease is assigned exactly once, no exporter holds two \
         active Leases, and no Lease is passed over for a later Lease of its priority.",
    ),
];

pub fn render_markdown(r: &Results, methods: &str) -> String {
    let mut out = String::from("# ucm benchmark results\n\n");
    out.push_str("Written by `make bench` (`hack/bench/bench.sh`, driver `benches/ucm/`). Do not edit by hand.\n\n");
    for (k, v) in &r.meta {
        let v = v
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| v.to_string());
        out.push_str(&format!("- **{k}**: {v}\n"));
    }
    out.push_str(
        "\nEach figure: median over the runs, with min and max; the reference and where it comes \
         from; ratio = median / reference (the `better` column says which direction favours ucm); \
         the command that reruns it.\n",
    );
    for (phase, title) in PHASE_TITLES {
        let figs: Vec<&Figure> = r.figures.iter().filter(|f| f.phase == *phase).collect();
        if figs.is_empty() {
            continue;
        }
        out.push_str(&format!("\n## {title}\n\n"));
        if let Some((_, intro)) = PHASE_INTROS.iter().find(|(p, _)| p == phase) {
            out.push_str(intro);
            out.push_str("\n\n");
        }
        out.push_str(&format!("Rerun: `{}`\n\n", rerun_command(phase)));
        out.push_str("| figure | median | min | max | runs | reference | ratio | better |\n");
        out.push_str("|---|---|---|---|---|---|---|---|\n");
        for f in &figs {
            let reference = f
                .reference
                .as_ref()
                .map(|r| {
                    format!(
                        "{} {} ({}{})",
                        fmt(r.value),
                        f.unit,
                        r.what,
                        if r.measured { ", same run" } else { "" }
                    )
                })
                .unwrap_or_else(|| "–".into());
            out.push_str(&format!(
                "| {} | **{} {}** | {} | {} | {} | {} | {} | {} |\n",
                f.title,
                fmt(f.median),
                f.unit,
                fmt(f.min),
                fmt(f.max),
                f.samples.len(),
                reference,
                f.ratio
                    .map(|x| format!("{x:.2}"))
                    .unwrap_or_else(|| "–".into()),
                f.better,
            ));
        }
        let notes: Vec<String> = figs
            .iter()
            .filter(|f| !f.note.is_empty())
            .map(|f| format!("- {}: {}", f.title, f.note))
            .collect();
        if !notes.is_empty() {
            out.push('\n');
            out.push_str(&notes.join("\n"));
            out.push('\n');
        }
    }
    out.push_str("\n## How each figure is measured\n\n");
    out.push_str(methods);
    out
}

/// Merges `fresh` into `dir/results.json` (when present) and writes both files.
pub fn write(dir: &Path, fresh: Results, methods: &str) -> std::io::Result<Results> {
    std::fs::create_dir_all(dir)?;
    let json_path = dir.join("results.json");
    let old: Results = std::fs::read(&json_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let all = old.merge(fresh);
    std::fs::write(&json_path, serde_json::to_vec_pretty(&all)?)?;
    std::fs::write(dir.join("results.md"), render_markdown(&all, methods))?;
    Ok(all)
}
