//! Credentials: the Exporter's and Client's token Secrets, their status and liveness, every
//! re-mint rule, renewal before expiry and the TokenExpiring condition.

use super::*;

// ---- The Exporter pass (docs/exporter.md): credential, status fields, Online and Registered,
// events, no-op passes, Offline timing (reconciler side) ----

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn exporter_credential_status_and_liveness() {
    const T: i64 = 6;
    let env = TestEnv::new("exp-cred").await;
    let m = manager(
        &env,
        &[
            "--exporter-grpc-endpoint=grpc.e2e:443",
            &format!("--exporter-offline-threshold={T}s"),
        ],
    );
    m.wait_ready().await;
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    create(
        &env.client,
        &env.ns,
        exporter_manifest("e1", json!({"board": "rpi"})),
    )
    .await;

    // Secret with a valid token, owned by the Exporter; status fields.
    eventually(TIMEOUT, "the Exporter status", || async {
        exporters
            .get("e1")
            .await
            .ok()
            .and_then(|e| e.status)
            .is_some_and(|s| s.token_expires_at.is_some())
    })
    .await;
    let e = exporters.get("e1").await.unwrap();
    let secret = secrets.get("e1-exporter").await.unwrap();
    let owner = &secret.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.controller),
        ("Exporter", "e1", Some(true))
    );
    assert_eq!(secret.type_.as_deref(), Some("Opaque"));
    let jwt = String::from_utf8(secret.data.unwrap()["token"].0.clone()).unwrap();
    let key = SigningKey::from_seed(SEED).unwrap();
    let claims = token::verify(&key, &jwt, Timestamp::now())
        .expect("the token verifies with the seed's key");
    assert_eq!(
        claims.sub,
        format!("exporter:{}:e1:{}", env.ns, e.uid().unwrap())
    );
    assert_eq!(claims.exp - claims.iat, 365 * DAY);
    let status = e.status.clone().unwrap();
    assert_eq!(status.credential.unwrap().name, "e1-exporter");
    assert_eq!(status.endpoint.as_deref(), Some("grpc.e2e:443"));
    assert_eq!(status.token_expires_at.unwrap().0.as_second(), claims.exp);
    assert_eq!(
        exporter_condition(&e, "Online").unwrap(),
        ("False".into(), "Seen".into(), "Never seen".into())
    );
    assert_eq!(status.status_message.as_deref(), Some("Never seen"));
    assert_eq!(
        exporter_condition(&e, "Registered").unwrap().1,
        "Unregister"
    );
    let exp = Timestamp::from_second(claims.exp).unwrap();
    assert_eq!(
        exporter_condition(&e, "TokenExpiring").unwrap(),
        (
            "False".into(),
            "Valid".into(),
            format!("Token expires on {} (364 days remaining)", rfc3339(exp))
        )
    );

    // A pass over the unchanged Exporter (triggered through its Secret) writes nothing.
    let rv_before = rv(&e);
    let writes = |text: String| {
        metric(
            &text,
            "ucm_exporter_status_writes_total",
            &[("source", "reconcile")],
        )
    };
    let writes_before = writes(m.metrics().await);
    let passes = reconciles(&m, "exporter").await;
    touch(&secrets, "e1-exporter").await;
    wait_reconciles(&m, "exporter", passes).await;
    assert_eq!(
        rv(&exporters.get("e1").await.unwrap()),
        rv_before,
        "no write on an unchanged Exporter"
    );
    assert_eq!(writes(m.metrics().await), writes_before);

    // Reported alive → Online, Registered.
    bring_online(&exporters, "e1").await;
    let e = exporters.get("e1").await.unwrap();
    assert_eq!(
        exporter_condition(&e, "Online").unwrap(),
        (
            "True".into(),
            "Seen".into(),
            format!("Last seen less than {T} seconds ago")
        )
    );
    assert_eq!(
        exporter_condition(&e, "Registered").unwrap(),
        ("True".into(), "Register".into(), String::new())
    );

    // Silence → Offline right after lastSeen + T, by the exact requeue (no polling).
    eventually(
        Duration::from_secs(30),
        "Offline after the threshold",
        || async {
            exporters.get("e1").await.ok().is_some_and(|e| {
                e.status.as_ref().and_then(|s| s.exporter_status)
                    == Some(ExporterStatusValue::Offline)
            })
        },
    )
    .await;
    let e = exporters.get("e1").await.unwrap();
    let s = e.status.clone().unwrap();
    let stale_at = s.last_seen.unwrap().0 + SignedDuration::from_secs(T);
    assert_eq!(
        s.status_message.as_deref(),
        Some(format!("Connection lost - last seen more than {T} seconds ago").as_str())
    );
    assert_eq!(
        exporter_condition(&e, "Online").unwrap(),
        (
            "False".into(),
            "Seen".into(),
            format!("Last seen more than {T} seconds ago")
        )
    );
    let offline_at = find_condition(s.conditions.as_ref(), "Online")
        .unwrap()
        .last_transition_time
        .0;
    // Never early; late only by scheduling (a 30 s timer, as upstream, would be far later).
    assert!(
        offline_at >= stale_at
            && offline_at.duration_since(stale_at) <= SignedDuration::from_secs(5),
        "Offline at {offline_at}, stale at {stale_at}"
    );

    // Recent but reported Offline (graceful shutdown) → Online=False/Offline with the message.
    bring_online(&exporters, "e1").await;
    report(&exporters, "e1", "Offline", "Exporter shutting down").await;
    eventually(TIMEOUT, "Online=False/Offline", || async {
        exporters
            .get("e1")
            .await
            .ok()
            .and_then(|e| exporter_condition(&e, "Online"))
            == Some((
                "False".into(),
                "Offline".into(),
                "Exporter shutting down".into(),
            ))
    })
    .await;

    // Events for the persisted transitions, from the reconciler.
    eventually(TIMEOUT, "the exporter events", || async {
        let r = events_of(&env.client, &env.ns, "e1").await;
        r.iter()
            .filter(|(reason, ..)| reason == "ExporterOffline")
            .count()
            == 2
    })
    .await;
    let r = events_of(&env.client, &env.ns, "e1").await;
    let has = |reason: &str, note: &str, type_: &str| {
        r.iter()
            .any(|(a, b, c)| a == reason && b.starts_with(note) && c == type_)
    };
    // A first credential is not news on an Exporter (upstream emits no event for it either);
    // renewals and replacements are (docs/exporter.md, "Events").
    assert!(
        !r.iter().any(|(reason, ..)| reason == "CredentialCreated"),
        "{r:?}"
    );
    assert!(
        has(
            "ExporterRegistered",
            "Exporter registered its capabilities: deviceCount=0",
            "Normal"
        ),
        "{r:?}"
    );
    assert!(
        has(
            "ExporterOnline",
            "Exporter is online: exporter=e1",
            "Normal"
        ),
        "{r:?}"
    );
    assert!(
        has(
            "ExporterOffline",
            "Exporter went offline (connection lost): exporter=e1",
            "Warning"
        ),
        "{r:?}"
    );
    assert!(
        has(
            "ExporterOffline",
            "Exporter reported offline (graceful shutdown): exporter=e1 message=Exporter shutting down",
            "Warning"
        ),
        "{r:?}"
    );
    assert!(
        !r.iter().any(|(a, ..)| a == "TokenExpiringSoon"),
        "a 365-day token is not expiring: {r:?}"
    );

    // Deleting the Exporter garbage-collects its Secret.
    exporters
        .delete("e1", &DeleteParams::default())
        .await
        .unwrap();
    eventually(TIMEOUT, "the Secret to be garbage-collected", || async {
        secrets
            .get_opt("e1-exporter")
            .await
            .ok()
            .flatten()
            .is_none()
    })
    .await;
}

