//! Condition merging (src/conditions.rs), both modes, over any list of existing conditions and
//! any sequence of desired ones. Properties: the setter returns true exactly when the list
//! changed; afterwards the condition says what was desired (message capped to the schema's
//! limit); other conditions and the order are untouched; metav1 mode moves
//! `lastTransitionTime` only when the status moves, KubeVirt mode when status, reason or
//! message move, and `lastProbeTime` ends null; setting the same thing twice is a no-op; the
//! reason/type validators agree with a transcription of the API's patterns.
#![no_main]

use arbitrary::Arbitrary;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use libfuzzer_sys::fuzz_target;
use ucm::conditions::{
    Desired, KubeVirtCondition, MAX_MESSAGE_CHARS, Status, cap_message, is_valid_reason,
    is_valid_type, remove, set, set_kubevirt,
};

const TYPES: [&str; 4] = ["Ready", "PVCReady", "example.com/Synced", "VolumesCreated"];
const REASONS: [&str; 4] = ["PodReady", "InUse", "A", "Waiting_for:it,now"];
const STATUSES: [&str; 4] = ["True", "False", "Unknown", "weird"];

#[derive(Arbitrary, Debug)]
struct Existing {
    ty: u8,
    status: u8,
    reason: u8,
    message: String,
    t: u16,
    probe: bool,
    generation: Option<i8>,
}

#[derive(Arbitrary, Debug)]
struct Want {
    ty: u8,
    status: u8,
    reason: u8,
    message: String,
    long: u16,
    generation: Option<i8>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    existing: Vec<Existing>,
    wants: Vec<Want>,
    reason_text: String,
    type_text: String,
}

fn time(s: i64) -> Time {
    Time(jiff::Timestamp::from_second(1_800_000_000 + s).unwrap())
}

fn status(b: u8) -> Status {
    [Status::True, Status::False, Status::Unknown][b as usize % 3]
}

/// `^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$`, 1–1024 characters.
fn reason_oracle(s: &str) -> bool {
    let c: Vec<char> = s.chars().collect();
    if c.is_empty() || c.len() > 1024 || !c[0].is_ascii_alphabetic() {
        return false;
    }
    let mid = |x: &char| x.is_ascii_alphanumeric() || matches!(x, '_' | ',' | ':');
    let end = |x: &char| x.is_ascii_alphanumeric() || *x == '_';
    c.len() == 1 || (c[1..c.len() - 1].iter().all(mid) && end(&c[c.len() - 1]))
}

fn message(w: &Want) -> String {
    // Now and then a message over the schema's limit.
    if w.long > 65_000 {
        "é".repeat(MAX_MESSAGE_CHARS + usize::from(w.long % 100))
    } else {
        w.message.clone()
    }
}

