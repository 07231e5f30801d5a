//! The events a pass emits (docs/exporter.md, "Events"): [`EventSpec`], the
//! `CredentialCreated` notes and the events.k8s.io `action` that keeps notes of different
//! meaning apart.

/// An event to emit once the write that persisted the transition succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSpec {
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

/// Note openings that tell apart events sharing a reason (see [`EventSpec::action`]).
pub const NOTE_CREATED: &str = "Credential secret created";
pub const NOTE_RENEWED: &str = "Credential token renewed";
pub const NOTE_REPLACED: &str = "Credential token replaced (invalid)";
pub const NOTE_GRACEFUL: &str = "Exporter reported offline (graceful shutdown)";

/// The `CredentialCreated` note (shared with the Client's events).
pub fn mint_note(
    kind: &str,
    reason: crate::exporter::auth::token::MintReason,
    secret: &str,
) -> String {
    let what = match reason {
        crate::exporter::auth::token::MintReason::Created => NOTE_CREATED,
        crate::exporter::auth::token::MintReason::Renewed => NOTE_RENEWED,
        crate::exporter::auth::token::MintReason::Replaced(_) => NOTE_REPLACED,
    };
    format!("{what} for {kind}: secret={secret}")
}

impl EventSpec {
    /// The events.k8s.io `action`. The event recorder folds repeats of one (object, reason,
    /// action) into a series that keeps the first note, so notes that mean different things
    /// (a renewal after a creation, a graceful shutdown after a lost connection) get their own
    /// action and stay visible.
    pub fn action(&self) -> &'static str {
        match self.reason {
            "CredentialCreated" if self.note.starts_with(NOTE_RENEWED) => "RenewCredential",
            "CredentialCreated" if self.note.starts_with(NOTE_REPLACED) => "ReplaceCredential",
            "CredentialCreated" => "CreateCredential",
            "ExporterOffline" if self.note.starts_with(NOTE_GRACEFUL) => "ReportOffline",
            _ => "Reconcile",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_that_differ_in_meaning_get_their_own_action() {
        let ev = |reason: &'static str, note: &str| EventSpec {
            warning: false,
            reason,
            note: note.into(),
        };
        let actions: Vec<&str> = [
            ev(
                "CredentialCreated",
                "Credential secret created for exporter: secret=s",
            ),
            ev(
                "CredentialCreated",
                "Credential token renewed for exporter: secret=s",
            ),
            ev(
                "CredentialCreated",
                "Credential token replaced (invalid) for client: secret=s",
            ),
            ev(
                "ExporterOffline",
                "Exporter went offline (connection lost): exporter=e",
            ),
            ev(
                "ExporterOffline",
                "Exporter reported offline (graceful shutdown): exporter=e",
            ),
            ev("ExporterOnline", "Exporter is online: exporter=e"),
        ]
        .iter()
        .map(EventSpec::action)
        .collect();
        assert_eq!(
            actions,
            [
                "CreateCredential",
                "RenewCredential",
                "ReplaceCredential",
                "Reconcile",
                "ReportOffline",
                "Reconcile"
            ]
        );
    }
}