// ---- Every re-mint rule, the migration annotations, the ownerRef repair (docs/exporter.md,
// "Credentials") ----

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn exporter_token_is_reminted_when_invalid() {
    let env = TestEnv::new("exp-remint").await;
    let m = manager(&env, &[]);
    m.wait_ready().await;
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    let key = SigningKey::from_seed(SEED).unwrap();
    create(&env.client, &env.ns, exporter_manifest("e1", json!({}))).await;
    let uid = exporters.get("e1").await.unwrap().uid().unwrap();
    let sub = format!("exporter:{}:e1:{uid}", env.ns);
    eventually(TIMEOUT, "the first token", || async {
        valid_claims(&secrets, "e1-exporter", &key).await.is_some()
    })
    .await;

    // Waits until the stored token is valid, has `want_sub`, is not `bad`, and the status shows
    // its expiry. (Signatures are deterministic: a token minted again within the same second
    // is byte-identical, so "changed" is judged by what was wrong, not by the bytes.)
    let reminted = |bad: Option<String>, want_sub: String, what: &'static str| {
        let secrets = secrets.clone();
        let exporters = exporters.clone();
        let key = key.clone();
        async move {
            eventually(TIMEOUT, what, || async {
                let Some(t) = token_of(&secrets, "e1-exporter").await else {
                    return false;
                };
                let Ok(c) = token::verify(&key, &t, Timestamp::now()) else {
                    return false;
                };
                let shown = exporters
                    .get("e1")
                    .await
                    .ok()
                    .and_then(|e| e.status)
                    .and_then(|s| s.token_expires_at)
                    .map(|t| t.0.as_second());
                Some(&t) != bad.as_ref() && c.sub == want_sub && shown == Some(c.exp)
            })
            .await;
        }
    };
    let now = Timestamp::now();
    let good = Claims {
        iss: token::ISSUER.into(),
        aud: vec![token::AUDIENCE.into()],
        sub: sub.clone(),
        iat: now.as_second(),
        exp: now.as_second() + 3600,
        jti: None,
        holder: None,
    };
    let cases: Vec<(&'static str, String)> = vec![
        (
            "an expired token to be replaced",
            token::mint(
                &key,
                &sub,
                now - SignedDuration::from_hours(2),
                SignedDuration::from_hours(1),
            )
            .0,
        ),
        (
            "a token with a foreign issuer to be replaced",
            token::sign(
                &key,
                &Claims {
                    iss: "https://issuer.example".into(),
                    ..good.clone()
                },
            ),
        ),
        (
            "a token with a foreign audience to be replaced",
            token::sign(
                &key,
                &Claims {
                    aud: vec!["someone-else".into()],
                    ..good.clone()
                },
            ),
        ),
        (
            "a token for another subject to be replaced",
            token::sign(
                &key,
                &Claims {
                    sub: format!("exporter:{}:e2:{uid}", env.ns),
                    ..good.clone()
                },
            ),
        ),
        (
            "a token signed by another key to be replaced",
            token::sign(&SigningKey::from_seed("another seed").unwrap(), &good),
        ),
        ("a malformed token to be replaced", "not-a-jwt".to_string()),
    ];
    for (what, bad) in cases {
        put_token(&secrets, "e1-exporter", &bad).await;
        reminted(Some(bad), sub.clone(), what).await;
    }

    // A missing `token` key: re-minted, and `data` is replaced entirely (stray keys go).
    secrets
        .patch(
            "e1-exporter",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"token": null, "stray": "eA=="}})),
        )
        .await
        .unwrap();
    eventually(
        TIMEOUT,
        "a Secret without token to be re-minted",
        || async {
            secrets
                .get("e1-exporter")
                .await
                .ok()
                .and_then(|s| s.data)
                .is_some_and(|d| d.keys().collect::<Vec<_>>() == vec!["token"])
        },
    )
    .await;
    reminted(None, sub.clone(), "the re-minted token").await;

    // A valid token whose controller ownerRef was removed: the ref is restored, the token kept.
    let kept = token_of(&secrets, "e1-exporter").await.unwrap();
    secrets
        .patch(
            "e1-exporter",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"ownerReferences": null}})),
        )
        .await
        .unwrap();
    eventually(TIMEOUT, "the ownerRef to be restored", || async {
        secrets.get("e1-exporter").await.ok().is_some_and(|s| {
            s.owner_references()
                .iter()
                .any(|r| r.uid == uid && r.controller == Some(true))
        })
    })
    .await;
    assert_eq!(token_of(&secrets, "e1-exporter").await.unwrap(), kept);

    // The migration annotations replace namespace and uid in the subject.
    exporters
        .patch(
            "e1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                "jumpstarter.dev/migrated-namespace": "old-lab",
                "jumpstarter.dev/migrated-uid": "0d6c-old-uid"}}})),
        )
        .await
        .unwrap();
    reminted(
        Some(kept),
        "exporter:old-lab:e1:0d6c-old-uid".into(),
        "a token for the migrated subject",
    )
    .await;

    // A deleted Secret is created again.
    let old_uid = secrets.get("e1-exporter").await.unwrap().uid();
    secrets
        .delete("e1-exporter", &DeleteParams::default())
        .await
        .unwrap();
    eventually(TIMEOUT, "the Secret to be created again", || async {
        secrets
            .get_opt("e1-exporter")
            .await
            .ok()
            .flatten()
            .is_some_and(|s| s.uid() != old_uid)
    })
    .await;
    reminted(
        None,
        "exporter:old-lab:e1:0d6c-old-uid".into(),
        "the new Secret's token",
    )
    .await;
    let r = events_of(&env.client, &env.ns, "e1").await;
    let replaced = r
        .iter()
        .filter(|(reason, note, _)| {
            reason == "CredentialCreated"
                && note == "Credential token replaced (invalid) for exporter: secret=e1-exporter"
        })
        .count();
    assert!(replaced >= 7, "one event per replacement: {r:?}");
    for (_, note, _) in &r {
        assert!(!note.contains("eyJ"), "no token in events: {note}");
    }
    assert!(!m.logs().contains("eyJ"), "no token in the manager's logs");
}