fuzz_target!(|inp: Input| {
    assert_eq!(
        is_valid_reason(&inp.reason_text),
        reason_oracle(&inp.reason_text)
    );
    let _ = is_valid_type(&inp.type_text);
    for t in TYPES {
        assert!(is_valid_type(t));
    }

    // metav1 mode; one existing condition per type, as the API keeps them.
    let mut metav1: Vec<Condition> = Vec::new();
    let mut kv: Vec<KubeVirtCondition> = Vec::new();
    for e in inp.existing.iter().take(8) {
        let ty = TYPES[e.ty as usize % TYPES.len()].to_string();
        if metav1.iter().any(|c| c.type_ == ty) {
            continue;
        }
        metav1.push(Condition {
            type_: ty.clone(),
            status: STATUSES[e.status as usize % 4].into(),
            reason: REASONS[e.reason as usize % 4].into(),
            message: e.message.clone(),
            observed_generation: e.generation.map(i64::from),
            last_transition_time: time(i64::from(e.t)),
        });
        kv.push(KubeVirtCondition {
            type_: ty,
            status: STATUSES[e.status as usize % 4].into(),
            last_probe_time: e.probe.then(|| time(0)),
            last_transition_time: Some(time(i64::from(e.t))),
            reason: Some(REASONS[e.reason as usize % 4].into()),
            message: Some(e.message.clone()),
        });
    }

    for (step, w) in inp.wants.iter().take(16).enumerate() {
        let now = time(100_000 + step as i64);
        let ty = TYPES[w.ty as usize % TYPES.len()];
        let reason = REASONS[w.reason as usize % REASONS.len()];
        let msg = message(w);
        let capped = cap_message(&msg);
        assert!(capped.chars().count() <= MAX_MESSAGE_CHARS);
        assert_eq!(cap_message(&capped), capped, "capping is idempotent");
        if msg.chars().count() <= MAX_MESSAGE_CHARS {
            assert_eq!(capped, msg);
        }
        let generation = w.generation.map(i64::from);
        let desired = || Desired::new(ty, status(w.status), reason, msg.clone());

        // metav1
        let before = metav1.clone();
        let changed = set(&mut metav1, desired(), generation, &now);
        assert_eq!(changed, before != metav1, "return value vs change");
        let c = metav1.iter().find(|c| c.type_ == ty).unwrap();
        assert_eq!(metav1.iter().filter(|c| c.type_ == ty).count(), 1);
        assert_eq!(
            (
                c.status.as_str(),
                c.reason.as_str(),
                c.message.as_str(),
                c.observed_generation
            ),
            (
                status(w.status).as_str(),
                reason,
                capped.as_str(),
                generation
            )
        );
        match before.iter().find(|b| b.type_ == ty) {
            None => {
                assert_eq!(c.last_transition_time, now);
                assert_eq!(&metav1[..before.len()], &before[..], "appended at the end");
            }
            Some(b) => {
                let moved = b.status != c.status;
                assert_eq!(
                    c.last_transition_time == now,
                    moved || b.last_transition_time == now
                );
                if !moved {
                    assert_eq!(c.last_transition_time, b.last_transition_time);
                }
                assert_eq!(before.len(), metav1.len());
                for (x, y) in before.iter().zip(&metav1) {
                    assert_eq!(x.type_, y.type_, "order kept");
                    if x.type_ != ty {
                        assert_eq!(x, y, "other conditions untouched");
                    }
                }
            }
        }
        let again = metav1.clone();
        assert!(!set(&mut metav1, desired(), generation, &time(999_999)));
        assert_eq!(again, metav1, "setting the same thing twice is a no-op");

        // KubeVirt
        let before = kv.clone();
        let changed = set_kubevirt(&mut kv, desired(), &now);
        assert_eq!(changed, before != kv, "return value vs change (kubevirt)");
        let c = kv.iter().find(|c| c.type_ == ty).unwrap();
        assert_eq!(c.last_probe_time, None);
        assert_eq!(
            (c.status.as_str(), c.reason.as_deref(), c.message.as_deref()),
            (
                status(w.status).as_str(),
                Some(reason),
                Some(capped.as_str())
            )
        );
        if let Some(b) = before.iter().find(|b| b.type_ == ty) {
            let same = b.status == c.status && b.reason == c.reason && b.message == c.message;
            if same {
                assert_eq!(c.last_transition_time, b.last_transition_time);
            } else {
                assert_eq!(c.last_transition_time, Some(now.clone()));
            }
            for (x, y) in before.iter().zip(&kv) {
                assert_eq!(x.type_, y.type_);
                if x.type_ != ty {
                    assert_eq!(x, y);
                }
            }
        }
        let again = kv.clone();
        assert!(!set_kubevirt(&mut kv, desired(), &time(999_999)));
        assert_eq!(again, kv);

        if w.long % 7 == 0 {
            let had = metav1.iter().any(|c| c.type_ == ty);
            assert_eq!(remove(&mut metav1, ty), had);
            assert!(!metav1.iter().any(|c| c.type_ == ty));
        }
    }
});