// ---- Renewal before expiry, in real time (docs/exporter.md, "Renewal") ----

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn exporter_token_is_renewed_before_expiry_and_a_client_token_is_not() {
    const LIFETIME: i64 = 24;
    // Renewal margin R = min(720h, 0.3333 × 24 s) = 7 s (whole seconds).
    const MARGIN: i64 = 7;
    let env = TestEnv::new("exp-renew").await;
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    create(
        &env.client,
        &env.ns,
        config_map(json!({"config": format!(
            "authentication:\n  internal:\n    tokenLifetime: {LIFETIME}s\n")})),
    )
    .await;
    let m = manager(&env, &[]);
    m.wait_ready().await;
    create(&env.client, &env.ns, exporter_manifest("e1", json!({}))).await;
    create(&env.client, &env.ns, client_manifest("c1", json!({}))).await;
    let key = SigningKey::from_seed(SEED).unwrap();
    let (first, first_client) = tokens_signed_by(&secrets, &key, "the first tokens").await;
    let t1 = token::verify(&key, &first, Timestamp::now()).unwrap();
    let c1 = token::verify(&key, &first_client, Timestamp::now()).unwrap();
    assert_eq!(t1.exp - t1.iat, LIFETIME);
    eventually(TIMEOUT, "TokenExpiring for the first token", || async {
        exporters.get("e1").await.ok().is_some_and(|e| {
            e.status
                .as_ref()
                .and_then(|s| s.token_expires_at.as_ref())
                .map(|t| t.0.as_second())
                == Some(t1.exp)
                && exporter_condition(&e, "TokenExpiring")
                    .is_some_and(|c| c.1 == "ExpiresWithin7Days")
        })
    })
    .await;
    let ltt = find_condition(
        exporters
            .get("e1")
            .await
            .unwrap()
            .status
            .unwrap()
            .conditions
            .as_ref(),
        "TokenExpiring",
    )
    .unwrap()
    .last_transition_time;

    // Nothing touches the objects: the pass is the requeue at exp − R.
    eventually(
        Duration::from_secs(2 * LIFETIME as u64),
        "the exporter token to be renewed",
        || async {
            token_of(&secrets, "e1-exporter")
                .await
                .is_some_and(|t| t != first)
        },
    )
    .await;
    let second = token_of(&secrets, "e1-exporter").await.unwrap();
    let t2 = token::verify(&key, &second, Timestamp::now()).unwrap();
    assert!(
        t2.iat >= t1.exp - MARGIN && t2.iat < t1.exp,
        "renewed at {} for a token valid until {} (margin {MARGIN} s)",
        t2.iat,
        t1.exp
    );
    if Timestamp::now().as_second() < t1.exp {
        // Stateless verification: the previous token stays valid until its own exp.
        token::verify(&key, &first, Timestamp::now()).expect("the old token is still valid");
    }
    eventually(TIMEOUT, "the status to follow the new token", || async {
        exporters.get("e1").await.ok().is_some_and(|e| {
            e.status
                .as_ref()
                .and_then(|s| s.token_expires_at.as_ref())
                .map(|t| t.0.as_second())
                == Some(t2.exp)
        })
    })
    .await;
    let cond = find_condition(
        exporters
            .get("e1")
            .await
            .unwrap()
            .status
            .unwrap()
            .conditions
            .as_ref(),
        "TokenExpiring",
    )
    .unwrap();
    assert_eq!(
        (cond.status.as_str(), cond.reason.as_str()),
        ("True", "ExpiresWithin7Days")
    );
    assert_eq!(
        cond.last_transition_time, ltt,
        "no transition: True before and after"
    );
    assert!(
        cond.message
            .contains(&rfc3339(Timestamp::from_second(t2.exp).unwrap())),
        "{}",
        cond.message
    );
    eventually(TIMEOUT, "the renewal event", || async {
        events_of(&env.client, &env.ns, "e1")
            .await
            .iter()
            .any(|(r, n, _)| {
                r == "CredentialCreated"
                    && n == "Credential token renewed for exporter: secret=e1-exporter"
            })
    })
    .await;

    // Client tokens are not renewed (clients rotate them): replaced only once expired.
    let client_now = token_of(&secrets, "c1-client").await.unwrap();
    if client_now != first_client {
        let c = token::verify(&key, &client_now, Timestamp::now()).unwrap();
        assert!(
            c.iat >= c1.exp,
            "the client token was replaced before it expired"
        );
    }
    eventually(
        Duration::from_secs(2 * LIFETIME as u64),
        "the expired client token to be replaced",
        || async {
            token_of(&secrets, "c1-client").await.is_some_and(|t| {
                token::verify(&key, &t, Timestamp::now()).is_ok_and(|c| c.iat >= c1.exp)
            })
        },
    )
    .await;
}

// ---- TokenExpiring at each boundary, TokenExpiringSoon only on becoming True ----

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn token_expiring_follows_the_token_in_the_secret() {
    let env = TestEnv::new("exp-expiring").await;
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let clients: Api<JClient> = Api::namespaced(env.client.clone(), &env.ns);
    // Renewal off, so that a token near its end stays in the Secret.
    let m = manager(&env, &["--exporter-token-renew-before=0"]);
    m.wait_ready().await;
    create(&env.client, &env.ns, exporter_manifest("e1", json!({}))).await;
    create(&env.client, &env.ns, client_manifest("c1", json!({}))).await;
    let key = SigningKey::from_seed(SEED).unwrap();
    tokens_signed_by(&secrets, &key, "the first tokens").await;
    let e_sub = format!(
        "exporter:{}:e1:{}",
        env.ns,
        exporters.get("e1").await.unwrap().uid().unwrap()
    );
    let c_sub = format!(
        "client:{}:c1:{}",
        env.ns,
        clients.get("c1").await.unwrap().uid().unwrap()
    );
    // Half a day past whole days, so the "N days remaining" count is exact.
    let in_days = |d: i64| Timestamp::now() + SignedDuration::from_hours(d * 24 + 12);

    // Injects a token expiring at `exp` and waits for the Exporter's TokenExpiring.
    let exporter_step = |exp: Timestamp, status: &'static str, reason: &'static str, days: i64| {
        let secrets = secrets.clone();
        let exporters = exporters.clone();
        let jwt = token_expiring_at(&key, &e_sub, exp);
        async move {
            put_token(&secrets, "e1-exporter", &jwt).await;
            let want = (
                status.to_string(),
                reason.to_string(),
                format!(
                    "Token expires on {} ({days} days remaining)",
                    rfc3339(Timestamp::from_second(exp.as_second()).unwrap())
                ),
            );
            eventually(TIMEOUT, &format!("TokenExpiring {reason}"), || async {
                exporters.get("e1").await.ok().is_some_and(|e| {
                    exporter_condition(&e, "TokenExpiring") == Some(want.clone())
                        && e.status
                            .as_ref()
                            .and_then(|s| s.token_expires_at.as_ref())
                            .map(|t| t.0.as_second())
                            == Some(exp.as_second())
                })
            })
            .await;
            exporters.get("e1").await.unwrap()
        }
    };
    let ltt = |e: &Exporter| {
        find_condition(
            e.status.as_ref().unwrap().conditions.as_ref(),
            "TokenExpiring",
        )
        .unwrap()
        .last_transition_time
    };
    let soon = || async {
        events_of(&env.client, &env.ns, "e1")
            .await
            .into_iter()
            .filter(|(r, _, t)| r == "TokenExpiringSoon" && t == "Warning")
            .map(|(_, n, _)| n)
            .collect::<Vec<_>>()
    };

    exporter_step(in_days(40), "False", "Valid", 40).await;
    let exp30 = in_days(20);
    let e = exporter_step(exp30, "True", "ExpiresWithin30Days", 20).await;
    let within30_since = ltt(&e);
    let e = exporter_step(in_days(5), "True", "ExpiresWithin7Days", 5).await;
    assert_eq!(
        ltt(&e),
        within30_since,
        "True → True keeps lastTransitionTime"
    );

    // Expired: re-minted in the same pass, so the condition shows the new token.
    put_token(
        &secrets,
        "e1-exporter",
        &token_expiring_at(
            &key,
            &e_sub,
            Timestamp::now() - SignedDuration::from_hours(1),
        ),
    )
    .await;
    eventually(TIMEOUT, "the expired token to be replaced", || async {
        let fresh = valid_claims(&secrets, "e1-exporter", &key)
            .await
            .is_some_and(|c| c.exp - c.iat == 365 * DAY);
        fresh
            && exporters
                .get("e1")
                .await
                .ok()
                .and_then(|e| exporter_condition(&e, "TokenExpiring"))
                .is_some_and(|c| c.1 == "Valid")
            && events_of(&env.client, &env.ns, "e1").await.iter().any(|(r, n, _)| {
                r == "CredentialCreated"
                    && n == "Credential token replaced (invalid) for exporter: secret=e1-exporter"
            })
    })
    .await;
    // The replacement's event is out, so every earlier event is too: one warning so far, for
    // the Valid → ExpiresWithin30Days transition only.
    assert_eq!(
        soon().await,
        vec![format!(
            "Token expires on {} (20 days remaining)",
            rfc3339(Timestamp::from_second(exp30.as_second()).unwrap())
        )]
    );
    // Becoming True again warns again.
    exporter_step(in_days(3), "True", "ExpiresWithin7Days", 3).await;
    eventually(TIMEOUT, "a second TokenExpiringSoon", || async {
        soon().await.len() == 2
    })
    .await;

    // The Client follows the same table (and is never renewed).
    let exp = in_days(20);
    put_token(&secrets, "c1-client", &token_expiring_at(&key, &c_sub, exp)).await;
    let exp = Timestamp::from_second(exp.as_second()).unwrap();
    eventually(TIMEOUT, "the Client's TokenExpiring", || async {
        clients.get("c1").await.ok().is_some_and(|c| {
            client_cond(&c, "TokenExpiring").is_some_and(|k| {
                k.status == "True"
                    && k.reason == "ExpiresWithin30Days"
                    && k.message == format!("Token expires on {} (20 days remaining)", rfc3339(exp))
            }) && c
                .status
                .as_ref()
                .and_then(|s| s.token_expires_at.as_ref())
                .map(|t| t.0)
                == Some(exp)
        }) && events_of(&env.client, &env.ns, "c1").await.contains(&(
            "TokenExpiringSoon".into(),
            format!(
                "Token for client c1 is expiring soon: expires={}",
                rfc3339(exp)
            ),
            "Warning".into(),
        ))
    })
    .await;
}

// ---- Client (docs/exporter.md, "The Client pass"): credential, status, events, re-mint, GC ----

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn client_gets_a_credential() {
    let env = TestEnv::new("exp-client").await;
    let m = manager(&env, &[]);
    m.wait_ready().await;
    create(&env.client, &env.ns, client_manifest("c1", json!({}))).await;
    let clients: Api<JClient> = Api::namespaced(env.client.clone(), &env.ns);
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    eventually(TIMEOUT, "the Client status", || async {
        clients
            .get("c1")
            .await
            .ok()
            .and_then(|c| c.status)
            .is_some_and(|s| s.token_expires_at.is_some())
    })
    .await;
    let c = clients.get("c1").await.unwrap();
    let secret = secrets.get("c1-client").await.unwrap();
    let owner = &secret.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.controller),
        ("Client", "c1", Some(true))
    );
    let key = SigningKey::from_seed(SEED).unwrap();
    let claims = valid_claims(&secrets, "c1-client", &key).await.unwrap();
    assert_eq!(
        claims.sub,
        format!("client:{}:c1:{}", env.ns, c.uid().unwrap())
    );
    assert_eq!(claims.exp - claims.iat, 365 * DAY);
    let s = c.status.clone().unwrap();
    assert_eq!(s.credential.unwrap().name, "c1-client");
    assert_eq!(s.endpoint.as_deref(), Some("localhost:8082"));
    assert_eq!(s.token_expires_at.unwrap().0.as_second(), claims.exp);
    let k = client_cond(&c, "TokenExpiring").unwrap();
    assert_eq!((k.status.as_str(), k.reason.as_str()), ("False", "Valid"));
    assert_eq!(k.observed_generation, c.metadata.generation);
    eventually(TIMEOUT, "CredentialCreated on the Client", || async {
        events_of(&env.client, &env.ns, "c1").await.contains(&(
            "CredentialCreated".into(),
            "Credential secret created for client: secret=c1-client".into(),
            "Normal".into(),
        ))
    })
    .await;

    // A token signed by another key is replaced.
    put_token(
        &secrets,
        "c1-client",
        &token::mint(
            &SigningKey::from_seed("other").unwrap(),
            &claims.sub,
            Timestamp::now(),
            SignedDuration::from_hours(1),
        )
        .0,
    )
    .await;
    eventually(
        TIMEOUT,
        "the foreign client token to be replaced",
        || async {
            valid_claims(&secrets, "c1-client", &key).await.is_some()
                && events_of(&env.client, &env.ns, "c1").await.contains(&(
                    "CredentialCreated".into(),
                    "Credential token replaced (invalid) for client: secret=c1-client".into(),
                    "Normal".into(),
                ))
        },
    )
    .await;

    // Deleting the Client garbage-collects its Secret.
    clients
        .delete("c1", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        TIMEOUT,
        "the client Secret to be garbage-collected",
        || async { secrets.get_opt("c1-client").await.ok().flatten().is_none() },
    )
    .await;
}
